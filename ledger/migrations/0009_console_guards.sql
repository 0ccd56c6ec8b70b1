-- The console's guards (docs/console.md, "Security").

-- One job per preview: the preview's id is on its confirm form, and a second confirm of the same
-- preview (a double submit, two tabs) finds the job the first one created instead of starting
-- another over the same events. Jobs made before this migration have none.
ALTER TABLE ledger.replay_jobs ADD COLUMN IF NOT EXISTS preview_id uuid;
CREATE UNIQUE INDEX IF NOT EXISTS replay_jobs_preview_id_key ON ledger.replay_jobs (preview_id);

-- Failed logins, shared by every console process: the throttle counts them per name and, with a
-- higher limit, per client address. The key is an HMAC under the console's secret key, never the
-- name typed (which is sometimes a password typed in the wrong field). Rows older than the
-- throttle's window are deleted as new failures are recorded.
CREATE TABLE IF NOT EXISTS ledger.login_failures (
    key        text        NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS login_failures_key_idx ON ledger.login_failures (key, failed_at);
CREATE INDEX IF NOT EXISTS login_failures_failed_at_idx ON ledger.login_failures (failed_at);
