-- Business writes of the built-in billing handlers. Each upsert is keyed by the
-- Stripe object id and applies only when its event is newer than the one that
-- last wrote the row, by (created, event id): Stripe's `created` has one-second
-- resolution, and the event id breaks same-second ties the same way every time,
-- so any delivery order converges to the same rows. Re-applying an event is a
-- no-op (its key is not newer than itself). An object fetched from the API
-- (workers/billing/snapshots.py) goes through the same statements with the key
-- (the second its answer arrived, 'api_fetch'): docs/stripe-api.md, "Fetched objects and the order guard".
-- A row keeps the account and mode it was first written with: billing.same_owner
-- (migration 0006) raises, before the order guard is looked at, when an object
-- comes under another account or mode, so the outcome does not depend on order.
-- The upserts repeat one shape on purpose: each names its own table's columns
-- and spells out its guard, which a generated statement would hide.

-- name: customer_upsert_if_newer
INSERT INTO billing.customers AS t
       (id, email, name, deleted, account, livemode, metadata, source_event_id, source_event_created)
VALUES (%(id)s, %(email)s, %(name)s, %(deleted)s, %(account)s, %(livemode)s, %(metadata)s,
        %(event_id)s, %(event_created)s)
ON CONFLICT (id) DO UPDATE
   SET email = EXCLUDED.email, name = EXCLUDED.name, deleted = EXCLUDED.deleted,
       metadata = EXCLUDED.metadata,
       source_event_id = EXCLUDED.source_event_id,
       source_event_created = EXCLUDED.source_event_created, updated_at = now()
 WHERE CASE WHEN billing.same_owner('customers', t.account, EXCLUDED.account, t.livemode, EXCLUDED.livemode)
            THEN (t.source_event_created, t.source_event_id)
               < (EXCLUDED.source_event_created, EXCLUDED.source_event_id) END
RETURNING id

-- name: customer_insert_stub
-- A customer we only know by id (from a Checkout session): never overwrites.
-- Its ordering key is -infinity, so that any customer.* event, even one created
-- before the Checkout session and delivered after it, still writes the row.
-- It takes the session's account and mode (a customer lives in the account of
-- its sessions); an existing row, of whatever account, is left alone.
INSERT INTO billing.customers (id, account, livemode, source_event_id, source_event_created)
VALUES (%(id)s, %(account)s, %(livemode)s, %(event_id)s, '-infinity')
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
-- An object fetched from the API passes transition = false: the transitions
-- are the history of events, and a fetch is none.
WITH upserted AS (
    INSERT INTO billing.subscriptions AS t
           (id, customer_id, status, price_id, product_id, quantity, cancel_at_period_end,
            current_period_start, current_period_end, trial_end, canceled_at, ended_at,
            features, account, livemode, source_event_id, source_event_created)
    VALUES (%(id)s, %(customer_id)s, %(status)s, %(price_id)s, %(product_id)s, %(quantity)s,
            %(cancel_at_period_end)s, %(current_period_start)s, %(current_period_end)s,
            %(trial_end)s, %(canceled_at)s, %(ended_at)s, %(features)s, %(account)s, %(livemode)s,
            %(event_id)s, %(event_created)s)
    ON CONFLICT (id) DO UPDATE
       SET customer_id = EXCLUDED.customer_id, status = EXCLUDED.status,
           price_id = EXCLUDED.price_id, product_id = EXCLUDED.product_id,
           quantity = EXCLUDED.quantity, cancel_at_period_end = EXCLUDED.cancel_at_period_end,
           current_period_start = EXCLUDED.current_period_start,
           current_period_end = EXCLUDED.current_period_end, trial_end = EXCLUDED.trial_end,
           canceled_at = EXCLUDED.canceled_at, ended_at = EXCLUDED.ended_at,
           features = EXCLUDED.features,
           source_event_id = EXCLUDED.source_event_id,
           source_event_created = EXCLUDED.source_event_created, updated_at = now()
     WHERE CASE WHEN billing.same_owner('subscriptions', t.account, EXCLUDED.account, t.livemode, EXCLUDED.livemode)
                THEN (t.source_event_created, t.source_event_id)
                   < (EXCLUDED.source_event_created, EXCLUDED.source_event_id) END
    RETURNING id
), transition AS (
    INSERT INTO billing.subscription_transitions
           (event_id, event_type, subscription_id, from_status, to_status,
            period_start, period_end, applied, event_created, account)
    SELECT %(event_id)s, %(event_type)s, %(id)s, %(from_status)s::text, %(status)s,
           %(current_period_start)s, %(current_period_end)s,
           EXISTS (SELECT 1 FROM upserted), %(event_created)s, %(account)s
     WHERE %(transition)s
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
INSERT INTO billing.entitlements (customer_id, feature, source, account)
SELECT DISTINCT s.customer_id, f, 'subscription', s.account
  FROM billing.subscriptions s, unnest(s.features) AS f
 WHERE s.customer_id = %(customer_id)s AND s.status IN ('active', 'trialing')
ON CONFLICT DO NOTHING

-- name: entitlement_summary_claim_if_newer
-- Ordering guard for Stripe's entitlement summaries; no row means a newer one was applied.
INSERT INTO billing.entitlement_summaries AS t (customer_id, account, source_event_id, source_event_created)
VALUES (%(customer_id)s, %(account)s, %(event_id)s, %(event_created)s)
ON CONFLICT (customer_id) DO UPDATE
   SET source_event_id = EXCLUDED.source_event_id, source_event_created = EXCLUDED.source_event_created
 WHERE CASE WHEN billing.same_owner('entitlement_summaries', t.account, EXCLUDED.account, true, true)
            THEN (t.source_event_created, t.source_event_id)
               < (EXCLUDED.source_event_created, EXCLUDED.source_event_id) END
RETURNING customer_id

-- name: entitlements_replace_from_stripe
-- Stripe's summary is the whole active set: drop what it no longer lists...
DELETE FROM billing.entitlements
 WHERE customer_id = %(customer_id)s AND source = 'stripe' AND feature <> ALL (%(features)s)

-- name: entitlements_add_from_stripe
-- ...and add what it lists.
INSERT INTO billing.entitlements (customer_id, feature, source, account)
SELECT %(customer_id)s, f, 'stripe', %(account)s FROM unnest(%(features)s::text[]) AS f
ON CONFLICT DO NOTHING

-- name: invoice_upsert_if_newer
INSERT INTO billing.invoices AS t
       (id, customer_id, subscription_id, status, amount_due, amount_paid, currency,
        period_start, period_end, billing_reason, deleted, account, livemode,
        source_event_id, source_event_created)
VALUES (%(id)s, %(customer_id)s, %(subscription_id)s, %(status)s, %(amount_due)s,
        %(amount_paid)s, %(currency)s, %(period_start)s, %(period_end)s,
        %(billing_reason)s, %(deleted)s, %(account)s, %(livemode)s, %(event_id)s, %(event_created)s)
ON CONFLICT (id) DO UPDATE
   SET customer_id = EXCLUDED.customer_id, subscription_id = EXCLUDED.subscription_id,
       status = EXCLUDED.status, amount_due = EXCLUDED.amount_due,
       amount_paid = EXCLUDED.amount_paid, currency = EXCLUDED.currency,
       period_start = EXCLUDED.period_start, period_end = EXCLUDED.period_end,
       billing_reason = EXCLUDED.billing_reason, deleted = EXCLUDED.deleted,
       source_event_id = EXCLUDED.source_event_id,
       source_event_created = EXCLUDED.source_event_created, updated_at = now()
 WHERE CASE WHEN billing.same_owner('invoices', t.account, EXCLUDED.account, t.livemode, EXCLUDED.livemode)
            THEN (t.source_event_created, t.source_event_id)
               < (EXCLUDED.source_event_created, EXCLUDED.source_event_id) END
RETURNING id

-- name: checkout_session_upsert_if_newer
INSERT INTO billing.checkout_sessions AS t
       (id, customer_id, subscription_id, client_reference_id, mode, status, payment_status,
        account, livemode, source_event_id, source_event_created)
VALUES (%(id)s, %(customer_id)s, %(subscription_id)s, %(client_reference_id)s, %(mode)s,
        %(status)s, %(payment_status)s, %(account)s, %(livemode)s, %(event_id)s, %(event_created)s)
ON CONFLICT (id) DO UPDATE
   SET customer_id = EXCLUDED.customer_id, subscription_id = EXCLUDED.subscription_id,
       client_reference_id = EXCLUDED.client_reference_id, mode = EXCLUDED.mode,
       status = EXCLUDED.status, payment_status = EXCLUDED.payment_status,
       source_event_id = EXCLUDED.source_event_id,
       source_event_created = EXCLUDED.source_event_created, updated_at = now()
 WHERE CASE WHEN billing.same_owner('checkout_sessions', t.account, EXCLUDED.account, t.livemode, EXCLUDED.livemode)
            THEN (t.source_event_created, t.source_event_id)
               < (EXCLUDED.source_event_created, EXCLUDED.source_event_id) END
RETURNING id

-- name: entitlements_of_customer
-- The customer's current features from every source, to tell whether a change happened.
SELECT DISTINCT feature FROM billing.entitlements WHERE customer_id = %(customer_id)s ORDER BY feature

-- name: object_upsert_if_newer
-- The generic mirror (every event's data.object, every fetched object): the latest
-- JSON of one object as one account sees it in one mode, under the same order guard.
-- Account and mode are part of the key, so a row never moves between them.
INSERT INTO billing.objects AS t
       (id, object_type, account, livemode, data, deleted, source_event_id, source_event_created)
VALUES (%(id)s, %(object_type)s, %(account)s, %(livemode)s, %(data)s, %(deleted)s,
        %(event_id)s, %(event_created)s)
ON CONFLICT (id, (coalesce(account, '')), livemode) DO UPDATE
   SET object_type = EXCLUDED.object_type, data = EXCLUDED.data, deleted = EXCLUDED.deleted,
       source_event_id = EXCLUDED.source_event_id,
       source_event_created = EXCLUDED.source_event_created, updated_at = now()
 WHERE (t.source_event_created, t.source_event_id)
     < (EXCLUDED.source_event_created, EXCLUDED.source_event_id)
RETURNING id
