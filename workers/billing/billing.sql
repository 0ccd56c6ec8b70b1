-- Business writes of the built-in billing handlers. Each upsert is keyed by the
-- Stripe object id and applies only when its event is newer than the one that
-- last wrote the row, by (created, event id): Stripe's `created` has one-second
-- resolution, and the event id breaks same-second ties the same way every time,
-- so any delivery order converges to the same rows. Re-applying an event is a
-- no-op (its key is not newer than itself).
-- The upserts repeat one shape on purpose: each names its own table's columns
-- and spells out its guard, which a generated statement would hide.

-- name: customer_upsert_if_newer
INSERT INTO billing.customers AS t
       (id, email, name, deleted, livemode, metadata, source_event_id, source_event_created)
VALUES (%(id)s, %(email)s, %(name)s, %(deleted)s, %(livemode)s, %(metadata)s,
        %(event_id)s, %(event_created)s)
ON CONFLICT (id) DO UPDATE
   SET email = EXCLUDED.email, name = EXCLUDED.name, deleted = EXCLUDED.deleted,
       livemode = EXCLUDED.livemode, metadata = EXCLUDED.metadata,
       source_event_id = EXCLUDED.source_event_id,
       source_event_created = EXCLUDED.source_event_created, updated_at = now()
 WHERE (t.source_event_created, t.source_event_id)
     < (EXCLUDED.source_event_created, EXCLUDED.source_event_id)
RETURNING id

-- name: customer_insert_stub
-- A customer we only know by id (from a Checkout session): never overwrites.
-- Its ordering key is -infinity, so that any customer.* event, even one created
-- before the Checkout session and delivered after it, still writes the row.
INSERT INTO billing.customers (id, livemode, source_event_id, source_event_created)
VALUES (%(id)s, %(livemode)s, %(event_id)s, '-infinity')
ON CONFLICT (id) DO NOTHING

-- name: subscription_lock
-- First statement of applying a subscription event: lock the row (if any) for
-- the rest of the apply transaction and read its status, the transition's
-- from_status. A statement of its own: a FOR UPDATE inside the WITH below runs
-- after that statement's own upsert changed the row, finds it "updated by the
-- current command" and returns nothing (from_status was always NULL).
SELECT status FROM billing.subscriptions WHERE id = %(id)s FOR UPDATE

-- name: subscription_apply_event
-- Upsert the subscription snapshot if newer, and record the event's transition
-- (from the status before, read by subscription_lock, to the status the event
-- carries) exactly once per event id. `applied` is false for a stale event.
WITH upserted AS (
    INSERT INTO billing.subscriptions AS t
           (id, customer_id, status, price_id, product_id, quantity, cancel_at_period_end,
            current_period_start, current_period_end, trial_end, canceled_at, ended_at,
            features, livemode, source_event_id, source_event_created)
    VALUES (%(id)s, %(customer_id)s, %(status)s, %(price_id)s, %(product_id)s, %(quantity)s,
            %(cancel_at_period_end)s, %(current_period_start)s, %(current_period_end)s,
            %(trial_end)s, %(canceled_at)s, %(ended_at)s, %(features)s, %(livemode)s,
            %(event_id)s, %(event_created)s)
    ON CONFLICT (id) DO UPDATE
       SET customer_id = EXCLUDED.customer_id, status = EXCLUDED.status,
           price_id = EXCLUDED.price_id, product_id = EXCLUDED.product_id,
           quantity = EXCLUDED.quantity, cancel_at_period_end = EXCLUDED.cancel_at_period_end,
           current_period_start = EXCLUDED.current_period_start,
           current_period_end = EXCLUDED.current_period_end, trial_end = EXCLUDED.trial_end,
           canceled_at = EXCLUDED.canceled_at, ended_at = EXCLUDED.ended_at,
           features = EXCLUDED.features, livemode = EXCLUDED.livemode,
           source_event_id = EXCLUDED.source_event_id,
           source_event_created = EXCLUDED.source_event_created, updated_at = now()
     WHERE (t.source_event_created, t.source_event_id)
         < (EXCLUDED.source_event_created, EXCLUDED.source_event_id)
    RETURNING id
), transition AS (
    INSERT INTO billing.subscription_transitions
           (event_id, event_type, subscription_id, from_status, to_status,
            period_start, period_end, applied, event_created)
    SELECT %(event_id)s, %(event_type)s, %(id)s, %(from_status)s::text, %(status)s,
           %(current_period_start)s, %(current_period_end)s,
           EXISTS (SELECT 1 FROM upserted), %(event_created)s
    ON CONFLICT (event_id) DO NOTHING
)
SELECT EXISTS (SELECT 1 FROM upserted) AS applied

-- name: entitlements_lock_customer
-- Serialise entitlement recomputation per customer: two subscriptions of one
-- customer applied at once must not each miss the other's change.
SELECT pg_advisory_xact_lock(hashtextextended('billing.entitlements:' || %(customer_id)s, 0))

-- name: entitlements_revoke_lapsed
-- Remove subscription-derived features no active/trialing subscription grants any more.
DELETE FROM billing.entitlements e
 WHERE e.customer_id = %(customer_id)s AND e.source = 'subscription'
   AND NOT EXISTS (
        SELECT 1 FROM billing.subscriptions s
         WHERE s.customer_id = e.customer_id AND s.status IN ('active', 'trialing')
           AND e.feature = ANY (s.features))

-- name: entitlements_grant_current
-- Add every feature an active/trialing subscription grants (granted_at kept for existing ones).
INSERT INTO billing.entitlements (customer_id, feature, source)
SELECT DISTINCT s.customer_id, f, 'subscription'
  FROM billing.subscriptions s, unnest(s.features) AS f
 WHERE s.customer_id = %(customer_id)s AND s.status IN ('active', 'trialing')
ON CONFLICT DO NOTHING

-- name: entitlement_summary_claim_if_newer
-- Ordering guard for Stripe's entitlement summaries; no row means a newer one was applied.
INSERT INTO billing.entitlement_summaries AS t (customer_id, source_event_id, source_event_created)
VALUES (%(customer_id)s, %(event_id)s, %(event_created)s)
ON CONFLICT (customer_id) DO UPDATE
   SET source_event_id = EXCLUDED.source_event_id, source_event_created = EXCLUDED.source_event_created
 WHERE (t.source_event_created, t.source_event_id)
     < (EXCLUDED.source_event_created, EXCLUDED.source_event_id)
RETURNING customer_id

-- name: entitlements_replace_from_stripe
-- Stripe's summary is the whole active set: drop what it no longer lists...
DELETE FROM billing.entitlements
 WHERE customer_id = %(customer_id)s AND source = 'stripe' AND feature <> ALL (%(features)s)

-- name: entitlements_add_from_stripe
-- ...and add what it lists.
INSERT INTO billing.entitlements (customer_id, feature, source)
SELECT %(customer_id)s, f, 'stripe' FROM unnest(%(features)s::text[]) AS f
ON CONFLICT DO NOTHING

-- name: invoice_upsert_if_newer
INSERT INTO billing.invoices AS t
       (id, customer_id, subscription_id, status, amount_due, amount_paid, currency,
        period_start, period_end, billing_reason, deleted, livemode,
        source_event_id, source_event_created)
VALUES (%(id)s, %(customer_id)s, %(subscription_id)s, %(status)s, %(amount_due)s,
        %(amount_paid)s, %(currency)s, %(period_start)s, %(period_end)s,
        %(billing_reason)s, %(deleted)s, %(livemode)s, %(event_id)s, %(event_created)s)
ON CONFLICT (id) DO UPDATE
   SET customer_id = EXCLUDED.customer_id, subscription_id = EXCLUDED.subscription_id,
       status = EXCLUDED.status, amount_due = EXCLUDED.amount_due,
       amount_paid = EXCLUDED.amount_paid, currency = EXCLUDED.currency,
       period_start = EXCLUDED.period_start, period_end = EXCLUDED.period_end,
       billing_reason = EXCLUDED.billing_reason, deleted = EXCLUDED.deleted,
       livemode = EXCLUDED.livemode, source_event_id = EXCLUDED.source_event_id,
       source_event_created = EXCLUDED.source_event_created, updated_at = now()
 WHERE (t.source_event_created, t.source_event_id)
     < (EXCLUDED.source_event_created, EXCLUDED.source_event_id)
RETURNING id

-- name: checkout_session_upsert_if_newer
INSERT INTO billing.checkout_sessions AS t
       (id, customer_id, subscription_id, client_reference_id, mode, status, payment_status,
        livemode, source_event_id, source_event_created)
VALUES (%(id)s, %(customer_id)s, %(subscription_id)s, %(client_reference_id)s, %(mode)s,
        %(status)s, %(payment_status)s, %(livemode)s, %(event_id)s, %(event_created)s)
ON CONFLICT (id) DO UPDATE
   SET customer_id = EXCLUDED.customer_id, subscription_id = EXCLUDED.subscription_id,
       client_reference_id = EXCLUDED.client_reference_id, mode = EXCLUDED.mode,
       status = EXCLUDED.status, payment_status = EXCLUDED.payment_status,
       livemode = EXCLUDED.livemode, source_event_id = EXCLUDED.source_event_id,
       source_event_created = EXCLUDED.source_event_created, updated_at = now()
 WHERE (t.source_event_created, t.source_event_id)
     < (EXCLUDED.source_event_created, EXCLUDED.source_event_id)
RETURNING id

-- name: entitlements_of_customer
-- The customer's current features from every source, to tell whether a change happened.
SELECT DISTINCT feature FROM billing.entitlements WHERE customer_id = %(customer_id)s ORDER BY feature
