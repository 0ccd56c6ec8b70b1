-- Every statement of ledger/migrate.py on the migration history (the migrations
-- themselves are the files in ledger/migrations).

-- name: migration_lock
-- Serialise concurrent `ledgerctl migrate` runs (several replicas may start at
-- once) until the end of this migration's transaction. The key is any constant:
-- it only has to be the same for every migrating process.
SELECT pg_advisory_xact_lock(7346221901)

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
-- In the migration's own transaction: the migration and its history row commit together.
INSERT INTO ledger.schema_migrations (version, name, checksum) VALUES (%(version)s, %(name)s, %(checksum)s)
