-- Re-projection (ledger/reprojection.py, docs/reprojection.md): billing rebuilt from the
-- ledger's stored payloads into a shadow copy of its tables (schema billing_rebuild),
-- compared with the live tables, and switched in; the tables it replaced are kept
-- (schema billing_before) for an undo until the next rebuild or a discard.

-- One row per rebuild. At most one is not over (building, built or applied: the
-- shadow or the tables before it exist), so two rebuilds never share the schemas.
CREATE TABLE IF NOT EXISTS ledger.reprojections (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    state           text        NOT NULL DEFAULT 'building'
                    CHECK (state IN ('building', 'built', 'applied', 'undone', 'cancelled', 'discarded')),
    scope           jsonb       NOT NULL DEFAULT '{}',
    started_by      text        NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT now(),
    -- The tables rebuilt: every table of schema billing when the rebuild started.
    tables          text[]      NOT NULL DEFAULT '{}',
    -- The main pass: the events to rebuild, queued in Stripe's order in `parts` parts (how far
    -- each got: ledger.reprojection_parts).
    total           bigint      NOT NULL DEFAULT 0,
    parts           integer     NOT NULL DEFAULT 1 CHECK (parts >= 1),
    -- Events processed at or after this time are applied again by the next catch-up: no
    -- transaction that could still commit a processed event had started before it.
    caught_up_to    timestamptz,
    caught_up       bigint      NOT NULL DEFAULT 0,
    built_at        timestamptz,
    applied_at      timestamptz,
    applied_by      text,
    lock_ms         double precision,
    finished_at     timestamptz,
    CONSTRAINT reprojections_built_when CHECK (state IN ('building', 'cancelled') OR built_at IS NOT NULL),
    CONSTRAINT reprojections_applied_by CHECK (state NOT IN ('applied', 'undone') OR applied_by IS NOT NULL)
);
CREATE UNIQUE INDEX IF NOT EXISTS reprojections_one_open ON ledger.reprojections ((true))
    WHERE state IN ('building', 'built', 'applied');

-- The main pass's parts, each applied by a process of its own: the events of one customer (or,
-- without one, of one object) are all in one part (ledger.reprojection_part), in Stripe's order.
CREATE TABLE IF NOT EXISTS ledger.reprojection_parts (
    reprojection_id bigint      NOT NULL REFERENCES ledger.reprojections (id) ON DELETE CASCADE,
    part            integer     NOT NULL,
    total           bigint      NOT NULL,
    done            bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (reprojection_id, part)
);

-- Which part an event goes to: by the customer its object names (bare or expanded; an Accounts v2
-- customer account), else by its object's id, else by its own id. What a worker locks first
-- (workers.handlers.object_keys) is the object and these; a customer's rows (its subscriptions,
-- their transitions, its entitlements) are written by its part alone.
CREATE OR REPLACE FUNCTION ledger.reprojection_part(payload json, event_id text, parts integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (abs(hashtextextended(coalesce(
                CASE json_typeof(o -> 'customer') WHEN 'object' THEN o -> 'customer' ->> 'id'
                                                  WHEN 'string' THEN o ->> 'customer' END,
                o ->> 'customer_account', o ->> 'id', event_id), 0)) % parts)::integer
      FROM (SELECT payload -> 'data' -> 'object' AS o) x
$$;

-- Events a rebuild could not apply: their payload pruned, a thin notification whose
-- object was fetched and not kept, or a handler that failed. The rebuild goes on.
CREATE TABLE IF NOT EXISTS ledger.reprojection_skips (
    reprojection_id bigint      NOT NULL REFERENCES ledger.reprojections (id) ON DELETE CASCADE,
    event_id        text        NOT NULL,
    event_type      text        NOT NULL,
    reason          text        NOT NULL,
    detail          text,
    PRIMARY KEY (reprojection_id, event_id)
);

-- Who did what to a rebuild: start, cancel, apply, undo, discard; the scope and the counts.
CREATE TABLE IF NOT EXISTS ledger.reprojection_audit (
    id              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    reprojection_id bigint      NOT NULL REFERENCES ledger.reprojections (id) ON DELETE CASCADE,
    action          text        NOT NULL CHECK (action IN ('start', 'cancel', 'apply', 'undo', 'discard')),
    actor           text        NOT NULL,
    scope           jsonb       NOT NULL,
    counts          jsonb       NOT NULL DEFAULT '{}',
    at              timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS reprojection_audit_run_idx ON ledger.reprojection_audit (reprojection_id, at);

-- An empty copy of every table of schema billing in schema `target`, made from what the
-- migrations built, never from a copy kept by hand: each table's columns, defaults and
-- checks (LIKE), its keys and indexes under the same names (so a switched-in table keeps
-- the names later migrations refer to), and its privileges (so the roles that read billing
-- still can). The tables' names, in order.
CREATE OR REPLACE FUNCTION ledger.reprojection_make_shadow(target text) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    t record;
    k record;
    g record;
    made text[] := '{}';
BEGIN
    EXECUTE format('DROP SCHEMA IF EXISTS %I CASCADE', target);
    EXECUTE format('CREATE SCHEMA %I', target);
    FOR t IN SELECT c.oid, c.relname, c.relacl
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'billing' AND c.relkind = 'r'
              ORDER BY c.relname
    LOOP
        EXECUTE format('CREATE TABLE %I.%I (LIKE billing.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                       'INCLUDING GENERATED INCLUDING IDENTITY INCLUDING STORAGE INCLUDING COMMENTS)',
                       target, t.relname, t.relname);
        FOR k IN SELECT conname, pg_get_constraintdef(oid) AS def
                   FROM pg_constraint WHERE conrelid = t.oid AND contype IN ('p', 'u', 'x')
        LOOP
            EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I %s', target, t.relname, k.conname, k.def);
        END LOOP;
        FOR k IN SELECT pg_get_indexdef(x.indexrelid) AS def
                   FROM pg_index x
                  WHERE x.indrelid = t.oid
                    AND NOT EXISTS (SELECT 1 FROM pg_constraint o WHERE o.conindid = x.indexrelid)
        LOOP
            EXECUTE regexp_replace(k.def, ' ON billing\.', format(' ON %I.', target));
        END LOOP;
        FOR g IN SELECT a.privilege_type, a.is_grantable,
                        CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END AS grantee
                   FROM aclexplode(t.relacl) a LEFT JOIN pg_roles r ON r.oid = a.grantee
                  WHERE a.grantee <> a.grantor
        LOOP
            EXECUTE format('GRANT %s ON %I.%I TO %s%s', g.privilege_type, target, t.relname, g.grantee,
                           CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
        END LOOP;
        made := made || t.relname::text;
    END LOOP;
    RETURN made;
END
$$;

-- What outside schema billing names a billing table by its identity, not its name: a view, a
-- foreign key. The switch would leave it on the table set aside, and dropping that table would
-- drop it, so a rebuild refuses to start or switch while there is any.
CREATE OR REPLACE FUNCTION ledger.reprojection_dependents() RETURNS text[]
LANGUAGE sql STABLE AS $$
    WITH billing_tables AS (
        SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'billing' AND c.relkind = 'r'
    )
    SELECT coalesce(array_agg(DISTINCT d ORDER BY d), '{}') FROM (
        SELECT format('view %s', r.ev_class::regclass) AS d
          FROM pg_depend dep JOIN pg_rewrite r ON r.oid = dep.objid
         WHERE dep.classid = 'pg_rewrite'::regclass AND dep.refobjid IN (SELECT oid FROM billing_tables)
           AND r.ev_class NOT IN (SELECT oid FROM billing_tables)
        UNION ALL
        SELECT format('foreign key %s on %s', k.conname, k.conrelid::regclass)
          FROM pg_constraint k
         WHERE k.contype = 'f' AND k.confrelid IN (SELECT oid FROM billing_tables)
           AND k.conrelid NOT IN (SELECT oid FROM billing_tables)
    ) x
$$;

-- The switch, in the caller's transaction, which holds the tables' locks: each of `tables`
-- moves from schema billing to `aside`, and its twin from `incoming` to billing. A
-- statement of a worker that waited for a lock finds the name again once it has it, and
-- writes the table now called billing.<name>.
CREATE OR REPLACE FUNCTION ledger.reprojection_switch(incoming text, aside text, tables text[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    name text;
    dependents text[] := ledger.reprojection_dependents();
BEGIN
    IF cardinality(dependents) > 0 THEN
        RAISE EXCEPTION 'billing tables are named by % outside schema billing, which a switch would leave on the '
                        'tables set aside: nothing was switched', array_to_string(dependents, ', ')
              USING ERRCODE = 'LR001';
    END IF;
    EXECUTE format('CREATE SCHEMA IF NOT EXISTS %I', aside);
    FOREACH name IN ARRAY tables LOOP
        IF to_regclass(format('%I.%I', incoming, name)) IS NULL THEN
            RAISE EXCEPTION 'table %.% is not there: nothing was switched', incoming, name;
        END IF;
        EXECUTE format('ALTER TABLE billing.%I SET SCHEMA %I', name, aside);
        EXECUTE format('ALTER TABLE %I.%I SET SCHEMA billing', incoming, name);
    END LOOP;
END
$$;
