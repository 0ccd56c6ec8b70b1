-- The transactional outbox: external effects recorded in the same transaction
-- as the business writes that call for them, delivered afterwards, at least
-- once, each carrying its idempotency key so the receiving side applies it once.

CREATE TABLE IF NOT EXISTS ledger.outbox (
    -- Also the effect's sequence number: effects of one ordering key (a customer)
    -- are recorded under a lock on that key, so their ids follow commit order.
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Deterministic, from stable ids (evt_123:entitlements.changed:cus_9):
    -- re-applying an event can never record an effect twice.
    idempotency_key  text        NOT NULL UNIQUE,
    effect           text        NOT NULL,
    event_id         text        NOT NULL REFERENCES ledger.events (id) ON DELETE CASCADE,
    ordering_key     text,
    payload          jsonb       NOT NULL,
    status           text        NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'sending', 'sent',
                                       'failed_recoverable', 'failed_permanent')),
    attempts         integer     NOT NULL DEFAULT 0,
    attempt_base     integer     NOT NULL DEFAULT 0,
    failure_reason   text,
    last_error       text,
    next_attempt_at  timestamptz,
    lease_owner      text,
    lease_expires_at timestamptz,
    wakeup_at        timestamptz NOT NULL DEFAULT now(),
    redrives         integer     NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    sent_at          timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT outbox_lease_iff_sending CHECK (
        (status = 'sending') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT outbox_failure_has_reason CHECK (
        status NOT IN ('failed_recoverable', 'failed_permanent') OR failure_reason IS NOT NULL),
    CONSTRAINT outbox_recoverable_is_scheduled CHECK (
        status <> 'failed_recoverable' OR next_attempt_at IS NOT NULL),
    CONSTRAINT outbox_sent_has_time CHECK ((status = 'sent') = (sent_at IS NOT NULL))
);

CREATE INDEX IF NOT EXISTS outbox_unsent_wakeup_idx ON ledger.outbox (wakeup_at)
    WHERE status IN ('pending', 'sending', 'failed_recoverable');
CREATE INDEX IF NOT EXISTS outbox_event_idx ON ledger.outbox (event_id);
CREATE INDEX IF NOT EXISTS outbox_failed_permanent_idx ON ledger.outbox (effect, updated_at)
    WHERE status = 'failed_permanent';
