-- The billing domain: Stripe objects as the business sees them. Public contract
-- (README). Every row is keyed by its Stripe id and remembers the event that last
-- wrote it (source_event_created, source_event_id): an upsert applies only if
-- its event is newer by that pair, so any delivery order yields the same rows.
-- No foreign keys between these tables: Stripe does not order deliveries, so a
-- subscription may legitimately arrive before its customer.

CREATE SCHEMA IF NOT EXISTS billing;

CREATE TABLE billing.customers (
    id                   text        PRIMARY KEY,
    email                text,
    name                 text,
    deleted              boolean     NOT NULL DEFAULT false,
    livemode             boolean     NOT NULL,
    metadata             jsonb       NOT NULL DEFAULT '{}',
    source_event_id      text        NOT NULL,
    source_event_created timestamptz NOT NULL,
    updated_at           timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE billing.subscriptions (
    id                   text        PRIMARY KEY,
    customer_id          text        NOT NULL,
    status               text        NOT NULL,
    price_id             text,
    product_id           text,
    quantity             integer,
    cancel_at_period_end boolean     NOT NULL DEFAULT false,
    current_period_start timestamptz,
    current_period_end   timestamptz,
    trial_end            timestamptz,
    canceled_at          timestamptz,
    ended_at             timestamptz,
    -- Features this subscription grants while active or trialing (price/plan
    -- metadata "features", plus the configured entitlements map).
    features             text[]      NOT NULL DEFAULT '{}',
    livemode             boolean     NOT NULL,
    source_event_id      text        NOT NULL,
    source_event_created timestamptz NOT NULL,
    updated_at           timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX subscriptions_customer_idx ON billing.subscriptions (customer_id);

CREATE TABLE billing.invoices (
    id                   text        PRIMARY KEY,
    customer_id          text,
    subscription_id      text,
    status               text,
    amount_due           bigint,
    amount_paid          bigint,
    currency             text,
    period_start         timestamptz,
    period_end           timestamptz,
    billing_reason       text,
    deleted              boolean     NOT NULL DEFAULT false,
    livemode             boolean     NOT NULL,
    source_event_id      text        NOT NULL,
    source_event_created timestamptz NOT NULL,
    updated_at           timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX invoices_customer_idx ON billing.invoices (customer_id);
CREATE INDEX invoices_subscription_idx ON billing.invoices (subscription_id);

-- Links a Checkout session to the customer and subscription it produced
-- (client_reference_id is how the product maps its own user to Stripe).
CREATE TABLE billing.checkout_sessions (
    id                   text        PRIMARY KEY,
    customer_id          text,
    subscription_id      text,
    client_reference_id  text,
    mode                 text,
    status               text,
    payment_status       text,
    livemode             boolean     NOT NULL,
    source_event_id      text        NOT NULL,
    source_event_created timestamptz NOT NULL,
    updated_at           timestamptz NOT NULL DEFAULT now()
);

-- What each customer may use now. source 'subscription' is derived from the
-- customer's active/trialing subscriptions; source 'stripe' mirrors Stripe's
-- entitlements.active_entitlement_summary.
CREATE TABLE billing.entitlements (
    customer_id text        NOT NULL,
    feature     text        NOT NULL,
    source      text        NOT NULL CHECK (source IN ('subscription', 'stripe')),
    granted_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (customer_id, feature, source)
);

-- The ordering guard for Stripe's entitlement summaries, one per customer.
CREATE TABLE billing.entitlement_summaries (
    customer_id          text        PRIMARY KEY,
    source_event_id      text        NOT NULL,
    source_event_created timestamptz NOT NULL
);

-- One row per applied subscription event: the business history. UNIQUE on the
-- event id, so re-applying an event can never record a second transition.
CREATE TABLE billing.subscription_transitions (
    event_id        text        PRIMARY KEY,
    event_type      text        NOT NULL,
    subscription_id text        NOT NULL,
    from_status     text,
    to_status       text        NOT NULL,
    period_start    timestamptz,
    period_end      timestamptz,
    -- false when a newer event had already written the subscription: the
    -- event is still processed, its snapshot is not applied.
    applied         boolean     NOT NULL,
    event_created   timestamptz NOT NULL,
    recorded_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX subscription_transitions_subscription_idx
    ON billing.subscription_transitions (subscription_id, event_created);
