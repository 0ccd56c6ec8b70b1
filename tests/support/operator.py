"""What the ledgerctl tests read back: the operator a replay is audited under, ``stats``' keys,
every ledger row as data, and the audit trail."""
from __future__ import annotations

import getpass
import socket

from tests.support.receiver import ledger_snapshot

# Who ledgerctl records as the actor of a replay run by these tests.
ACTOR = f"{getpass.getuser()}@{socket.gethostname()}"

STATS_KEYS = {"by_status", "by_status_and_type", "oldest_unprocessed_age_s", "due_retries", "scheduled_retries",
              "expired_leases", "in_progress", "queue_depth"}


def ledger_rows(kit) -> dict[str, list[str]]:
    """Every row of ledger.events (payload included), attempts, deliveries and audit, as JSON text."""
    snapshot = ledger_snapshot(kit.settings.database_url)
    snapshot["audit"] = [r["j"] for r in kit.query("SELECT row_to_json(t)::text AS j FROM ledger.audit t ORDER BY id")]
    return snapshot


def audit(kit, event_id: str | None = None) -> list[dict]:
    """The audit trail (of one event, or all), oldest first."""
    return kit.query("SELECT event_id, action, actor, reason, from_status FROM ledger.audit "
                     "WHERE %(id)s::text IS NULL OR event_id = %(id)s ORDER BY id", {"id": event_id})
