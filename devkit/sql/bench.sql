-- The benchmarks (devkit/benchmarks/): set-up, resets, the counters they read, and the
-- states they put the ledger in. The monitor role's statements (bench_monitor) are left
-- out of every count, so none of these is ever measured. What pgbench runs to measure
-- the limit is the product's own SQL (ledger.queries.SQL), not anything here.

-- Set-up (devkit/benchmarks/pg.py).

-- name: bench_role_exists
SELECT 1 FROM pg_roles WHERE rolname = %(role)s

-- name: bench_role_create
-- The role the benchmark reads its counters with, so that its own statements can be left out.
CREATE ROLE {role} LOGIN SUPERUSER

-- name: bench_statements_extension
-- Statement counts per event (cost, statements_by_name); preloaded by the private server.
CREATE EXTENSION IF NOT EXISTS pg_stat_statements

-- name: bench_schema_create
-- A schema for tables of the benchmark's own, next to the ledger's.
CREATE SCHEMA IF NOT EXISTS bench

-- State between measurements.

-- name: bench_tables_to_reset
-- Every table a scenario fills (the migrations' bookkeeping excepted).
SELECT format('%I.%I', schemaname, tablename) FROM pg_tables
 WHERE schemaname IN ('ledger', 'billing', 'bench') AND tablename <> 'schema_migrations'

-- name: bench_truncate
-- A fresh, empty ledger for the next measurement: no product door empties the ledger.
TRUNCATE {tables}

-- name: bench_vacuum_analyze
-- After a reset or a load: the planner's statistics and the visibility map as a settled ledger has them.
VACUUM ANALYZE {tables}

-- name: bench_vacuum_analyze_index_cleanup
-- The same, with the indexes cleaned however few rows died: a plain VACUUM skips them under
-- 2 percent dead pages, leaving the entries of rows that left a partial index in it.
VACUUM (ANALYZE, INDEX_CLEANUP ON) {tables}

-- name: bench_delete_unfinished
-- Back to the history alone between measurements on the 1M-event ledger (TRUNCATE would
-- take the history too): the unfinished rows the last scenario left, with their deliveries
-- and attempts (named without a foreign key on a partitioned ledger). No product door deletes
-- events; this is the benchmark's reset.
WITH gone AS (
    DELETE FROM ledger.events WHERE status IN ('received', 'processing', 'failed_recoverable') RETURNING id
), deliveries AS (
    DELETE FROM ledger.deliveries d USING gone g WHERE d.event_id = g.id
)
DELETE FROM ledger.attempts a USING gone g WHERE a.event_id = g.id

-- Counters.

-- name: bench_unfinished_count
-- Progress of a drain, and the backlog depth during the burst (partial index: cheap at any size).
SELECT count(*) FROM ledger.events WHERE status IN ('received', 'processing', 'failed_recoverable')

-- name: bench_oldest_unfinished_age_s
SELECT extract(epoch FROM now() - min(received_at)) FROM ledger.events
 WHERE status IN ('received', 'processing', 'failed_recoverable')

-- name: bench_backlog_depth_and_age
-- The burst's sampler, every 0.25 s: backlog depth and the oldest unprocessed event's age now.
SELECT count(*), coalesce(extract(epoch FROM clock_timestamp() - min(received_at)), 0)
  FROM ledger.events WHERE status IN ('received', 'processing', 'failed_recoverable')

-- name: bench_clock
SELECT clock_timestamp()

-- name: bench_statements_reset
-- The start of a metered phase: pg_stat_statements from zero.
SELECT pg_stat_statements_reset()

-- name: bench_stats_clear_snapshot
-- pg_stat_database is read once per transaction: without this a second read repeats the first.
SELECT pg_stat_clear_snapshot()

-- name: bench_transactions
-- Transactions per event: this database's commits and rollbacks so far.
SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()

-- name: bench_statements
-- Statements per event, by name: this database's pg_stat_statements without the monitor's own.
SELECT s.query, s.calls, s.rows, s.total_exec_time FROM pg_stat_statements s
  JOIN pg_database d ON d.oid = s.dbid JOIN pg_roles r ON r.oid = s.userid
 WHERE d.datname = current_database() AND r.rolname <> %(monitor_role)s ORDER BY s.calls DESC

-- name: bench_backends_terminate
-- The receiver's or a worker's backends exit, and publish their transaction counters as they do
-- (Postgres 15 publishes an idle backend's counters up to 10 s late).
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
 WHERE application_name = %(application_name)s AND datname = current_database()

-- name: bench_backends_count
SELECT count(*) FROM pg_stat_activity WHERE application_name = %(application_name)s

-- Outcomes of a scenario's events.

-- name: bench_run_stats
-- The burst: processed or not, first claim, last finish, longest wait, first receipt.
SELECT count(*) FILTER (WHERE e.status = 'processed'), count(*) FILTER (WHERE e.status <> 'processed'),
       extract(epoch FROM min(a.started_at)), extract(epoch FROM max(e.processed_at)),
       extract(epoch FROM max(e.processed_at - e.received_at)), extract(epoch FROM min(e.received_at))
  FROM ledger.events e LEFT JOIN ledger.attempts a ON a.event_id = e.id AND a.attempt = 1
 WHERE e.id = ANY(%(ids)s)

-- name: bench_events_failed_count
-- A drain's errors: its events that ended failed (recoverable or permanent).
SELECT count(*) FROM ledger.events WHERE id = ANY(%(ids)s) AND status LIKE 'failed%%'

-- name: bench_events_processed_count
-- What pgbench processed of its copy of the backlog.
SELECT count(*) FROM ledger.events WHERE id = ANY(%(ids)s) AND status = 'processed'

-- name: bench_events_present
-- The burst's deliveries that have their ledger row (acknowledged means committed).
SELECT id FROM ledger.events WHERE id = ANY(%(ids)s)

-- name: bench_events_count
-- The replay starts once the live ingest is recording deliveries.
SELECT count(*) FROM ledger.events

-- name: bench_replay_window
-- The replay's start, end and size, from its audit rows (one per replayed event).
SELECT extract(epoch FROM min(at)), extract(epoch FROM max(at)), count(*) FROM ledger.audit

-- name: bench_live_events_during_replay
-- Live deliveries recorded while the replay ran: the live ingest's rate during it.
SELECT count(*) FROM ledger.events
 WHERE received_at BETWEEN (SELECT min(at) FROM ledger.audit) AND (SELECT max(at) FROM ledger.audit)
   AND NOT id = ANY(%(ids)s)

-- States a scenario starts from. Written straight into ledger.events: the states a worker
-- or the sweep would have left, for a thousand or ten thousand rows at once, before any
-- process runs (the product moves rows one attempt at a time, and only as it happens).

-- name: bench_seed_failed_permanent
-- The replay's backlog: events that gave up (no handler), for ledgerctl replay to take back.
UPDATE ledger.events
   SET status = 'failed_permanent', failure_reason = 'unsupported_type',
       last_error = 'no handler (benchmark)', attempts = 1, updated_at = now()
 WHERE id = ANY(%(ids)s)

-- name: bench_seed_overdue_wakeups
-- The sweep's unfinished set: received events whose wake-up is an hour overdue.
UPDATE ledger.events SET wakeup_at = now() - interval '1 hour' WHERE id = ANY(%(ids)s)

-- name: bench_seed_scheduled_retries
-- The sweep's unfinished set: retries due in an hour (the sweep must leave them).
UPDATE ledger.events
   SET status = 'failed_recoverable', failure_reason = 'db_unavailable', attempts = 1,
       next_attempt_at = now() + interval '1 hour'
 WHERE id = ANY(%(ids)s)

-- name: bench_seed_live_leases
-- The sweep's unfinished set: attempts in progress under a lease an hour from expiry.
UPDATE ledger.events
   SET status = 'processing', lease_owner = 'bench', attempts = 1, lease_expires_at = now() + interval '1 hour'
 WHERE id = ANY(%(ids)s)

-- The sweep's query and the history's indexes (scale).

-- name: bench_explain
-- The plan and timing of a product statement (the sweep's), rolled back by the caller.
EXPLAIN (ANALYZE, BUFFERS) {statement}

-- name: bench_events_partial_indexes
-- The unfinished-set partial indexes of ledger.events, which the sweep's plan should use.
SELECT indexname FROM pg_indexes
 WHERE schemaname = 'ledger' AND tablename = 'events' AND indexdef LIKE %(pattern)s

-- name: bench_history_secondary_indexes
-- Indexes dropped for the history's load and rebuilt from their own definitions after it
-- (partial indexes stay: the history is not in them; primary keys stay). A partitioned table's
-- definition reads ON ONLY, which would rebuild the parent's index alone, without its partitions'.
SELECT indexname, replace(indexdef, ' ON ONLY ', ' ON ') FROM pg_indexes
 WHERE schemaname = 'ledger' AND tablename IN ('events', 'deliveries')
   AND indexdef NOT LIKE '% WHERE %' AND indexname NOT LIKE '%pkey'

-- name: bench_index_drop
DROP INDEX {index}

-- name: bench_checkpoint
-- The history's dirty pages written now, not in a checkpoint during the measurements after it.
CHECKPOINT

-- name: bench_relation_sizes
SELECT relname, pg_total_relation_size(oid) FROM pg_class
 WHERE relname IN ('events', 'deliveries', 'attempts', 'subscriptions', 'invoices',
                   'customers', 'subscription_transitions', 'entitlements') AND relkind = 'r'

-- name: bench_rows
SELECT count(*) FROM {table}

-- name: bench_database_size
SELECT pg_database_size(current_database())

-- name: bench_wal_lsn
-- Where the WAL is now: a phase's WAL bytes are the difference of two (bench_wal_bytes_since).
SELECT pg_current_wal_lsn()::text

-- name: bench_wal_bytes_since
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %(lsn)s::pg_lsn)::bigint
