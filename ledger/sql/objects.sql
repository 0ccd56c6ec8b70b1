-- Object locks: which business objects an apply transaction writes, locked before
-- any of its writes (workers/processor.py, "Object locks"). A key is a Stripe
-- object id (the event's object, its customer, its subscription); the lock is a
-- transaction-scoped advisory lock on its 64-bit hash, so it costs no row and is
-- released by COMMIT or ROLLBACK. Two transactions that lock the same objects in
-- opposite orders deadlock, and Postgres finds that only after deadlock_timeout:
-- so a transaction either never waits for one (object_try_lock), or takes all it
-- needs in the one global order, by hash (object_lock), letting go of what it holds
-- whenever one wait runs long.

-- name: object_try_lock
-- A batch's transaction, just before it applies a member: every key of the member's it
-- can have without waiting. A key another transaction holds is not returned; a member
-- that needs it goes in a later transaction (ApplyTransaction.lock) instead of waiting
-- here with locks held.
SELECT key
  FROM unnest(%(keys)s::text[]) AS key
 WHERE pg_try_advisory_xact_lock(hashtextextended('ledger.object:' || key, 0))

-- name: object_lock
-- A transaction that waits for its keys (ApplyTransaction.lock): all of them, in ascending
-- order of their hash, the one order every waiting transaction uses, so no two of them wait
-- for each other. The sorted subquery fixes the order in which the outer query calls
-- pg_advisory_xact_lock. Each wait is bounded by the caller's lock_timeout: past it the keys
-- taken are let go of (a savepoint rolled back) and the whole set is waited for again.
SELECT count(pg_advisory_xact_lock(lock_id)) AS locked
  FROM (SELECT DISTINCT hashtextextended('ledger.object:' || key, 0) AS lock_id
          FROM unnest(%(keys)s::text[]) AS key
         ORDER BY lock_id) AS ordered
