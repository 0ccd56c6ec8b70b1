-- The event ledger: one row per Stripe event id, and an append-only history of
-- every attempt to process it. This is the public contract documented in README.

CREATE SCHEMA IF NOT EXISTS ledger;

CREATE TABLE ledger.events (
    id               text        PRIMARY KEY CHECK (id LIKE 'evt\_%'),
    type             text        NOT NULL CHECK (type <> ''),
    status           text        NOT NULL DEFAULT 'received'
                     CHECK (status IN ('received', 'processing', 'processed',
                                       'failed_recoverable', 'failed_permanent')),
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- Machine-readable reason of the current failure state
    -- (unsupported_type, unmappable_payload, retries_exhausted, db_unavailable, ...).
    failure_reason   text,
    -- Human-readable detail of the latest failure; never contains payload values.
    last_error       text,
    stripe_created   timestamptz NOT NULL,
    livemode         boolean     NOT NULL,
    api_version      text,
    account          text,
    -- The verified request body, byte for byte (json keeps the text as sent).
    -- NULL only once retention has pruned a processed event.
    payload          json,
    received_at      timestamptz NOT NULL DEFAULT now(),
    -- When the last wake-up (broker message) was due to reach a worker. The
    -- recovery sweep only re-drives events whose wake-up is overdue.
    wakeup_at        timestamptz NOT NULL DEFAULT now(),
    -- Sweep re-drives since a worker last claimed the event; each doubles the
    -- wait before the next one, so a backlog is never flooded with duplicates.
    redrives         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz,
    lease_owner      text,
    lease_expires_at timestamptz,
    processed_at     timestamptz,
    updated_at       timestamptz NOT NULL DEFAULT now(),

    -- A row is leased exactly while it is processing.
    CONSTRAINT events_lease_iff_processing CHECK (
        (status = 'processing') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    -- Both failure states say why.
    CONSTRAINT events_failure_has_reason CHECK (
        status NOT IN ('failed_recoverable', 'failed_permanent') OR failure_reason IS NOT NULL),
    -- A recoverable failure always knows when it may run again.
    CONSTRAINT events_recoverable_is_scheduled CHECK (
        status <> 'failed_recoverable' OR next_attempt_at IS NOT NULL),
    CONSTRAINT events_processed_has_time CHECK (
        (status = 'processed') = (processed_at IS NOT NULL)),
    CONSTRAINT events_payload_until_pruned CHECK (
        payload IS NOT NULL OR status = 'processed')
);

-- The unprocessed set is small and hot; history is large and cold. Partial
-- indexes keep every sweep and stats query proportional to the small set.
CREATE INDEX events_unfinished_wakeup_idx ON ledger.events (wakeup_at)
    WHERE status IN ('received', 'processing', 'failed_recoverable');
CREATE INDEX events_received_at_unfinished_idx ON ledger.events (received_at)
    WHERE status IN ('received', 'processing', 'failed_recoverable');
CREATE INDEX events_failed_permanent_idx ON ledger.events (type, updated_at)
    WHERE status = 'failed_permanent';
CREATE INDEX events_type_created_idx ON ledger.events (type, stripe_created);

-- Every delivery Stripe made of an event, appended by the receiver. A table of
-- its own so that recording a redelivery never waits on the event row, which a
-- worker holds locked while it applies the event.
CREATE TABLE ledger.deliveries (
    event_id     text        NOT NULL REFERENCES ledger.events (id) ON DELETE CASCADE,
    delivered_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX deliveries_event_idx ON ledger.deliveries (event_id, delivered_at);

CREATE TABLE ledger.attempts (
    event_id    text        NOT NULL REFERENCES ledger.events (id) ON DELETE CASCADE,
    attempt     integer     NOT NULL CHECK (attempt >= 1),
    worker      text        NOT NULL,
    lease_owner text        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    outcome     text        NOT NULL DEFAULT 'running'
                CHECK (outcome IN ('running', 'processed', 'failed_recoverable',
                                   'failed_permanent', 'lease_lost', 'lease_expired')),
    error_class text,
    error       text,
    PRIMARY KEY (event_id, attempt),
    CONSTRAINT attempts_finished_iff_not_running CHECK (
        (outcome = 'running') = (finished_at IS NULL))
);
