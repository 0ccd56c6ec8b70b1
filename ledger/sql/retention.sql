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
-- partition with its bounds (its events' rows are read in that month's partitions only).
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
-- snapshot held between slices). Excluded: an event with an effect still to deliver, and a
-- held one (by id, or by the customer its payload names). The relation: one of
-- events_heap_blocks' (a TID range means something in one heap, not across a partitioned
-- table's); the columns: what ledger/archive_lines.py builds the events' lines from.
SELECT {columns}
  FROM {relation} e
 WHERE e.ctid >= format('(%%s,0)', %(first_block)s::bigint)::tid
   AND e.ctid < format('(%%s,0)', %(end_block)s::bigint)::tid
   AND ledger.event_past_window(e.status, e.processed_at, e.updated_at, %(processed_days)s, %(failed_days)s)
   AND NOT EXISTS (SELECT 1 FROM ledger.outbox o
                    WHERE o.event_id = e.id AND o.status NOT IN ('sent', 'failed_permanent'))
   AND NOT EXISTS (SELECT 1 FROM ledger.retention_holds h
                    WHERE h.released_at IS NULL
                      AND (h.event_id = e.id OR h.customer_id = ledger.event_customer(e.payload)))

-- name: archive_session_utc
-- An archive line's timestamps say +00:00, whatever the server's or the runner's time zone.
SET TIME ZONE 'UTC'

-- name: archive_table_columns
-- A ledger table's columns in row_to_json's order, with their types: what an archive line holds.
SELECT attname::text AS name, format_type(atttypid, NULL) AS type
  FROM pg_attribute
 WHERE attrelid = %(table)s::regclass AND attnum > 0 AND NOT attisdropped
 ORDER BY attnum

-- name: archive_slice_ids_create
-- A builder's slice's event ids, for its statements to read (a transaction's: emptied at its end).
CREATE TEMPORARY TABLE IF NOT EXISTS archive_slice_ids (id text NOT NULL) ON COMMIT DELETE ROWS

-- name: archive_slice_ids_copy
COPY archive_slice_ids (id) FROM STDIN

-- name: archive_rows_of
-- The rows of one table naming these events, for their archive lines: each event's in its
-- line's order. The columns: the row's place (its event's version) and its columns; the month:
-- archive_rows_in_month for a table partitioned by its event's month, else TRUE.
SELECT {columns}
  FROM {table} x
 WHERE x.event_id = ANY (ARRAY(SELECT id FROM archive_slice_ids)) AND {month}
 ORDER BY x.event_id, {order}

-- name: archive_row_places
-- Where each row naming these events is, and which transaction wrote it: their versions
-- now (ledger/archive_lines.py), compared under their locks with those of their lines.
SELECT {event_id} AS event_id, x.tableoid::text || ':' || x.ctid::text || ':' || x.xmin::text AS place
  FROM {table} x
 WHERE {event_id} = ANY (%(ids)s::text[]) AND {month}

-- name: archive_rows_in_month
-- A fragment: the rows of a table partitioned by month, in the month of created_from..created_to
-- only (NULL: every month).
(%(created_from)s::timestamptz IS NULL
 OR (x.event_created >= %(created_from)s::timestamptz AND x.event_created < %(created_to)s::timestamptz))

-- name: archive_events_in_month
-- A fragment: archive_rows_in_month for the events themselves.
(%(created_from)s::timestamptz IS NULL
 OR (x.stripe_created >= %(created_from)s::timestamptz AND x.stripe_created < %(created_to)s::timestamptz))

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
-- they name their event without a foreign key, so no cascade takes them). %(ids)s: the page's
-- events whose version is still their line's (archive_row_places, under events_lock_archived's
-- locks); one that changed since (a delivery appended, a replay) is not among them: it stays,
-- and the next run archives it again. created_from/created_to: the file's month on a
-- partitioned ledger (its partitions only are read), NULL on a plain one.
WITH gone AS (
    DELETE FROM ledger.events e
     WHERE e.id = ANY (%(ids)s::text[])
       AND (%(created_from)s::timestamptz IS NULL
            OR (e.stripe_created >= %(created_from)s AND e.stripe_created < %(created_to)s))
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
