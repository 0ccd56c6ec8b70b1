"""Reconcile reports, kept: each run of ``ledgerctl reconcile`` or of the console's drift page records
what it compared, the drift it found and what a fix applied (ledger.reconcile_runs). The console shows
the last ones; the metric reconcile_drift_objects reads the latest per object type."""
from __future__ import annotations

import json
from typing import Any, Iterable

from ledger.db import ProcessPool
from ledger.queries import SQL
from ledger.statements import run_statement


class ReconcileRuns:
    def __init__(self, pool: ProcessPool):
        self._pool = pool

    def record(self, report: dict[str, Any], *, actor: str, types: Iterable[str], fixed: bool) -> int:
        """``report``: Reconcile's ``as_dict()``."""
        row = run_statement(self._pool, SQL.reconcile_run_record, {
            "actor": actor, "account": report.get("account") or "", "types": list(types), "fixed": fixed,
            "checked": json.dumps(report["checked"], default=str), "drift": json.dumps(report["drift"], default=str),
            "fixes": json.dumps(report["fixes"], default=str)})[0]
        return row["id"]

    def recent(self, *, limit: int = 10) -> list[dict[str, Any]]:
        return run_statement(self._pool, SQL.reconcile_runs_recent, {"limit": limit})

    def drift_by_type(self) -> list[dict[str, Any]]:
        """For each object type, the drifted objects of the latest run that compared it, and its time."""
        return run_statement(self._pool, SQL.reconcile_drift_latest)
