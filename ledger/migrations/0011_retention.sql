-- Retention: final events leave the ledger only through the archive (docs/retention.md).
--
-- An event leaves with every row that names it (deliveries, attempts, audit, outbox,
-- health alerts, snapshot twins, replay job members): one JSON line per event, built by
-- ledger.event_archive_lines, and put back by ledger.event_restore_line. Both live here, in
-- one place, so that what is archived, what is compared before a removal and what a
-- restore writes can never disagree.

-- Holds keep matching events in the ledger past every window (a dispute, an audit, a
-- customer's request). By event id, or by customer: an event whose data.object is the
-- customer or names it in its `customer` field.
CREATE TABLE IF NOT EXISTS ledger.retention_holds (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    text        CHECK (event_id LIKE 'evt\_%'),
    customer_id text        CHECK (customer_id LIKE 'cus\_%'),
    reason      text        NOT NULL CHECK (reason <> ''),
    actor       text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    released_at timestamptz,
    released_by text,
    CONSTRAINT retention_holds_one_target CHECK ((event_id IS NULL) <> (customer_id IS NULL))
);
CREATE INDEX IF NOT EXISTS retention_holds_event_idx ON ledger.retention_holds (event_id)
    WHERE released_at IS NULL AND event_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS retention_holds_customer_idx ON ledger.retention_holds (customer_id)
    WHERE released_at IS NULL AND customer_id IS NOT NULL;

-- One row per retention run: what it archived, removed and kept, and how long it took.
CREATE TABLE IF NOT EXISTS ledger.retention_runs (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    runner          text        NOT NULL,
    status          text        NOT NULL DEFAULT 'running'
                    CHECK (status IN ('running', 'done', 'failed')),
    processed_days  integer     NOT NULL,
    failed_days     integer     NOT NULL,
    archived        bigint      NOT NULL DEFAULT 0,
    removed         bigint      NOT NULL DEFAULT 0,
    -- Archived, then found changed before its removal (a redelivery, a replay): left in place.
    changed         bigint      NOT NULL DEFAULT 0,
    kept_by_hold    bigint      NOT NULL DEFAULT 0,
    files           integer     NOT NULL DEFAULT 0,
    error           text,
    started_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    CONSTRAINT retention_runs_failed_says_why CHECK (status <> 'failed' OR error IS NOT NULL)
);

-- The archive's catalogue: each file written, its checksum and when it was read back.
-- The file's manifest in the archive is the truth for a restore; this row is what the
-- ledger knows without reading the archive.
CREATE TABLE IF NOT EXISTS ledger.archive_files (
    key          text        PRIMARY KEY,
    run_id       bigint      NOT NULL REFERENCES ledger.retention_runs (id),
    month        date        NOT NULL,
    events       integer     NOT NULL,
    bytes        bigint      NOT NULL,
    sha256       text        NOT NULL,
    verified_at  timestamptz,
    removed      integer     NOT NULL DEFAULT 0,
    restored_at  timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now()
);

-- Whether an event is past its retention window: processed ones counted from processing,
-- failed_permanent ones from the failure. Every other status is never past it: an unfinished
-- event (received, processing, failed_recoverable) stays however old it is. Inlined by the
-- planner, so the partial indexes above still serve it.
CREATE OR REPLACE FUNCTION ledger.event_past_window(status text, processed_at timestamptz, updated_at timestamptz,
                                                    processed_days integer, failed_days integer) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT (status = 'processed' AND processed_at < now() - make_interval(days => processed_days))
        OR (status = 'failed_permanent' AND updated_at < now() - make_interval(days => failed_days))
$$;

-- The customer an event is about, for holds by customer: its object, or the object's
-- customer. NULL once the payload was pruned: such an event is held by its id only.
CREATE OR REPLACE FUNCTION ledger.event_customer(payload json) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN payload #>> '{data,object,object}' = 'customer' THEN payload #>> '{data,object,id}'
                ELSE payload #>> '{data,object,customer}' END
$$;

-- An event's row as JSON without its payload (which goes apart, as a string: below).
-- PL/pgSQL so that the payload is set aside before the row is written out. STABLE, not
-- IMMUTABLE: a timestamptz is written in the session's time zone.
CREATE OR REPLACE FUNCTION ledger.event_row_json(e ledger.events) RETURNS json
LANGUAGE plpgsql STABLE AS $$
BEGIN
    e.payload := NULL;
    RETURN row_to_json(e);
END
$$;

-- Events and every row that names them, one line of JSON each, for a set of ids at once
-- (each table joined once for all of them: per-event subqueries cost twice as much). The
-- payload goes as a string, so its bytes (the body Stripe signed) come back exactly; the
-- other columns as row_to_json writes them, which jsonb_populate_record reads back to the
-- same values. What is archived, what a removal compares with the file, and what a restore
-- reads are all this one definition.
CREATE OR REPLACE FUNCTION ledger.event_archive_lines(ids text[])
RETURNS TABLE (id text, month text, line text)
LANGUAGE sql STABLE AS $$
    WITH c AS MATERIALIZED (
        SELECT e.id, e.stripe_created, ledger.event_row_json(e) AS row, e.payload::text AS body
          FROM ledger.events e WHERE e.id = ANY (ids)
    ), d AS (SELECT x.event_id, json_agg(x ORDER BY x.delivered_at, x.source) AS j
               FROM ledger.deliveries x JOIN c ON c.id = x.event_id GROUP BY x.event_id
    ), a AS (SELECT x.event_id, json_agg(x ORDER BY x.attempt) AS j
               FROM ledger.attempts x JOIN c ON c.id = x.event_id GROUP BY x.event_id
    ), u AS (SELECT x.event_id, json_agg(x ORDER BY x.id) AS j
               FROM ledger.audit x JOIN c ON c.id = x.event_id GROUP BY x.event_id
    ), o AS (SELECT x.event_id, json_agg(x ORDER BY x.id) AS j
               FROM ledger.outbox x JOIN c ON c.id = x.event_id GROUP BY x.event_id
    ), h AS (SELECT x.event_id, json_agg(x) AS j
               FROM ledger.health_alerts x JOIN c ON c.id = x.event_id GROUP BY x.event_id
    ), s AS (SELECT x.event_id, json_agg(x ORDER BY x.snapshot_event_id) AS j
               FROM ledger.snapshot_twins x JOIN c ON c.id = x.event_id GROUP BY x.event_id
    ), r AS (SELECT x.event_id, json_agg(x ORDER BY x.job_id) AS j
               FROM ledger.replay_job_events x JOIN c ON c.id = x.event_id GROUP BY x.event_id
    )
    -- json_agg puts a newline between elements: outside strings a newline is only whitespace
    -- (inside one it is escaped), so it becomes a space, and the line stays one line.
    SELECT c.id, to_char(c.stripe_created AT TIME ZONE 'UTC', 'YYYY-MM'),
           replace(json_build_object('event', c.row, 'payload', c.body,
                                     'deliveries', coalesce(d.j, '[]'), 'attempts', coalesce(a.j, '[]'),
                                     'audit', coalesce(u.j, '[]'), 'outbox', coalesce(o.j, '[]'),
                                     'health_alerts', coalesce(h.j, '[]'), 'snapshot_twins', coalesce(s.j, '[]'),
                                     'replay_job_events', coalesce(r.j, '[]'))::text, E'\n', ' ')
      FROM c LEFT JOIN d ON d.event_id = c.id LEFT JOIN a ON a.event_id = c.id LEFT JOIN u ON u.event_id = c.id
             LEFT JOIN o ON o.event_id = c.id LEFT JOIN h ON h.event_id = c.id LEFT JOIN s ON s.event_id = c.id
             LEFT JOIN r ON r.event_id = c.id
$$;

-- An event's rows are found by its id in every table that names it (the archive line, and
-- ON DELETE CASCADE when it leaves); these two had no index on it.
CREATE INDEX IF NOT EXISTS snapshot_twins_event_idx ON ledger.snapshot_twins (event_id);
CREATE INDEX IF NOT EXISTS replay_job_events_event_idx ON ledger.replay_job_events (event_id);

-- A line back into the ledger. An event already there is left as it is, rows and all
-- (a restore run twice, or an id Stripe delivered again since): true when it was written.
CREATE OR REPLACE FUNCTION ledger.event_restore_line(line text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    doc jsonb := line::jsonb;
    e ledger.events;
    written int;
BEGIN
    e := jsonb_populate_record(NULL::ledger.events, doc -> 'event');
    e.payload := (doc ->> 'payload')::json;
    INSERT INTO ledger.events SELECT e.* ON CONFLICT (id) DO NOTHING;
    GET DIAGNOSTICS written = ROW_COUNT;
    IF written = 0 THEN
        RETURN false;
    END IF;
    INSERT INTO ledger.deliveries SELECT * FROM jsonb_populate_recordset(NULL::ledger.deliveries, doc -> 'deliveries');
    INSERT INTO ledger.attempts SELECT * FROM jsonb_populate_recordset(NULL::ledger.attempts, doc -> 'attempts');
    INSERT INTO ledger.audit OVERRIDING SYSTEM VALUE
        SELECT * FROM jsonb_populate_recordset(NULL::ledger.audit, doc -> 'audit');
    INSERT INTO ledger.outbox OVERRIDING SYSTEM VALUE
        SELECT * FROM jsonb_populate_recordset(NULL::ledger.outbox, doc -> 'outbox');
    INSERT INTO ledger.health_alerts
        SELECT * FROM jsonb_populate_recordset(NULL::ledger.health_alerts, doc -> 'health_alerts');
    INSERT INTO ledger.snapshot_twins
        SELECT * FROM jsonb_populate_recordset(NULL::ledger.snapshot_twins, doc -> 'snapshot_twins');
    INSERT INTO ledger.replay_job_events
        SELECT * FROM jsonb_populate_recordset(NULL::ledger.replay_job_events, doc -> 'replay_job_events');
    RETURN true;
END
$$;
