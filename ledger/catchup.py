"""The catch-up's side of the ledger: its cursors, its per-account lock, and which listed events
the ledger already has. The run itself (listing Stripe, recording, waking) is workers/catchup.py;
the statements are ledger/sql/catchup.sql.

The lock is a session advisory lock on a connection of its own, never a pooled one: it must
stay held, idle and outside any transaction, for as long as the run calls Stripe.
"""
from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any, Iterator

from ledger.config import Settings
from ledger.db import ProcessPool, session_lock
from ledger.errors import LedgerError
from ledger.queries import SQL
from ledger.statements import run_statement

_IDS_PER_STATEMENT = 1000


class CatchupBusy(LedgerError):
    """Another catch-up of the same account holds its lock."""


def account_name(key: str | None) -> str:
    return f"account {key}" if key else "the platform"


class CatchupLedger:
    """One account's cursor is keyed by ``key``: the connected account's id, '' for the platform."""

    def __init__(self, settings: Settings, pool: ProcessPool):
        self._settings = settings
        self._pool = pool

    def accounts(self) -> list[str]:
        """Every key with a cursor ('' the platform), in order."""
        return [row["account"] for row in run_statement(self._pool, SQL.catchup_cursor_accounts)]

    def cursor(self, key: str) -> dict[str, Any] | None:
        rows = run_statement(self._pool, SQL.catchup_cursor_get, {"account": key})
        return rows[0] if rows else None

    def advance(self, key: str, event_id: str, created: datetime) -> None:
        """Move the cursor to a recorded event, never backwards (call only after its delivery committed)."""
        run_statement(self._pool, SQL.catchup_cursor_advance_if_newer,
                      {"account": key, "event_id": event_id, "event_created": created})

    def record_run(self, key: str, *, found: int) -> None:
        run_statement(self._pool, SQL.catchup_cursor_record_run, {"account": key, "found": found})

    def known_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` the ledger has, under their own id or as a thin notification's snapshot twin."""
        return self._ids(SQL.catchup_known_event_ids, ids)

    def snapshot_twin_ids(self, ids: list[str]) -> set[str]:
        """Which of ``ids`` a thin notification already brought, as its snapshot twin."""
        return self._ids(SQL.catchup_snapshot_twin_ids, ids)

    def _ids(self, sql: str, ids: list[str]) -> set[str]:
        known: set[str] = set()
        for at in range(0, len(ids), _IDS_PER_STATEMENT):
            known.update(row["id"] for row in run_statement(self._pool, sql, {"ids": ids[at:at + _IDS_PER_STATEMENT]}))
        return known

    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[None]:
        """Hold the account's catch-up lock for the block; CatchupBusy if another run holds it."""
        with session_lock(self._settings, SQL.catchup_lock_try, SQL.catchup_unlock, {"account": key},
                          name="ledger-catchup") as held:
            if not held:
                raise CatchupBusy(f"another catch-up of {account_name(key)} is running (it holds the advisory "
                                  f"lock); nothing was done")
            yield
