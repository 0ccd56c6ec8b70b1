-- The operator console (ledger/console.py, ledger/reconcile_runs.py): the overview, failure
-- groups, replay jobs, reconcile reports and failed logins. Its event list and counts are
-- operations.sql's (events_page, events_count_capped), shared with ledgerctl.

-- name: console_unfinished
-- The overview's exact counts of every status but processed, the oldest unfinished event's age, the
-- retries due and the leases expired, in one snapshot, each from an index that holds what it reads
-- (index-only scans; a row's heap page only where the visibility map does not vouch for it): the
-- unfinished set's count and oldest from its index by received_at, processing and expired leases from
-- the processing events' (lease INCLUDEd), both failure states and due retries from the failed events'
-- (migration 0020). Received is the unfinished set less the other two. Processed is counted up to a cap
-- (console_processed_count_capped), past which it is the table's estimated size less these
-- (console_table_estimate), shown as an estimate.
SELECT u.unfinished - p.processing - f.failed_recoverable AS received, p.processing, f.failed_recoverable,
       f.failed_permanent, extract(epoch FROM now() - u.oldest) AS oldest_unprocessed_age_s, f.due_retries,
       p.expired_leases
  FROM (SELECT count(*) AS unfinished, min(received_at) AS oldest
          FROM ledger.events
         WHERE status IN ('received', 'processing', 'failed_recoverable')) u,
       (SELECT count(*) AS processing, count(*) FILTER (WHERE lease_expires_at < now()) AS expired_leases
          FROM ledger.events
         WHERE status = 'processing') p,
       (SELECT count(*) FILTER (WHERE status = 'failed_recoverable') AS failed_recoverable,
               count(*) FILTER (WHERE status = 'failed_recoverable' AND next_attempt_at <= now()) AS due_retries,
               count(*) FILTER (WHERE status = 'failed_permanent') AS failed_permanent
          FROM ledger.events
         WHERE status IN ('failed_permanent', 'failed_recoverable')) f

-- name: console_processed_count_capped
-- Processed events, counted up to the cap: past it the overview estimates instead.
SELECT count(*) AS events FROM (SELECT 1 FROM ledger.events WHERE status = 'processed' LIMIT %(cap)s) processed

-- name: console_table_estimate
SELECT greatest(reltuples, 0)::bigint AS events FROM pg_class WHERE oid = 'ledger.events'::regclass

-- name: console_per_minute
-- The last hour, minute by minute: events processed, and attempts that failed.
WITH minutes AS (
    SELECT generate_series(date_trunc('minute', now()) - interval '59 minutes', date_trunc('minute', now()),
                           interval '1 minute') AS minute
), processed AS (
    SELECT date_trunc('minute', processed_at) AS minute, count(*) AS n
      FROM ledger.events
     WHERE status = 'processed' AND payload IS NOT NULL
       AND processed_at >= date_trunc('minute', now()) - interval '59 minutes'
     GROUP BY 1
), failed AS (
    SELECT date_trunc('minute', finished_at) AS minute, count(*) AS n
      FROM ledger.attempts
     WHERE outcome IN ('failed_recoverable', 'failed_permanent')
       AND finished_at >= date_trunc('minute', now()) - interval '59 minutes'
     GROUP BY 1
)
SELECT m.minute, coalesce(p.n, 0) AS processed, coalesce(f.n, 0) AS failed
  FROM minutes m LEFT JOIN processed p USING (minute) LEFT JOIN failed f USING (minute)
 ORDER BY m.minute

-- name: console_catchup_cursors
SELECT account, last_event_id, last_event_created, last_run_at, last_found,
       extract(epoch FROM now() - last_run_at) AS last_run_age_s
  FROM ledger.catchup_cursors
 ORDER BY account

-- name: console_failure_groups
-- Failed events grouped by reason and type: how many, first and last seen.
SELECT status, failure_reason AS reason, type, count(*) AS events,
       min(updated_at) AS first_seen, max(updated_at) AS last_seen
  FROM ledger.events
 WHERE status IN ('failed_permanent', 'failed_recoverable')
 GROUP BY status, failure_reason, type
 ORDER BY count(*) DESC, status, reason, type
 LIMIT %(limit)s

-- name: console_event_delivery_list
SELECT delivered_at, source FROM ledger.deliveries WHERE event_id = %(id)s ORDER BY delivered_at

-- name: console_event_thin_of
-- A snapshot event's thin notification: the notification applied under this event's id.
SELECT event_id FROM ledger.snapshot_twins WHERE snapshot_event_id = %(id)s

-- name: console_event_outbox
SELECT id, effect, status, attempts, failure_reason, created_at, sent_at
  FROM ledger.outbox
 WHERE event_id = %(id)s
 ORDER BY id

-- name: replay_job_create
-- (job_reason: the operator's why; reason, the filter's failure reason, belongs to {where}.)
-- Operator (console): a bulk replay of the events its filter matches now, fixed here. Nothing
-- is created unless the count is the one the operator previewed and confirmed (then the set
-- changed in between: preview again), nor when this preview made a job already (id NULL: a
-- concurrent confirm waits on the unique preview_id until the first commits, then does nothing).
WITH job AS (
    INSERT INTO ledger.replay_jobs (actor, reason, filter, force, total, preview_id)
    VALUES (%(actor)s, %(job_reason)s, %(filter)s, %(force)s, %(expected)s, %(preview_id)s)
    ON CONFLICT (preview_id) DO NOTHING
    RETURNING id
), chosen AS (
    INSERT INTO ledger.replay_job_events (job_id, event_id, event_created)
    SELECT job.id, e.id, e.stripe_created FROM job, ledger.events e WHERE {where}
    RETURNING event_id
)
SELECT (SELECT id FROM job) AS id, (SELECT count(*) FROM chosen) AS total

-- name: replay_job_of_preview
-- The job a confirmed preview made (replay_job_create found its preview_id taken).
SELECT id, total FROM ledger.replay_jobs WHERE preview_id = %(preview_id)s

-- name: replay_job_claim
-- Console process: take a running job whose runner's lease expired (or that has none), for
-- lease_s. Several console processes run none twice.
UPDATE ledger.replay_jobs j
   SET runner = %(runner)s, lease_expires_at = now() + make_interval(secs => %(lease_s)s)
 WHERE j.id = (SELECT id FROM ledger.replay_jobs
                WHERE status = 'running' AND (lease_expires_at IS NULL OR lease_expires_at < now()
                                              OR runner = %(runner)s)
                ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING j.id, j.actor, j.reason, j.force, j.filter

-- name: replay_job_take_batch
-- Runner, in the transaction of one batch: the job, while it is running and the lease ours (a
-- cancel stops it before the next batch), locked for the batch; and the job's next events not
-- reached yet. Each is then replayed by event_replay_if_finished_or_failed (operations.sql),
-- the one replay transition, with the job's filter status as the expected status.
SELECT j.id, j.actor, j.reason, j.force, j.filter->>'status' AS expected_status,
       array(SELECT je.event_id FROM ledger.replay_job_events je
              WHERE je.job_id = j.id AND je.outcome IS NULL
              ORDER BY je.event_id LIMIT %(batch)s) AS event_ids
  FROM ledger.replay_jobs j
 WHERE j.id = %(job_id)s AND j.status = 'running' AND j.runner = %(runner)s
   FOR NO KEY UPDATE

-- name: replay_job_record_batch
-- Runner, same transaction: what became of the batch's events (replayed, or skipped: a worker
-- held it, it was waiting already, or it left the filter), the job's counts, its lease renewed,
-- and finished once every event was reached.
WITH marked AS (
    UPDATE ledger.replay_job_events je
       SET outcome = CASE WHEN je.event_id = ANY(%(replayed)s) THEN 'replayed' ELSE 'skipped' END,
           done_at = now()
     WHERE je.job_id = %(job_id)s AND je.event_id = ANY(%(reached)s)
    RETURNING je.outcome
)
UPDATE ledger.replay_jobs j
   SET replayed = j.replayed + (SELECT count(*) FROM marked WHERE outcome = 'replayed'),
       skipped = j.skipped + (SELECT count(*) FROM marked WHERE outcome = 'skipped'),
       lease_expires_at = now() + make_interval(secs => %(lease_s)s),
       status = CASE WHEN j.replayed + j.skipped + (SELECT count(*) FROM marked) >= j.total
                     THEN 'finished' ELSE j.status END,
       finished_at = CASE WHEN j.replayed + j.skipped + (SELECT count(*) FROM marked) >= j.total
                          THEN now() END
 WHERE j.id = %(job_id)s
RETURNING j.status

-- name: replay_job_cancel
-- Operator: stop a running job; the events it has not reached stay as they are.
UPDATE ledger.replay_jobs
   SET status = 'cancelled', cancelled_by = %(actor)s, finished_at = now()
 WHERE id = %(id)s AND status = 'running'
RETURNING id

-- name: replay_job_get
SELECT id, actor, reason, filter, force, total, replayed, skipped, status, cancelled_by, created_at, finished_at
  FROM ledger.replay_jobs
 WHERE id = %(id)s

-- name: replay_jobs_recent
SELECT id, actor, reason, filter, force, total, replayed, skipped, status, cancelled_by, created_at, finished_at
  FROM ledger.replay_jobs
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: reconcile_run_record
INSERT INTO ledger.reconcile_runs (actor, account, types, fixed, checked, drift, fixes)
VALUES (%(actor)s, %(account)s, %(types)s, %(fixed)s, %(checked)s, %(drift)s, %(fixes)s)
RETURNING id, ran_at

-- name: reconcile_runs_recent
SELECT id, actor, account, types, fixed, checked, drift, fixes, ran_at
  FROM ledger.reconcile_runs
 ORDER BY ran_at DESC, id DESC
 LIMIT %(limit)s

-- name: reconcile_drift_latest
-- For each object type, the drift of the latest run that compared it (the metric's source).
SELECT DISTINCT ON (t.type) t.type, r.ran_at,
       (SELECT count(DISTINCT d->>'id') FROM jsonb_array_elements(r.drift) d WHERE d->>'type' = t.type) AS objects
  FROM ledger.reconcile_runs r, unnest(r.types) AS t(type)
 ORDER BY t.type, r.ran_at DESC, r.id DESC

-- name: console_event_payload
-- The payload as recorded (NULL once retention pruned it).
SELECT payload FROM ledger.events WHERE id = %(id)s

-- name: login_failures_recent
-- Console login: each key's failed logins within the throttle's window, and how long ago the
-- last one was (ops/console/auth.py turns them into a wait).
SELECT key, count(*) AS failures, extract(epoch FROM now() - max(failed_at))::float8 AS since_last_s
  FROM ledger.login_failures
 WHERE key = ANY(%(keys)s) AND failed_at > now() - make_interval(secs => %(window_s)s)
 GROUP BY key

-- name: login_failure_record
-- Console login: one failure for each key; failures past the window are forgotten here.
WITH forgotten AS (
    DELETE FROM ledger.login_failures WHERE failed_at <= now() - make_interval(secs => %(window_s)s)
)
INSERT INTO ledger.login_failures (key) SELECT unnest(%(keys)s::text[])

-- name: login_failures_forget
-- Console login: a name that logged in starts over (its address keeps its count).
DELETE FROM ledger.login_failures WHERE key = %(key)s
