-- migrate: outside a transaction
-- Console filters that match nothing in their range, fast on a large ledger (docs/console.md). The list
-- walks its index from the newest row in the range and checked each row's filters on the heap; a
-- filter that matches nothing read the whole range's rows, twice (the page, then its count).
--
-- * The list's index gains the mode and the type as key columns after the ones it is ordered by. A
--   btree checks a condition on any key column inside the index, so rows of the other mode, or of
--   types outside a glob's literal prefix, are passed over without their heap rows being read. The
--   type in byte order (text_pattern_ops), which the bounds of a glob's prefix read in any collation
--   (ledger/event_query.py, glob_prefix_range): LIKE reads no btree unless the database's collation
--   is C. Same entries as the index it replaces, which it then drops: the ingest path writes no more
--   entries than before.
-- * Thin notifications (types v1.* and v2.*): an index of theirs only. A ledger of snapshot events
--   never writes an entry into it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_list_idx ON ledger.events (received_at DESC, id DESC, livemode, type text_pattern_ops);
DROP INDEX CONCURRENTLY IF EXISTS ledger.events_received_at_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_thin_received_at_id_idx ON ledger.events (received_at DESC, id DESC) WHERE left(type, 3) IN ('v1.', 'v2.');
