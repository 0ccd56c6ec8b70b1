-- Worker liveness beside the lease (docs/guarantee.md, "Liveness and the lease").
--
-- Each worker process holds a session-level advisory lock on a random key for as long as its
-- Postgres session lives (ledger/liveness.py), and stamps that key on every event and effect it
-- claims. Postgres ends the session when the process dies (at once) or when its host goes silent
-- (TCP keepalives and tcp_user_timeout on the workers' sessions), and the lock goes with it. The
-- sweep's rescuer takes over the leases of keys nobody holds any more within seconds, instead
-- of waiting out LEDGER_LEASE_S. NULL: a claim made without liveness (a worker of an earlier
-- release, a tool): its lease alone governs.
ALTER TABLE ledger.events ADD COLUMN IF NOT EXISTS lease_liveness_key bigint;
ALTER TABLE ledger.outbox ADD COLUMN IF NOT EXISTS lease_liveness_key bigint;
-- The rescuer reads the keys of leased rows only: the in-flight few.
CREATE INDEX IF NOT EXISTS events_processing_liveness_idx ON ledger.events (lease_liveness_key)
    WHERE status = 'processing';
CREATE INDEX IF NOT EXISTS outbox_sending_liveness_idx ON ledger.outbox (lease_liveness_key)
    WHERE status = 'sending';

-- An attempt whose worker was found gone and whose lease the rescuer took over: worker_lost.
-- NOT VALID: every existing row already satisfies the wider set, and new rows are checked; the
-- history is not scanned under the table lock.
ALTER TABLE ledger.attempts DROP CONSTRAINT IF EXISTS attempts_outcome_check;
ALTER TABLE ledger.attempts ADD CONSTRAINT attempts_outcome_check
    CHECK (outcome IN ('running', 'processed', 'failed_recoverable', 'failed_permanent', 'lease_lost',
                       'lease_expired', 'worker_lost')) NOT VALID;
