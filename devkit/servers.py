"""A private PostgreSQL server for tests that stop or break one.

Started from the installed binaries on a free port, in a temporary directory.
initdb refuses to run as root, so as root the server runs as the `postgres` user.
"""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    for candidate in (shutil.which(name), *sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(f"{name} not found")


class PrivatePostgres:
    def __init__(self):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ledger-pg-"))
        self.data = self.dir / "data"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = list(args)
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=120)

    def init(self) -> "PrivatePostgres":
        self._run(_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        return self

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"), "-w", "-t", "60", "start")

    def stop(self, mode: str = "immediate") -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("private postgres did not start")

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
