-- Named SQL of the peer (devkit/benchmarks/peer): what the benchmark reads and resets in the
-- sync engine's own database. The engine's statements are its own; none of them is here.
-- Same convention as ledger/sql/*.sql (ledger.queries); identifiers go through devkit.sql.compose.

-- name: peer_tables
-- The tables the engine's migrations created in its schema.
SELECT table_name FROM information_schema.tables WHERE table_schema = 'stripe'

-- name: peer_data_tables
-- The engine's data tables: every table of its schema but its migrations' and account
-- bookkeeping, emptied after the warm-up as the ledger is.
SELECT table_name FROM information_schema.tables
 WHERE table_schema = 'stripe' AND table_type = 'BASE TABLE'
   AND table_name NOT IN ('_migrations', 'accounts', '_managed_webhooks')

-- name: peer_truncate
TRUNCATE {tables}

-- name: peer_vacuum
-- Back to the state of a fresh database: statistics of empty tables.
VACUUM ANALYZE

-- name: peer_rows
SELECT count(*) FROM {table}

-- name: peer_ids
-- The objects the engine wrote: each event's object must be among them (applied, not only acknowledged).
SELECT id FROM {table}

-- name: peer_last_write
-- When the engine last inserted or updated a row of this table (its _updated_at: now() of the
-- upsert's transaction): the end of its run when later than wrk's last answer.
SELECT extract(epoch FROM max(_updated_at))::float8 FROM {table}
