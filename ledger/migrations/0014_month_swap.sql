-- A month past its window leaves a partitioned ledger as tables, without deleting its rows one
-- by one (docs/retention.md, "A month leaves").
--
-- Until now a run deleted a month's archived events row by row, then detached its partitions and
-- moved what they still held (held, unfinished, failed inside their longer window) into the
-- default partition, under the ledger's exclusive lock: 3.7 s for 25,000 kept events of a
-- 3,000,000-event ledger, and the deletes left a month of dead rows for autovacuum, whose lock
-- then kept the drop from ever getting its own.
--
-- Now a month whose end is past the processed window is replaced:
-- 1. watched: triggers on its three partitions write the id of every event one of its rows
--    changes for (an insert, an update, a delete) to ledger.partition_changes, before the run
--    reads the month;
-- 2. archived as any month is, and the file verified;
-- 3. staged: the rows the file does not hold (its events kept) copied into new tables shaped
--    like the partitions, with their indexes and a CHECK of the month's range, while the
--    ledger keeps working;
-- 4. swapped, in one short transaction under the tables' lock: the staged copies of the events
--    changed since step 1 taken again from the partitions, the partitions detached and the
--    staged tables attached in their place (the CHECK spares the scan): metadata, and the few
--    changed rows;
-- 5. dropped: the detached tables, and the rows of the plain tables naming their events.
-- Nothing is deleted row by row; the lock lasts for the changed rows, not for the kept ones.

CREATE TABLE IF NOT EXISTS ledger.partition_changes (
    month    date NOT NULL,
    event_id text NOT NULL,
    PRIMARY KEY (month, event_id)
);

-- The ids of the events a run archived from a month it replaces (the complement is kept).
CREATE TABLE IF NOT EXISTS ledger.retention_archived (
    run_id   bigint NOT NULL,
    month    date   NOT NULL,
    event_id text   NOT NULL,
    PRIMARY KEY (run_id, month, event_id)
);

ALTER TABLE ledger.dropped_partitions ALTER COLUMN kept SET DEFAULT 0;
COMMENT ON COLUMN ledger.dropped_partitions.kept IS
    'events the month kept: in its new partition (the default partition before migration 0014)';

-- Step 1's trigger: TG_ARGV[0] the month, TG_ARGV[1] the column naming the event.
CREATE OR REPLACE FUNCTION ledger.partition_change_logged() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger.partition_changes (month, event_id)
    VALUES (TG_ARGV[0]::date, to_jsonb(coalesce(NEW, OLD)) ->> TG_ARGV[1])
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

-- Step 1: false when the month has no partitions (nothing to replace). The caller bounds the
-- wait for the partitions' lock (CREATE TRIGGER stops their writers while it waits).
CREATE OR REPLACE FUNCTION ledger.partition_month_watch(month date) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    t record;
BEGIN
    IF NOT ledger.is_partitioned()
       OR to_regclass(format('ledger.%I', ledger.partition_name('events', month))) IS NULL THEN
        RETURN false;
    END IF;
    -- Made once per partition (a month not replaced by one run stays watched for the next): each
    -- CREATE TRIGGER waits for the partition's writers, and theirs for it.
    FOR t IN SELECT name FROM ledger.partitioned_tables() ORDER BY name <> 'events', name LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_trigger
                        WHERE tgrelid = format('ledger.%I', ledger.partition_name(t.name, month))::regclass
                          AND tgname = 'partition_change_logged') THEN
            EXECUTE format('CREATE TRIGGER partition_change_logged AFTER INSERT OR UPDATE OR DELETE '
                           'ON ledger.%I FOR EACH ROW EXECUTE FUNCTION ledger.partition_change_logged(%L, %L)',
                           ledger.partition_name(t.name, month), month,
                           CASE t.name WHEN 'events' THEN 'id' ELSE 'event_id' END);
        END IF;
    END LOOP;
    RETURN true;
END
$$;

-- A month's staged table: <partition>_kept.
CREATE OR REPLACE FUNCTION ledger.partition_staged_name(tbl text, month date) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT ledger.partition_name(tbl, month) || '_kept'
$$;

-- Step 3: the rows of the events run_id did not archive from the month, copied (again, after a
-- run that stopped) into the staged tables; how many events.
CREATE OR REPLACE FUNCTION ledger.partition_month_stage(month date, run_id bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    t record;
    staged text;
    kept bigint;
BEGIN
    FOR t IN SELECT name, key FROM ledger.partitioned_tables() ORDER BY name <> 'events', name LOOP
        staged := ledger.partition_staged_name(t.name, month);
        EXECUTE format('DROP TABLE IF EXISTS ledger.%I', staged);
        EXECUTE format('CREATE TABLE ledger.%I (LIKE ledger.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                       'INCLUDING INDEXES INCLUDING STORAGE)', staged, ledger.partition_name(t.name, month));
        EXECUTE format('ALTER TABLE ledger.%I ADD CONSTRAINT %I CHECK (%I >= %L AND %I < %L)', staged,
                       staged || '_month', t.key, month::timestamp AT TIME ZONE 'UTC', t.key,
                       (month + interval '1 month')::timestamp AT TIME ZONE 'UTC');
        IF t.name = 'events' THEN
            EXECUTE format('INSERT INTO ledger.%I SELECT * FROM ledger.%I x WHERE NOT EXISTS ('
                           'SELECT 1 FROM ledger.retention_archived a '
                           'WHERE a.run_id = %s AND a.month = %L AND a.event_id = x.id)',
                           staged, ledger.partition_name(t.name, month), run_id, month);
            GET DIAGNOSTICS kept = ROW_COUNT;
        ELSE
            EXECUTE format('INSERT INTO ledger.%I SELECT * FROM ledger.%I x WHERE EXISTS ('
                           'SELECT 1 FROM ledger.%I k WHERE k.id = x.event_id)',
                           staged, ledger.partition_name(t.name, month),
                           ledger.partition_staged_name('events', month));
        END IF;
        EXECUTE format('ANALYZE ledger.%I', staged);
    END LOOP;
    RETURN kept;
END
$$;

-- Step 4. The caller has set the transaction's lock timeout. Returns the events the month keeps
-- (staged, and changed since it was watched), how many changed, and how many of those the run
-- had archived (they stay: the file holds an older state of them). A month that keeps nothing
-- gets no new partition: a restore of it goes to the default partition.
CREATE OR REPLACE FUNCTION ledger.partition_month_swap(month date, run_id bigint)
RETURNS TABLE (kept bigint, changed bigint, archived_kept bigint)
LANGUAGE plpgsql AS $$
DECLARE
    t record;
    part text;
    staged text;
    ids text[];
BEGIN
    -- The parents, in the order writers take them: the detach needs them exclusively anyway.
    LOCK TABLE ledger.events, ledger.attempts, ledger.deliveries IN ACCESS EXCLUSIVE MODE;
    ids := ARRAY(SELECT c.event_id FROM ledger.partition_changes c WHERE c.month = partition_month_swap.month);
    changed := coalesce(array_length(ids, 1), 0);
    archived_kept := (SELECT count(*) FROM ledger.retention_archived a
                       WHERE a.run_id = partition_month_swap.run_id AND a.month = partition_month_swap.month
                         AND a.event_id = ANY (ids));
    FOR t IN SELECT name, key FROM ledger.partitioned_tables() ORDER BY name <> 'events', name LOOP
        part := ledger.partition_name(t.name, month);
        staged := ledger.partition_staged_name(t.name, month);
        -- An event changed since it was watched: its rows now, whatever the file holds of it.
        EXECUTE format('DELETE FROM ledger.%I WHERE %I = ANY ($1)', staged,
                       CASE t.name WHEN 'events' THEN 'id' ELSE 'event_id' END) USING ids;
        EXECUTE format('INSERT INTO ledger.%I SELECT * FROM ledger.%I WHERE %I = ANY ($1)', staged, part,
                       CASE t.name WHEN 'events' THEN 'id' ELSE 'event_id' END) USING ids;
        IF t.name = 'events' THEN
            EXECUTE format('SELECT count(*) FROM ledger.%I', staged) INTO kept;
        END IF;
        EXECUTE format('ALTER TABLE ledger.%I DETACH PARTITION ledger.%I', t.name, part);
        EXECUTE format('ALTER TABLE ledger.%I RENAME TO %I', part, part || '_gone');
        IF kept > 0 THEN
            EXECUTE format('ALTER TABLE ledger.%I ATTACH PARTITION ledger.%I FOR VALUES FROM (%L) TO (%L)',
                           t.name, staged, month::timestamp AT TIME ZONE 'UTC',
                           (month + interval '1 month')::timestamp AT TIME ZONE 'UTC');
            EXECUTE format('ALTER TABLE ledger.%I RENAME TO %I', staged, part);
            EXECUTE format('ALTER TABLE ledger.%I DROP CONSTRAINT %I', part, staged || '_month');
        ELSE
            EXECUTE format('DROP TABLE ledger.%I', staged);
        END IF;
    END LOOP;
    DELETE FROM ledger.partition_changes c WHERE c.month = partition_month_swap.month;
    INSERT INTO ledger.dropped_partitions AS p (month, kept, run_id)
    VALUES (partition_month_swap.month, kept, partition_month_swap.run_id)
    ON CONFLICT ON CONSTRAINT dropped_partitions_pkey
    DO UPDATE SET kept = EXCLUDED.kept, run_id = EXCLUDED.run_id, dropped_at = now();
    RETURN NEXT;
END
$$;

-- Step 5, first half: the tables a swap detached (<partition>_gone), events first; the caller
-- locks them, then drops them (ledger.partition_month_drop_gone).
CREATE OR REPLACE FUNCTION ledger.partition_month_gone(month date) RETURNS SETOF text
LANGUAGE sql STABLE AS $$
    SELECT ledger.partition_name(t.name, month) || '_gone'
      FROM ledger.partitioned_tables() t
     WHERE to_regclass(format('ledger.%I', ledger.partition_name(t.name, month) || '_gone')) IS NOT NULL
     ORDER BY t.name <> 'events', t.name
$$;

CREATE OR REPLACE FUNCTION ledger.partition_month_drop_gone(month date) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    gone text;
BEGIN
    FOR gone IN SELECT ledger.partition_month_gone(month) LOOP
        EXECUTE format('DROP TABLE ledger.%I', gone);
    END LOOP;
END
$$;

-- What a run that died left of a month's replacement: staged tables (<partition>_kept, its stage
-- or swap never finished) and detached ones (<partition>_gone, its swap committed, their drop
-- did not), by month and kind.
CREATE OR REPLACE FUNCTION ledger.partition_month_leftovers()
RETURNS TABLE (month date, kind text)
LANGUAGE sql STABLE AS $$
    SELECT DISTINCT to_date(m[2], 'YYYY_MM'), m[3]
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
           LATERAL regexp_match(c.relname, '^(events|deliveries|attempts)_(\d{4}_\d{2})_(kept|gone)$') m
     WHERE n.nspname = 'ledger' AND c.relkind = 'r' AND m IS NOT NULL
     ORDER BY 1, 2
$$;

CREATE OR REPLACE FUNCTION ledger.partition_month_unstage(month date) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT name FROM ledger.partitioned_tables() LOOP
        EXECUTE format('DROP TABLE IF EXISTS ledger.%I', ledger.partition_staged_name(t.name, month));
    END LOOP;
END
$$;

-- The month drop of migration 0012, replaced by the steps above.
DROP FUNCTION IF EXISTS ledger.partition_drop(date, bigint, integer);
