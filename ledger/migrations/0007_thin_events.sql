-- Thin event notifications: Stripe's health alerts, and the snapshot twins of thin notifications.

-- Stripe's health alerts: one row per v2.core.health.event_generation_failure.resolved
-- notification, the event Stripe sends when it failed to generate an event (that event is
-- never delivered nor listed). Written by the worker in the transaction that applies the
-- refetched object, so an alert is recorded exactly when its repair committed.
CREATE TABLE IF NOT EXISTS ledger.health_alerts (
    -- The notification's id: a redelivery or a replay records nothing new.
    event_id           text        PRIMARY KEY REFERENCES ledger.events (id) ON DELETE CASCADE,
    alert_id           text,
    -- The type of the event Stripe failed to generate, and the object it was about.
    failed_event_type  text,
    related_object_type text,
    related_object_id  text,
    -- The connected account of the object (NULL = the platform), and the mode.
    account            text,
    livemode           boolean     NOT NULL,
    severity           text,
    summary            text,
    resolved_at        timestamptz,
    -- What the worker did about it: the object refetched and applied, gone at Stripe, or of a
    -- type it cannot fetch (the operator repairs that one).
    repair             text        NOT NULL
                       CHECK (repair IN ('applied', 'object_not_found', 'unsupported_object_type')),
    recorded_at        timestamptz NOT NULL DEFAULT now()
);

-- Most recent first, for ledgerctl health and the README runbook.
CREATE INDEX IF NOT EXISTS health_alerts_recorded_at_idx ON ledger.health_alerts (recorded_at DESC);

-- A thin v1 notification and the snapshot event of the same change (Stripe names it in the v2
-- event's snapshot_event) are one change under two ids. The worker records the pair when it
-- applies the notification under the snapshot event's id; catch-up then counts that snapshot id
-- as known, and ledgerctl shows the rows it wrote. A table of its own: a column and index on
-- ledger.events would lock the receiver's table while they are built.
CREATE TABLE IF NOT EXISTS ledger.snapshot_twins (
    snapshot_event_id text        PRIMARY KEY,
    event_id          text        NOT NULL REFERENCES ledger.events (id) ON DELETE CASCADE,
    recorded_at       timestamptz NOT NULL DEFAULT now()
);
