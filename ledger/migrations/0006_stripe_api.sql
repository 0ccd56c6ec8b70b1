-- Talking to Stripe: where each delivery came from, the catch-up cursors, the generic
-- mirror of every object, and the account (Connect) of every billing row.

-- Who recorded a delivery: Stripe's webhook, or a catch-up that listed the event from
-- the API (ledgerctl catchup). Both go through the same statement (event_record_delivery).
-- The CHECK is NOT VALID: every existing row holds the default, so scanning them all
-- under this ALTER's exclusive lock (the receiver waiting meanwhile) would prove nothing.
ALTER TABLE ledger.deliveries ADD COLUMN IF NOT EXISTS source text NOT NULL DEFAULT 'webhook';
ALTER TABLE ledger.deliveries ADD CONSTRAINT deliveries_source_known
    CHECK (source IN ('webhook', 'catchup')) NOT VALID;

-- Where the last catch-up of each account ended ('' = the platform): the next run with
-- --from-cursor lists from there.
CREATE TABLE IF NOT EXISTS ledger.catchup_cursors (
    account            text        PRIMARY KEY,
    last_event_id      text,
    last_event_created timestamptz,
    last_run_at        timestamptz,
    -- Events the last run found that no webhook had delivered.
    last_found         integer,
    updated_at         timestamptz NOT NULL DEFAULT now()
);

-- The connected account a row belongs to (NULL = the platform) on every billing table.
ALTER TABLE billing.customers ADD COLUMN IF NOT EXISTS account text;
ALTER TABLE billing.subscriptions ADD COLUMN IF NOT EXISTS account text;
ALTER TABLE billing.invoices ADD COLUMN IF NOT EXISTS account text;
ALTER TABLE billing.checkout_sessions ADD COLUMN IF NOT EXISTS account text;
ALTER TABLE billing.entitlements ADD COLUMN IF NOT EXISTS account text;
ALTER TABLE billing.entitlement_summaries ADD COLUMN IF NOT EXISTS account text;
ALTER TABLE billing.subscription_transitions ADD COLUMN IF NOT EXISTS account text;

-- Rows written before this migration by a Connect event get that event's account (the
-- ledger keeps every event's envelope): from now on a row never changes account (see
-- billing.same_owner), so a NULL left on a connected account's row would refuse its
-- next event.
UPDATE billing.customers t SET account = e.account
  FROM ledger.events e WHERE e.id = t.source_event_id AND e.account IS NOT NULL;
UPDATE billing.subscriptions t SET account = e.account
  FROM ledger.events e WHERE e.id = t.source_event_id AND e.account IS NOT NULL;
UPDATE billing.invoices t SET account = e.account
  FROM ledger.events e WHERE e.id = t.source_event_id AND e.account IS NOT NULL;
UPDATE billing.checkout_sessions t SET account = e.account
  FROM ledger.events e WHERE e.id = t.source_event_id AND e.account IS NOT NULL;
UPDATE billing.entitlement_summaries t SET account = e.account
  FROM ledger.events e WHERE e.id = t.source_event_id AND e.account IS NOT NULL;
UPDATE billing.subscription_transitions t SET account = e.account
  FROM ledger.events e WHERE e.id = t.event_id AND e.account IS NOT NULL;
UPDATE billing.entitlements t SET account = s.account
  FROM billing.subscriptions s
 WHERE t.source = 'subscription' AND s.customer_id = t.customer_id AND s.account IS NOT NULL;
UPDATE billing.entitlements t SET account = s.account
  FROM billing.entitlement_summaries s
 WHERE t.source = 'stripe' AND s.customer_id = t.customer_id AND s.account IS NOT NULL;

-- The typed tables stay keyed by Stripe id alone: a customer, subscription, invoice or
-- Checkout session lives in exactly one account and one mode at Stripe, and its id is
-- unique across all of them. Their upserts call this in their ON CONFLICT condition: an
-- object arriving under another account or mode than its row's is refused (SQLSTATE
-- 23514, constraint billing_row_owner: the event fails permanently, constraint_violation),
-- whatever the order of the two events, instead of moving the row.
CREATE OR REPLACE FUNCTION billing.same_owner(tbl text, row_account text, new_account text,
                                              row_livemode boolean, new_livemode boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF row_account IS DISTINCT FROM new_account OR row_livemode IS DISTINCT FROM new_livemode THEN
        -- No id, account or value in the message: classify() records names only anyway.
        RAISE EXCEPTION 'a billing.% row belongs to another account or mode than this object', tbl
            USING ERRCODE = '23514', SCHEMA = 'billing', TABLE = tbl, CONSTRAINT = 'billing_row_owner';
    END IF;
    RETURN true;
END
$$;

-- The generic mirror: the latest data.object of every event of any type (and of every
-- object fetched from the API), under the same order guard as the typed tables.
-- Keyed by (id, account, livemode), not by id alone: some objects are seen by several
-- accounts or in both modes (the Connect application ca_... of every connected
-- account's account.application.* events; a connected account's acct_... in its test
-- and live account.updated events), and each account's view is kept apart.
CREATE TABLE IF NOT EXISTS billing.objects (
    id                   text        NOT NULL,
    -- data.object.object: customer, charge, payment_intent, checkout.session, ...
    object_type          text        NOT NULL,
    account              text,
    livemode             boolean     NOT NULL,
    data                 jsonb       NOT NULL,
    -- A *.deleted event (not customer.subscription.deleted: a canceled subscription is
    -- still there at Stripe), or an object that says deleted: true.
    deleted              boolean     NOT NULL DEFAULT false,
    -- The event that last wrote the row, or 'api_fetch' (and the second the fetch's
    -- answer arrived) for an object fetched from the API.
    source_event_id      text        NOT NULL,
    source_event_created timestamptz NOT NULL,
    updated_at           timestamptz NOT NULL DEFAULT now()
);
-- The key: coalesce makes the platform (NULL) one account, as a primary key cannot.
CREATE UNIQUE INDEX IF NOT EXISTS objects_key ON billing.objects (id, (coalesce(account, '')), livemode);
CREATE INDEX IF NOT EXISTS objects_type_account_idx ON billing.objects (object_type, account);
