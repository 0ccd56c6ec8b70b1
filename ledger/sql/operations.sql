-- Operator statements (ledgerctl, and the console's event list and replays): inspection, replay,
-- payload pruning.

-- name: stats_by_status_and_type
SELECT status, type, count(*) AS events
  FROM ledger.events
 GROUP BY status, type
 ORDER BY status, type

-- name: stats_unfinished
-- Reads only the small unfinished set (partial index), whatever the history size.
SELECT count(*)                                                                  AS unfinished,
       extract(epoch FROM now() - min(received_at))                              AS oldest_unprocessed_age_s,
       count(*) FILTER (WHERE status = 'failed_recoverable' AND next_attempt_at <= now()) AS due_retries,
       count(*) FILTER (WHERE status = 'failed_recoverable' AND next_attempt_at > now())  AS scheduled_retries,
       count(*) FILTER (WHERE status = 'processing' AND lease_expires_at < now())        AS expired_leases,
       count(*) FILTER (WHERE status = 'processing' AND lease_expires_at >= now())       AS in_progress
  FROM ledger.events
 WHERE status IN ('received', 'processing', 'failed_recoverable')

-- The event lists (ledgerctl events list, the console) choose events by
-- ledger.event_query.EventQuery: its fixed fragments, joined under {where}, a field left
-- empty adding none, so every combination gets a plan over the indexes of migration 0008.

-- name: events_page
-- One page, newest first, after the keyset (received_at, id) of the last row shown: a row
-- arriving meanwhile sorts before the page, so paging on never shows a row twice or skips one.
SELECT e.id, e.type, e.status, e.attempts, e.failure_reason, e.account, e.livemode, e.stripe_created,
       e.received_at, e.processed_at
  FROM ledger.events e
 WHERE {where}
 ORDER BY e.received_at DESC, e.id DESC
 LIMIT %(limit)s

-- name: events_count_capped
-- How many events match, counted up to the cap: past it the console says "cap+". In the list's
-- order, so the count walks the same index from the newest row: a bare LIMIT lets the planner
-- pick a sequential scan, which starts wherever the last one stopped (synchronized scans) and
-- may read most of the table before the range's rows.
SELECT count(*) AS events
  FROM (SELECT 1 FROM ledger.events e WHERE {where} ORDER BY e.received_at DESC, e.id DESC LIMIT %(cap)s) matched

-- name: event_attempts
SELECT attempt, worker, started_at, finished_at, outcome, error_class, error
  FROM ledger.attempts
 WHERE event_id = %(id)s
 ORDER BY attempt

-- name: event_audit
SELECT action, actor, reason, from_status, at
  FROM ledger.audit
 WHERE event_id = %(id)s
 ORDER BY at, id

-- name: event_deliveries
SELECT count(*) AS deliveries, min(delivered_at) AS first_delivered_at, max(delivered_at) AS last_delivered_at
  FROM ledger.deliveries
 WHERE event_id = %(id)s

-- name: event_snapshot_twins
-- The snapshot events a thin notification was applied under: its business rows carry their ids.
SELECT snapshot_event_id FROM ledger.snapshot_twins WHERE event_id = %(id)s ORDER BY snapshot_event_id

-- name: events_ids_after
-- Bulk replay (ledgerctl), keyset-paginated by id so a long run neither skips nor repeats rows.
SELECT e.id
  FROM ledger.events e
 WHERE {where}
   AND e.id > %(after)s
 ORDER BY e.id
 LIMIT %(limit)s

-- name: event_replay_if_finished_or_failed
-- Operator (ledgerctl replay, the console, a console replay job): failed_permanent |
-- failed_recoverable (| processed, with force) -> received. The same guarded compare-and-set
-- as every transition: an event a worker holds, or one already waiting, is left alone (no
-- row); so is one whose status is no longer expected_status (a replay job's filter; NULL: any).
-- The retry budget starts again (attempt_base), the history keeps its attempts, and the audit
-- says who, why, and which replay job (NULL: none). A processed event whose payload retention
-- removed cannot be replayed.
WITH target AS (
    SELECT id, status, stripe_created
      FROM ledger.events
     WHERE id = %(id)s
       AND (status IN ('failed_permanent', 'failed_recoverable')
            OR (%(force)s AND status = 'processed'))
       AND (%(expected_status)s::text IS NULL OR status = %(expected_status)s)
       AND payload IS NOT NULL
       FOR NO KEY UPDATE
), replayed AS (
    UPDATE ledger.events e
       SET status = 'received', failure_reason = NULL, last_error = NULL, next_attempt_at = NULL,
           processed_at = NULL, attempt_base = e.attempts, wakeup_at = now(), redrives = 0,
           updated_at = now()
      FROM target
     WHERE e.id = target.id
), audited AS (
    INSERT INTO ledger.audit (event_id, event_created, action, actor, reason, from_status, replay_job_id)
    SELECT id, stripe_created, 'replay', %(actor)s, %(reason)s, status, %(replay_job_id)s FROM target
)
SELECT id, status AS from_status FROM target

-- name: events_prune_payloads
-- Retention: drop the payload of processed events older than the cut-off, one
-- batch at a time. Unfinished events are never touched (and the schema's CHECK
-- refuses a NULL payload on any status but processed).
WITH batch AS (
    SELECT id
      FROM ledger.events
     WHERE status = 'processed' AND payload IS NOT NULL
       AND processed_at < now() - make_interval(secs => %(older_than_s)s)
     ORDER BY processed_at
     LIMIT %(batch)s
       FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE ledger.events e
   SET payload = NULL, updated_at = now()
  FROM batch
 WHERE e.id = batch.id
RETURNING e.id

-- name: events_count_prunable
SELECT count(*) AS prunable
  FROM ledger.events
 WHERE status = 'processed' AND payload IS NOT NULL
   AND processed_at < now() - make_interval(secs => %(older_than_s)s)

-- name: object_events
-- ledgerctl objects show: the events whose data.object is the object (``own``) and, for a
-- customer, the events of its other objects (its subscriptions' and invoices', by the customer id
-- recorded with them): a customer's rows are derived from those too. In Stripe's order, with what
-- an operator asks of each. The ids are recorded with each event since migration 0016; an event
-- recorded before that is found by its payload. Each way of naming the object is a branch of its own,
-- so each reads its index (migration 0017) instead of one OR reading the ledger; an event not at its
-- end yet is found among the unfinished ones (the backlog), which those indexes leave out.
WITH found AS (
    SELECT id, stripe_created FROM ledger.events
     WHERE object_id = %(id)s AND object_id IS NOT NULL AND status IN ('processed', 'failed_permanent')
    UNION SELECT id, stripe_created FROM ledger.events
     WHERE customer_id = %(id)s AND customer_id IS NOT NULL AND status IN ('processed', 'failed_permanent')
    UNION SELECT id, stripe_created FROM ledger.events
     WHERE status IN ('received', 'processing', 'failed_recoverable') AND (object_id = %(id)s OR customer_id = %(id)s)
    UNION SELECT id, stripe_created FROM ledger.events WHERE payload -> 'data' -> 'object' ->> 'id' = %(id)s AND object_id IS NULL
    UNION SELECT id, stripe_created FROM ledger.events WHERE payload -> 'data' -> 'object' ->> 'customer' = %(id)s AND object_id IS NULL
)
SELECT e.id, e.type, e.status, e.attempts, e.failure_reason, e.last_error, e.stripe_created, e.livemode,
       e.account, e.api_version, e.payload, e.applied_object, e.applied_api_version, e.applied_as,
       coalesce(e.object_id, e.payload -> 'data' -> 'object' ->> 'id') = %(id)s AS own,
       (SELECT count(*) FROM ledger.deliveries d WHERE d.event_id = e.id) AS deliveries,
       (SELECT count(*) FROM ledger.audit a WHERE a.event_id = e.id AND a.action = 'replay') AS replays
  FROM ledger.events e JOIN found USING (id, stripe_created)
 ORDER BY e.stripe_created, e.id
