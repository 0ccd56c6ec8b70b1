"""Private PostgreSQL and Redis servers, started from the installed binaries on free ports.

For whatever must not touch the machine's shared servers: tests that stop or
break a server, the test suite on a machine where none runs, the chaos run,
the benchmarks and devstack. initdb refuses to run as root, so as root the
PostgreSQL server runs as the ``postgres`` user, in a directory it owns.
"""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping

from devkit.procs import Process, answers, children_of, cpu_seconds, free_port, wait_until

# Throwaway servers for tests: durability buys nothing there.
TEST_OPTIONS = {"fsync": "off", "max_connections": "200"}


def pg_bin(name: str) -> str:
    """A PostgreSQL program: on PATH, or in the newest /usr/lib/postgresql/*/bin (where Debian keeps them)."""
    for candidate in (shutil.which(name), *sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError(f"{name} not found (install PostgreSQL's server binaries, e.g. apt-get install postgresql)")


def with_db(url: str, database: str) -> str:
    """The same server URL naming another database."""
    head, _, tail = url.rpartition("/")
    query = tail.partition("?")[2]
    return f"{head}/{database}" + (f"?{query}" if query else "")


class PrivatePostgres:
    """A PostgreSQL server of our own.

    ``dir`` keeps the data (``dir/data``) and the log; by default a temporary
    directory that ``destroy()`` removes. ``options`` are server settings
    (``-c name=value``); unset, Postgres' defaults (fsync and synchronous_commit on).
    """

    def __init__(self, *, dir: Path | None = None, port: int | None = None,
                 options: Mapping[str, str] | None = None):
        self.port = port or free_port()
        self.dir = Path(dir) if dir else Path(tempfile.mkdtemp(prefix="ledger-pg-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data = self.dir / "data"
        self.log_path = self.dir / "postgres.log"
        self.options = dict(options or {})
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)

    @property
    def url(self) -> str:
        return self.url_for("postgres")

    def url_for(self, database: str, user: str = "postgres") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = list(args)
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def init(self) -> "PrivatePostgres":
        """initdb, unless ``dir`` already holds a cluster (devstack keeps one between runs)."""
        if not (self.data / "PG_VERSION").exists():
            self._run(pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                      "--no-sync")
        return self

    def start(self) -> "PrivatePostgres":
        settings = {"port": str(self.port), "unix_socket_directories": str(self.dir),
                    "listen_addresses": "127.0.0.1", **self.options}
        opts = " ".join(f"-c {name}={value}" for name, value in settings.items())
        self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.log_path), "-w",
                  "-t", "60", "start")
        return self

    def stop(self, mode: str = "immediate") -> None:
        """pg_ctl stop: ``immediate`` is a crash (recovery at the next start), ``fast`` a clean shutdown."""
        if self.data.exists():
            self._run(pg_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop", check=False)

    def wait_ready(self, timeout_s: float = 30) -> None:
        wait_until(lambda: answers(self.port), timeout_s=timeout_s, interval_s=0.1,
                   what="the private PostgreSQL to accept connections")

    def destroy(self) -> None:
        """Stop the server and remove its directory."""
        self.stop("fast")
        if (self.data / "postmaster.pid").exists():
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def backend_pids(self) -> list[int]:
        """The postmaster and every process it forked (backends, checkpointer, autovacuum...)."""
        master = self.postmaster_pid()
        return [] if master is None else [master, *children_of(master)]

    def cpu_s(self) -> float:
        """CPU seconds of the whole server so far: live processes, and the backends that exited."""
        pids = self.backend_pids()
        if not pids:
            return 0.0
        return cpu_seconds(pids[0], reaped_children=True) + sum(cpu_seconds(p) for p in pids[1:])


class PrivateRedis(Process):
    """``redis-server`` on a free port, nothing persisted (like the machine's own)."""

    def __init__(self, log_path: Path, *, port: int | None = None, databases: int = 16):
        self.port = port or free_port()
        server = shutil.which("redis-server") or "/usr/bin/redis-server"
        super().__init__("redis", [server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
                                   "--databases", str(databases), "--dir", str(Path(log_path).parent)],
                         os.environ, log_path)

    def url_for(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def url(self) -> str:
        return self.url_for(0)

    def start(self, timeout_s: float = 30) -> "PrivateRedis":
        super().start()

        def pong() -> bool:
            self.ensure_alive()
            return answers(self.port)
        wait_until(pong, timeout_s=timeout_s, what="the private redis-server to answer")
        return self

    def flush(self) -> None:
        import redis

        with redis.Redis(port=self.port, socket_connect_timeout=2, socket_timeout=5) as client:
            client.flushall()


class MotoS3(Process):
    """An S3-compatible server of its own (moto's server mode, ``moto_server``) on a free port: the archive's
    bucket for tests and benchmarks, spoken to over HTTP by boto3 like any S3 endpoint. ``client_env`` is what a
    process needs to use it (AWS_ENDPOINT_URL and test credentials)."""

    def __init__(self, log_path: Path, *, port: int | None = None):
        self.port = port or free_port()
        server = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
        super().__init__("moto-s3", [server, "-H", "127.0.0.1", "-p", str(self.port)], os.environ, log_path)

    @property
    def client_env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "test",
                "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self, timeout_s: float = 30) -> "MotoS3":
        super().start()

        def listening() -> bool:
            self.ensure_alive()
            return answers(self.port)
        wait_until(listening, timeout_s=timeout_s, what="the S3 server (moto) to listen")
        return self

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.client_env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                     aws_secret_access_key="test", region_name="us-east-1").create_bucket(Bucket=name)


class RabbitVhost:
    """A vhost of its own on a running RabbitMQ (the machine's, 127.0.0.1:5672, guest/guest by
    default): queues and messages of a run never meet another's, and dropping the vhost drops
    them all. Made and dropped with ``rabbitmqctl``, which must be on PATH (Debian's rabbitmq-server)."""

    def __init__(self, name: str | None = None, *, host: str = "127.0.0.1", port: int = 5672,
                 user: str = "guest", password: str = "guest"):
        self.name = name or f"ledger-{os.getpid()}-{secrets.token_hex(4)}"
        self.host, self.port, self.user, self.password = host, port, user, password

    @property
    def url(self) -> str:
        return f"amqp://{self.user}:{self.password}@{self.host}:{self.port}/{self.name}"

    @staticmethod
    def available() -> bool:
        """Whether a RabbitMQ answers here and rabbitmqctl can manage it."""
        if shutil.which("rabbitmqctl") is None or not answers(5672):
            return False
        return subprocess.run(["rabbitmqctl", "-q", "list_vhosts"], capture_output=True, timeout=60).returncode == 0

    def ctl(self, *args: str, check: bool = True) -> str:
        """``rabbitmqctl ARGS``: its output; a failure raises with what it said (unless ``check`` is False)."""
        done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
        if check and done.returncode:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: exit {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()[-500:]}")
        return done.stdout

    def purge(self, queues) -> None:
        """The messages waiting in ``queues`` dropped, over AMQP (rabbitmqctl is slow on a busy machine);
        connections, consumers and the messages they hold unacked stay. A queue not declared yet is
        skipped (the broker closes that channel: each queue gets one of its own)."""
        purge_amqp_queues(self.url, queues)

    def create(self) -> "RabbitVhost":
        self.ctl("delete_vhost", self.name, check=False)
        self.ctl("add_vhost", self.name)
        self.ctl("set_permissions", "-p", self.name, self.user, ".*", ".*", ".*")
        return self

    def drop(self) -> None:
        self.ctl("delete_vhost", self.name, check=False)

    def __enter__(self) -> "RabbitVhost":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.drop()


def purge_amqp_queues(url: str, queues) -> None:
    """``RabbitVhost.purge`` for a broker known by its URL."""
    from kombu import Connection

    with Connection(url, connect_timeout=10) as conn:
        for queue in queues:
            channel = conn.channel()
            try:
                channel.queue_purge(queue)
            except conn.channel_errors:
                continue  # not declared yet: the broker closed the channel
            channel.close()


class PrivateRabbit:
    """A RabbitMQ node of our own (``rabbitmq-server`` from the installed package, as the rabbitmq user),
    on free ports, its data in a temporary directory: a test may kill it, restart it, or raise a memory
    alarm on it without touching the machine's node. guest may connect from anywhere (its loopback
    limit is off): tests reach it from network namespaces too."""

    def __init__(self):
        self.name = f"ledger-{secrets.token_hex(3)}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ledger-rabbit-"))
        (self.dir / "plugins").write_text("[].\n")
        (self.dir / "rabbitmq.conf").write_text("loopback_users = none\n")
        entry = pwd.getpwnam("rabbitmq") if os.geteuid() == 0 else None
        if entry is not None:
            for path in (self.dir, self.dir / "plugins", self.dir / "rabbitmq.conf"):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.env = {**os.environ, "RABBITMQ_NODENAME": self.name, "RABBITMQ_NODE_PORT": str(self.port),
                    "RABBITMQ_DIST_PORT": str(self.dist_port), "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
                    "RABBITMQ_LOG_BASE": str(self.dir / "log"), "RABBITMQ_PID_FILE": str(self.dir / "pid"),
                    "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "plugins"),
                    "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq")}
        self._process: subprocess.Popen | None = None

    @staticmethod
    def available() -> str | None:
        """None when a node can be started here; else why not."""
        if shutil.which("rabbitmq-server") is None or shutil.which("rabbitmqctl") is None:
            return "rabbitmq-server is not installed (Debian: apt-get install rabbitmq-server)"
        return None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def ctl(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(["rabbitmqctl", "-q", "-n", self.name, *args], capture_output=True, text=True,
                              timeout=120, env=self.env)
        if check and done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {(done.stderr or done.stdout).strip()[:300]}")
        return done.stdout

    def start(self, timeout_s: float = 90) -> "PrivateRabbit":
        with open(self.dir / "server.log", "ab") as out:
            self._process = subprocess.Popen(["rabbitmq-server"], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        wait_until(lambda: answers(self.port), timeout_s=timeout_s, interval_s=0.2,
                   what="the private RabbitMQ node to listen")
        self.ctl("await_startup")
        return self

    def kill(self) -> None:
        """SIGKILL the node's whole process group: a crash."""
        # The Erlang VM runs as the rabbitmq user, outside the wrapper's group: its pid file names it.
        try:
            os.kill(int((self.dir / "pid").read_text().split()[0]), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
        if self._process is not None and self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except OSError:
                pass
            self._process.wait(timeout=30)
        wait_until(lambda: not answers(self.port), timeout_s=30, what="the private RabbitMQ node to be gone")

    def block_publishers(self) -> None:
        """A memory alarm: RabbitMQ blocks every connection that publishes."""
        self.ctl("set_vm_memory_high_watermark", "0.0000001")

    def unblock_publishers(self) -> None:
        self.ctl("set_vm_memory_high_watermark", "0.4")

    def destroy(self) -> None:
        """Stop the node, whatever became of the wrapper that started it (a test that failed half-way
        may have killed it and left the VM running), and remove its directory."""
        if self._process is not None:
            self.ctl("stop", check=False)
            if answers(self.port):
                self.kill()
            if self._process.poll() is None:
                try:
                    self._process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
