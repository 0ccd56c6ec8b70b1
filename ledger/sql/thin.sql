-- Thin event notifications (workers/thin.py, workers/health.py): health alerts, snapshot twins,
-- the objects they were applied as.

-- name: health_alert_record
-- Worker, in the apply transaction of a v2.core.health.event_generation_failure.resolved
-- notification: the alert and what was done about it. Keyed by the notification's id, so a
-- replay of the notification (which refetches and re-applies the object) keeps the first row.
-- A row back: this attempt recorded it (its log line and metric follow the COMMIT).
INSERT INTO ledger.health_alerts (event_id, event_created, alert_id, failed_event_type, related_object_type,
                                  related_object_id, account, livemode, severity, summary, resolved_at, repair)
VALUES (%(event_id)s, (SELECT stripe_created FROM ledger.events WHERE id = %(event_id)s), %(alert_id)s, %(failed_event_type)s, %(related_object_type)s, %(related_object_id)s,
        %(account)s, %(livemode)s, %(severity)s, %(summary)s, %(resolved_at)s, %(repair)s)
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id

-- name: health_alerts_recent
-- ledgerctl health: the latest alerts, newest first.
SELECT event_id, alert_id, failed_event_type, related_object_type, related_object_id, account, livemode,
       severity, summary, resolved_at, repair, recorded_at
  FROM ledger.health_alerts
 ORDER BY recorded_at DESC, event_id
 LIMIT %(limit)s

-- name: event_record_snapshot_twin
-- Worker, in the apply transaction of a thin v1 notification that Stripe says is the thin
-- version of a snapshot event: the pair, so that catch-up counts the snapshot id as known and
-- inspection finds the rows (they carry the snapshot id). The first notification of a snapshot
-- id keeps it; a second one (a replay) records nothing new.
INSERT INTO ledger.snapshot_twins (snapshot_event_id, event_id, event_created)
VALUES (%(snapshot_event_id)s, %(event_id)s, (SELECT stripe_created FROM ledger.events WHERE id = %(event_id)s))
ON CONFLICT (snapshot_event_id) DO NOTHING

-- name: event_record_applied_object
-- Worker, in the apply transaction of a thin v1 notification: the object it fetched and applied,
-- when, at which API version, and under which id (migration 0016), so that a rebuild applies the
-- same. A later attempt (a replay) records what it applied in turn.
UPDATE ledger.events
   SET applied_object = %(object)s, applied_object_at = %(fetched_at)s,
       applied_api_version = %(api_version)s, applied_as = %(applied_as)s
 WHERE id = %(event_id)s AND stripe_created = %(created)s
