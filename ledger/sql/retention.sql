-- Retention (ledger/retention.py, docs/retention.md): final events past their window
-- (ledger.event_past_window, migration 0011) leave the ledger through the archive. Never
-- an unfinished event, never one with an effect still to deliver, never a held one.

-- name: retention_try_lock
-- One runner at a time, across hosts: a session-level advisory lock held by the
-- runner's own connection for the whole run (released when it ends, or dies).
SELECT pg_try_advisory_lock(hashtextextended('ledger.retention', 0)) AS locked

-- name: retention_unlock
SELECT pg_advisory_unlock(hashtextextended('ledger.retention', 0))

-- name: retention_run_start
INSERT INTO ledger.retention_runs (runner, processed_days, failed_days)
VALUES (%(runner)s, %(processed_days)s, %(failed_days)s)
RETURNING id

-- name: retention_run_progress
UPDATE ledger.retention_runs
   SET archived = archived + %(archived)s, removed = removed + %(removed)s,
       changed = changed + %(changed)s, files = files + %(files)s
 WHERE id = %(run_id)s

-- name: retention_run_finish
-- running -> done | failed (a failed run says why).
UPDATE ledger.retention_runs
   SET status = %(status)s, error = %(error)s, kept_by_hold = %(kept_by_hold)s,
       partitions_dropped = %(partitions_dropped)s, finished_at = now()
 WHERE id = %(run_id)s AND status = 'running'

-- name: partitions_past_window
-- The months whose every processed event is past its window: replaced by what they keep once
-- their archive is verified (ledger.partition_month_*, migration 0014). Oldest first.
SELECT starts::date AS month
  FROM ledger.event_partitions()
 WHERE NOT is_default AND ends < now() - make_interval(days => %(processed_days)s)
 ORDER BY starts

-- name: partition_month_watch
SELECT ledger.partition_month_watch(%(month)s) AS watched

-- name: retention_archived_clear
DELETE FROM ledger.retention_archived WHERE run_id = %(run_id)s AND month = %(month)s

-- name: retention_archived_copy
COPY ledger.retention_archived (run_id, month, event_id) FROM STDIN

-- name: retention_archived_count
SELECT count(*) AS archived FROM ledger.retention_archived WHERE run_id = %(run_id)s AND month = %(month)s

-- name: partition_month_stage
SELECT ledger.partition_month_stage(%(month)s, %(run_id)s) AS staged

-- name: partition_month_swap
SELECT kept, changed, archived_kept FROM ledger.partition_month_swap(%(month)s, %(run_id)s)

-- name: partition_month_gone
SELECT ledger.partition_month_gone(%(month)s) AS name

-- name: partition_month_drop_gone
SELECT ledger.partition_month_drop_gone(%(month)s)

-- name: partition_month_leftovers
SELECT month, kind FROM ledger.partition_month_leftovers()

-- name: partition_month_unstage
SELECT ledger.partition_month_unstage(%(month)s)

-- name: retention_archived_pending
-- A run's archived ids of a month not yet cleared: the run died after its archive; `swapped`
-- when its swap committed (the rows naming its gone events remain to be deleted).
SELECT DISTINCT a.run_id, a.month,
       EXISTS (SELECT 1 FROM ledger.dropped_partitions p WHERE p.month = a.month AND p.run_id = a.run_id) AS swapped
  FROM ledger.retention_archived a
 ORDER BY 1, 2

-- name: retention_dependents_gone
-- After a month's swap: the rows of a plain table naming the events that left with it (archived by
-- the run, and not in the ledger any more). {table}: one of ledger.event_dependent_tables().
DELETE FROM {table} x USING ledger.retention_archived a
 WHERE a.run_id = %(run_id)s AND a.month = %(month)s AND x.event_id = a.event_id
   AND NOT EXISTS (SELECT 1 FROM ledger.events e WHERE e.id = x.event_id)

-- name: events_heap_blocks
-- How far a run reads: each table holding events (ledger.events itself, or each of its
-- partitions) and its size in blocks when the run starts (later rows are new); a month's
-- partition with its bounds (ledger.event_archive_lines reads the month's rows only).
SELECT relid::text AS relation, pg_relation_size(relid) / current_setting('block_size')::bigint AS blocks,
       p.starts AS created_from, p.ends AS created_to
  FROM (SELECT relid FROM pg_partition_tree('ledger.events') WHERE isleaf
        UNION ALL  -- a plain table is no tree: itself
        SELECT 'ledger.events'::regclass WHERE NOT ledger.is_partitioned()) heaps
  LEFT JOIN ledger.event_partitions() p ON format('ledger.%%I', p.name) = relid::text AND NOT p.is_default
 ORDER BY relid::text

-- name: ledger_is_partitioned
SELECT ledger.is_partitioned() AS partitioned

-- name: retention_candidates
-- The events past their window in a range of the table's blocks (a TID range scan: each
-- statement reads a bounded slice of the heap in physical order, no index, no sort, no
-- snapshot held between slices), each with the month of its `created` (its archive file)
-- and its archive line. Excluded: an event with an effect still to deliver, and a held one
-- (by id, or by the customer its payload names). {relation}: one of events_heap_blocks'
-- (a TID range means something in one heap, not across a partitioned table's).
SELECT l.id, l.month, l.line
  FROM ledger.event_archive_lines(ARRAY(
        SELECT e.id
          FROM {relation} e
         WHERE e.ctid >= format('(%%s,0)', %(first_block)s::bigint)::tid
           AND e.ctid < format('(%%s,0)', %(end_block)s::bigint)::tid
           AND ledger.event_past_window(e.status, e.processed_at, e.updated_at, %(processed_days)s, %(failed_days)s)
           AND NOT EXISTS (SELECT 1 FROM ledger.outbox o
                            WHERE o.event_id = e.id AND o.status NOT IN ('sent', 'failed_permanent'))
           AND NOT EXISTS (SELECT 1 FROM ledger.retention_holds h
                            WHERE h.released_at IS NULL
                              AND (h.event_id = e.id OR h.customer_id = ledger.event_customer(e.payload)))),
        %(created_from)s, %(created_to)s) AS l

-- name: retention_count_held
-- Events past their window that a hold keeps: reported by each run.
SELECT count(*) AS held
  FROM ledger.events e
 WHERE ledger.event_past_window(e.status, e.processed_at, e.updated_at, %(processed_days)s, %(failed_days)s)
   AND EXISTS (SELECT 1 FROM ledger.retention_holds h
                WHERE h.released_at IS NULL
                  AND (h.event_id = e.id OR h.customer_id = ledger.event_customer(e.payload)))

-- name: archive_file_record
-- A file written and read back: catalogued before any of its events is removed.
INSERT INTO ledger.archive_files (key, run_id, month, events, bytes, sha256, verified_at)
VALUES (%(key)s, %(run_id)s, %(month)s, %(events)s, %(bytes)s, %(sha256)s, now())

-- name: events_lock_archived
-- First statement of a removal's transaction: lock the page's events in id order (two
-- removals, or a removal and a replay, never deadlock). While they are locked nothing can
-- change them or add a row that names them (a delivery, an attempt, an effect: each
-- takes a key-share lock on the event), so the next statement, whose snapshot is taken
-- after these locks were granted, compares with the rows as they will be deleted.
SELECT e.id FROM ledger.events e WHERE e.id = ANY (%(ids)s::text[]) ORDER BY e.id FOR UPDATE

-- name: events_remove_archived
-- Archived and verified -> gone, with every row that names them (here: on a partitioned ledger
-- they name their event without a foreign key, so no cascade takes them): only an event whose
-- archive line is still what the file holds. created_from/created_to: the file's month on a
-- partitioned ledger (its partitions only are read), NULL on a plain one.
-- One that changed since (a delivery appended, a replay) stays, and the next run archives it again.
WITH archived AS (
    SELECT a.id, a.fingerprint FROM unnest(%(ids)s::text[], %(fingerprints)s::text[]) AS a(id, fingerprint)
), unchanged AS (
    SELECT l.id FROM ledger.event_archive_lines(%(ids)s::text[], %(created_from)s, %(created_to)s) AS l
      JOIN archived a ON a.id = l.id AND a.fingerprint = md5(l.line)
), gone AS (
    DELETE FROM ledger.events e USING unchanged u WHERE e.id = u.id
    RETURNING e.id
), deliveries AS (
    DELETE FROM ledger.deliveries x USING gone g WHERE x.event_id = g.id
       AND (%(created_from)s::timestamptz IS NULL
            OR (x.event_created >= %(created_from)s AND x.event_created < %(created_to)s))
), attempts AS (
    DELETE FROM ledger.attempts x USING gone g WHERE x.event_id = g.id
       AND (%(created_from)s::timestamptz IS NULL
            OR (x.event_created >= %(created_from)s AND x.event_created < %(created_to)s))
), audit AS (
    DELETE FROM ledger.audit x USING gone g WHERE x.event_id = g.id
), outbox AS (
    DELETE FROM ledger.outbox x USING gone g WHERE x.event_id = g.id
), health_alerts AS (
    DELETE FROM ledger.health_alerts x USING gone g WHERE x.event_id = g.id
), snapshot_twins AS (
    DELETE FROM ledger.snapshot_twins x USING gone g WHERE x.event_id = g.id
), replay_job_events AS (
    DELETE FROM ledger.replay_job_events x USING gone g WHERE x.event_id = g.id
)
SELECT id FROM gone

-- name: archive_file_removed
UPDATE ledger.archive_files SET removed = removed + %(removed)s WHERE key = %(key)s

-- name: archive_file_restored
UPDATE ledger.archive_files SET restored_at = now() WHERE key = %(key)s

-- name: archive_files_list
SELECT key, run_id, month, events, bytes, sha256, verified_at, removed, restored_at, created_at
  FROM ledger.archive_files
 ORDER BY month, created_at, key

-- name: events_restore_lines
-- Archive lines back into the ledger, in one transaction: how many were written (an event the
-- ledger has again is left as it is: ledger.event_restore_line).
SELECT count(*) FILTER (WHERE ledger.event_restore_line(l)) AS written FROM unnest(%(lines)s::text[]) AS l

-- name: retention_runs_recent
SELECT id, runner, status, processed_days, failed_days, archived, removed, changed, kept_by_hold,
       files, partitions_dropped, error, started_at, finished_at,
       extract(epoch FROM coalesce(finished_at, now()) - started_at) AS seconds
  FROM ledger.retention_runs
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: retention_health
SELECT extract(epoch FROM (SELECT max(finished_at) FROM ledger.retention_runs WHERE status = 'done'))::float8
           AS last_success_s,
       coalesce((SELECT status = 'failed' FROM ledger.retention_runs ORDER BY id DESC LIMIT 1), false) AS last_failed

-- name: retention_hold_add
INSERT INTO ledger.retention_holds (event_id, customer_id, reason, actor)
VALUES (%(event_id)s, %(customer_id)s, %(reason)s, %(actor)s)
RETURNING id

-- name: retention_hold_release
UPDATE ledger.retention_holds SET released_at = now(), released_by = %(actor)s
 WHERE id = %(id)s AND released_at IS NULL
RETURNING id

-- name: retention_holds_active
SELECT id, event_id, customer_id, reason, actor, created_at
  FROM ledger.retention_holds
 WHERE released_at IS NULL
 ORDER BY id
