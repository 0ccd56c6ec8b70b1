-- Time partitions (docs/retention.md, "Partitions"): ledger.events and the two tables that
-- grow with every event (deliveries, attempts) are partitioned by month of the event's
-- Stripe `created`, so that a month past every window leaves the ledger as a dropped table
-- instead of row by row.
--
-- Why Stripe's `created` and not the time of arrival: it is part of the event, the same on
-- every delivery of it (a redelivery, a catch-up fetch, a thin event's refetch), so every
-- copy of an event id lands in the one partition its first copy went to, and the primary
-- key (id, stripe_created) there is the dedupe (docs/guarantee.md, "Dedupe across
-- partitions").
--
-- Every table that names an event carries that time (event_created) and references the
-- event by (id, stripe_created): a partitioned table's unique key must hold its partition
-- key. The small ones (audit, outbox, health alerts, snapshot twins, replay job members)
-- stay plain tables; the outbox must, since an idempotency key is unique across events.
--
-- A ledger without events becomes partitioned here. One that has events keeps its shape
-- (this migration only adds nullable columns to it, without a rewrite) until the online
-- migration (`ledgerctl partitions migrate`) moves it; the code runs on either shape.

ALTER TABLE ledger.deliveries        ADD COLUMN IF NOT EXISTS event_created timestamptz;
ALTER TABLE ledger.attempts          ADD COLUMN IF NOT EXISTS event_created timestamptz;
ALTER TABLE ledger.audit             ADD COLUMN IF NOT EXISTS event_created timestamptz;
ALTER TABLE ledger.outbox            ADD COLUMN IF NOT EXISTS event_created timestamptz;
ALTER TABLE ledger.health_alerts     ADD COLUMN IF NOT EXISTS event_created timestamptz;
ALTER TABLE ledger.snapshot_twins    ADD COLUMN IF NOT EXISTS event_created timestamptz;
ALTER TABLE ledger.replay_job_events ADD COLUMN IF NOT EXISTS event_created timestamptz;

-- The partitioned tables and the column each is partitioned on.
CREATE OR REPLACE FUNCTION ledger.partitioned_tables()
RETURNS TABLE (name text, key text)
LANGUAGE sql IMMUTABLE AS $$
    VALUES ('events', 'stripe_created'), ('deliveries', 'event_created'), ('attempts', 'event_created')
$$;

-- The plain tables that name an event, referencing it by (event_id, event_created).
CREATE OR REPLACE FUNCTION ledger.event_dependent_tables()
RETURNS TABLE (name text)
LANGUAGE sql IMMUTABLE AS $$
    VALUES ('audit'), ('outbox'), ('health_alerts'), ('snapshot_twins'), ('replay_job_events')
$$;

CREATE OR REPLACE FUNCTION ledger.is_partitioned() RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT relkind = 'p' FROM pg_class WHERE oid = 'ledger.events'::regclass
$$;

-- A month's partition name: events_2026_12.
CREATE OR REPLACE FUNCTION ledger.partition_name(tbl text, month date) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT tbl || '_' || to_char(month, 'YYYY_MM')
$$;

-- A partitioned twin of a plain table, its shape read from the table itself (columns,
-- defaults, checks, indexes: whatever the migrations before this one made it), not from a
-- second copy kept by hand. Its primary key gains the partition key; its indexes are named
-- <name>__p until ledger.partition_swap gives them the plain table's names.
CREATE OR REPLACE FUNCTION ledger.partition_twin(tbl text, key text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    twin text := tbl || '_partitioned';
    idx record;
    cols text;
BEGIN
    EXECUTE format('CREATE TABLE ledger.%I (LIKE ledger.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                   'INCLUDING STORAGE INCLUDING COMMENTS) PARTITION BY RANGE (%I)', twin, tbl, key);
    EXECUTE format('ALTER TABLE ledger.%I ALTER COLUMN %I SET NOT NULL', twin, key);
    FOR idx IN SELECT c.relname AS name, i.indisprimary AS is_primary, i.indisunique AS is_unique,
                      pg_get_indexdef(i.indexrelid) AS def, i.indexrelid
                 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                WHERE i.indrelid = format('ledger.%I', tbl)::regclass
    LOOP
        IF idx.is_primary THEN
            SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY k.ord) INTO cols
              FROM pg_index i, unnest(i.indkey) WITH ORDINALITY AS k (attnum, ord)
              JOIN pg_attribute a ON a.attnum = k.attnum
             WHERE i.indexrelid = idx.indexrelid AND a.attrelid = i.indrelid;
            EXECUTE format('ALTER TABLE ledger.%I ADD CONSTRAINT %I PRIMARY KEY (%s, %I)',
                           twin, idx.name || '__p', cols, key);
        ELSIF idx.is_unique THEN
            RAISE EXCEPTION 'ledger.%: a unique index (%) cannot move to a partitioned table as it is', tbl, idx.name;
        ELSE
            EXECUTE replace(replace(idx.def, format(' ON ledger.%s ', tbl), format(' ON ledger.%s ', twin)),
                            format('INDEX %s ON', idx.name), format('INDEX %s ON', idx.name || '__p'));
        END IF;
    END LOOP;
END
$$;

-- The twin takes the plain table's place and names. The plain table is dropped: the caller
-- has copied its rows (the online migration) or it had none.
CREATE OR REPLACE FUNCTION ledger.partition_swap(tbl text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    twin text := tbl || '_partitioned';
    idx record;
BEGIN
    EXECUTE format('DROP TABLE ledger.%I', tbl);
    EXECUTE format('ALTER TABLE ledger.%I RENAME TO %I', twin, tbl);
    FOR idx IN SELECT c.relname AS name, con.conname
                 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                 LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
                WHERE i.indrelid = format('ledger.%I', tbl)::regclass AND c.relname LIKE '%\_\_p'
    LOOP
        IF idx.conname IS NOT NULL THEN
            EXECUTE format('ALTER TABLE ledger.%I RENAME CONSTRAINT %I TO %I', tbl, idx.conname,
                           left(idx.conname, -3));
        ELSE
            EXECUTE format('ALTER INDEX ledger.%I RENAME TO %I', idx.name, left(idx.name, -3));
        END IF;
    END LOOP;
END
$$;

-- The references of every table naming an event, by (event_id, event_created). Called once
-- the partitioned events table is in place.
CREATE OR REPLACE FUNCTION ledger.partition_references() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t text;
BEGIN
    FOR t IN SELECT name FROM ledger.partitioned_tables() WHERE name <> 'events'
             UNION ALL SELECT name FROM ledger.event_dependent_tables()
    LOOP
        EXECUTE format('ALTER TABLE ledger.%I DROP CONSTRAINT IF EXISTS %I', t, t || '_event_id_fkey');
        EXECUTE format('ALTER TABLE ledger.%I ALTER COLUMN event_created SET NOT NULL', t);
        EXECUTE format('ALTER TABLE ledger.%I ADD CONSTRAINT %I FOREIGN KEY (event_id, event_created) '
                       'REFERENCES ledger.events (id, stripe_created) ON DELETE CASCADE', t, t || '_event_fkey');
    END LOOP;
END
$$;

-- One month's partition of every partitioned table, if it is not there yet: false when it
-- was. Refused (an exception) when the default partition holds rows of that month: they
-- would have to move first, and nothing moves rows behind an operator's back.
CREATE OR REPLACE FUNCTION ledger.partition_create(month date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    t record;
    made boolean := false;
    first date := date_trunc('month', month)::date;
BEGIN
    FOR t IN SELECT name FROM ledger.partitioned_tables() LOOP
        IF to_regclass(format('ledger.%I', ledger.partition_name(t.name, first))) IS NULL THEN
            EXECUTE format('CREATE TABLE ledger.%I PARTITION OF ledger.%I FOR VALUES FROM (%L) TO (%L)',
                           ledger.partition_name(t.name, first), t.name,
                           first::timestamp AT TIME ZONE 'UTC', (first + interval '1 month')::timestamp AT TIME ZONE 'UTC');
            made := true;
        END IF;
    END LOOP;
    RETURN made;
END
$$;

-- The partitions of ledger.events there are, oldest first, with the range each covers (a
-- function, not a view: a view would pin the table a migration swaps).
CREATE OR REPLACE FUNCTION ledger.event_partitions()
RETURNS TABLE (name text, starts timestamptz, ends timestamptz, is_default boolean)
LANGUAGE sql STABLE AS $$
    SELECT c.relname::text,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\)'))[1]::timestamptz,
           (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \(''([^'']+)''\)'))[1]::timestamptz,
           pg_get_expr(c.relpartbound, c.oid) = 'DEFAULT'
      FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
     WHERE i.inhparent = 'ledger.events'::regclass
     ORDER BY 3 NULLS LAST
$$;

-- The maintenance the sweep runs (ledger/partitions.py): this month's partition and the next
-- `ahead` months', where missing; their names back. One caller at a time (several sweeps
-- may call it), and never a wait of more than a second for the table's lock: a month is made
-- weeks before it starts, so a refusal only means the next pass does it.
CREATE OR REPLACE FUNCTION ledger.partitions_ensure(ahead integer) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    m date;
BEGIN
    IF NOT ledger.is_partitioned() THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('ledger.partitions', 0));
    SET LOCAL lock_timeout = '1s';
    FOR m IN SELECT generate_series(date_trunc('month', now()), date_trunc('month', now()) + make_interval(months => ahead),
                                    interval '1 month')::date
    LOOP
        IF ledger.partition_create(m) THEN
            RETURN NEXT ledger.partition_name('events', m);
        END IF;
    END LOOP;
END
$$;

-- Months whose partitions a retention run dropped: rows of those months found later in the
-- default partition were kept there on purpose (a hold, a longer window), not strays.
CREATE TABLE IF NOT EXISTS ledger.dropped_partitions (
    month      date        PRIMARY KEY,
    events     bigint      NOT NULL,
    kept       bigint      NOT NULL,
    run_id     bigint,
    dropped_at timestamptz NOT NULL DEFAULT now()
);

-- Events in the default partition of a month no retention run dropped: they came with a
-- `created` outside every planned month (a clock far off, partitions not made in time). 0 on
-- a ledger that is not partitioned. The default partition holds only such strays and the
-- rows kept past a dropped month, so this reads a small table.
CREATE OR REPLACE FUNCTION ledger.partition_strays() RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
DECLARE
    strays bigint;
BEGIN
    IF NOT ledger.is_partitioned() THEN
        RETURN 0;
    END IF;
    EXECUTE 'SELECT count(*) FROM ledger.events_default d
              WHERE NOT EXISTS (SELECT 1 FROM ledger.dropped_partitions p
                                 WHERE p.month = date_trunc(''month'', d.stripe_created AT TIME ZONE ''UTC'')::date)'
       INTO strays;
    RETURN strays;
END
$$;

-- A ledger without events is partitioned now: months from the one 31 days back (Stripe's
-- catch-up horizon: the oldest event a catch-up may still bring) to three ahead, and a
-- default partition for anything else.
DO $$
DECLARE
    t record;
    m date;
BEGIN
    IF EXISTS (SELECT 1 FROM ledger.events) OR ledger.is_partitioned() THEN
        RETURN;
    END IF;
    -- Takes the table's row type; made again below, for the new table.
    DROP FUNCTION IF EXISTS ledger.event_row_json(ledger.events);
    FOR t IN SELECT name FROM ledger.event_dependent_tables()
             UNION ALL SELECT name FROM ledger.partitioned_tables() WHERE name <> 'events' LOOP
        EXECUTE format('ALTER TABLE ledger.%I DROP CONSTRAINT IF EXISTS %I', t.name, t.name || '_event_id_fkey');
    END LOOP;
    FOR t IN SELECT name, key FROM ledger.partitioned_tables() LOOP
        PERFORM ledger.partition_twin(t.name, t.key);
        PERFORM ledger.partition_swap(t.name);
        EXECUTE format('CREATE TABLE ledger.%I PARTITION OF ledger.%I DEFAULT', t.name || '_default', t.name);
    END LOOP;
    PERFORM ledger.partition_references();
    FOR m IN SELECT generate_series(date_trunc('month', now() - interval '31 days'),
                                    date_trunc('month', now()) + interval '3 months', interval '1 month')::date
    LOOP
        PERFORM ledger.partition_create(m);
    END LOOP;
END
$$;

-- As in 0011, made again for whichever table ledger.events now is.
CREATE OR REPLACE FUNCTION ledger.event_row_json(e ledger.events) RETURNS json
LANGUAGE plpgsql STABLE AS $$
BEGIN
    e.payload := NULL;
    RETURN row_to_json(e);
END
$$;

-- 0011's restore, on either shape: a line archived before this migration has no
-- event_created in its rows; every row of an event takes the event's own.
CREATE OR REPLACE FUNCTION ledger.event_restore_line(line text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    doc jsonb := line::jsonb;
    e ledger.events;
    created jsonb;
    written int;
BEGIN
    e := jsonb_populate_record(NULL::ledger.events, doc -> 'event');
    e.payload := (doc ->> 'payload')::json;
    created := jsonb_build_object('event_created', e.stripe_created);
    INSERT INTO ledger.events SELECT e.* ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS written = ROW_COUNT;
    IF written = 0 THEN
        RETURN false;
    END IF;
    INSERT INTO ledger.deliveries
        SELECT (jsonb_populate_record(NULL::ledger.deliveries, x || created)).* FROM jsonb_array_elements(doc -> 'deliveries') x;
    INSERT INTO ledger.attempts
        SELECT (jsonb_populate_record(NULL::ledger.attempts, x || created)).* FROM jsonb_array_elements(doc -> 'attempts') x;
    INSERT INTO ledger.audit OVERRIDING SYSTEM VALUE
        SELECT (jsonb_populate_record(NULL::ledger.audit, x || created)).* FROM jsonb_array_elements(doc -> 'audit') x;
    INSERT INTO ledger.outbox OVERRIDING SYSTEM VALUE
        SELECT (jsonb_populate_record(NULL::ledger.outbox, x || created)).* FROM jsonb_array_elements(doc -> 'outbox') x;
    INSERT INTO ledger.health_alerts
        SELECT (jsonb_populate_record(NULL::ledger.health_alerts, x || created)).*
          FROM jsonb_array_elements(doc -> 'health_alerts') x;
    INSERT INTO ledger.snapshot_twins
        SELECT (jsonb_populate_record(NULL::ledger.snapshot_twins, x || created)).*
          FROM jsonb_array_elements(doc -> 'snapshot_twins') x;
    INSERT INTO ledger.replay_job_events
        SELECT (jsonb_populate_record(NULL::ledger.replay_job_events, x || created)).*
          FROM jsonb_array_elements(doc -> 'replay_job_events') x;
    RETURN true;
END
$$;
