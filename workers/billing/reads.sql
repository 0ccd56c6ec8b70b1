-- Reads of the billing tables for operators (workers/billing/reads.py): ledgerctl events show
-- and reconcile. The writes are composed from the table declarations (workers/rowsql.py).

-- name: rows_written_by_events
-- ledgerctl events show: the rows whose current state these events wrote, and their transition
-- records. The ids are an event's own and, for a thin notification, its snapshot twins' (the
-- rows carry the id they were applied under).
WITH ids AS (SELECT unnest(%(ids)s::text[]) AS id)
SELECT 'billing.customers' AS table_name, id AS row_id FROM billing.customers WHERE source_event_id IN (SELECT id FROM ids)
UNION ALL
SELECT 'billing.subscriptions', id FROM billing.subscriptions WHERE source_event_id IN (SELECT id FROM ids)
UNION ALL
SELECT 'billing.invoices', id FROM billing.invoices WHERE source_event_id IN (SELECT id FROM ids)
UNION ALL
SELECT 'billing.checkout_sessions', id FROM billing.checkout_sessions WHERE source_event_id IN (SELECT id FROM ids)
UNION ALL
SELECT 'billing.subscription_transitions', subscription_id || ' ' || coalesce(from_status, '∅') || ' -> ' || to_status
       || CASE WHEN applied THEN '' ELSE ' (stale, not applied)' END
  FROM billing.subscription_transitions WHERE event_id IN (SELECT id FROM ids)

-- Reconcile: the local rows of one type for one account ('' = platform, stored as NULL) and
-- mode (NULL: both).

-- name: reconcile_customers
SELECT id, email, name, deleted
  FROM billing.customers
 WHERE account IS NOT DISTINCT FROM nullif(%(account)s, '')
   AND (%(livemode)s::boolean IS NULL OR livemode = %(livemode)s)

-- name: reconcile_subscriptions
SELECT id, customer_id, status, price_id, quantity, cancel_at_period_end,
       current_period_start, current_period_end, false AS deleted
  FROM billing.subscriptions
 WHERE account IS NOT DISTINCT FROM nullif(%(account)s, '')
   AND (%(livemode)s::boolean IS NULL OR livemode = %(livemode)s)

-- name: reconcile_invoices
SELECT id, customer_id, subscription_id, status, amount_due, amount_paid, currency,
       period_start, period_end, deleted
  FROM billing.invoices
 WHERE account IS NOT DISTINCT FROM nullif(%(account)s, '')
   AND (%(livemode)s::boolean IS NULL OR livemode = %(livemode)s)

-- name: reconcile_objects
-- The generic mirror's rows of one object type (obj["object"]: charge, checkout.session, ...).
SELECT id, data, deleted
  FROM billing.objects
 WHERE object_type = %(object_type)s
   AND account IS NOT DISTINCT FROM nullif(%(account)s, '')
   AND (%(livemode)s::boolean IS NULL OR livemode = %(livemode)s)
