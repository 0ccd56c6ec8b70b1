"""The ledger's time partitions: made ahead of time, watched (docs/retention.md, "Partitions").

A partitioned ledger (``ledgerctl partitions migrate``, ledger/partition_migration.py) has ledger.events,
ledger.deliveries and ledger.attempts partitioned by month of the event's Stripe ``created``. Months must exist before their events arrive: an event whose month
has no partition lands in the default partition, which is kept small on purpose (a retention run
keeps a month's remaining events in that month's new tables, not there). The sweep calls ``ensure``
at start, then before each retention run (every LEDGER_RETENTION_INTERVAL_S, the hour by default)
or, with no run to make, at least hourly, for the current month and ``AHEAD`` months after it; the metrics say how many months are ready and how many events
strayed, and two alerts fire on them (docs/monitoring.md). On a ledger not partitioned yet
every call here is a no-op (``health`` says so).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.db import ProcessPool
from ledger.queries import SQL
from ledger.statements import run_statement

# Months made after the current one: a missed pass or three (a sweep down for a day) still
# finds next month's partition there.
AHEAD = 3


@dataclass(frozen=True)
class PartitionHealth:
    partitioned: bool
    months_ahead: int   # months after the current one whose partitions exist
    strays: int         # events in the default partition of a month no retention run dropped


class Partitions:
    def __init__(self, pool: ProcessPool):
        self._pool = pool

    def ensure(self, ahead: int = AHEAD) -> list[str]:
        """This month's partitions and the next ``ahead`` months', where missing: the events partitions made."""
        return [row["name"] for row in run_statement(self._pool, SQL.partitions_ensure, {"ahead": ahead})]

    def health(self) -> PartitionHealth:
        row = run_statement(self._pool, SQL.partitions_health)[0]
        return PartitionHealth(bool(row["partitioned"]), int(row["months_ahead"]), int(row["strays"]))

    def listed(self) -> list[dict[str, Any]]:
        return run_statement(self._pool, SQL.partitions_list)
