-- migrate: outside a transaction
-- An object's events found by its id (`ledgerctl objects show`, the console's object page, a repair
-- scoped to an object or a customer: workers/object_view.py, workers/object_repair.py) without
-- reading the ledger, by the ids the receiver records with each event since migration 0016.
--
-- Only events that reached an end (processed, failed_permanent) are indexed by them. Each change of
-- an event's status writes a new row version into every index whose predicate holds for it, and an
-- event is written three times on its way (received, processing, processed): an index of every event
-- cost the receiver and the workers about three entries per event, indexed only at its end it costs
-- one. An event still on its way is found through the index of unfinished events (0008's
-- events_unfinished_wakeup_idx): the backlog, not the ledger.
--
-- An event recorded before 0016 is found by its payload, through an index of those events only: a
-- new event never enters it. Built concurrently (ledger/index_builds.py): on a ledger of millions of
-- events a build inside a transaction would hold the receiver's inserts until it ends.
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_object_idx ON ledger.events (object_id) WHERE object_id IS NOT NULL AND status IN ('processed', 'failed_permanent');
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_customer_idx ON ledger.events (customer_id) WHERE customer_id IS NOT NULL AND status IN ('processed', 'failed_permanent');
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_payload_object_idx ON ledger.events ((payload -> 'data' -> 'object' ->> 'id')) WHERE object_id IS NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_payload_customer_idx ON ledger.events ((payload -> 'data' -> 'object' ->> 'customer')) WHERE object_id IS NULL;
