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
-- Every table that names an event carries that time (event_created) and names the event by
-- (event_id, event_created), without a foreign key: the two partitioned with it (deliveries,
-- attempts) month by month, the small ones (audit, outbox, health alerts, snapshot twins,
-- replay job members) as plain tables (the outbox must be one: an idempotency key is unique
-- across events). Why no foreign key: a partitioned table's references cost a lookup through
-- the partitions per row written (every delivery and claim), a detached month is first checked
-- against every table pointing into it (a scan of them all, under the drop's lock), and a
-- dropped month's kept events move to the default partition with their rows untouched
-- (ledger.partition_drop). The rows are written with their event by the statements that write
-- it, and leave with it by the removal's own statement (events_remove_archived).
--
-- This migration only adds nullable columns (no rewrite, no lock held for a copy) and the
-- functions below: a ledger keeps its shape until `ledgerctl partitions migrate` moves it,
-- online (ledger/partition_migration.py), and the code runs on either shape. Partitioning is
-- the operator's choice, not a deploy's, until it serves the console and retention as fast as
-- the plain tables do (docs/retention.md, "Partitions").

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

-- The plain tables that name an event by (event_id, event_created).
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

-- The twin takes the plain table's place and names. The plain table is dropped (it had no
-- rows), or set aside as <name>_before_partitions, its indexes renamed <name>__old (the online
-- migration: dropping a large table, which unlinks its files before its locks go, waits for
-- after the swap, ledger.partition_migration_cleanup). Names only: no row is read or written.
CREATE OR REPLACE FUNCTION ledger.partition_swap(tbl text, set_aside boolean DEFAULT false) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    idx record;
BEGIN
    IF set_aside THEN
        FOR idx IN SELECT c.relname AS name, con.conname
                     FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                     LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
                    WHERE i.indrelid = format('ledger.%I', tbl)::regclass
        LOOP
            IF idx.conname IS NOT NULL THEN
                EXECUTE format('ALTER TABLE ledger.%I RENAME CONSTRAINT %I TO %I', tbl, idx.conname,
                               idx.conname || '__old');
            ELSE
                EXECUTE format('ALTER INDEX ledger.%I RENAME TO %I', idx.name, idx.name || '__old');
            END IF;
        END LOOP;
        EXECUTE format('ALTER TABLE ledger.%I RENAME TO %I', tbl, tbl || '_before_partitions');
    ELSE
        EXECUTE format('DROP TABLE ledger.%I', tbl);
    END IF;
    EXECUTE format('ALTER TABLE ledger.%I RENAME TO %I', tbl || '_partitioned', tbl);
    PERFORM ledger.partition_index_names(tbl);
END
$$;

-- A swapped table's indexes and constraints take the names the plain table's had (<name>__p
-- until then).
CREATE OR REPLACE FUNCTION ledger.partition_index_names(tbl text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    idx record;
BEGIN
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

-- One month's partition of every partitioned table, if it is not there yet: false when it
-- was. Refused (an exception) when the default partition holds rows of that month: they
-- would have to move first, and nothing moves rows behind an operator's back.
CREATE OR REPLACE FUNCTION ledger.partition_create(month date, parent_suffix text DEFAULT '') RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    t record;
    made boolean := false;
    first date := date_trunc('month', month)::date;
BEGIN
    FOR t IN SELECT name FROM ledger.partitioned_tables() LOOP
        IF to_regclass(format('ledger.%I', ledger.partition_name(t.name, first))) IS NULL THEN
            EXECUTE format('CREATE TABLE ledger.%I PARTITION OF ledger.%I FOR VALUES FROM (%L) TO (%L)',
                           ledger.partition_name(t.name, first), t.name || parent_suffix,
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
    kept       bigint      NOT NULL,   -- events moved to the default partition
    run_id     bigint,
    dropped_at timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE ledger.retention_runs ADD COLUMN IF NOT EXISTS partitions_dropped integer NOT NULL DEFAULT 0;

-- A month whose events retention removed leaves as tables: its partitions are detached,
-- whatever is still in them (events kept: held, unfinished, failed ones with a longer window,
-- changed since they were archived; with their deliveries and attempts) moves to the default
-- partition, and the detached tables are dropped. All in one transaction that waits at most
-- lock_ms for the tables' locks (taken in the order the receiver and the workers take them,
-- events first), so that a refusal costs the receiver no more than that: the next run tries
-- again. A redelivery of a kept event meanwhile waits for the commit, then finds it in the
-- default partition. The numbers of events and of their rows moved come back; nothing when
-- the month has no partition (dropped already, or a ledger not partitioned).
CREATE OR REPLACE FUNCTION ledger.partition_drop(month date, run_id bigint, lock_ms integer)
RETURNS TABLE (kept_events bigint, kept_rows bigint)
LANGUAGE plpgsql AS $$
DECLARE
    first date := date_trunc('month', month)::date;
    t record;
    moved bigint;
    events_kept bigint := 0;
    rows_kept bigint := 0;
BEGIN
    IF NOT ledger.is_partitioned()
       OR to_regclass(format('ledger.%I', ledger.partition_name('events', first))) IS NULL THEN
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', lock_ms || 'ms', true);
    LOCK TABLE ledger.events, ledger.attempts, ledger.deliveries IN ACCESS EXCLUSIVE MODE;
    FOR t IN SELECT name FROM ledger.partitioned_tables() LOOP
        EXECUTE format('ALTER TABLE ledger.%I DETACH PARTITION ledger.%I', t.name, ledger.partition_name(t.name, first));
    END LOOP;
    FOR t IN SELECT name FROM ledger.partitioned_tables() ORDER BY name <> 'events' LOOP
        EXECUTE format('INSERT INTO ledger.%I SELECT * FROM ledger.%I', t.name, ledger.partition_name(t.name, first));
        GET DIAGNOSTICS moved = ROW_COUNT;
        IF t.name = 'events' THEN
            events_kept := moved;
        ELSE
            rows_kept := rows_kept + moved;
        END IF;
        EXECUTE format('DROP TABLE ledger.%I', ledger.partition_name(t.name, first));
    END LOOP;
    INSERT INTO ledger.dropped_partitions (month, kept, run_id) VALUES (first, events_kept, run_id)
    ON CONFLICT ON CONSTRAINT dropped_partitions_pkey
    DO UPDATE SET kept = ledger.dropped_partitions.kept + EXCLUDED.kept, dropped_at = now();
    RETURN QUERY SELECT events_kept, rows_kept;
END
$$;

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

-- The online migration of a ledger that had events (ledgerctl partitions migrate;
-- ledger/partition_migration.py drives these steps, docs/retention.md "Partitions"): the
-- partitioned twins are built beside the tables while the receiver and the workers keep
-- writing to them, kept in step by triggers, filled in batches, and take the tables' place
-- in one short transaction.
CREATE TABLE IF NOT EXISTS ledger.partition_migration (
    id           boolean     PRIMARY KEY DEFAULT true CHECK (id),
    phase        text        NOT NULL CHECK (phase IN ('mirroring', 'done')),
    -- When the triggers began to mirror: a delivery recorded before it is copied by the
    -- backfill, one after it by its trigger (deliveries have no key to meet on).
    mirrored_from timestamptz,
    started_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);

-- Step 1: the twins (their months: every month that has events, and the months ahead), their
-- references to each other, and the mirror triggers on the tables. The triggers are made in
-- one short transaction at the end, which waits for the writers in flight (CREATE TRIGGER's
-- lock); from its commit on, every write to the tables is written to the twins too.
CREATE OR REPLACE FUNCTION ledger.partition_migration_twins(months date[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t record;
    m date;
BEGIN
    FOR t IN SELECT name, key FROM ledger.partitioned_tables() LOOP
        PERFORM ledger.partition_twin(t.name, t.key);
        EXECUTE format('CREATE TABLE ledger.%I PARTITION OF ledger.%I DEFAULT', t.name || '_default',
                       t.name || '_partitioned');
    END LOOP;
    FOREACH m IN ARRAY months LOOP
        PERFORM ledger.partition_create(m, '_partitioned');
    END LOOP;
END
$$;

-- The mirror: a write to ledger.events, ledger.attempts or ledger.deliveries, written to its
-- twin (an upsert on the twin's key). An event deleted takes its rows in the twins with it, as
-- the tables' cascade does with theirs. A row of an event's (an attempt, a delivery) brings the
-- event along if the backfill has not copied it yet, so no row in the twins lacks its event;
-- a row written before 0012 has no event_created, and takes its event's. The functions are
-- written for the columns the tables have (partition_migration_mirror makes them).
CREATE OR REPLACE FUNCTION ledger.partition_mirror_event_of(event_id text) RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
    created timestamptz;
BEGIN
    INSERT INTO ledger.events_partitioned SELECT * FROM ledger.events WHERE id = event_id
    ON CONFLICT DO NOTHING;
    SELECT stripe_created INTO created FROM ledger.events WHERE id = event_id;
    RETURN created;
END
$$;

-- "a = EXCLUDED.a, ..." for every column of a table.
CREATE OR REPLACE FUNCTION ledger.partition_upsert_set(tbl text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT string_agg(format('%I = EXCLUDED.%I', attname, attname), ', ' ORDER BY attnum)
      FROM pg_attribute
     WHERE attrelid = format('ledger.%I', tbl)::regclass AND attnum > 0 AND NOT attisdropped
$$;

CREATE OR REPLACE FUNCTION ledger.partition_migration_mirror() RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
    since timestamptz;
BEGIN
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION ledger.partition_mirror_events() RETURNS trigger
        LANGUAGE plpgsql AS $b$
        BEGIN
            IF TG_OP = 'DELETE' THEN
                DELETE FROM ledger.events_partitioned WHERE id = OLD.id AND stripe_created = OLD.stripe_created;
                DELETE FROM ledger.deliveries_partitioned WHERE event_id = OLD.id;
                DELETE FROM ledger.attempts_partitioned WHERE event_id = OLD.id;
            ELSE
                INSERT INTO ledger.events_partitioned SELECT (NEW).*
                ON CONFLICT (id, stripe_created) DO UPDATE SET %s;
            END IF;
            RETURN NULL;
        END
        $b$ $f$, ledger.partition_upsert_set('events'));
    EXECUTE format($f$
        CREATE OR REPLACE FUNCTION ledger.partition_mirror_attempts() RETURNS trigger
        LANGUAGE plpgsql AS $b$
        DECLARE
            r ledger.attempts;
            created timestamptz;
        BEGIN
            IF TG_OP = 'DELETE' THEN
                DELETE FROM ledger.attempts_partitioned WHERE event_id = OLD.event_id AND attempt = OLD.attempt;
                RETURN NULL;
            END IF;
            r := NEW;
            created := ledger.partition_mirror_event_of(r.event_id);
            r.event_created := coalesce(r.event_created, created);
            INSERT INTO ledger.attempts_partitioned SELECT (r).*
            ON CONFLICT (event_id, attempt, event_created) DO UPDATE SET %s;
            RETURN NULL;
        END
        $b$ $f$, ledger.partition_upsert_set('attempts'));
    CREATE OR REPLACE FUNCTION ledger.partition_mirror_deliveries() RETURNS trigger
    LANGUAGE plpgsql AS $b$
    DECLARE
        r ledger.deliveries;
        created timestamptz;
    BEGIN
        r := NEW;
        created := ledger.partition_mirror_event_of(r.event_id);
        r.event_created := coalesce(r.event_created, created);
        INSERT INTO ledger.deliveries_partitioned SELECT (r).*;
        RETURN NULL;
    END
    $b$;
    CREATE TRIGGER partition_mirror AFTER INSERT OR UPDATE OR DELETE ON ledger.events
        FOR EACH ROW EXECUTE FUNCTION ledger.partition_mirror_events();
    CREATE TRIGGER partition_mirror AFTER INSERT OR UPDATE OR DELETE ON ledger.attempts
        FOR EACH ROW EXECUTE FUNCTION ledger.partition_mirror_attempts();
    -- Deliveries are only ever inserted (and deleted with their event: the events mirror removes them).
    CREATE TRIGGER partition_mirror AFTER INSERT ON ledger.deliveries
        FOR EACH ROW EXECUTE FUNCTION ledger.partition_mirror_deliveries();
    since := clock_timestamp();
    INSERT INTO ledger.partition_migration (phase, mirrored_from) VALUES ('mirroring', since);
    RETURN since;
END
$$;

-- The swap: the twins take the tables' place. The caller holds the tables' exclusive locks
-- (partition_migration_swap's first statement) and has checked the twins hold every row.
CREATE OR REPLACE FUNCTION ledger.partition_migration_swap() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t record;
BEGIN
    DROP FUNCTION IF EXISTS ledger.event_row_json(ledger.events);
    FOR t IN SELECT name FROM ledger.event_dependent_tables() LOOP
        EXECUTE format('ALTER TABLE ledger.%I DROP CONSTRAINT IF EXISTS %I', t.name, t.name || '_event_id_fkey');
        EXECUTE format('ALTER TABLE ledger.%I ALTER COLUMN event_created SET NOT NULL', t.name);
        EXECUTE format('ALTER TABLE ledger.%I DROP CONSTRAINT IF EXISTS %I', t.name, t.name || '_event_created_set');
    END LOOP;
    PERFORM ledger.partition_swap('deliveries', true);
    PERFORM ledger.partition_swap('attempts', true);
    PERFORM ledger.partition_swap('events', true);
    EXECUTE $f$
        CREATE FUNCTION ledger.event_row_json(e ledger.events) RETURNS json
        LANGUAGE plpgsql STABLE AS $b$
        BEGIN
            e.payload := NULL;
            RETURN row_to_json(e);
        END
        $b$
    $f$;
    UPDATE ledger.partition_migration SET phase = 'done', finished_at = now();
END
$$;

-- After the swap, without its lock: the tables set aside are dropped (their mirror triggers and
-- their foreign keys with them), then the mirror's functions. Nobody else touches those tables.
CREATE OR REPLACE FUNCTION ledger.partition_migration_cleanup() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT name FROM ledger.partitioned_tables() ORDER BY name = 'events' LOOP
        EXECUTE format('DROP TABLE IF EXISTS ledger.%I', t.name || '_before_partitions');
    END LOOP;
    DROP FUNCTION IF EXISTS ledger.partition_mirror_events();
    DROP FUNCTION IF EXISTS ledger.partition_mirror_attempts();
    DROP FUNCTION IF EXISTS ledger.partition_mirror_deliveries();
END
$$;

-- Giving up before the swap: the twins and the triggers go, the tables stay as they were.
CREATE OR REPLACE FUNCTION ledger.partition_migration_abort() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t record;
BEGIN
    DROP TRIGGER IF EXISTS partition_mirror ON ledger.events;
    DROP TRIGGER IF EXISTS partition_mirror ON ledger.attempts;
    DROP TRIGGER IF EXISTS partition_mirror ON ledger.deliveries;
    DROP FUNCTION IF EXISTS ledger.partition_mirror_events();
    DROP FUNCTION IF EXISTS ledger.partition_mirror_attempts();
    DROP FUNCTION IF EXISTS ledger.partition_mirror_deliveries();
    FOR t IN SELECT name FROM ledger.partitioned_tables() ORDER BY name = 'events' LOOP
        EXECUTE format('DROP TABLE IF EXISTS ledger.%I', t.name || '_partitioned');
    END LOOP;
    DELETE FROM ledger.partition_migration WHERE phase = 'mirroring';
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
