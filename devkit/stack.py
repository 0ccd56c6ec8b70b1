"""The product's own processes, started as docs/configuration.md runs them: receiver, workers, sweep.

Each is a ``devkit.procs.Process`` (a process group of its own, a log file).
The environment they get comes from ``stack_env``: the variables the pipeline
reads are set by the caller alone, never inherited from the shell that runs
the tests or the benchmark.
"""
from __future__ import annotations

import http.client
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from devkit.procs import REPO, VENV_BIN, Process, free_port, venv_tool, wait_until

# Prefixes of the variables the pipeline reads (ledger.config.Settings); a child gets only the caller's.
OWNED_VARIABLES = ("DATABASE_URL", "CELERY_", "LEDGER_", "DB_", "BROKER_", "STRIPE_", "OUTBOX_", "LOG_LEVEL",
                   "PROMETHEUS_MULTIPROC_DIR", "METRICS_PORT", "INGEST_", "CHAOS_")


def stack_env(database_url: str, broker_url: str, variables: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of one of the stack's processes: ours, plus the machine's unrelated variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(OWNED_VARIABLES)}
    env.update({"DATABASE_URL": database_url, "CELERY_BROKER_URL": broker_url, "PYTHONPATH": str(REPO),
                "PYTHONUNBUFFERED": "1", "LOG_LEVEL": "INFO"})
    env.update(variables or {})
    return env


@dataclass
class HttpAnswer:
    status_code: int
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def http_request(port: int, method: str, path: str, body: bytes | None = None,
                 headers: Mapping[str, str] | None = None, timeout: float = 30) -> HttpAnswer:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers or {}))
        response = conn.getresponse()
        return HttpAnswer(response.status, response.read())
    finally:
        conn.close()


# The WSGI servers the receiver can run under: the first is the documented command (docs/configuration.md), the second its
# alternative (SUPPORTED_RECEIVER_SERVERS: the e2e tests run both). granian is here to be measured
# (ops/bench --receiver granian) and its framing tested, not run: docs/configuration.md, "Running it", says why.
RECEIVER_SERVERS = ("gunicorn-gthread", "gunicorn-sync", "granian")
SUPPORTED_RECEIVER_SERVERS = RECEIVER_SERVERS[:2]
DEFAULT_RECEIVER_SERVER = RECEIVER_SERVERS[0]
# Threads per worker process when the caller names none: gthread's, and granian's blocking
# threads (the ones that run the WSGI app), each as many as a worker's DB_POOL_MAX_SIZE (16).
DEFAULT_THREADS = {"gunicorn-sync": 1, "gunicorn-gthread": 16, "granian": 16}


def receiver_command(server: str, *, host: str, port: int, workers: int, threads: int | None = None,
                     extra_args: tuple[str, ...] = ()) -> list[str]:
    """The receiver's command line under ``server`` (one of RECEIVER_SERVERS), as docs/configuration.md runs it."""
    if server not in RECEIVER_SERVERS:
        raise ValueError(f"unknown receiver server {server!r}: choose one of {', '.join(RECEIVER_SERVERS)}")
    if server == "gunicorn-sync" and (threads or 1) > 1:
        raise ValueError("sync workers have one thread: threads > 1 is gunicorn-gthread")
    threads = threads or DEFAULT_THREADS[server]
    if server == "granian":
        # Backpressure = threads: a worker takes no more requests than it has threads to run them
        # (granian's default is 1024/workers, with half as many threads, far more than the pool has
        # connections); the rest wait in the listen backlog.
        return [venv_tool("granian"), "--interface", "wsgi", "--factory", "--host", host, "--port", str(port),
                "--workers", str(workers), "--blocking-threads", str(threads), "--backpressure", str(threads),
                "--respawn-failed-workers", *extra_args, "ingest.app:create_app"]
    # No control socket: the default one is a fixed path in $HOME shared by every gunicorn.
    cmd = [venv_tool("gunicorn"), "-b", f"{host}:{port}", "-w", str(workers), "--no-control-socket"]
    if server == "gunicorn-gthread":
        cmd += ["--worker-class", "gthread", "--threads", str(threads)]
    return [*cmd, *extra_args, "ingest.app:create_app()"]


class Receiver(Process):
    """The receiver (``ingest.app:create_app()``) under ``server`` (RECEIVER_SERVERS), on a free port.

    ``threads``: gthread's threads per worker, or granian's blocking threads per worker
    (DEFAULT_THREADS when None; sync workers have one); ``threads`` > 1 without a ``server`` is
    gunicorn-gthread. ``extra_args`` are the server's own options. Ready when ``ready_path``
    answers 200 and every worker process is up.
    """

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, server: str | None = None,
                 workers: int = 2, threads: int | None = None, port: int | None = None, host: str = "127.0.0.1",
                 ready_path: str = "/healthz", extra_args: tuple[str, ...] = ()):
        if server is None:
            server = "gunicorn-gthread" if (threads or 2) > 1 else "gunicorn-sync"
        self.port = port or free_port()
        self.server = server
        self.workers = workers
        self.threads = threads or DEFAULT_THREADS.get(server, 1)
        self.ready_path = ready_path
        cmd = receiver_command(server, host=host, port=self.port, workers=workers, threads=threads,
                               extra_args=extra_args)
        super().__init__("receiver", cmd, env, Path(log_dir) / f"receiver-{self.port}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> "Receiver":
        super().start()

        def ready() -> bool:
            self.ensure_alive()
            try:
                answered = http_request(self.port, "GET", self.ready_path, timeout=2).status_code == 200
            except OSError:
                return False
            return answered and len(self.children()) >= self.workers
        try:
            wait_until(ready, timeout_s=timeout_s, what=f"the receiver to answer {self.ready_path}")
        except AssertionError:
            self.kill()
            raise RuntimeError(f"receiver did not answer {self.ready_path}:\n{self.log(4000)}") from None
        return self

    def post(self, body: bytes, headers: Mapping[str, str], path: str = "/webhooks/stripe") -> HttpAnswer:
        return http_request(self.port, "POST", path, body, {"Content-Type": "application/json", **headers})

    def pids(self) -> dict[str, list[int]]:
        return {"receiver master": [self.pid] if self.pid else [], "receiver worker": self.children()}


class Worker(Process):
    """``celery -A workers worker`` consuming ``queues``, with a prefork pool of ``concurrency``."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, queues: tuple[str, ...], concurrency: int = 1,
                 node: str, nice: int = 0):
        self.node = node
        cmd = [venv_tool("celery"), "-A", "workers", "worker", "--pool=prefork", "-c", str(concurrency),
               "--loglevel=INFO", "-Q", ",".join(queues), "-n", f"{node}@%h",
               "--without-mingle", "--without-gossip", "--without-heartbeat"]
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        super().__init__(node, cmd, env, Path(log_dir) / f"{node}.log")

    def ready(self) -> bool:
        """Consuming: Celery logs `` ready.`` once its pool is up (raises if the worker exited)."""
        self.ensure_alive()
        return " ready." in self.log()

    def wait_ready(self, timeout_s: float = 60.0) -> "Worker":
        wait_until(self.ready, timeout_s=timeout_s, interval_s=0.1, what=f"worker {self.node} to be ready")
        return self

    def pids(self) -> dict[str, list[int]]:
        return {"worker main": [self.pid] if self.pid else [], "worker pool process": self.children()}


class ReadmeWorker(Worker):
    """``celery -A workers worker --concurrency N`` as docs/configuration.md runs it: every queue, Celery's own
    log level (WARNING, so no line per task), mingle, gossip and heartbeats on. Only a node
    name is added (two workers on one host need distinct ones).

    It logs nothing once it consumes (``ready()`` cannot see it): whoever starts it waits for
    its pool processes, then for a task it ran.
    """

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, concurrency: int, node: str):
        Process.__init__(self, node, [venv_tool("celery"), "-A", "workers", "worker", "--concurrency",
                                      str(concurrency), "-n", f"{node}@%h"], env, Path(log_dir) / f"{node}.log")
        self.node = node


class Sweep(Process):
    """``ledgerctl sweep --loop``: the recovery sweep, as an operator runs it."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, name: str = "sweep"):
        super().__init__(name, [venv_tool("ledgerctl"), "sweep", "--loop"], env, Path(log_dir) / f"{name}.log")


class Console(Process):
    """``ledgerctl console``: the operator console under gunicorn, on a free port; ready when /login answers."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, port: int | None = None):
        self.port = port or free_port()
        super().__init__("console", [venv_tool("ledgerctl"), "console", "--port", str(self.port)], env,
                         Path(log_dir) / f"console-{self.port}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> "Console":
        super().start()

        def ready() -> bool:
            self.ensure_alive()
            try:
                return http_request(self.port, "GET", "/login", timeout=2).status_code == 200
            except OSError:
                return False
        try:
            wait_until(ready, timeout_s=timeout_s, what="the console to answer /login")
        except AssertionError:
            self.kill()
            raise RuntimeError(f"console did not answer /login:\n{self.log(4000)}") from None
        return self


# The product's console scripts the classes above start (through venv_tool).
PRODUCT_TOOLS = ("gunicorn", "granian", "celery", "ledgerctl")


@dataclass(frozen=True)
class Checkout:
    """A copy of the product to run: its source tree and the virtualenv whose console scripts run it.

    The default is this checkout, run by the running interpreter's environment (what
    every class above starts). Another one (an older revision in a git worktree, with a
    virtualenv of its own) runs the same way: ``env`` puts its tree on PYTHONPATH, and
    ``adopt`` points a Receiver, Worker or Sweep built above at its console scripts and
    its tree as the working directory, so that nothing of this checkout's code runs in it.
    """
    root: Path = REPO
    bin_dir: Path = VENV_BIN

    def tool(self, name: str) -> str:
        """``name`` (gunicorn, granian, celery, ledgerctl) from this checkout's virtualenv."""
        if self.bin_dir == VENV_BIN:
            return venv_tool(name)
        path = self.bin_dir / name
        if not path.exists():
            raise RuntimeError(f"{name} not found in {self.bin_dir}")
        return str(path)

    def env(self, database_url: str, broker_url: str, variables: Mapping[str, str] | None = None) -> dict[str, str]:
        """``stack_env`` with this checkout's tree as PYTHONPATH."""
        return stack_env(database_url, broker_url, {"PYTHONPATH": str(self.root), **(variables or {})})

    def adopt(self, process: Process) -> Process:
        """``process`` (not started) running this checkout's console scripts, in its tree."""
        process.cmd = [self.tool(Path(arg).name) if os.path.isabs(arg) and Path(arg).name in PRODUCT_TOOLS else arg
                       for arg in process.cmd]
        process.cwd = self.root
        return process
