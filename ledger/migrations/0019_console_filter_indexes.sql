-- migrate: outside a transaction
-- Console filters that match nothing in their range, fast on a large ledger (docs/console.md). The list
-- walks events_received_at_id_idx from the newest row and checks each row's filters on the heap; a
-- filter that matches nothing reads the whole range, twice (the page, then its count).
--
-- * livemode: a key column of the list's index, after the columns it is ordered by. A btree checks a
--   condition on any key column inside the index, so rows of the other mode are passed over without
--   their heap rows being read. Same entries as the index it replaces, which it then drops: the ingest
--   path writes no more than before.
-- * a type glob (invoice.*): the index of types in byte order (text_pattern_ops), which the bounds of
--   the glob's literal prefix read in any collation (ledger/event_query.py, glob_prefix_range); LIKE
--   reads no btree unless the database's collation is C. It replaces the index of types in the
--   collation's order: the same entries again.
-- * thin notifications (types v1.* and v2.*): an index of theirs only. A ledger of snapshot events
--   never writes an entry into it.
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_received_at_id_livemode_idx ON ledger.events (received_at DESC, id DESC, livemode);
DROP INDEX CONCURRENTLY IF EXISTS ledger.events_received_at_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_type_pattern_received_at_id_idx ON ledger.events (type text_pattern_ops, received_at DESC, id DESC);
DROP INDEX CONCURRENTLY IF EXISTS ledger.events_type_received_at_id_idx;
CREATE INDEX CONCURRENTLY IF NOT EXISTS events_thin_received_at_id_idx ON ledger.events (received_at DESC, id DESC) WHERE left(type, 3) IN ('v1.', 'v2.');
