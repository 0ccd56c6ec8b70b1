-- Every statement of ledger/migrate.py on the migration history, and what ledger/index_builds.py
-- reads of the catalog (the migrations themselves are the files in ledger/migrations).

-- name: migration_lock
-- Serialise concurrent `ledgerctl migrate` runs (several replicas may start at
-- once), for the whole run: a session lock, since a concurrent index build runs
-- outside any transaction. Tried, not waited for (ledger/migrate.py polls). The
-- key is any constant: it only has to be the same for every migrating process.
SELECT pg_try_advisory_lock(7346221901) AS locked

-- name: migration_unlock
SELECT pg_advisory_unlock(7346221901) AS unlocked

-- name: migration_history_create
-- The history itself, made sure of before each migration is looked up in it.
CREATE SCHEMA IF NOT EXISTS ledger;
CREATE TABLE IF NOT EXISTS ledger.schema_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: migration_history_exists
-- Whether there is a history yet: `ledgerctl migrate --check` reads it without creating it.
SELECT to_regclass('ledger.schema_migrations') IS NOT NULL AS exists

-- name: migration_history
SELECT version, name, checksum FROM ledger.schema_migrations

-- name: migration_record
-- In the migration's own transaction: the migration and its history row commit together. For one
-- run outside a transaction, once each of its indexes is built and valid.
INSERT INTO ledger.schema_migrations (version, name, checksum) VALUES (%(version)s, %(name)s, %(checksum)s)

-- name: index_table
-- The table an index of a migration run outside a transaction goes on (ledger/index_builds.py): its
-- kind (r plain, p partitioned) and its rows as last counted, for what `ledgerctl migrate` says.
SELECT c.oid, c.relkind AS kind, greatest(c.reltuples, 0)::bigint AS rows
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relname = %(table)s

-- name: index_validity
-- Whether an index is there, and valid: an interrupted concurrent build leaves it INVALID.
SELECT x.indisvalid AS valid
  FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relname = %(name)s

-- name: index_partitions
-- A partitioned table's partitions, each with whether it has an index attached to the parent's yet.
SELECT c.relname AS name, c.relkind AS kind, greatest(c.reltuples, 0)::bigint AS rows,
       EXISTS (SELECT 1 FROM pg_inherits ii JOIN pg_index x ON x.indexrelid = ii.inhrelid
                WHERE ii.inhparent = to_regclass(%(parent_index)s) AND x.indrelid = c.oid) AS attached
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = %(table)s
 ORDER BY c.relname

-- name: index_kind
-- An index a migration drops: its kind (i an index, I a partitioned table's), if it is there.
SELECT c.relkind AS kind
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relname = %(name)s AND c.relkind IN ('i', 'I')
