-- A worker process's proof of life (ledger/liveness.py): an advisory lock on a random key, held
-- in shared mode by a Postgres session of the process's own for as long as it lives, and by each
-- of its apply transactions while they run. A key nobody holds in any mode is a gone process
-- (event_rescue_if_owner_gone probes it with an exclusive try). The keys are random 63-bit
-- numbers; object locks (objects.sql) hash text into the same space, and a collision is as
-- likely as guessing a random 64-bit number twice.

-- name: liveness_claim_key
-- Worker process, once per liveness session: take the key exclusively, proving no live session
-- holds it (false: draw another), before holding it shared (liveness_hold_key) and letting go
-- of the exclusive hold (liveness_release_exclusive).
SELECT pg_try_advisory_lock(%(key)s) AS free

-- name: liveness_hold_key
-- Worker process: the session's shared hold on its key, for the session's life.
SELECT pg_advisory_lock_shared(%(key)s)

-- name: liveness_release_exclusive
-- Worker process: the exclusive hold of liveness_claim_key released; the shared one stays.
SELECT pg_advisory_unlock(%(key)s)

-- name: liveness_hold_for_transaction
-- Worker, first statement of an apply transaction: its claims' keys held shared until COMMIT, so
-- that the process counts as alive while its transaction runs, even should its liveness session
-- end first: its events are rescued only once nothing of it holds row or object locks.
SELECT count(pg_advisory_xact_lock_shared(key)) FROM unnest(%(keys)s::bigint[]) AS key

-- name: liveness_keys_of_expired_leases
-- Rescuer: the liveness keys of leases that ran out while a session of their owner still lives:
-- a stopped worker (SIGSTOP, a frozen VM), whose lease governs. Its sessions are ended
-- (liveness_end_sessions) so that its open transaction lets go of the rows the next claim takes.
SELECT DISTINCT lease_liveness_key AS key
  FROM ledger.events
 WHERE status = 'processing' AND lease_liveness_key IS NOT NULL AND lease_expires_at < now()
UNION
SELECT DISTINCT lease_liveness_key
  FROM ledger.outbox
 WHERE status = 'sending' AND lease_liveness_key IS NOT NULL AND lease_expires_at < now()

-- name: liveness_end_sessions
-- Rescuer: end every session that holds one of these keys (a stopped worker's liveness session
-- and its open transactions), once their leases ran out. The pids ended.
SELECT l.pid, pg_terminate_backend(l.pid) AS ended
  FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.pid <> pg_backend_pid()
   AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY(%(keys)s::bigint[])
