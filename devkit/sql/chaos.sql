-- The chaos run (devkit/chaos.py) and the handlers it loads into its workers
-- (devkit/chaos_handlers.py). The run itself only reads the ledger: every row in
-- ledger.* is written by the product (the receiver over HTTP, the workers, and the
-- reference run's EventStore.record_delivery and EventProcessor).

-- The handler module's own schema (public.*, never the ledger's), created in each run's databases.

-- name: chaos_effects_create
-- What chaos.effect writes. No unique constraint, on purpose: an event applied twice
-- shows up as two rows, which is what the run counts.
CREATE TABLE IF NOT EXISTS public.chaos_effects (event_id text NOT NULL, n bigserial)

-- name: chaos_lock_create
-- One row that the harness holds locked for the whole run, for the lock-timeout fault.
CREATE TABLE IF NOT EXISTS public.chaos_lock (id integer PRIMARY KEY)

-- name: chaos_lock_seed
INSERT INTO public.chaos_lock (id) VALUES (1) ON CONFLICT DO NOTHING

-- name: chaos_lock_row
-- The harness takes this lock once and keeps its transaction open; a handler asks for it
-- under a 20 ms lock_timeout and gets a real SQLSTATE 55P03 inside the apply transaction.
SELECT id FROM public.chaos_lock WHERE id = 1 FOR UPDATE

-- Handlers, inside the apply transaction (devkit/chaos_handlers.py).

-- name: chaos_effect_record
-- The effect whose count proves exactly-once: one row per apply that committed.
INSERT INTO public.chaos_effects (event_id) VALUES (%(event_id)s)

-- name: chaos_fault_lock_timeout
-- Makes the following chaos_lock_row fail fast with lock_not_available (this transaction only).
SET LOCAL lock_timeout = '20ms'

-- name: chaos_fault_statement_timeout
-- Makes the following chaos_fault_sleep fail with query_canceled (this transaction only).
SET LOCAL statement_timeout = '20ms'

-- name: chaos_fault_sleep
SELECT pg_sleep(1)

-- Faults the harness injects.

-- name: chaos_terminate_worker_backends
-- Kills the workers' connections (application_name 'worker', this run's database only);
-- how many it ended tells whether the fault happened.
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
 WHERE datname = current_database() AND application_name = 'worker' AND pid <> pg_backend_pid()

-- Progress and the checks at the end.

-- name: chaos_events_by_status
-- Progress while delivering, and quiescence: nothing left received / processing / failed_recoverable.
SELECT status, count(*) FROM ledger.events GROUP BY status

-- name: chaos_events_sent
-- Status and reason of every event the run sent (missing ones are lost).
SELECT id, status, failure_reason FROM ledger.events WHERE id = ANY(%(ids)s)

-- name: chaos_events_count_not_sent
-- Ledger rows for ids the run never sent: there must be none.
SELECT count(*) FROM ledger.events WHERE NOT (id = ANY(%(ids)s))

-- name: chaos_effects_by_event
-- chaos.effect rows per event: more than one is an event applied twice.
SELECT event_id, count(*) FROM public.chaos_effects GROUP BY event_id

-- name: chaos_transitions_by_event
-- The same for subscription events: one transition record per applied event.
SELECT event_id, count(*) FROM billing.subscription_transitions GROUP BY event_id

-- name: chaos_deliveries_count
-- Every delivery the receiver recorded (the run's duplicates included).
SELECT count(*) FROM ledger.deliveries

-- name: chaos_attempts_by_outcome
SELECT outcome, count(*) FROM ledger.attempts GROUP BY outcome

-- name: chaos_attempts_by_error_class
-- The domain faults that really happened, by the error class the workers recorded.
SELECT error_class, count(*) FROM ledger.attempts WHERE error_class = ANY(%(classes)s) GROUP BY error_class

-- name: chaos_attempts_processed
-- Attempts that committed: none may be one that fault_for() picked for a fault.
SELECT event_id, attempt FROM ledger.attempts WHERE outcome = 'processed'

-- Billing rows, compared between the chaos database and the in-order reference: the
-- columns that say what a row is, not when it was written.

-- name: chaos_snapshot_customers
SELECT id, email, name, deleted, livemode, metadata::text, source_event_id, source_event_created
  FROM billing.customers

-- name: chaos_snapshot_subscriptions
SELECT id, customer_id, status, price_id, product_id, quantity, cancel_at_period_end,
       current_period_start, current_period_end, trial_end, canceled_at, ended_at, features,
       livemode, source_event_id, source_event_created
  FROM billing.subscriptions

-- name: chaos_snapshot_invoices
SELECT id, customer_id, subscription_id, status, amount_due, amount_paid, currency, period_start,
       period_end, billing_reason, deleted, livemode, source_event_id, source_event_created
  FROM billing.invoices

-- name: chaos_snapshot_checkout_sessions
SELECT id, customer_id, subscription_id, client_reference_id, mode, status,
       payment_status, livemode, source_event_id, source_event_created
  FROM billing.checkout_sessions

-- name: chaos_snapshot_entitlements
SELECT customer_id, feature, source FROM billing.entitlements
