"""The benchmark's own stack: a private Postgres and Redis, the real receiver and real workers.

Everything is started as a process group of its own and registered with a
``Cleanup`` that stops it (also on Ctrl-C or SIGTERM) and removes the private
servers' directories. Nothing here touches the machine's shared Postgres or Redis.
"""
from __future__ import annotations

import http.client
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_bin(name: str) -> str:
    for candidate in (shutil.which(name), *sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(f"{name} not found (install PostgreSQL's server binaries)")


def venv_tool(name: str) -> str:
    path = VENV_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found next to {sys.executable} nor on PATH")
    return found


# -- cleanup ----------------------------------------------------------------------------

class Cleanup:
    """Stops everything registered, newest first, exactly once; Ctrl-C and SIGTERM end the run through it."""

    def __init__(self):
        self._actions: list[tuple[str, Callable[[], None]]] = []

    def add(self, what: str, action: Callable[[], None]) -> None:
        self._actions.append((what, action))

    def remove(self, action: Callable[[], None]) -> None:
        self._actions = [(w, a) for w, a in self._actions if a is not action]

    def run(self) -> None:
        # Ctrl-C during cleanup must not leave the rest running.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            while self._actions:
                what, action = self._actions.pop()
                try:
                    action()
                except Exception as exc:  # keep stopping the others
                    print(f"[bench] cleanup of {what} failed: {exc}", file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous)

    def install_signal_handlers(self) -> None:
        def on_term(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGHUP, on_term)
        # Also when started with SIGINT ignored (from a non-interactive shell's background job).
        signal.signal(signal.SIGINT, signal.default_int_handler)


def stop_group(proc: subprocess.Popen, *, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Signal the process group of ``proc``; SIGKILL whatever is left after ``grace_s``."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # stray children of a leader that already exited
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- /proc accounting ---------------------------------------------------------------------

def children_of(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found.extend(int(p) for p in fh.read().split())
    except OSError:
        pass
    return found


def cpu_seconds(pid: int, *, reaped_children: bool = False) -> float:
    """utime + stime of one process (plus those of its children it has reaped, if asked)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])
        if reaped_children:
            ticks += int(fields[13]) + int(fields[14])
        return ticks / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak resident set) of one process, in KiB."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def pids_of_user_cmd(marker: str) -> list[int]:
    """Processes whose command line contains ``marker`` (used for the private Postgres' backends)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


# -- private Postgres -------------------------------------------------------------------

@dataclass
class PrivatePostgres:
    """A server of our own from the installed binaries, on a free port, in a temporary directory.

    As root it runs as the ``postgres`` user (initdb refuses root). Durability settings
    are Postgres' defaults (fsync=on, synchronous_commit=on): the limit it measures is
    the one production has. ``pg_stat_statements`` is preloaded to count statements.
    """
    shared_buffers: str = "1GB"
    port: int = field(default_factory=free_port)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ledger-bench-pg-")))

    def __post_init__(self):
        self.data = self.dir / "data"
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)

    def url(self, database: str = "postgres", user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = list(args)
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    @property
    def options(self) -> list[str]:
        return [f"port={self.port}", f"unix_socket_directories={self.dir}", "listen_addresses=127.0.0.1",
                "max_connections=300", f"shared_buffers={self.shared_buffers}",
                "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=top",
                "pg_stat_statements.max=5000", "track_io_timing=on", "max_wal_size=8GB",
                "checkpoint_timeout=15min", "maintenance_work_mem=512MB"]

    def start(self) -> "PrivatePostgres":
        self._run(pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        opts = " ".join(f"-c {o}" for o in self.options)
        self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.dir / "log"), "-w",
                  "-t", "60", "start")
        return self

    def stop(self) -> None:
        if self.data.exists():
            self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop",
                      check=False)
            if (self.data / "postmaster.pid").exists():
                self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def cpu_s(self) -> float:
        """CPU seconds of the whole server so far: live processes, and the backends that exited."""
        pids = self.backend_pids()
        if not pids:
            return 0.0
        return cpu_seconds(pids[0], reaped_children=True) + sum(cpu_seconds(p) for p in pids[1:])

    def backend_pids(self) -> list[int]:
        """The postmaster and every process it forked (backends, checkpointer, autovacuum...)."""
        pidfile = self.data / "postmaster.pid"
        try:
            master = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return []
        return [master, *children_of(master)]


# -- private Redis ------------------------------------------------------------------------

@dataclass
class PrivateRedis:
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, log_dir: Path) -> "PrivateRedis":
        log = open(log_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--protected-mode", "no", "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s=5)


# -- the receiver and the workers -------------------------------------------------------

def base_env(database_url: str, broker_url: str, secret: str, queue: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DATABASE_URL", "CELERY_", "LEDGER_", "DB_", "BROKER_", "STRIPE_",
                                "PROMETHEUS_MULTIPROC_DIR", "METRICS_PORT", "OUTBOX_"))}
    env.update(DATABASE_URL=database_url, CELERY_BROKER_URL=broker_url, STRIPE_WEBHOOK_SECRET=secret,
               LEDGER_QUEUE=queue, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", LOG_LEVEL="INFO")
    env.update(extra)
    return env


def http_get(port: int, path: str, timeout: float = 2) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


class Receiver:
    """``gunicorn -w N 'ingest.app:create_app()'``, the production command (README), on a free port."""

    def __init__(self, env: dict[str, str], log_dir: Path, *, workers: int = 4, threads: int = 1):
        self.env = env
        self.workers = workers
        self.threads = threads
        self.port = free_port()
        self.log_path = log_dir / f"receiver-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> "Receiver":
        cmd = [venv_tool("gunicorn"), "-b", f"127.0.0.1:{self.port}", "-w", str(self.workers),
               "--no-control-socket", "--backlog", "2048", "ingest.app:create_app()"]
        if self.threads > 1:
            cmd[-1:-1] = ["--worker-class", "gthread", "--threads", str(self.threads)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"receiver exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if http_get(self.port, "/readyz") == 200 and len(self.worker_pids()) >= self.workers:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"receiver did not become ready; see {self.log_path}")

    def worker_pids(self) -> list[int]:
        return children_of(self.proc.pid) if self.proc else []

    def pids(self) -> dict[str, list[int]]:
        return {"receiver master": [self.proc.pid], "receiver worker": self.worker_pids()}

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s=15)


class WorkerFleet:
    """N ``celery -A workers worker --concurrency 1`` instances: one per "machine" the user adds."""

    def __init__(self, env: dict[str, str], log_dir: Path, *, count: int, queue: str, label: str = "w",
                 nice: int = 0):
        self.env = env
        self.count = count
        self.nice = nice
        self.queue = queue
        self.log_dir = log_dir
        self.label = label
        self.procs: list[subprocess.Popen] = []

    def start(self, timeout_s: float = 90) -> "WorkerFleet":
        for index in range(self.count):
            node = f"{self.label}{index}-{os.getpid()}"
            cmd = [venv_tool("celery"), "-A", "workers", "worker", "--concurrency", "1", "--loglevel", "INFO",
                   "-Q", self.queue, "-n", f"{node}@%h", "--without-mingle", "--without-gossip",
                   "--without-heartbeat"]
            if self.nice:
                cmd = ["nice", "-n", str(self.nice), *cmd]
            with open(self.log_dir / f"{node}.log", "ab") as log:
                self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log,
                                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                   start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {proc.returncode}; see logs in {self.log_dir}")
            if all(children_of(p.pid) for p in self.procs):
                return self
            time.sleep(0.1)
        raise RuntimeError("workers did not start their pool processes")

    def pids(self) -> dict[str, list[int]]:
        return {"worker main": [p.pid for p in self.procs],
                "worker pool process": [c for p in self.procs for c in children_of(p.pid)]}

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            stop_group(proc, grace_s=15)


@dataclass
class ProcessWatch:
    """CPU seconds and peak RSS of named groups of processes over a phase."""
    groups: Callable[[], dict[str, list[int]]]
    _start: dict[int, float] = field(default_factory=dict)

    def begin(self) -> None:
        self._start = {pid: cpu_seconds(pid) for pids in self.groups().values() for pid in pids}

    def cpu_s(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pids in self.groups().items():
            out[name] = sum(max(0.0, cpu_seconds(pid) - self._start.get(pid, 0.0)) for pid in pids)
        return out

    def peak_rss_mb(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pids in self.groups().items():
            peaks = [memory_kb(pid).get("VmHWM", 0) for pid in pids]
            if peaks:
                out[name] = max(peaks) / 1024
        return out


def wire_segments(pids: list[int], port: int) -> dict[tuple[int, int], tuple[int, int]]:
    """Per TCP connection of these processes to ``port``: (data segments in, data segments out).

    From the kernel's own counters (``ss -ti``). Postgres sends its answers only
    when the client asks (Sync, Flush) or its buffer fills, so the data segments
    a client receives on loopback (MSS of tens of KB) count its round trips,
    pipelined or not; the segments it sends count its writes.
    """
    out = subprocess.run(["ss", "-tinpH", "dst", f"127.0.0.1:{port}"], capture_output=True, text=True).stdout
    wanted = set(pids)
    counts: dict[tuple[int, int], tuple[int, int]] = {}
    for head, info in zip(*[iter(out.splitlines())] * 2):
        pid_match = re.search(r"pid=(\d+)", head)
        local = re.search(r"127\.0\.0\.1:(\d+)\s", head)
        if not pid_match or not local or int(pid_match[1]) not in wanted:
            continue
        seg_in = re.search(r"data_segs_in:(\d+)", info)
        seg_out = re.search(r"data_segs_out:(\d+)", info)
        counts[(int(pid_match[1]), int(local[1]))] = (int(seg_in[1]) if seg_in else 0,
                                                      int(seg_out[1]) if seg_out else 0)
    return counts
