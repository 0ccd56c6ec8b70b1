-- What a worker applied for a thin notification, kept with the event: the object it fetched from
-- Stripe's API for it (applied_object), when (applied_object_at), at which API version Stripe
-- rendered it (applied_api_version), and the id its rows were written under (applied_as: the
-- snapshot event of the same change, when Stripe names one; NULL: the notification's own). Stripe
-- keeps an event 30 days and an object only as it is now: the ledger is the only record of what
-- was applied, and a rebuild (workers/reproject.py) applies it again from here as a snapshot
-- event. Columns of the event's own row, so retention archives, removes and restores them with it,
-- and no index: adding a nullable column without a default rewrites nothing.
ALTER TABLE ledger.events ADD COLUMN IF NOT EXISTS applied_object      json;
ALTER TABLE ledger.events ADD COLUMN IF NOT EXISTS applied_object_at   timestamptz;
ALTER TABLE ledger.events ADD COLUMN IF NOT EXISTS applied_api_version text;
ALTER TABLE ledger.events ADD COLUMN IF NOT EXISTS applied_as          text;

-- The Stripe object an event is about and that object's customer (ledger.stripe_events.object_and_customer),
-- recorded by the receiver and catch-up from the body they parse anyway: what keeps a customer's events
-- in one part of a rebuild without parsing every payload (ledger.reprojection_key), and what finds an
-- object's events. NULL for an event recorded before; no index here (one built inside a migration's
-- transaction would hold the receiver's inserts for as long as it takes).
ALTER TABLE ledger.events ADD COLUMN IF NOT EXISTS object_id   text;
ALTER TABLE ledger.events ADD COLUMN IF NOT EXISTS customer_id text;

-- Which part of a rebuild an event goes to is decided by this key: its object's customer, else its
-- object, else its own id (one customer's subscriptions, transitions and entitlements are written by
-- one part). From the columns above; for a thin notification, from the object its worker applied; for
-- an event recorded before the columns, from its payload (which costs a parse of it).
CREATE OR REPLACE FUNCTION ledger.object_customer(o json) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(CASE json_typeof(o -> 'customer') WHEN 'object' THEN o -> 'customer' ->> 'id'
                                                      WHEN 'string' THEN o ->> 'customer' END,
                    o ->> 'customer_account')
$$;

CREATE OR REPLACE FUNCTION ledger.reprojection_key(customer_id text, object_id text, applied_object json,
                                                   payload json, event_id text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT coalesce(customer_id,
                    ledger.object_customer(applied_object),
                    CASE WHEN object_id IS NULL THEN ledger.object_customer(payload -> 'data' -> 'object') END,
                    applied_object ->> 'id',
                    object_id,
                    CASE WHEN object_id IS NULL THEN payload -> 'data' -> 'object' ->> 'id' END,
                    event_id)
$$;

-- The shadow of some of billing's tables: reprojection_make_shadow(target) copies every table of
-- schema billing; a rebuild copies only the tables its handlers write (billing's own, and those of
-- a user's handlers declared rebuilt), so a table of schema billing that no rebuilt handler writes
-- is never emptied by a switch. The same copy as migration 0015's: columns, defaults, checks, keys
-- and indexes under their names, privileges.
CREATE OR REPLACE FUNCTION ledger.reprojection_make_shadow(target text, only_tables text[]) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    t record;
    k record;
    g record;
    missing text[];
    made text[] := '{}';
BEGIN
    SELECT array_agg(x ORDER BY x) INTO missing
      FROM unnest(only_tables) x
     WHERE to_regclass(format('billing.%I', x)) IS NULL;
    IF missing IS NOT NULL THEN
        RAISE EXCEPTION 'no table billing.% to rebuild', array_to_string(missing, ', billing.')
              USING ERRCODE = 'LR002';
    END IF;
    EXECUTE format('DROP SCHEMA IF EXISTS %I CASCADE', target);
    EXECUTE format('CREATE SCHEMA %I', target);
    FOR t IN SELECT c.oid, c.relname, c.relacl
               FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = 'billing' AND c.relkind = 'r' AND c.relname = ANY (only_tables)
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

-- Whether a rebuild applied the event a row names as its source (its source_event_id, or a
-- transition's event_id): an event of the ledger, processed, that the rebuild did not list as
-- skipped; or the snapshot event of the same change as such a thin notification (the rows of
-- one carry the other's id). A row whose source it did not apply (the event pruned, removed by
-- retention, a thin notification from before the ledger kept its object, one a handler now
-- refuses, or no event at all: an object fetched from the API) is kept through an apply
-- (workers/reproject.py): a rebuild cannot see what wrote it.
CREATE OR REPLACE FUNCTION ledger.reprojection_rebuilt(run bigint, source text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM ledger.events e
                    WHERE e.id = source AND e.status = 'processed'
                      AND NOT EXISTS (SELECT 1 FROM ledger.reprojection_skips k
                                       WHERE k.reprojection_id = run AND k.event_id = e.id))
        OR EXISTS (SELECT 1 FROM ledger.snapshot_twins t JOIN ledger.events e ON e.id = t.event_id
                    WHERE t.snapshot_event_id = source AND e.status = 'processed'
                      AND NOT EXISTS (SELECT 1 FROM ledger.reprojection_skips k
                                       WHERE k.reprojection_id = run AND k.event_id = e.id))
$$;
