-- Every statement that reads or moves ledger.events and ledger.attempts.
-- Transitions are compare-and-set: the expected state (and lease owner) sits in
-- the WHERE clause, and "no row" is an outcome the caller names and handles.

-- name: event_record_delivery
-- Receiver: received (new row), or a redelivery of an id we hold.
-- A new id is inserted as `received`. A known id only has its delivery counted;
-- its payload and status are never overwritten by a delivery. A redelivered
-- recoverable failure becomes due now: Stripe retrying is a second chance to
-- process, never a reason to wait longer. `wake` tells the receiver whether the
-- event still needs a worker (unprocessed, or processing under an expired lease).
-- DO UPDATE (not DO NOTHING) so that concurrent copies always get the row back.
INSERT INTO ledger.events AS e
       (id, type, stripe_created, livemode, api_version, account, payload)
VALUES (%(id)s, %(type)s, to_timestamp(%(created)s), %(livemode)s, %(api_version)s,
        %(account)s, %(payload)s::json)
ON CONFLICT (id) DO UPDATE
   SET deliveries        = e.deliveries + 1,
       last_delivered_at = now(),
       next_attempt_at   = CASE WHEN e.status = 'failed_recoverable'
                                THEN least(e.next_attempt_at, now())
                                ELSE e.next_attempt_at END,
       wakeup_at         = CASE WHEN e.status IN ('received', 'failed_recoverable')
                                  OR (e.status = 'processing' AND e.lease_expires_at < now())
                                THEN now() ELSE e.wakeup_at END
RETURNING (xmax = 0) AS inserted,
          status,
          (status IN ('received', 'failed_recoverable')
           OR (status = 'processing' AND lease_expires_at < now())) AS wake

-- name: event_get
-- Read one event row (no payload) for inspection and responses.
SELECT id, type, status, attempts, failure_reason, last_error, stripe_created, livemode,
       api_version, account, received_at, deliveries, last_delivered_at, wakeup_at,
       next_attempt_at, lease_owner, lease_expires_at, processed_at, updated_at
  FROM ledger.events
 WHERE id = %(id)s
