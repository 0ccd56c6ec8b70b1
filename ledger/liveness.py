"""A worker process's proof of life, apart from its leases (docs/guarantee.md, "Liveness and the lease").

A lease says how long a claim may take; it cannot tell a dead worker from a slow one. Postgres can:
each worker process keeps a session of its own that holds a session-level advisory lock on a random
key, in shared mode (ledger/sql/liveness.sql), and stamps that key on every claim; each of its apply
transactions holds its claims' keys shared too, until COMMIT. The lock lives exactly as long as the
sessions, and a session as long as the process and its link:

* the process dies (SIGKILL, OOM, a crash): its sockets close, Postgres ends the session at once;
* its host goes silent (a partition, a dead machine): Postgres ends the session once TCP keepalives
  go unanswered, or data it sent stays unacknowledged for tcp_user_timeout (``session_guards``);
* the process is stopped (SIGSTOP) or merely slow: its kernel keeps the connection answering, the
  session lives, and the lease governs.

The sweep's rescuer (workers/rescue.py) takes over the leases of keys that nobody holds any more.

The session is opened on first use, in whichever process uses it (after fork, like
ledger.db.ProcessPool), and checked before each claim without a round trip: a session that
Postgres ended has left its socket readable (its goodbye, or EOF). Then a new session draws a new key;
claims made under the old one are rescued and fenced like any other. When no session can be opened
(Postgres away), claims carry no key and their leases alone govern.
"""
from __future__ import annotations

import logging
import os
import secrets
import select
import threading
from dataclasses import dataclass
from typing import Any

import psycopg

from ledger.config import Settings
from ledger.db import session_guards
from ledger.queries import SQL

log = logging.getLogger(__name__)


class Liveness:
    def __init__(self, settings: Settings, *, name: str = "worker-liveness"):
        self._settings = settings
        self._name = name
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self._pid: int | None = None
        self._key: int | None = None

    def key(self) -> int | None:
        """The key this process's claims carry now: held by a live session of its own (opened, or opened
        again, here), or None when none can be opened."""
        with self._lock:
            if not self._session_alive():
                self._open()
            return self._key

    def _session_alive(self) -> bool:
        conn = self._conn
        if conn is None or self._pid != os.getpid():
            # Inherited across fork, the session is the parent's: never used, never closed here.
            self._conn = None
            return False
        if conn.closed or conn.broken:
            return False
        # An idle session receives nothing unless Postgres is ending it (a FATAL notice, then EOF).
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
        return not readable

    def _open(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn, self._key, self._pid = None, None, os.getpid()
        options, kwargs = session_guards(self._settings, name=self._name)
        conn = None
        try:
            conn = psycopg.connect(self._settings.database_url, autocommit=True, options=options,
                                   connect_timeout=max(1, int(self._settings.db_pool_timeout_s)), **kwargs)
            for _ in range(4):
                key = secrets.randbits(63)
                if conn.execute(SQL.liveness_claim_key, {"key": key}).fetchone()[0]:
                    conn.execute(SQL.liveness_hold_key, {"key": key})
                    conn.execute(SQL.liveness_release_exclusive, {"key": key})
                    self._conn, self._key = conn, key
                    return
            conn.close()
        except psycopg.Error as exc:
            if conn is not None:
                conn.close()
            log.warning("no liveness session: this process's leases will be waited out if it dies",
                        extra={"error_class": type(exc).__name__})

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn, self._key = None, None


@dataclass(frozen=True)
class Probe:
    """One rescue pass over leased rows (event_rescue_if_owner_gone, outbox_rescue_if_owner_gone): each
    liveness key probed (True: its session lives) and every row taken over, as the statement returned it."""
    alive: dict[int, bool]
    rescued: list[dict[str, Any]]


def probe(rows: list[dict[str, Any]], id_column: str) -> Probe:
    """A rescue statement's rows (key, alive, and the id of each row taken over, if any) as a Probe."""
    return Probe(alive={row["key"]: row["alive"] for row in rows},
                 rescued=[row for row in rows if row[id_column] is not None])
