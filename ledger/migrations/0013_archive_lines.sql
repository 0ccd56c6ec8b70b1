-- Archive lines built for what they are: a few thousand ids at a time (docs/retention.md).
--
-- ledger.event_archive_lines (migration 0011) joined every table naming events to the ids, with
-- estimates of millions of rows: Postgres compiled its plan with JIT on every call (seconds per
-- slice of 5,000 events, more than building the lines), and, on a partitioned ledger, looked
-- each id up in every month's partition of events, deliveries and attempts. Now each event's
-- rows are read by index, in its month's partitions only, without JIT; a caller that knows the
-- month the events are in (a partition's slice, a month's archive file) passes its bounds, and
-- the events themselves are read in that month's partition only.
--
-- The bounds are for a partitioned ledger only, where every row names its event's `created`
-- (event_created, NOT NULL there). On a plain ledger, rows recorded before migration 0012 have
-- none, and a caller passes no bounds (ledger/retention.py).
DROP FUNCTION IF EXISTS ledger.event_archive_lines(text[]);

CREATE OR REPLACE FUNCTION ledger.event_archive_lines(ids text[], created_from timestamptz DEFAULT NULL,
                                                      created_to timestamptz DEFAULT NULL)
RETURNS TABLE (id text, month text, line text)
LANGUAGE plpgsql STABLE
SET jit = off
AS $$
DECLARE
    events_in text := '';
    same_month text := '';
BEGIN
    IF created_from IS NOT NULL THEN
        events_in := ' AND e.stripe_created >= $2 AND e.stripe_created < $3';
    END IF;
    IF ledger.is_partitioned() THEN
        same_month := ' AND x.event_created = e.stripe_created';
    END IF;
    -- Each table's rows per event by its index (a scalar subquery runs per event whatever the
    -- estimates: joined, a slice's thousands of ids made the planner read whole tables), and on
    -- a partitioned ledger in its event's month's partition only (pruned as it runs).
    -- json_agg puts a newline between elements: outside strings a newline is only whitespace
    -- (inside one it is escaped), so it becomes a space, and the line stays one line.
    RETURN QUERY EXECUTE format($q$
    SELECT e.id, to_char(e.stripe_created AT TIME ZONE 'UTC', 'YYYY-MM'),
           replace(json_build_object(
               'event', ledger.event_row_json(e), 'payload', e.payload::text,
               'deliveries', coalesce((SELECT json_agg(x ORDER BY x.delivered_at, x.source) FROM ledger.deliveries x
                                        WHERE x.event_id = e.id%2$s), '[]'),
               'attempts', coalesce((SELECT json_agg(x ORDER BY x.attempt) FROM ledger.attempts x
                                      WHERE x.event_id = e.id%2$s), '[]'),
               'audit', coalesce((SELECT json_agg(x ORDER BY x.id) FROM ledger.audit x WHERE x.event_id = e.id), '[]'),
               'outbox', coalesce((SELECT json_agg(x ORDER BY x.id) FROM ledger.outbox x WHERE x.event_id = e.id), '[]'),
               'health_alerts', coalesce((SELECT json_agg(x) FROM ledger.health_alerts x WHERE x.event_id = e.id), '[]'),
               'snapshot_twins', coalesce((SELECT json_agg(x ORDER BY x.snapshot_event_id) FROM ledger.snapshot_twins x
                                            WHERE x.event_id = e.id), '[]'),
               'replay_job_events', coalesce((SELECT json_agg(x ORDER BY x.job_id) FROM ledger.replay_job_events x
                                               WHERE x.event_id = e.id), '[]'))::text, E'\n', ' ')
      FROM ledger.events e WHERE e.id = ANY ($1)%1$s
    $q$, events_in, same_month) USING ids, created_from, created_to;
END
$$;
