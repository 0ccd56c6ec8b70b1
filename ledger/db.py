"""Connection pools, one per process, created after fork.

Celery's prefork pool and gunicorn both fork; a pool opened in the parent would
hand the same sockets to every child. ``ProcessPool`` opens its pool lazily in
whichever process first asks and reopens it when it finds itself in a new pid.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, Mapping

import psycopg
from psycopg_pool import ConnectionPool

from ledger import jsoncodec
from ledger.config import Settings


# Keepalive probes Postgres sends a silent peer before it gives up on it (tcp_keepalives_count).
KEEPALIVE_PROBES = 3
# How often a backend running a statement looks whether its client is still there.
CLIENT_CHECK_MS = 2000


def session_guards(settings: Settings, *, name: str) -> tuple[str, dict]:
    """The options (server settings) and libpq parameters of a worker's sessions, which must end soon
    after their process or its host is gone (ledger/liveness.py):

    * TCP keepalives, both ways: a peer silent for ``dead_peer_s`` (idle, then KEEPALIVE_PROBES probes)
      is dead, and the session ends, rolling back its transaction and letting go of its locks;
    * ``tcp_user_timeout``: data sent and not acknowledged for ``dead_peer_s`` ends it too (a cut that
      fell in the middle of a pipeline, where the backend is writing, not waiting);
    * ``client_connection_check_interval``: a backend waiting on a lock notices its client is gone;
    * ``idle_in_transaction_session_timeout`` at half the lease, Celery's soft time limit: no live
      worker's transaction idles that long (the limit ends its attempt first), so only a stopped
      process's open transaction is ended, and its locks with it (its lease still governs).
    """
    interval_s = max(1, round(settings.dead_peer_s / 5))
    idle_s = max(1, round(settings.dead_peer_s - KEEPALIVE_PROBES * interval_s))
    user_timeout_ms = int(settings.dead_peer_s * 1000)
    options = (f"-c application_name={name} -c tcp_keepalives_idle={idle_s} "
               f"-c tcp_keepalives_interval={interval_s} -c tcp_keepalives_count={KEEPALIVE_PROBES} "
               f"-c tcp_user_timeout={user_timeout_ms} -c client_connection_check_interval={CLIENT_CHECK_MS} "
               f"-c idle_in_transaction_session_timeout={settings.lease_s * 500}")
    return options, {"keepalives": 1, "keepalives_idle": idle_s, "keepalives_interval": interval_s,
                     "keepalives_count": KEEPALIVE_PROBES, "tcp_user_timeout": user_timeout_ms}


@contextlib.contextmanager
def session_lock(settings: Settings, try_lock: str, unlock: str, params: Mapping[str, Any] | None = None, *,
                 name: str) -> Iterator[bool]:
    """A session-level advisory lock held on a connection of its own (autocommit: it holds no snapshot,
    however long the block runs) for the block: yields whether it was granted. The lock goes with the
    session, so a holder that dies releases it; the unlock's own failure (Postgres gone) is not the block's."""
    conn = psycopg.connect(settings.database_url, autocommit=True,
                           connect_timeout=max(1, int(settings.db_pool_timeout_s)), application_name=name)
    try:
        held = bool(conn.execute(try_lock, params or {}).fetchone()[0])
        try:
            yield held
        finally:
            if held:
                with contextlib.suppress(psycopg.Error):
                    conn.execute(unlock, params or {})
    finally:
        conn.close()


class ProcessPool:
    def __init__(self, settings: Settings, *, name: str, max_size: int | None = None,
                 statement_timeout_ms: int | None = None, interactive: bool = False, guarded: bool = False):
        self._settings = settings
        self._name = name
        self._max_size = max_size or settings.db_pool_max_size
        self._statement_timeout_ms = statement_timeout_ms
        self._interactive = interactive
        # A worker's pool: its sessions end soon after the process or its host is gone (session_guards).
        self._guarded = guarded
        self._lock = threading.Lock()
        self._pool: ConnectionPool | None = None
        self._pid: int | None = None

    @property
    def settings(self) -> Settings:
        return self._settings

    def get(self) -> ConnectionPool:
        pid = os.getpid()
        if self._pool is None or self._pid != pid:
            with self._lock:
                if self._pool is None or self._pid != pid:
                    # The inherited pool belongs to the parent: drop it without closing its sockets.
                    self._pool = self._open()
                    self._pid = pid
        return self._pool

    def _open(self) -> ConnectionPool:
        options, guards = session_guards(self._settings, name=self._name) if self._guarded else (
            f"-c application_name={self._name}", {})
        if self._statement_timeout_ms:
            options += f" -c statement_timeout={self._statement_timeout_ms}"
        if self._interactive:
            # A person waits on each statement (the console): no JIT compile and no parallel workers to
            # start, whose few tens of milliseconds a short indexed statement never wins back.
            options += " -c jit=off -c max_parallel_workers_per_gather=0"
        return ConnectionPool(
            self._settings.database_url,
            min_size=1,
            max_size=self._max_size,
            timeout=self._settings.db_pool_timeout_s,
            kwargs={"autocommit": True, "connect_timeout": max(1, int(self._settings.db_pool_timeout_s)),
                    "options": options, **guards},
            name=self._name,
            # A claim reads each event's payload: orjson where it reads the same values (ledger/jsoncodec.py).
            configure=jsoncodec.use,
            # The default backs off reconnecting for up to 5 minutes: after an
            # outage the receiver would keep answering 503 long after Postgres is back.
            reconnect_timeout=5,
            open=True,
        )

    def close(self) -> None:
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.close()
            self._pool = None
