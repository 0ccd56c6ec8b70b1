-- A repair scoped to one object or one customer (workers/object_repair.py, ledger/object_repairs.py):
-- billing's rows of it rewritten from the ledger's events of it, in one transaction that holds the
-- objects' locks (ledger/sql/objects.sql) from before it reads the events to its commit.

-- name: object_repair_record
-- The audit of a repair, in the repair's own transaction: it commits with the rows it names.
INSERT INTO ledger.object_repairs (scope, object_id, actor, counts, changes)
VALUES (%(scope)s, %(object_id)s, %(actor)s, %(counts)s, %(changes)s)
RETURNING id, at

-- name: object_repairs_of
-- The repairs of an object, newest first (its page lists them).
SELECT id, scope, object_id, actor, counts, at
  FROM ledger.object_repairs
 WHERE object_id = %(object_id)s
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s
