-- Operator actions on events, and a retry budget that a replay renews.

-- Attempts made before the latest replay: the retry budget (LEDGER_MAX_ATTEMPTS)
-- counts attempts since then, while attempt numbers in the history keep growing.
ALTER TABLE ledger.events ADD COLUMN IF NOT EXISTS attempt_base integer NOT NULL DEFAULT 0;

-- Append-only record of what operators did to an event: who, when, why.
CREATE TABLE IF NOT EXISTS ledger.audit (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    text        NOT NULL REFERENCES ledger.events (id) ON DELETE CASCADE,
    action      text        NOT NULL CHECK (action IN ('replay')),
    actor       text        NOT NULL,
    reason      text,
    from_status text        NOT NULL,
    at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS audit_event_idx ON ledger.audit (event_id, at);

-- Retention scans processed events by age.
CREATE INDEX IF NOT EXISTS events_processed_at_idx ON ledger.events (processed_at)
    WHERE status = 'processed' AND payload IS NOT NULL;
