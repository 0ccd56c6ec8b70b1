"""Connection pools, one per process, created after fork.

Celery's prefork pool and gunicorn both fork; a pool opened in the parent would
hand the same sockets to every child. ``ProcessPool`` opens its pool lazily in
whichever process first asks and reopens it when it finds itself in a new pid.
"""
from __future__ import annotations

import os
import threading

from psycopg_pool import ConnectionPool

from ledger.config import Settings


class ProcessPool:
    def __init__(self, settings: Settings, *, name: str, max_size: int | None = None,
                 statement_timeout_ms: int | None = None, interactive: bool = False):
        self._settings = settings
        self._name = name
        self._max_size = max_size or settings.db_pool_max_size
        self._statement_timeout_ms = statement_timeout_ms
        self._interactive = interactive
        self._lock = threading.Lock()
        self._pool: ConnectionPool | None = None
        self._pid: int | None = None

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
        options = f"-c application_name={self._name}"
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
                    "options": options},
            name=self._name,
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
