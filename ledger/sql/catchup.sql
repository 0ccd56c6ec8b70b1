-- Catch-up (ledger/catchup.py, run by workers/catchup.py): its cursor, its lock, and which
-- listed events the ledger already has. It records events through the receiver's own
-- statement (event_record_delivery, events.sql).

-- name: catchup_lock_try
-- Catch-up: take the session lock of one account's catch-up, on a connection kept for
-- the run and idle (no transaction) while it calls Stripe. false: another catch-up of
-- that account is running. Released by catchup_unlock, or when the connection ends.
SELECT pg_try_advisory_lock(hashtextextended('ledger.catchup:' || %(account)s, 0)) AS locked

-- name: catchup_unlock
-- Catch-up: give the account's lock back at the end of the run.
SELECT pg_advisory_unlock(hashtextextended('ledger.catchup:' || %(account)s, 0)) AS unlocked

-- name: catchup_cursor_get
-- Catch-up: where the last catch-up of this account ('' = platform) ended. No row: none ran.
SELECT account, last_event_id, last_event_created, last_run_at, last_found, updated_at
  FROM ledger.catchup_cursors
 WHERE account = %(account)s

-- name: catchup_cursor_advance_if_newer
-- Catch-up: move the cursor to the newest event recorded so far (called only after that
-- event's delivery committed). Never backwards in time: a run that started from an older
-- position (a slow run overtaken by another) cannot undo a newer one's progress.
INSERT INTO ledger.catchup_cursors AS t (account, last_event_id, last_event_created, updated_at)
VALUES (%(account)s, %(event_id)s, %(event_created)s, now())
ON CONFLICT (account) DO UPDATE
   SET last_event_id = EXCLUDED.last_event_id, last_event_created = EXCLUDED.last_event_created,
       updated_at = now()
 WHERE t.last_event_created IS NULL OR t.last_event_created <= EXCLUDED.last_event_created

-- name: catchup_cursor_record_run
-- Catch-up: a run of this account finished; `last_found` counts the events it found that no
-- webhook had delivered. Creates the row of an account's first run (with no position yet):
-- from then on the periodic catch-up covers that account too.
INSERT INTO ledger.catchup_cursors AS t (account, last_run_at, last_found, updated_at)
VALUES (%(account)s, now(), %(found)s, now())
ON CONFLICT (account) DO UPDATE
   SET last_run_at = now(), last_found = EXCLUDED.last_found, updated_at = now()

-- name: catchup_cursor_accounts
-- Periodic catch-up: every account with a cursor ('' = platform).
SELECT account FROM ledger.catchup_cursors ORDER BY account

-- name: catchup_known_event_ids
-- Catch-up: which of these event ids the ledger already has (a dry run's "already
-- delivered", and the overlap a run from the cursor lists again), under its own id or as
-- the snapshot twin of a thin notification applied under it.
SELECT id FROM ledger.events WHERE id = ANY(%(ids)s)
UNION
SELECT snapshot_event_id FROM ledger.snapshot_twins WHERE snapshot_event_id = ANY(%(ids)s)

-- name: catchup_snapshot_twin_ids
-- Catch-up: which of these (snapshot) event ids a thin notification already brought, as its
-- snapshot twin: not recorded again (the change is in the ledger under the notification's id).
SELECT snapshot_event_id AS id FROM ledger.snapshot_twins WHERE snapshot_event_id = ANY(%(ids)s)
