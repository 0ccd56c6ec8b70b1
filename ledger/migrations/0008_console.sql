-- The operator console: replay jobs (a filter's events, fixed when the operator confirmed),
-- reconcile reports, and the indexes the console's event list pages by.

-- A bulk replay: who, why, which filter, and how far it got. The events it replays are the
-- ones its filter matched when it was created (ledger.replay_job_events), never the ones that
-- match later: the count the operator confirmed is the count replayed.
CREATE TABLE IF NOT EXISTS ledger.replay_jobs (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    actor            text        NOT NULL,
    reason           text,
    filter           jsonb       NOT NULL,
    force            boolean     NOT NULL DEFAULT false,
    total            integer     NOT NULL,
    replayed         integer     NOT NULL DEFAULT 0,
    skipped          integer     NOT NULL DEFAULT 0,
    status           text        NOT NULL DEFAULT 'running'
                     CHECK (status IN ('running', 'finished', 'cancelled')),
    cancelled_by     text,
    -- The console process running it; another one takes it over once the lease expired.
    runner           text,
    lease_expires_at timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz
);
CREATE INDEX IF NOT EXISTS replay_jobs_running_idx ON ledger.replay_jobs (id) WHERE status = 'running';

CREATE TABLE IF NOT EXISTS ledger.replay_job_events (
    job_id      bigint      NOT NULL REFERENCES ledger.replay_jobs (id) ON DELETE CASCADE,
    event_id    text        NOT NULL REFERENCES ledger.events (id) ON DELETE CASCADE,
    -- NULL: not reached yet; then replayed, or skipped (a worker held it, or it no longer
    -- matched: already waiting, or processed since).
    outcome     text        CHECK (outcome IN ('replayed', 'skipped')),
    done_at     timestamptz,
    PRIMARY KEY (job_id, event_id)
);

-- The audit names the job a replay came from.
ALTER TABLE ledger.audit ADD COLUMN IF NOT EXISTS replay_job_id bigint;

-- The last reconcile runs (ledgerctl reconcile, the console's drift page): what was compared,
-- the drift found, what a --fix applied. The latest per type feeds reconcile_drift_objects.
CREATE TABLE IF NOT EXISTS ledger.reconcile_runs (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    actor       text        NOT NULL,
    account     text        NOT NULL DEFAULT '',
    types       text[]      NOT NULL,
    fixed       boolean     NOT NULL,
    checked     jsonb       NOT NULL,
    drift       jsonb       NOT NULL,
    fixes       jsonb       NOT NULL,
    ran_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS reconcile_runs_ran_at_idx ON ledger.reconcile_runs (ran_at DESC);

-- The console's event list pages newest first by (received_at, id), filtered or not: keyset
-- pagination walks these indexes whatever the ledger's size.
CREATE INDEX IF NOT EXISTS events_received_at_id_idx ON ledger.events (received_at DESC, id DESC);
CREATE INDEX IF NOT EXISTS events_status_received_at_id_idx ON ledger.events (status, received_at DESC, id DESC);
CREATE INDEX IF NOT EXISTS events_type_received_at_id_idx ON ledger.events (type, received_at DESC, id DESC);
CREATE INDEX IF NOT EXISTS events_account_received_at_id_idx ON ledger.events (account, received_at DESC, id DESC)
    WHERE account IS NOT NULL;
-- The source filter "catchup": the few deliveries catch-up made, by time.
CREATE INDEX IF NOT EXISTS deliveries_catchup_idx ON ledger.deliveries (delivered_at, event_id)
    WHERE source = 'catchup';
-- The overview's failures per minute over the last hour.
CREATE INDEX IF NOT EXISTS attempts_failed_finished_at_idx ON ledger.attempts (finished_at)
    WHERE outcome IN ('failed_recoverable', 'failed_permanent');
