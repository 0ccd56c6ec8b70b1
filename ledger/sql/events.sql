-- The receiver's and the workers' statements on ledger.events and ledger.attempts: record,
-- claim, fence, finish, fail, sweep, rescue. (The operator's are operations.sql's, retention's
-- retention.sql's.)
-- Transitions are compare-and-set: the expected state (and lease owner) sits in
-- the WHERE clause, and "no row" is an outcome the caller names and handles.
-- Beside an event's id, its status is tested as coalesce(status, '') (status is never
-- NULL): the planner must not answer such a statement from a partial index of unfinished
-- events, whose predicate is a status test. It prefers those whenever its statistics say few
-- events are unfinished, and on a ledger whose backlog grew since, that reads the whole backlog
-- for each id: 7 ms at 5,000 unfinished events, against 0.1 ms through the primary key.
-- Once an event is claimed, its statements name it by its whole key, (id, stripe_created): on a
-- partitioned ledger an id alone is looked up in every month's partition, and a worker's claim,
-- fence and finish did that about seven times an event (docs/retention.md, "Partitions"). The
-- attempt a claim closes for a worker gone is still found by id: on a ledger never partitioned, an
-- attempt from before migration 0012 has no event_created.

-- name: event_record_delivery
-- Receiver and catch-up: a new id becomes `received`; a known id is left as it is
-- (its payload and status are never overwritten by a delivery). Either way the
-- delivery is appended to ledger.deliveries with its source (webhook or catchup:
-- one statement, so both dedupe alike). Never waits on a worker: DO NOTHING
-- does not lock the existing row, and the foreign key's KEY SHARE lock does not
-- conflict with the worker's NO KEY UPDATE lock.
-- No row back means a concurrent copy committed the id after this statement's
-- snapshot was taken: the caller reads it with event_delivery_status.
-- On a partitioned ledger the key is (id, stripe_created), and Stripe's `created` is the
-- same on every copy of an event, so a copy meets its first one in the same partition
-- (ON CONFLICT); the NOT EXISTS makes an id already there, whatever its time, a
-- duplicate too (docs/guarantee.md, "Dedupe across partitions").
WITH existing AS (
    SELECT status, lease_expires_at, stripe_created FROM ledger.events WHERE id = %(id)s
), inserted AS (
    INSERT INTO ledger.events (id, type, stripe_created, livemode, api_version, account, payload, object_id,
                               customer_id)
    SELECT %(id)s, %(type)s, to_timestamp(%(created)s), %(livemode)s, %(api_version)s,
           %(account)s, %(payload)s::json, %(object_id)s, %(customer_id)s
     WHERE NOT EXISTS (SELECT 1 FROM existing)
    ON CONFLICT DO NOTHING
    RETURNING status, lease_expires_at
), delivery AS (
    INSERT INTO ledger.deliveries (event_id, event_created, source)
    VALUES (%(id)s, coalesce((SELECT stripe_created FROM existing), to_timestamp(%(created)s)), %(source)s)
)
SELECT true AS inserted, status, false AS lease_expired FROM inserted
UNION ALL
SELECT false, status, coalesce(lease_expires_at < now(), false) FROM existing

-- name: event_delivery_status
-- Receiver: status of an id a concurrent delivery inserted (see event_record_delivery).
SELECT false AS inserted, status, coalesce(lease_expires_at < now(), false) AS lease_expired
  FROM ledger.events
 WHERE id = %(id)s

-- name: event_hasten_if_recoverable
-- Receiver: failed_recoverable -> failed_recoverable, due now. A redelivery from
-- Stripe is a second chance to process, never a reason to wait out our backoff.
UPDATE ledger.events
   SET next_attempt_at = least(next_attempt_at, now()), wakeup_at = now(), updated_at = now()
 WHERE id = %(id)s AND coalesce(status, '') = 'failed_recoverable'

-- name: event_get
-- Read one event row (no payload) for inspection and responses.
SELECT id, type, status, attempts, failure_reason, last_error, stripe_created, livemode,
       api_version, account, received_at,
       (SELECT count(*) FROM ledger.deliveries d WHERE d.event_id = e.id) AS deliveries,
       wakeup_at, redrives, next_attempt_at, lease_owner, lease_expires_at, processed_at, updated_at
  FROM ledger.events e
 WHERE id = %(id)s

-- name: event_claim
-- Worker: received | failed_recoverable (due) | processing (lease expired) -> processing,
-- for every claimable id of the wake-ups it holds (one, or a batch) in one statement,
-- under one lease owner. The compare-and-set that makes one worker, on any host, the
-- owner of an attempt: concurrent claims of one id serialise on the row, and every one
-- but the first finds the guard false and gets no row (another has it, or it is done).
-- One owner per claim is enough: each event's fence, finish and fail still check it per id,
-- so a take-over of one member (a new owner on that row) fences that member alone.
-- A row another transaction holds locked is skipped, not waited for: its holder
-- (a worker applying it, a claim, the sweep, a redelivery making it due) finishes
-- it or sends the next wake-up, and the sweep re-drives whatever is left; so a
-- batch never waits on another worker's apply. In the same statement each dead
-- worker's attempt is closed as lease_expired, and this attempt is opened in the history.
-- liveness_key: the advisory-lock key whose holder is this worker process's Postgres
-- session (ledger/liveness.py; NULL: none); once nobody holds it, the rescuer takes the
-- lease over without waiting for it to expire (event_rescue_if_owner_gone).
WITH claimable AS (
    SELECT id, stripe_created
      FROM ledger.events
     WHERE id = ANY(%(ids)s)
       AND (coalesce(status, '') = 'received'
            OR (coalesce(status, '') = 'failed_recoverable' AND next_attempt_at <= now())
            OR (coalesce(status, '') = 'processing' AND lease_expires_at < now()))
       FOR NO KEY UPDATE SKIP LOCKED
), claimed AS (
    UPDATE ledger.events
       SET status           = 'processing',
           lease_owner      = %(lease_owner)s,
           lease_expires_at = now() + make_interval(secs => %(lease_s)s),
           lease_liveness_key = %(liveness_key)s,
           attempts         = attempts + 1,
           redrives         = 0,
           updated_at       = now()
     WHERE (id, stripe_created) IN (SELECT id, stripe_created FROM claimable)
 RETURNING id, type, attempts, attempts - attempt_base AS tries, payload, stripe_created,
           livemode, api_version, account, lease_liveness_key
), closed AS (
    UPDATE ledger.attempts
       SET outcome = 'lease_expired', finished_at = now(),
           error_class = 'LeaseExpired', error = 'worker stopped before finishing; lease expired'
     WHERE event_id IN (SELECT id FROM claimed) AND outcome = 'running'
 RETURNING event_id
), opened AS (
    INSERT INTO ledger.attempts (event_id, event_created, attempt, worker, lease_owner)
    SELECT id, stripe_created, attempts, %(worker)s, %(lease_owner)s FROM claimed
)
SELECT claimed.*, claimed.id IN (SELECT event_id FROM closed) AS rescued FROM claimed

-- name: event_lock_if_lease_held
-- Worker, first statement of the apply transaction: the fence. Locks the row
-- (NO KEY UPDATE, so the receiver's delivery inserts never wait on it) and
-- proves the lease is still ours. Holding the row lock to COMMIT means no one
-- can re-claim while we apply. A worker whose lease expired and was re-claimed
-- gets LL001 (ledger.lease_not_held): the pipelined statements behind it are
-- skipped, none of its business writes runs, and it reports LeaseLost.
-- It opens each event's savepoint (WorkerLedger.applying), and the refusal rolls
-- back that savepoint alone.
SELECT coalesce((SELECT id
                   FROM ledger.events
                  WHERE id = %(id)s AND stripe_created = %(created)s
                    AND coalesce(status, '') = 'processing' AND lease_owner = %(lease_owner)s
                    FOR NO KEY UPDATE),
                ledger.lease_not_held(%(id)s)) AS id

-- name: event_finish_if_lease_held
-- Worker, last statement of the apply transaction: processing -> processed,
-- committed together with the business writes, and the attempt closed.
-- The transaction is pipelined (nothing is read back before COMMIT), so when the
-- lease is not ours this statement raises LL001 (ledger.lease_not_held) and the
-- COMMIT behind it never runs: the caller rolls back and reports LeaseLost.
-- COALESCE evaluates its second argument only when the first is NULL.
WITH finished AS (
    UPDATE ledger.events
       SET status = 'processed', processed_at = now(), lease_owner = NULL,
           lease_expires_at = NULL, lease_liveness_key = NULL, next_attempt_at = NULL, failure_reason = NULL,
           last_error = NULL, updated_at = now()
     WHERE id = %(id)s AND stripe_created = %(created)s
       AND coalesce(status, '') = 'processing' AND lease_owner = %(lease_owner)s
 RETURNING id
), closed AS (
    UPDATE ledger.attempts
       SET outcome = 'processed', finished_at = now()
     WHERE event_id IN (SELECT id FROM finished) AND event_created = %(created)s AND attempt = %(attempt)s
)
SELECT coalesce((SELECT id FROM finished), ledger.lease_not_held(%(id)s)) AS event_id

-- name: events_lock_if_leases_held
-- Worker, the set-based apply transaction's fence (ApplyTransaction.fence): for a
-- batch at once what event_lock_if_lease_held is for one event. Locks the rows
-- whose lease (id, lease_owner) is still the attempt's, in id order (two batches'
-- fences never lock in crossing orders), NO KEY UPDATE as there, and returns
-- their ids: an id not returned was taken over, and the caller applies nothing of it.
-- Held to COMMIT, so no one re-claims a member while the batch applies.
SELECT e.id
  FROM ledger.events e
  JOIN unnest(%(ids)s::text[], %(createds)s::timestamptz[], %(lease_owners)s::text[]) AS m(id, created, lease_owner)
    ON e.id = m.id AND e.stripe_created = m.created AND e.lease_owner = m.lease_owner
 WHERE coalesce(e.status, '') = 'processing'
 ORDER BY e.id
   FOR NO KEY UPDATE OF e

-- name: events_finish_if_leases_held
-- Worker, last statement of the set-based apply transaction: processing -> processed
-- for every member it applied, each attempt closed, in one statement: what
-- event_finish_if_lease_held is for one event. Every member must still hold its
-- lease (the fence locked the rows, so only a defect can make one not): if any does
-- not, LL001 (ledger.lease_not_held) aborts the transaction and the COMMIT behind
-- it never runs; the caller rolls back and applies the batch member by member.
WITH members AS (
    SELECT * FROM unnest(%(ids)s::text[], %(createds)s::timestamptz[], %(lease_owners)s::text[], %(attempts)s::int[])
                  AS m(id, created, lease_owner, attempt)
), finished AS (
    UPDATE ledger.events e
       SET status = 'processed', processed_at = now(), lease_owner = NULL,
           lease_expires_at = NULL, lease_liveness_key = NULL, next_attempt_at = NULL, failure_reason = NULL,
           last_error = NULL, updated_at = now()
      FROM members m
     WHERE e.id = m.id AND e.stripe_created = m.created AND coalesce(e.status, '') = 'processing'
       AND e.lease_owner = m.lease_owner
 RETURNING e.id
), closed AS (
    UPDATE ledger.attempts a
       SET outcome = 'processed', finished_at = now()
      FROM members m
     WHERE a.event_id = m.id AND a.event_created = m.created AND a.attempt = m.attempt
       AND a.event_id IN (SELECT id FROM finished)
)
SELECT CASE WHEN (SELECT count(*) FROM finished) = cardinality(%(ids)s::text[])
            THEN (SELECT count(*) FROM finished)
            ELSE ledger.lease_not_held((SELECT min(id) FROM members WHERE id NOT IN (SELECT id FROM finished)))::bigint
       END AS finished

-- name: event_fail_if_lease_held
-- Worker, after the apply transaction rolled back: processing ->
-- failed_recoverable (with next_attempt_at) or failed_permanent (with reason),
-- and the attempt closed with the error. When the worker itself schedules the
-- retry's wake-up (a short countdown), wakeup_at moves to that time so the sweep
-- does not send a second one. No row means the lease is not ours (LeaseLost).
WITH failed AS (
    UPDATE ledger.events
       SET status           = %(status)s,
           failure_reason   = %(reason)s,
           last_error       = %(error)s,
           next_attempt_at  = CASE WHEN %(status)s = 'failed_recoverable'
                                    THEN now() + make_interval(secs => %(delay_s)s) END,
           wakeup_at        = CASE WHEN %(status)s = 'failed_recoverable' AND %(wake_scheduled)s
                                    THEN now() + make_interval(secs => %(delay_s)s)
                                    ELSE wakeup_at END,
           lease_owner      = NULL,
           lease_expires_at = NULL,
           lease_liveness_key = NULL,
           updated_at       = now()
     WHERE id = %(id)s AND stripe_created = %(created)s
       AND coalesce(status, '') = 'processing' AND lease_owner = %(lease_owner)s
 RETURNING id
)
UPDATE ledger.attempts
   SET outcome = %(status)s, finished_at = now(), error_class = %(error_class)s, error = %(error)s
 WHERE event_id IN (SELECT id FROM failed) AND event_created = %(created)s AND attempt = %(attempt)s
RETURNING event_id

-- name: attempt_mark_lease_lost
-- Worker: its lease was taken over; close its own attempt as lease_lost so the
-- history says what happened. Guarded by outcome so a closed attempt is kept.
UPDATE ledger.attempts
   SET outcome = 'lease_lost', finished_at = now(), error_class = 'LeaseLost', error = %(error)s
 WHERE event_id = %(id)s AND event_created = %(created)s AND attempt = %(attempt)s AND outcome = 'running'

-- name: event_sweep_overdue_wakeups
-- Sweep: pick events that could run now but whose wake-up is overdue (the
-- receiver's enqueue was lost, Redis restarted empty, a worker died, a retry's
-- delay outlived any countdown), and mark them re-driven. Each re-drive doubles
-- the wait before the next (redrives, reset by a claim), batches are bounded,
-- and SKIP LOCKED lets several sweepers run at once without picking the same row. NO KEY
-- UPDATE: it changes no key, so it must not stop a FOR KEY SHARE (a foreign key's check, a
-- partition backfill's copy).
UPDATE ledger.events e
   SET wakeup_at = now(), redrives = e.redrives + 1
 WHERE e.id IN (
        SELECT id
          FROM ledger.events
         WHERE status IN ('received', 'processing', 'failed_recoverable')
           AND wakeup_at < now() - make_interval(secs => %(overdue_s)s * power(2, least(redrives, 6)))
           AND (status = 'received'
                OR (status = 'failed_recoverable' AND next_attempt_at <= now())
                OR (status = 'processing' AND lease_expires_at < now()))
         ORDER BY wakeup_at
         LIMIT %(batch)s
           FOR NO KEY UPDATE SKIP LOCKED)
RETURNING e.id, e.status

-- name: event_rescue_if_owner_gone
-- Rescuer (the sweep): processing under a live lease whose owner is gone -> processing with
-- its lease expired now, so the next claim takes it (and the rescuer wakes it). An owner is
-- gone when nobody holds its liveness key any more: the worker's Postgres session, which
-- holds it, ended (its process died, or Postgres gave up on its silent host). The probe
-- takes the key for this statement only; a live owner's key is held, so a live owner is
-- never taken over however long its handler runs (its lease governs, as for an owner that
-- is stopped but whose session lives). The owner's attempt is closed as worker_lost. A row
-- still locked (the gone worker's apply transaction not yet ended) is skipped: a later pass
-- takes it. Every probed key comes back with whether it is alive; each rescued event once.
-- A late owner is fenced as ever: the next claim gives the row another lease_owner.
WITH owners AS MATERIALIZED (
    SELECT DISTINCT lease_liveness_key AS key
      FROM ledger.events
     WHERE status = 'processing' AND lease_liveness_key IS NOT NULL AND lease_expires_at > now()
), probed AS MATERIALIZED (
    SELECT key, NOT pg_try_advisory_xact_lock(key) AS alive FROM owners
), taken AS (
    SELECT id
      FROM ledger.events
     WHERE status = 'processing' AND lease_expires_at > now()
       AND lease_liveness_key IN (SELECT key FROM probed WHERE NOT alive)
       FOR NO KEY UPDATE SKIP LOCKED
), rescued AS (
    UPDATE ledger.events e
       SET lease_expires_at = now(), wakeup_at = now(), redrives = 0, updated_at = now()
     WHERE e.id IN (SELECT id FROM taken)
 RETURNING e.id, e.lease_liveness_key AS key, e.attempts
), closed AS (
    UPDATE ledger.attempts a
       SET outcome = 'worker_lost', finished_at = now(), error_class = 'WorkerGone',
           error = 'its worker''s Postgres session ended (the process died or its host went silent); '
                   'the lease was taken over'
      FROM rescued r
     WHERE a.event_id = r.id AND a.attempt = r.attempts AND a.outcome = 'running'
 RETURNING a.event_id, a.started_at
)
SELECT p.key, p.alive, r.id AS event_id, extract(epoch FROM now() - c.started_at)::float8 AS held_s
  FROM probed p
  LEFT JOIN rescued r ON r.key = p.key
  LEFT JOIN closed c ON c.event_id = r.id
