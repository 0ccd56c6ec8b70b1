"""Worker and sweep metrics (prometheus-client)."""
from __future__ import annotations

from prometheus_client import Counter

ATTEMPTS = Counter("worker_attempts_total", "Finished attempts by event type, outcome and reason",
                   ["type", "outcome", "reason"])
REDRIVES = Counter("sweep_redrives_total", "Wake-ups re-sent by the recovery sweep")
