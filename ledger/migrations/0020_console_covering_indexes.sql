-- migrate: outside a transaction
-- The console's overview and failure groups without reading the rows they count (docs/console.md). They
-- counted the backlog and the failed events through indexes that named the rows, then read each row in the
-- heap for a column the index lacked (its status, reason, next attempt, lease): on a ledger of millions of
-- events, a heap page per row, over 100 ms for each page. The indexes here hold every column those
-- statements read (console_unfinished, console_failure_groups), so they are index-only scans; a row's heap
-- page is still read where the visibility map does not vouch for it (rows written since (auto)vacuum last
-- passed). Each replaces an index of the same rows, which it then drops: an event that never fails writes
-- no more index entries than before.
--
-- * Failed events, both failure states: status, type, updated_at (after the status, the keys of the index
--   of failed_permanent events it replaces, so whatever read that one reads this one alike), the failure
--   reason and when a recoverable one is due. Entries: one per failure, as before, now for recoverable
--   failures too.
-- * Events being processed: the liveness key of migration 0010's index (the rescuer's), and the lease's
--   expiry, for the overview's expired leases (and the rescuer's owners, read from the index too). Same
--   rows, each entry 8 bytes wider.
--
-- Every statement that changes a column added here changes an indexed column already (status, updated_at,
-- wakeup_at): no update that was HOT stops being so.
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_failed_idx ON ledger.events (status, type, updated_at) INCLUDE (failure_reason, next_attempt_at) WHERE status IN ('failed_permanent', 'failed_recoverable');
DROP INDEX CONCURRENTLY IF EXISTS ledger.events_failed_permanent_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_processing_lease_idx ON ledger.events (lease_liveness_key) INCLUDE (lease_expires_at) WHERE status = 'processing';
DROP INDEX CONCURRENTLY IF EXISTS ledger.events_processing_liveness_idx;
