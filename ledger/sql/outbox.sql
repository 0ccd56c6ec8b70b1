-- Every statement on ledger.outbox. The same state machine as events
-- (ledger/states.py, OutboxStatus):
-- pending -> sending (lease) -> sent | failed_recoverable (due later) | failed_permanent.

-- name: outbox_record
-- Handler, inside the apply transaction: record an effect once per idempotency key.
-- No row back means the key was already recorded (the event is being re-applied).
INSERT INTO ledger.outbox (idempotency_key, effect, event_id, event_created, ordering_key, payload)
VALUES (%(idempotency_key)s, %(effect)s, %(event_id)s,
        (SELECT stripe_created FROM ledger.events WHERE id = %(event_id)s), %(ordering_key)s, %(payload)s)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id

-- name: outbox_lock_ordering_key
-- Handler, inside the apply transaction, before recording an effect with an
-- ordering key: effects of one key are then recorded one transaction at a time,
-- so their ids (the sequence receivers see) follow commit order.
SELECT pg_advisory_xact_lock(hashtextextended('ledger.outbox:' || %(ordering_key)s, 0))

-- name: outbox_claim
-- Dispatcher: pending | failed_recoverable (due) | sending (lease expired) -> sending.
-- The same compare-and-set as event_claim: one dispatcher owns a delivery attempt.
UPDATE ledger.outbox
   SET status = 'sending', lease_owner = %(lease_owner)s,
       lease_expires_at = now() + make_interval(secs => %(lease_s)s), lease_liveness_key = %(liveness_key)s,
       attempts = attempts + 1, redrives = 0, updated_at = now()
 WHERE id = %(id)s
   AND (status = 'pending'
        OR (status = 'failed_recoverable' AND next_attempt_at <= now())
        OR (status = 'sending' AND lease_expires_at < now()))
RETURNING id, idempotency_key, effect, event_id, ordering_key, payload, attempts,
          attempts - attempt_base AS tries

-- name: outbox_finish_if_lease_held
-- Dispatcher: sending -> sent. No row: our lease was taken over (the other
-- dispatcher's call carries the same idempotency key, so the effect still lands once).
UPDATE ledger.outbox
   SET status = 'sent', sent_at = now(), lease_owner = NULL, lease_expires_at = NULL, lease_liveness_key = NULL,
       failure_reason = NULL, last_error = NULL, next_attempt_at = NULL, updated_at = now()
 WHERE id = %(id)s AND status = 'sending' AND lease_owner = %(lease_owner)s
RETURNING id

-- name: outbox_fail_if_lease_held
-- Dispatcher: sending -> failed_recoverable (with next_attempt_at) | failed_permanent.
UPDATE ledger.outbox
   SET status          = %(status)s,
       failure_reason  = %(reason)s,
       last_error      = %(error)s,
       next_attempt_at = CASE WHEN %(status)s = 'failed_recoverable'
                              THEN now() + make_interval(secs => %(delay_s)s) END,
       wakeup_at       = CASE WHEN %(status)s = 'failed_recoverable' AND %(wake_scheduled)s
                              THEN now() + make_interval(secs => %(delay_s)s)
                              ELSE wakeup_at END,
       lease_owner = NULL, lease_expires_at = NULL, lease_liveness_key = NULL, updated_at = now()
 WHERE id = %(id)s AND status = 'sending' AND lease_owner = %(lease_owner)s
RETURNING id

-- name: outbox_sweep_overdue_wakeups
-- Sweep: unsent effects whose wake-up is overdue (same rules as events).
-- The twin of event_sweep_overdue_wakeups, kept separate: a statement cannot take
-- its table and state names as parameters, and each stays one plain guarded UPDATE.
UPDATE ledger.outbox o
   SET wakeup_at = now(), redrives = o.redrives + 1
 WHERE o.id IN (
        SELECT id
          FROM ledger.outbox
         WHERE status IN ('pending', 'sending', 'failed_recoverable')
           AND wakeup_at < now() - make_interval(secs => %(overdue_s)s * power(2, least(redrives, 6)))
           AND (status = 'pending'
                OR (status = 'failed_recoverable' AND next_attempt_at <= now())
                OR (status = 'sending' AND lease_expires_at < now()))
         ORDER BY wakeup_at
         LIMIT %(batch)s
           FOR NO KEY UPDATE SKIP LOCKED)
RETURNING o.id

-- name: outbox_list
SELECT id, effect, idempotency_key, event_id, ordering_key, status, attempts, failure_reason,
       created_at, sent_at
  FROM ledger.outbox
 WHERE (%(status)s::text IS NULL OR status = %(status)s)
   AND (%(effect_like)s::text IS NULL OR effect LIKE %(effect_like)s)
 ORDER BY id DESC
 LIMIT %(limit)s

-- name: outbox_get
SELECT id, effect, idempotency_key, event_id, ordering_key, payload, status, attempts,
       failure_reason, last_error, next_attempt_at, lease_owner, lease_expires_at, created_at,
       sent_at, updated_at
  FROM ledger.outbox
 WHERE id = %(id)s

-- name: outbox_select_for_replay
SELECT id FROM ledger.outbox
 WHERE status = %(status)s AND (%(effect_like)s::text IS NULL OR effect LIKE %(effect_like)s) AND id > %(after)s
 ORDER BY id
 LIMIT %(limit)s

-- name: outbox_replay_if_failed
-- Operator: failed_permanent | failed_recoverable (| sent, with force) -> pending, fresh retry budget.
UPDATE ledger.outbox
   SET status = 'pending', failure_reason = NULL, last_error = NULL, next_attempt_at = NULL,
       sent_at = NULL, attempt_base = attempts, wakeup_at = now(), redrives = 0, updated_at = now()
 WHERE id = %(id)s
   AND (status IN ('failed_permanent', 'failed_recoverable') OR (%(force)s AND status = 'sent'))
RETURNING id

-- name: outbox_stats
SELECT count(*) FILTER (WHERE status IN ('pending', 'sending', 'failed_recoverable')) AS depth,
       count(*) FILTER (WHERE status = 'failed_permanent') AS failed_permanent,
       extract(epoch FROM now() - min(created_at) FILTER (
           WHERE status IN ('pending', 'sending', 'failed_recoverable'))) AS oldest_unsent_age_s
  FROM ledger.outbox
 WHERE status <> 'sent'

-- name: outbox_rescue_if_owner_gone
-- Rescuer (the sweep): sending under a live lease whose dispatcher is gone -> sending with its
-- lease expired now, as event_rescue_if_owner_gone does for events (the outbox keeps no attempt
-- history: its attempts count stays). The effect's idempotency key makes a late delivery of the
-- gone dispatcher harmless.
WITH owners AS MATERIALIZED (
    SELECT DISTINCT lease_liveness_key AS key
      FROM ledger.outbox
     WHERE status = 'sending' AND lease_liveness_key IS NOT NULL AND lease_expires_at > now()
), probed AS MATERIALIZED (
    SELECT key, NOT pg_try_advisory_xact_lock(key) AS alive FROM owners
), taken AS (
    SELECT id
      FROM ledger.outbox
     WHERE status = 'sending' AND lease_expires_at > now()
       AND lease_liveness_key IN (SELECT key FROM probed WHERE NOT alive)
       FOR NO KEY UPDATE SKIP LOCKED
), rescued AS (
    UPDATE ledger.outbox o
       SET lease_expires_at = now(), wakeup_at = now(), redrives = 0, updated_at = now()
     WHERE o.id IN (SELECT id FROM taken)
 RETURNING o.id, o.lease_liveness_key AS key
)
SELECT p.key, p.alive, r.id AS outbox_id
  FROM probed p
  LEFT JOIN rescued r ON r.key = p.key
