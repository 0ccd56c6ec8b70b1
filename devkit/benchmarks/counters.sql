-- Named SQL of the benchmark's own counters (devkit/benchmarks; the rest is in devkit/sql/bench.sql).
-- Same convention as ledger/sql/*.sql (ledger.queries).

-- name: bench_deadlocks
-- Deadlocks Postgres detected in these databases since the server started (a backend publishes
-- its count when its transaction ends, at most once a second, and when it exits: callers read it
-- once the measured processes have stopped). The monitor's own snapshot is cleared first.
SELECT coalesce(sum(deadlocks), 0)::bigint FROM pg_stat_database WHERE datname = ANY(%(databases)s)

-- name: bench_attempts_deadlocked
-- Attempts of these events that failed on a deadlock (ledger.attempts.error_class is the
-- exception's class: psycopg's DeadlockDetected, SQLSTATE 40P01).
SELECT count(*) FROM ledger.attempts WHERE event_id = ANY(%(ids)s) AND error_class = 'DeadlockDetected'

-- name: bench_backends_of
-- Backends of one application still connected (any database): 0 once its processes have exited.
SELECT count(*) FROM pg_stat_activity WHERE application_name = %(application_name)s

-- name: bench_commits_of
-- Transactions committed in these databases so far (published as for bench_deadlocks: read once the
-- measured processes have stopped). Every system pays a commit per transaction, so this is its cost.
SELECT coalesce(sum(xact_commit), 0)::bigint FROM pg_stat_database WHERE datname = ANY(%(databases)s)

-- name: bench_statement_calls_of
-- Statements run in these databases since pg_stat_statements was last reset, by every role.
SELECT coalesce(sum(s.calls), 0)::bigint FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
 WHERE d.datname = ANY(%(databases)s)
