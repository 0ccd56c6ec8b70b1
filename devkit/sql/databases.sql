-- Databases of their own for the chaos run, the benchmarks and devstack (names composed in by devkit.sql.compose).

-- name: database_create
-- A fresh database for one run: the chaos run's pair, the benchmark's ledger_bench.
CREATE DATABASE {database}

-- name: database_drop
-- The end of a run (or a benchmark's leftover from an interrupted one); FORCE ends its sessions.
DROP DATABASE IF EXISTS {database} WITH (FORCE)

-- name: database_exists
-- devstack: create the database of DATABASE_URL only when it is missing.
SELECT 1 FROM pg_database WHERE datname = %(database)s
