-- name: health_alert_record
-- Worker, in the apply transaction of a v2.core.health.event_generation_failure.resolved
-- notification: the alert and what was done about it. Keyed by the notification's id, so a
-- replay of the notification (which refetches and re-applies the object) keeps the first row.
-- A row back: this attempt recorded it (its log line and metric follow the COMMIT).
INSERT INTO ledger.health_alerts (event_id, alert_id, failed_event_type, related_object_type, related_object_id,
                                  account, livemode, severity, summary, resolved_at, repair)
VALUES (%(event_id)s, %(alert_id)s, %(failed_event_type)s, %(related_object_type)s, %(related_object_id)s,
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
