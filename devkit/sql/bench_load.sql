-- What the benchmarks load in bulk (devkit/benchmarks/workload.py): backlogs, pgbench's
-- parameter table and the 1M-event history. These write ledger.* without the product's
-- door (EventStore.record_delivery, one round trip per event) on purpose: a drain
-- measures the workers alone, so its 20,000 received rows must be in place before any
-- worker starts, in a second rather than in minutes; the history is a million rows.

-- Backlogs (COPY ... FROM STDIN, rows written by the caller).

-- name: bench_backlog_copy_events
-- The events as the receiver's event_record_delivery leaves them: `received`, due now.
COPY ledger.events (id, type, stripe_created, livemode, api_version, account, payload) FROM STDIN

-- name: bench_backlog_copy_deliveries
-- One delivery each, as event_record_delivery appends it.
COPY ledger.deliveries (event_id, event_created) FROM STDIN

-- name: bench_analyze_events
-- Statistics for the new rows before anything is measured on them.
ANALYZE ledger.events

-- The history (scale): set-based INSERT ... SELECT generate_series, run on two connections
-- at once with foreign-key triggers off (the rows are consistent by construction). Event g
-- (of `total`) is 'evt_' || substr(md5('e' || g), 1, 24), received at `start` plus `step` per
-- event (scale: 400 days ago, 30 s) and processed 150 ms later; lifecycle c (of `lifecycles`) is ten events, whose
-- types, in order, are `types`.

-- name: bench_bulk_load_replica
-- No foreign-key triggers on this connection: the history's rows reference each other by construction.
SET session_replication_role = replica

-- name: bench_bulk_load_memory
-- Memory for the index rebuilds after the load.
SET maintenance_work_mem = '512MB'

-- name: bench_history_events
-- The processed events, their payload the template with the event's and the customer's ids in place.
INSERT INTO ledger.events (id, type, status, attempts, stripe_created, livemode, api_version, payload,
                           received_at, wakeup_at, processed_at, updated_at)
SELECT x.id, (%(types)s::text[])[1 + g %% 10], 'processed', 1,
       %(start)s::timestamptz + g * %(step)s::interval, false, '2020-08-27',
       (%(head)s::text || x.id || %(middle)s::text || 'cus_' || substr(md5('c' || g / 10), 1, 24)
        || %(tail)s::text)::json,
       %(start)s::timestamptz + g * %(step)s::interval,
       %(start)s::timestamptz + g * %(step)s::interval,
       %(start)s::timestamptz + g * %(step)s::interval + interval '150 ms',
       %(start)s::timestamptz + g * %(step)s::interval + interval '150 ms'
  FROM generate_series(0, %(total)s::integer - 1) AS g,
       LATERAL (SELECT 'evt_' || substr(md5('e' || g), 1, 24) AS id) AS x
 ORDER BY x.id

-- name: bench_history_deliveries
-- One delivery per event.
INSERT INTO ledger.deliveries (event_id, event_created, delivered_at)
SELECT 'evt_' || substr(md5('e' || g), 1, 24), %(start)s::timestamptz + g * %(step)s::interval,
       %(start)s::timestamptz + g * %(step)s::interval
  FROM generate_series(0, %(total)s::integer - 1) AS g

-- name: bench_history_attempts
-- One processed attempt per event.
INSERT INTO ledger.attempts (event_id, event_created, attempt, worker, lease_owner, started_at, finished_at, outcome)
SELECT 'evt_' || substr(md5('e' || g), 1, 24), %(start)s::timestamptz + g * %(step)s::interval, 1,
       'history:1', 'history',
       %(start)s::timestamptz + g * %(step)s::interval + interval '50 ms',
       %(start)s::timestamptz + g * %(step)s::interval + interval '150 ms', 'processed'
  FROM generate_series(0, %(total)s::integer - 1) AS g
 ORDER BY 1

-- name: bench_history_customers
-- One customer per lifecycle, written by its first event.
INSERT INTO billing.customers (id, email, livemode, metadata, source_event_id, source_event_created)
SELECT 'cus_' || substr(md5('c' || c), 1, 24), 'cus' || c || '@example.test', false, '{}',
       'evt_' || substr(md5('e' || c * 10), 1, 24), %(start)s::timestamptz + c * (10 * %(step)s::interval)
  FROM generate_series(0, %(lifecycles)s::integer - 1) AS c

-- name: bench_history_subscriptions
-- One subscription per lifecycle, written by its last event: half canceled, half active.
INSERT INTO billing.subscriptions (id, customer_id, status, price_id, product_id, quantity,
                                   current_period_start, current_period_end, canceled_at, ended_at, features,
                                   livemode, source_event_id, source_event_created)
SELECT 'sub_' || substr(md5('s' || c), 1, 24), 'cus_' || substr(md5('c' || c), 1, 24),
       CASE WHEN c %% 2 = 0 THEN 'canceled' ELSE 'active' END, 'price_hist', 'prod_hist', 1,
       %(start)s::timestamptz, %(start)s::timestamptz + interval '30 days',
       CASE WHEN c %% 2 = 0 THEN %(start)s::timestamptz + interval '30 days' END,
       CASE WHEN c %% 2 = 0 THEN %(start)s::timestamptz + interval '30 days' END,
       '{seats,reports}', false, 'evt_' || substr(md5('e' || (c * 10 + 9)), 1, 24),
       %(start)s::timestamptz + (c * 10 + 9) * %(step)s::interval
  FROM generate_series(0, %(lifecycles)s::integer - 1) AS c

-- name: bench_history_invoices
-- Two paid invoices per lifecycle.
INSERT INTO billing.invoices (id, customer_id, subscription_id, status, amount_due, amount_paid, currency,
                              period_start, period_end, billing_reason, livemode, source_event_id,
                              source_event_created)
SELECT 'in_' || substr(md5('i' || c || '-' || k), 1, 24), 'cus_' || substr(md5('c' || c), 1, 24),
       'sub_' || substr(md5('s' || c), 1, 24), 'paid', 1500, 1500, 'usd',
       %(start)s::timestamptz, %(start)s::timestamptz + interval '30 days', 'subscription_cycle', false,
       'evt_' || substr(md5('e' || (c * 10 + 6)), 1, 24),
       %(start)s::timestamptz + (c * 10 + 6) * %(step)s::interval
  FROM generate_series(0, %(lifecycles)s::integer - 1) AS c, generate_series(1, 2) AS k

-- name: bench_history_transitions
-- Six subscription transitions per lifecycle (its subscription events).
INSERT INTO billing.subscription_transitions (event_id, event_type, subscription_id, from_status,
                                              to_status, applied, event_created)
SELECT 'evt_' || substr(md5('e' || (c * 10 + s)), 1, 24), (%(types)s::text[])[1 + s],
       'sub_' || substr(md5('s' || c), 1, 24), 'active', 'active', true,
       %(start)s::timestamptz + (c * 10 + s) * %(step)s::interval
  FROM generate_series(0, %(lifecycles)s::integer - 1) AS c, unnest(ARRAY[1, 2, 5, 7, 8, 9]) AS s
 ORDER BY 1

-- name: bench_history_entitlements
-- Two entitlements for each active subscription's customer.
INSERT INTO billing.entitlements (customer_id, feature, source)
SELECT 'cus_' || substr(md5('c' || c), 1, 24), f, 'subscription'
  FROM generate_series(1, %(lifecycles)s::integer - 1, 2) AS c, unnest(ARRAY['seats', 'reports']) AS f
