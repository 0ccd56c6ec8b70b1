-- Re-projection (ledger/reprojection.py, docs/reprojection.md): a rebuild of billing from the
-- ledger's payloads, into the shadow schema billing_rebuild; its runs' states move
-- building -> built -> applied -> undone | discarded, or building | built -> cancelled.

-- name: reprojection_try_lock
-- One process works on a rebuild at a time (builds, catches up, switches), across hosts: a
-- session-level advisory lock on the runner's own connection, released when it ends or dies.
SELECT pg_try_advisory_lock(hashtextextended('ledger.reprojection', 0)) AS locked

-- name: reprojection_unlock
SELECT pg_advisory_unlock(hashtextextended('ledger.reprojection', 0))

-- name: reprojection_open
-- The rebuild that is not over, if any (reprojections_one_open allows one); `done`: its parts' sum.
SELECT r.*, (SELECT coalesce(sum(p.done), 0)::bigint FROM ledger.reprojection_parts p WHERE p.reprojection_id = r.id) AS done
  FROM ledger.reprojections r WHERE r.state IN ('building', 'built', 'applied')

-- name: reprojection_get
SELECT r.*, (SELECT coalesce(sum(p.done), 0)::bigint FROM ledger.reprojection_parts p WHERE p.reprojection_id = r.id) AS done
  FROM ledger.reprojections r WHERE r.id = %(id)s

-- name: reprojection_latest
SELECT r.*, (SELECT coalesce(sum(p.done), 0)::bigint FROM ledger.reprojection_parts p WHERE p.reprojection_id = r.id) AS done
  FROM ledger.reprojections r ORDER BY r.id DESC LIMIT 1

-- name: reprojection_parts
SELECT part, total, done FROM ledger.reprojection_parts WHERE reprojection_id = %(id)s ORDER BY part

-- name: reprojection_dependents
SELECT ledger.reprojection_dependents() AS dependents

-- name: reprojection_make_shadow
-- The shadow of the tables the rebuild writes (migration 0016); their names, in order.
SELECT ledger.reprojection_make_shadow(%(schema)s, %(tables)s::text[]) AS tables

-- name: reprojection_drop_schema
-- {schema}: billing_rebuild or billing_before, never a name from outside.
DROP SCHEMA IF EXISTS {schema} CASCADE

-- name: reprojection_create_queue
-- The main pass's events, in Stripe's order, numbered: what "done" counts, where a resumed
-- rebuild goes on from. In the shadow schema, not a billing table: it is never switched in.
CREATE TABLE billing_rebuild.reprojection_queue (
    part           integer     NOT NULL,
    seq            bigint      NOT NULL,
    event_id       text        NOT NULL,
    stripe_created timestamptz NOT NULL,
    PRIMARY KEY (part, seq)
)

-- name: reprojection_fill_queue
-- Every processed event, in its part (by ledger.reprojection_key: its customer's, migration 0016),
-- numbered in the part by (created, id): Stripe's `created` has one-second resolution, the id breaks
-- ties the same way every time. One part reads no key at all.
INSERT INTO billing_rebuild.reprojection_queue (part, seq, event_id, stripe_created)
SELECT part, row_number() OVER (PARTITION BY part ORDER BY stripe_created, id), id, stripe_created
  FROM (SELECT CASE WHEN %(parts)s::integer = 1 THEN 0
                    ELSE (abs(hashtextextended(ledger.reprojection_key(customer_id, object_id, applied_object,
                                                                       payload, id), 0)) %% %(parts)s)::integer
               END AS part, id, stripe_created
          FROM ledger.events WHERE status = 'processed') e

-- name: reprojection_create_kept
-- The live rows a rebuild keeps (their source is an event it did not apply: see
-- ledger.reprojection_rebuilt), by table and key, merged into the shadow; what the diff lists
-- as kept. In the shadow schema: never switched in.
CREATE TABLE IF NOT EXISTS billing_rebuild.reprojection_kept (
    table_name text  NOT NULL,
    key        jsonb NOT NULL,
    source     text,
    PRIMARY KEY (table_name, key)
)

-- name: reprojection_record_kept
INSERT INTO billing_rebuild.reprojection_kept (table_name, key, source)
SELECT %(table)s, k.key, k.source FROM unnest(%(keys)s::jsonb[], %(sources)s::text[]) AS k(key, source)
ON CONFLICT (table_name, key) DO UPDATE SET source = EXCLUDED.source

-- name: reprojection_kept_counts
SELECT table_name, count(*) AS rows FROM billing_rebuild.reprojection_kept GROUP BY table_name

-- name: reprojection_kept_rows
SELECT key, source FROM billing_rebuild.reprojection_kept WHERE table_name = %(table)s ORDER BY key::text
 LIMIT %(limit)s

-- name: reprojection_create_parts
INSERT INTO ledger.reprojection_parts (reprojection_id, part, total)
SELECT %(id)s, part, count(*) FROM billing_rebuild.reprojection_queue GROUP BY part

-- name: reprojection_catchup_cut
-- Where the next catch-up starts: a processed event is stamped with its transaction's start
-- (processed_at = now()), so an event not yet visible now will carry a time at or after the
-- start of the oldest transaction open in this database, or after this statement's.
SELECT least(now(), min(xact_start)) AS cut
  FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL

-- name: reprojection_create
-- A new rebuild (the shadow made, its queue filled): building.
INSERT INTO ledger.reprojections (scope, started_by, tables, total, parts, caught_up_to)
VALUES (%(scope)s, %(actor)s, %(tables)s, %(total)s, %(parts)s, %(cut)s)
RETURNING id

-- name: reprojection_queued_events
-- A slice of a part of the main pass: the part's seq in (after, after + size], each event read again by
-- its key. One no longer processed (replayed since) is left to the catch-up, which applies it
-- once it is processed again.
SELECT q.seq, e.id, e.type, e.payload, e.stripe_created, e.livemode, e.account, e.api_version,
       e.applied_object, e.applied_api_version, e.applied_as
  FROM billing_rebuild.reprojection_queue q
  JOIN ledger.events e ON e.id = q.event_id AND e.stripe_created = q.stripe_created
 WHERE q.part = %(part)s AND q.seq > %(after)s::bigint AND q.seq <= %(after)s::bigint + %(size)s::bigint
   AND e.status = 'processed'
 ORDER BY q.seq

-- name: reprojection_processed_since
-- A catch-up's events: every one processed at or after `since`, by key, in Stripe's order. A pruned
-- one was processed long before any rebuild.
SELECT id, stripe_created FROM ledger.events
 WHERE status = 'processed' AND payload IS NOT NULL AND processed_at >= %(since)s
 ORDER BY stripe_created, id

-- name: reprojection_events_by_key
-- A slice of a catch-up, read by key, in the order given. One no longer processed (replayed since) is
-- left to a later catch-up, which meets it once it is processed again.
SELECT e.id, e.type, e.payload, e.stripe_created, e.livemode, e.account, e.api_version,
       e.applied_object, e.applied_api_version, e.applied_as
  FROM unnest(%(ids)s::text[], %(created)s::timestamptz[]) WITH ORDINALITY AS k(id, stripe_created, n)
  JOIN ledger.events e ON e.id = k.id AND e.stripe_created = k.stripe_created
 WHERE e.status = 'processed'
 ORDER BY k.n

-- name: reprojection_advance
-- In the slice's transaction: its part's progress. No row: the rebuild was cancelled (or is no
-- longer building), and the slice is rolled back.
UPDATE ledger.reprojection_parts p SET done = %(done)s
 WHERE p.reprojection_id = %(id)s AND p.part = %(part)s
   AND EXISTS (SELECT 1 FROM ledger.reprojections r WHERE r.id = p.reprojection_id AND r.state = 'building')
RETURNING part

-- name: reprojection_record_catchup
-- In the catch-up's last transaction: the events it applied, and where the next one starts.
UPDATE ledger.reprojections SET caught_up_to = %(cut)s, caught_up = caught_up + %(applied)s
 WHERE id = %(id)s AND state = %(state)s
RETURNING id

-- name: reprojection_skip
-- An event the rebuild could not apply, and why; found again (a resumed slice), the latest reason.
INSERT INTO ledger.reprojection_skips (reprojection_id, event_id, event_type, reason, detail)
VALUES (%(id)s, %(event_id)s, %(event_type)s, %(reason)s, %(detail)s)
ON CONFLICT (reprojection_id, event_id) DO UPDATE SET reason = EXCLUDED.reason, detail = EXCLUDED.detail

-- name: reprojection_unskip
-- An event applied by a later slice (a catch-up after its replay): no longer one it could not apply.
DELETE FROM ledger.reprojection_skips WHERE reprojection_id = %(id)s AND event_id = ANY (%(event_ids)s)

-- name: reprojection_skips
SELECT event_id, event_type, reason, detail FROM ledger.reprojection_skips
 WHERE reprojection_id = %(id)s ORDER BY event_id LIMIT %(limit)s

-- name: reprojection_skip_counts
SELECT reason, count(*) AS events FROM ledger.reprojection_skips
 WHERE reprojection_id = %(id)s GROUP BY reason ORDER BY reason

-- name: reprojection_built
-- building -> built: the main pass done and caught up.
UPDATE ledger.reprojections SET state = 'built', built_at = now()
 WHERE id = %(id)s AND state = 'building'
RETURNING id

-- name: reprojection_cancelled
-- building | built -> cancelled (its shadow is dropped).
UPDATE ledger.reprojections SET state = 'cancelled', finished_at = now()
 WHERE id = %(id)s AND state IN ('building', 'built')
RETURNING id

-- name: reprojection_applied
-- built -> applied, in the switch's transaction.
UPDATE ledger.reprojections SET state = 'applied', applied_at = now(), applied_by = %(actor)s
 WHERE id = %(id)s AND state = 'built'
RETURNING id

-- name: reprojection_undone
-- applied -> undone, in the switch back's transaction.
UPDATE ledger.reprojections SET state = 'undone', finished_at = now()
 WHERE id = %(id)s AND state = 'applied'
RETURNING id

-- name: reprojection_lock_held
-- After the switch's COMMIT: how long it held the live tables' locks.
UPDATE ledger.reprojections SET lock_ms = %(lock_ms)s WHERE id = %(id)s

-- name: reprojection_discarded
-- applied -> discarded: the tables before it are dropped, and no undo is possible any more.
UPDATE ledger.reprojections SET state = 'discarded', finished_at = now()
 WHERE id = %(id)s AND state = 'applied'
RETURNING id

-- name: reprojection_audit
INSERT INTO ledger.reprojection_audit (reprojection_id, action, actor, scope, counts)
VALUES (%(id)s, %(action)s, %(actor)s, %(scope)s, %(counts)s)

-- name: reprojection_audit_of
SELECT action, actor, scope, counts, at FROM ledger.reprojection_audit
 WHERE reprojection_id = %(id)s ORDER BY at, id

-- name: reprojection_lock_tables
-- The live tables, exclusively, for the last catch-up and the switch: readers wait as well,
-- for as long as the lock lasts (it is measured). {tables}: billing.<each>.
LOCK TABLE {tables} IN ACCESS EXCLUSIVE MODE

-- name: reprojection_switch
SELECT ledger.reprojection_switch(%(incoming)s, %(aside)s, %(tables)s)

-- name: reprojection_table_shape
-- What the diff compares of a table: its columns but those that say when a row was written
-- (a DEFAULT now(): updated_at, recorded_at, granted_at), and the key it is matched on (the
-- primary key, else its first unique index: billing.objects' expression key).
SELECT (SELECT array_agg(a.attname::text ORDER BY a.attnum)
          FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
           AND pg_get_expr(d.adbin, d.adrelid) = 'now()') AS written_at,
       (SELECT array_agg(pg_get_indexdef(x.indexrelid, k, true) ORDER BY k)
          FROM generate_series(1, x.indnkeyatts) AS k) AS key
  FROM pg_class c
  JOIN LATERAL (SELECT * FROM pg_index i WHERE i.indrelid = c.oid AND i.indisunique
                 ORDER BY i.indisprimary DESC, i.indexrelid LIMIT 1) x ON true
 WHERE c.oid = format('billing.%%I', %(table)s::text)::regclass

-- name: reprojection_diff
-- One table's rows that differ (their key, the live row, the rebuilt one; NULL where the row is
-- not there), to `limit`; and the counts, in every row. Generated from reprojection_table_shape:
-- {key} the key's expressions (named k0, k1, ...), {join} their equalities, {table} the table's name;
-- written_at the columns left out.
WITH l AS (SELECT {key}, to_jsonb(t) - %(written_at)s::text[] AS r FROM billing.{table} t),
     s AS (SELECT {key}, to_jsonb(t) - %(written_at)s::text[] AS r FROM billing_rebuild.{table} t),
     d AS (SELECT l.r AS live, s.r AS rebuilt FROM l FULL JOIN s ON {join} WHERE l.r IS DISTINCT FROM s.r),
     n AS (SELECT count(*) FILTER (WHERE rebuilt IS NULL) AS only_live,
                  count(*) FILTER (WHERE live IS NULL) AS only_rebuilt,
                  count(*) FILTER (WHERE live IS NOT NULL AND rebuilt IS NOT NULL) AS changed FROM d)
SELECT n.only_live, n.only_rebuilt, n.changed, x.live, x.rebuilt
  FROM n LEFT JOIN LATERAL (SELECT * FROM d ORDER BY coalesce(d.live, d.rebuilt)::text LIMIT %(limit)s) x ON true
