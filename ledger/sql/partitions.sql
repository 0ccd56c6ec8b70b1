-- The ledger's time partitions (migration 0012; docs/retention.md, "Partitions").

-- name: partitions_ensure
-- Sweep: this month's partitions and the next `ahead` months', where missing (the function
-- takes its own advisory lock and a one-second lock timeout); the events partitions made.
SELECT ledger.partitions_ensure(%(ahead)s::integer) AS name

-- name: partitions_health
-- Metrics, ledgerctl partitions: whether the ledger is partitioned, how many months after the
-- current one have their partitions, and the events outside every planned month.
SELECT ledger.is_partitioned() AS partitioned,
       (SELECT count(*) FROM ledger.event_partitions() p
         WHERE p.starts >= date_trunc('month', now()) + interval '1 month') AS months_ahead,
       ledger.partition_strays() AS strays

-- name: partitions_list
-- ledgerctl partitions: every partition of ledger.events, oldest first, with its range.
SELECT name, starts, ends, is_default FROM ledger.event_partitions()

-- The online migration (ledger/partition_migration.py; the functions are migration 0012's).

-- name: partition_migration_try_lock
-- One migration at a time: a session-level advisory lock on a connection of its own.
SELECT pg_try_advisory_lock(hashtextextended('ledger.partition_migration', 0)) AS locked

-- name: partition_migration_unlock
SELECT pg_advisory_unlock(hashtextextended('ledger.partition_migration', 0))

-- name: partition_migration_state
-- Where a migration stands: no row (not started), mirroring (twins filled, not swapped), done.
SELECT ledger.is_partitioned() AS partitioned,
       (SELECT phase FROM ledger.partition_migration) AS phase,
       (SELECT mirrored_from FROM ledger.partition_migration) AS mirrored_from

-- name: partition_migration_months
-- The months the twins get a partition of: every month that has events (one pass over the
-- table, before anything is locked), and from the one 31 days back (Stripe's catch-up horizon:
-- the oldest event a catch-up may still bring) to `ahead` after this one.
SELECT DISTINCT date_trunc('month', stripe_created AT TIME ZONE 'UTC')::date AS month FROM ledger.events
UNION
SELECT generate_series(date_trunc('month', now() - interval '31 days'),
                       date_trunc('month', now()) + make_interval(months => %(ahead)s), interval '1 month')::date
ORDER BY 1

-- name: partition_migration_twins
SELECT ledger.partition_migration_twins(%(months)s::date[])

-- name: partition_migration_mirror
-- The triggers, in one transaction that waits at most lock_ms for the writers in flight.
SELECT set_config('lock_timeout', %(lock_ms)s || 'ms', true), ledger.partition_migration_mirror() AS since

-- name: partition_backfill_events
-- The next batch of events by id into the twin. FOR KEY SHARE: a delete (retention) waits for
-- this batch, then its trigger removes the copy; an update does not wait, and its trigger's
-- upsert (or this batch's copy of the newer row) leaves the newest in the twin.
WITH batch AS (
    SELECT * FROM ledger.events WHERE id > %(after)s ORDER BY id LIMIT %(batch)s FOR KEY SHARE
), copied AS (
    INSERT INTO ledger.events_partitioned SELECT * FROM batch ON CONFLICT DO NOTHING
)
SELECT max(id) AS last, count(*) AS read FROM batch

-- name: partition_backfill_attempts
-- The next batch of attempts by (event_id, attempt) into the twin, each with its event's time.
WITH batch AS (
    SELECT a AS r, a.event_id, a.attempt FROM ledger.attempts a
     WHERE (a.event_id, a.attempt) > (%(after_event)s, %(after_attempt)s)
     ORDER BY a.event_id, a.attempt LIMIT %(batch)s FOR KEY SHARE
), copied AS (
    INSERT INTO ledger.attempts_partitioned
    SELECT (jsonb_populate_record(b.r, jsonb_build_object('event_created', e.stripe_created))).*
      FROM batch b JOIN ledger.events_partitioned e ON e.id = b.event_id
    ON CONFLICT DO NOTHING
)
SELECT (SELECT event_id FROM batch ORDER BY event_id DESC, attempt DESC LIMIT 1) AS last_event,
       (SELECT attempt FROM batch ORDER BY event_id DESC, attempt DESC LIMIT 1) AS last_attempt,
       (SELECT count(*) FROM batch) AS read

-- name: partition_backfill_deliveries_reset
-- Deliveries have no key to meet on: a backfill that starts again removes what an earlier
-- one copied (those recorded before the triggers), then copies them all once.
DELETE FROM ledger.deliveries_partitioned WHERE delivered_at < %(since)s

-- name: partition_backfill_deliveries_blocks
SELECT pg_relation_size('ledger.deliveries') / current_setting('block_size')::bigint AS blocks

-- name: partition_backfill_deliveries
-- A slice of the deliveries' heap (a TID range) recorded before the triggers began, each with
-- its event's time; the ones after are the triggers'.
INSERT INTO ledger.deliveries_partitioned
SELECT (jsonb_populate_record(d, jsonb_build_object('event_created', e.stripe_created))).*
  FROM ledger.deliveries d JOIN ledger.events_partitioned e ON e.id = d.event_id
 WHERE d.ctid >= format('(%%s,0)', %(first_block)s::bigint)::tid
   AND d.ctid < format('(%%s,0)', %(end_block)s::bigint)::tid
   AND d.delivered_at < %(since)s

-- name: partition_dependents_guard
-- A table naming events gets event_created on every row before the swap: a CHECK, not
-- validated (new rows are checked at once), then validated once the old rows are set, so that
-- the swap's SET NOT NULL needs no scan.
SELECT format('ALTER TABLE ledger.%%I ADD CONSTRAINT %%I CHECK (event_created IS NOT NULL) NOT VALID',
              name, name || '_event_created_set') AS ddl,
       format('ALTER TABLE ledger.%%I VALIDATE CONSTRAINT %%I', name, name || '_event_created_set') AS validate,
       name
  FROM ledger.event_dependent_tables()

-- name: partition_dependents_backfill
-- Up to `batch` rows of a table naming events without event_created, given their event's.
-- ({table}: one of ledger.event_dependent_tables().)
WITH batch AS (
    SELECT x.ctid AS row_id, e.stripe_created FROM {table} x JOIN ledger.events e ON e.id = x.event_id
     WHERE x.event_created IS NULL LIMIT %(batch)s
)
UPDATE {table} x SET event_created = b.stripe_created FROM batch b WHERE x.ctid = b.row_id

-- name: lock_timeout
-- The first statement of a transaction that takes the ledger's tables' locks (the migration's
-- steps, a month's watch, swap and drop): how long each lock may be waited for (a receiver's
-- insert queues behind the wait meanwhile).
SELECT set_config('lock_timeout', %(lock_ms)s || 'ms', true)

-- name: partition_migration_lock
-- Then the tables, exclusively, in the order the receiver and the workers take them: events first
-- (a worker's transaction starts with its claim), then the tables written after it, those naming
-- events among them ({dependents}: the swap alters them too). Taken later, one of those would be
-- waited for while a writer holding it waits for events: a deadlock, not a lock timeout.
LOCK TABLE ledger.events, ledger.attempts, ledger.deliveries{dependents} IN ACCESS EXCLUSIVE MODE

-- name: event_dependent_tables
SELECT name FROM ledger.event_dependent_tables() ORDER BY name

-- name: partition_migration_counts
-- Before the swap, in one snapshot: the rows of each table and of its twin (they must be equal).
SELECT (SELECT count(*) FROM ledger.events) AS events, (SELECT count(*) FROM ledger.events_partitioned) AS events_twin,
       (SELECT count(*) FROM ledger.attempts) AS attempts,
       (SELECT count(*) FROM ledger.attempts_partitioned) AS attempts_twin,
       (SELECT count(*) FROM ledger.deliveries) AS deliveries,
       (SELECT count(*) FROM ledger.deliveries_partitioned) AS deliveries_twin

-- name: partition_migration_swap
SELECT ledger.partition_migration_swap()

-- name: partition_migration_cleanup
-- After the swap: the tables set aside dropped. The caller holds their locks (lock_exclusive).
SELECT ledger.partition_migration_cleanup()

-- name: partition_migration_set_aside
-- The tables the swap set aside that are still there, events first.
SELECT t.name || '_before_partitions' AS name
  FROM ledger.partitioned_tables() t
 WHERE to_regclass(format('ledger.%%I', t.name || '_before_partitions')) IS NOT NULL
 ORDER BY t.name <> 'events', t.name

-- name: lock_exclusive
-- Tables nobody writes any more, about to be dropped (the tables a migration's swap set aside, the
-- partitions a month's swap detached), exclusively, events first. A statement planned before the
-- swap still locks them (events, then the others) before Postgres sees its plan is stale and
-- plans it again. Dropped one by one, a drop holding the old deliveries would wait for such a
-- statement while it waits for the drop. {tables}: events' first.
LOCK TABLE {tables} IN ACCESS EXCLUSIVE MODE

-- name: partition_migration_abort
SELECT ledger.partition_migration_abort()
