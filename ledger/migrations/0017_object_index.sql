-- migrate: outside a transaction
-- An object's events found by its id (`ledgerctl objects show`, the console's object page, a repair
-- scoped to an object or a customer: workers/object_view.py) without reading the ledger: by the ids
-- the receiver records with each event since migration 0016, and, for an event recorded before,
-- by its payload (an index of those only: a new event never enters it, so it costs ingest nothing).
-- Built concurrently (ledger/index_builds.py): on a ledger of millions of events a build inside a
-- transaction would hold the receiver's inserts until it ends.
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_object_idx ON ledger.events (object_id) WHERE object_id IS NOT NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_customer_idx ON ledger.events (customer_id) WHERE customer_id IS NOT NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_payload_object_idx ON ledger.events ((payload -> 'data' -> 'object' ->> 'id')) WHERE object_id IS NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_payload_customer_idx ON ledger.events ((payload -> 'data' -> 'object' ->> 'customer')) WHERE object_id IS NULL;
