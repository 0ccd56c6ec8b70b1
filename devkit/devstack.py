"""ops/devstack: run the whole pipeline locally, without Docker.

  ops/devstack             start everything, stay in the foreground; Ctrl-C stops it all
  ops/devstack up -d       start everything in the background and return
  ops/devstack stop        stop what a previous `up` started (private Postgres/Redis too)
  ops/devstack status      show which processes are running
  ops/devstack logs        follow every log (tail -F)

Without an active virtualenv it uses <repo>/.venv, creating it and running
`pip install -e '<repo>[test,ops]'` when it is missing, or lacks ledgerctl or Flower.
With one active, binaries come from $VIRTUAL_ENV/bin or else from PATH.

PostgreSQL and Redis: the servers at DATABASE_URL and CELERY_BROKER_URL when they
answer (the database is created if missing). When one does not answer, a private
server is started from the installed binaries (initdb/pg_ctl, redis-server) on a
free port under $DEVSTACK_DIR, and stopped with the rest. A private Postgres keeps
its data in $DEVSTACK_DIR/postgres between runs (in a temporary directory, removed
at stop, when the `postgres` user that root must run it as cannot reach that one).

Then it runs `ledgerctl migrate` and starts the receiver (gunicorn on
127.0.0.1:8000), $WORKERS Celery workers, the recovery sweep (`ledgerctl sweep
--loop`), the operator console (`ledgerctl console`, 127.0.0.1:8100) and Flower
(when installed), each in its own process group, logging to
$DEVSTACK_DIR/logs/. It writes the effective settings to $DEVSTACK_DIR/env
(`. .devstack/env` in another shell, then `ledgerctl ...` talks to this stack),
and prints a `ledgerctl send-test-event` command and a signed curl that deliver
a real event.

Settings (environment):
  DATABASE_URL        postgresql://postgres@127.0.0.1:5432/ledger
  CELERY_BROKER_URL   redis://127.0.0.1:6379/0 (--broker amqp: amqp://guest:guest@127.0.0.1:5672//)
  STRIPE_WEBHOOK_SECRET  a dev-only whsec_ value (printed) when unset
  WORKERS             2       Celery worker processes (each with WORKER_CONCURRENCY children)
  WORKER_CONCURRENCY  2
  GUNICORN_WORKERS    2
  GUNICORN_THREADS    16      gthread threads per receiver process
  RECEIVER_PORT       8000
  FLOWER_PORT         5555
  CONSOLE_PORT        8100    the operator console (ledgerctl console); LEDGER_CONSOLE_USERS unset: a
                              dev-only operator devstack:devstack (printed), a fresh secret key per run
  FLOWER_BASIC_AUTH   devstack:devstack (printed) when unset
  DEVSTACK_DIR        <repo>/.devstack   pids, logs, env, private servers, prometheus multiprocess dir
  DEVSTACK_STOP_TIMEOUT 20   seconds a process gets to exit on SIGTERM before SIGKILL
and every other variable of ledger/config.py (LOG_LEVEL, LEDGER_*, ...) passes through.

How: ``ops/devstack`` (bash) finds or creates the virtualenv and runs ``python -m
devkit.devstack``. Each process is a ``devkit.procs.Process`` (a process group of its
own, a log file); the private servers are ``devkit.servers``'. Every process also gets
a pid file (its group's id), so that ``stop``, ``status`` and a later ``up`` (run by
another ``ops/devstack``) find what an ``up -d`` left running. This module imports
nothing outside the standard library and devkit at load time: ``stop``, ``status`` and
``logs`` run on any python3.
"""
from __future__ import annotations

import contextlib
import http.client
import io
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devkit.procs import REPO, Process, answers, free_port, group_alive, leads_group, signal_group
from devkit.servers import PrivatePostgres, PrivateRedis, pg_bin, with_db
from devkit.stack import http_request

DEV_WEBHOOK_SECRET = "whsec_devstack_local_only_0123456789"
# --broker: the broker the stack runs on when CELERY_BROKER_URL is unset.
BROKER_URLS = {"redis": "redis://127.0.0.1:6379/0", "amqp": "amqp://guest:guest@127.0.0.1:5672//"}


def broker_scheme_prefixes(broker: str) -> tuple[str, ...]:
    return ("redis://", "rediss://") if broker == "redis" else ("amqp://", "amqps://", "pyamqp://")
DEV_FLOWER_AUTH = "devstack:devstack"
DEV_CONSOLE_LOGIN = ("devstack", "devstack")
FIXTURE = f"{REPO}/../shared/stripe-fixtures/customer.created__rubymock_1.json"
DEFAULT_WEBHOOK_URL = "http://127.0.0.1:8000/webhooks/stripe"
# Started before everything else and stopped after it (they are what the rest uses).
SERVICES = ("postgres", "redis")
# Stopped first, in this order: no new traffic, then the consumers.
FRONT = ("receiver", "console", "flower", "sweep")
# The effective settings $DEVSTACK_DIR/env carries for another shell.
ENV_FILE_VARIABLES = re.compile(
    r"(DATABASE_URL|CELERY_BROKER_URL|FLOWER_BASIC_AUTH|LOG_LEVEL|(LEDGER|STRIPE|DB|BROKER|INGEST)_[A-Z0-9_]+)")


def say(message: str) -> None:
    print(f"[devstack] {message}", flush=True)


def warn(message: str) -> None:
    print(f"[devstack] WARNING: {message}", file=sys.stderr, flush=True)


def die(message: str) -> None:
    print(f"[devstack] error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def usage(out=sys.stdout) -> None:
    print(__doc__.split("\nSettings (environment):")[0].rstrip("\n"), file=out)


def rel(path: str) -> str:
    """A path as the user would type it from here."""
    cwd = os.getcwd()
    return path[len(cwd) + 1:] if path.startswith(cwd + "/") else path


def tool(name: str) -> str | None:
    """The active virtualenv's program if it has it, else PATH's."""
    venv = os.environ.get("VIRTUAL_ENV")
    if venv and os.access(f"{venv}/bin/{name}", os.X_OK):
        return f"{venv}/bin/{name}"
    return shutil.which(name)


def env_default(name: str, default: str) -> str:
    """``${NAME:-default}``: unset and empty both take the default."""
    return os.environ.get(name) or default


def read_text(path: str) -> str | None:
    """A file's text without its trailing newlines (``$(<file)``), None if missing or empty."""
    try:
        text = Path(path).read_text().rstrip("\n")
    except OSError:
        return None
    return text or None


def http_ok(port: int, path: str) -> bool:
    try:
        return http_request(port, "GET", path, timeout=2).status_code == 200
    except (OSError, http.client.HTTPException):
        return False


def port_in_use(port: str) -> bool:
    try:
        return answers(int(port))
    except ValueError:
        return False


def redis_state(url: str) -> tuple[int, str]:
    """0: Redis answers PING at url; 2: nothing answers; 1: it answers but refuses (the message)."""
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2).ping()
    except redis.AuthenticationError as exc:  # a ConnectionError, but the server did answer
        return 1, str(exc)
    except (redis.ConnectionError, redis.TimeoutError):
        return 2, ""
    except (redis.RedisError, ValueError) as exc:
        return 1, str(exc)
    return 0, ""


class _Signalled(BaseException):
    """Ctrl-C, SIGTERM (``ops/devstack stop``) or SIGHUP during ``up``: stop everything, exit 128+signal."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_signal(signum, _frame):
    for sig in HANDLED_SIGNALS:  # a second one ends this process at once
        signal.signal(sig, signal.SIG_DFL)
    raise _Signalled(128 + signum)


class Devstack:
    """One run directory ($DEVSTACK_DIR): pid files, logs, the env file, a private Postgres' cluster."""

    def __init__(self):
        run_dir = os.environ.get("DEVSTACK_DIR") or f"{REPO}/.devstack"
        self.run_dir = run_dir if run_dir.startswith("/") else f"{os.getcwd()}/{run_dir}"
        self.pid_dir = f"{self.run_dir}/pids"
        self.log_dir = f"{self.run_dir}/logs"
        self.env_file = f"{self.run_dir}/env"
        # Where a private Postgres keeps its cluster (a path in a file: it may be a temporary directory).
        self.pg_dir_file = f"{self.run_dir}/postgres.dir"
        # The foreground `ops/devstack` (if any): `stop` asks it to stop everything, so it exits cleanly.
        self.supervisor_pidfile = f"{self.run_dir}/devstack.pid"
        self.stop_timeout = int(os.environ.get("DEVSTACK_STOP_TIMEOUT") or 20)
        self.started: dict[str, Process | None] = {}  # this run's, in start order (None: the adopted postmaster)
        self.supervisor_stopped = False
        self.armed = False

    # -- pid files ---------------------------------------------------------------------------
    def pidfile_of(self, name: str) -> str:
        return f"{self.pid_dir}/{name}.pid"

    def read_pid(self, name: str) -> int | None:
        text = read_text(self.pidfile_of(name))
        return int(text) if text and text.isdigit() else None

    def forget(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.pidfile_of(name))

    def names(self) -> list[str]:
        return sorted(p.stem for p in Path(self.pid_dir).glob("*.pid"))

    def running_names(self) -> list[str]:
        return [n for n in self.names() if (pid := self.read_pid(n)) and group_alive(pid)]

    def launch(self, proc: Process) -> Process:
        """Start ``proc`` (its log gets a header line first) and write its pid file."""
        self.forget(proc.name)
        Path(proc.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(proc.log_path, "a") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} start: {' '.join(proc.cmd)}\n")
        try:
            proc.start()
        except OSError as exc:
            die(f"{proc.name} did not start (see {proc.log_path}): {exc}")
        finally:
            if proc.pid:
                Path(self.pidfile_of(proc.name)).write_text(f"{proc.pid}\n")
                self.started[proc.name] = proc
        return proc

    def command(self, name: str, cmd: list[str]) -> Process:
        return self.launch(Process(name, cmd, os.environ, Path(f"{self.log_dir}/{name}.log")))

    def is_up(self, name: str) -> bool:
        """The process still runs (our child: polled, so that it is reaped when it is not)."""
        proc = self.started.get(name)
        if proc is not None:
            return proc.alive
        pid = self.read_pid(name)
        return pid is not None and leads_group(pid)

    def report_exited(self, name: str) -> None:
        log = f"{self.log_dir}/{name}.log"
        warn(f"{name} exited; last lines of {log}:")
        try:
            lines = Path(log).read_text(errors="replace").splitlines()[-15:]
        except OSError:
            lines = []
        for line in lines:
            print(f"    | {line}", file=sys.stderr)
        sys.stderr.flush()

    # -- stopping ------------------------------------------------------------------------------
    def adopt_postgres(self) -> None:
        """The postmaster pg_ctl started leads a session of its own: its pid file becomes ours.

        Also before stopping, so that a server whose start was interrupted (Ctrl-C during
        pg_ctl) is stopped too.
        """
        pg_dir = read_text(self.pg_dir_file)
        first = (read_text(f"{pg_dir}/data/postmaster.pid") or "").split("\n")[0] if pg_dir else ""
        if first.isdigit() and leads_group(int(first)):
            os.makedirs(self.pid_dir, exist_ok=True)
            Path(self.pidfile_of("postgres")).write_text(f"{first}\n")

    def stop_one(self, name: str) -> None:
        """After stop_wave signalled the leader (a graceful shutdown), wait; halfway through the
        stop timeout whatever is left of its group gets SIGTERM, at the end SIGKILL."""
        pid = self.read_pid(name)
        if pid is None:
            self.forget(name)
            return
        waited, half = 0, self.stop_timeout * 5
        while group_alive(pid) and waited < self.stop_timeout * 10:
            if waited == half:  # the leader is gone or stuck: ask the rest of the group too
                signal_group(pid, signal.SIGTERM)
            time.sleep(0.1)
            waited += 1
            self.reap()
        if group_alive(pid):
            warn(f"{name} (pid {pid}) did not exit within {self.stop_timeout}s; "
                 f"sending SIGKILL to its process group")
            signal_group(pid, signal.SIGKILL)
            time.sleep(0.2)
        self.forget(name)
        say(f"stopped {name} (pid {pid})")

    def stop_wave(self, names: list[str]) -> bool:
        """Signal every live one at once (workers need the most time), then wait for each.
        False when none was running."""
        live = []
        for name in names:
            pid = self.read_pid(name)
            if pid and group_alive(pid):
                live.append(name)
            else:
                self.forget(name)
        if not live:
            return False
        for name in live:
            # SIGINT is Postgres' fast shutdown (SIGTERM would wait for every client to leave).
            pid = self.read_pid(name)
            if pid and leads_group(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGINT if name == "postgres" else signal.SIGTERM)
        for name in live:
            self.stop_one(name)
        return True

    def reap(self) -> None:
        for proc in self.started.values():
            if proc is not None and proc.proc is not None:
                proc.proc.poll()

    def stop_all(self) -> None:
        """Stop in dependency order: no new traffic first, then the consumers, then the private servers."""
        if not os.path.isdir(self.run_dir):
            say(f"nothing to stop (no {self.run_dir})")
            return
        self.adopt_postgres()
        apps = [n for n in FRONT if os.path.exists(self.pidfile_of(n))]
        apps += [n for n in self.names() if n not in FRONT and n not in SERVICES]
        services = [n for n in SERVICES if os.path.exists(self.pidfile_of(n))]
        stopped = bool(apps) and self.stop_wave(apps)
        stopped = (bool(services) and self.stop_wave(services)) or stopped
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.env_file)
        # A private Postgres in a temporary directory (see start_private_postgres) goes with its server.
        pg_dir = read_text(self.pg_dir_file)
        temporary = pg_dir and os.path.basename(pg_dir).startswith("devstack-postgres.")
        if temporary and pg_dir != f"{self.run_dir}/postgres":
            shutil.rmtree(pg_dir, ignore_errors=True)
            os.remove(self.pg_dir_file)
        if not (stopped or self.supervisor_stopped):
            say("nothing running")

    def stop_supervisor(self) -> None:
        text = read_text(self.supervisor_pidfile)
        if text and text.isdigit() and int(text) != os.getpid() and "devstack" in _cmdline(int(text)):
            pid = int(text)
            say(f"asking the foreground ops/devstack (pid {pid}) to stop everything")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
            for _ in range((self.stop_timeout * 2 + 10) * 10):
                if not _exists(pid):
                    break
                time.sleep(0.1)
            self.supervisor_stopped = True
            if not _exists(pid):
                say("stopped (see its terminal for details)")
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.supervisor_pidfile)

    def status(self) -> None:
        names = self.names()
        for name in names:
            pid = self.read_pid(name)
            log = f"{self.log_dir}/{name}.log"
            if pid and group_alive(pid):
                print(f"  {name:<10} running  pid {pid!s:<7} log {log}")
            else:
                print(f"  {name:<10} exited            log {log}")
        if not names:
            say(f"nothing started (no pid files in {self.pid_dir})")

    def logs(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        files = sorted(str(p) for p in Path(self.log_dir).glob("*.log")) or [f"{self.log_dir}/*.log"]
        os.execvp("tail", ["tail", "-n", "20", "-F", *files])

    # -- the servers ---------------------------------------------------------------------------
    def postgres_answers(self) -> bool:
        """A server answers at DATABASE_URL, or is starting up (ensure_database waits for it)."""
        try:
            pg_isready = pg_bin("pg_isready")
        except RuntimeError:
            die("pg_isready not found (install the PostgreSQL client, e.g. apt-get install postgresql-client)")
        rc = subprocess.run([pg_isready, "-q", "-t", "3", "-d", os.environ["DATABASE_URL"]]).returncode
        if rc in (0, 1):  # accepting, or rejecting while it starts up
            return True
        if rc == 2:
            return False
        die(f"pg_isready cannot use DATABASE_URL={os.environ['DATABASE_URL']}")

    def postgres_dir(self) -> str:
        """Where the private cluster lives: $DEVSTACK_DIR/postgres, or (as root, when the postgres
        user cannot reach that, e.g. under /root or pytest's tmp) a temporary directory of its own."""
        pg_dir = f"{self.run_dir}/postgres"
        os.makedirs(pg_dir, exist_ok=True)
        if os.geteuid() != 0:
            return pg_dir
        try:
            entry = pwd.getpwnam("postgres")
        except KeyError:
            die("as root, the private PostgreSQL must run as the 'postgres' user, and there is none "
                "(useradd --system postgres)")
        os.chown(pg_dir, entry.pw_uid, entry.pw_gid)
        reachable = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-w", pg_dir, "-a", "-x", pg_dir])
        if reachable.returncode == 0:
            return pg_dir
        previous = read_text(self.pg_dir_file)
        if previous and "/devstack-postgres." in previous and os.path.isdir(previous):
            return previous
        pg_dir = tempfile.mkdtemp(prefix="devstack-postgres.", dir=os.environ.get("TMPDIR") or "/tmp")
        os.chown(pg_dir, entry.pw_uid, entry.pw_gid)
        return pg_dir

    def start_private_postgres(self) -> str:
        try:
            pg_bin("initdb")
            pg_bin("pg_ctl")
        except RuntimeError:
            die("no PostgreSQL answers at DATABASE_URL and initdb/pg_ctl are not installed (e.g. apt-get install "
                "postgresql), or set DATABASE_URL to a running server")
        pg_dir = self.postgres_dir()
        Path(self.pg_dir_file).write_text(f"{pg_dir}\n")
        server = PrivatePostgres(dir=Path(pg_dir), port=free_port())
        server.log_path.touch()
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(server.log_path, entry.pw_uid, entry.pw_gid)
        link = Path(f"{self.log_dir}/postgres.log")
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(server.log_path)
        if not (server.data / "PG_VERSION").is_file() or not (server.data / "PG_VERSION").stat().st_size:
            say(f"initdb {rel(pg_dir)}/data")
            self._postgres_step(server.init, "initdb failed")
        self._postgres_step(server.start, "the private PostgreSQL did not start")
        self.adopt_postgres()
        if self.read_pid("postgres") is None:
            die("the private PostgreSQL started, but its postmaster.pid is not readable")
        self.started["postgres"] = None
        database = os.environ["DATABASE_URL"].split("?", 1)[0].rsplit("/", 1)[1]
        os.environ["DATABASE_URL"] = server.url_for(database)
        return f"private PostgreSQL {os.environ['DATABASE_URL']} (data in {rel(pg_dir)}/data)"

    def _postgres_step(self, step, failure: str) -> None:
        """initdb or pg_ctl start; on failure their output goes to the server's log, shown with the error."""
        try:
            step()
        except subprocess.SubprocessError as exc:
            with open(f"{self.log_dir}/postgres.log", "a") as log:
                log.write(f"{getattr(exc, 'stdout', '') or ''}{getattr(exc, 'stderr', '') or ''}")
            self.report_exited("postgres")
            die(failure)

    def ensure_database(self) -> None:
        import psycopg

        from devkit.sql import SQL, compose

        url = os.environ["DATABASE_URL"]
        server, database = url.split("?", 1)[0].rsplit("/", 1)
        if not re.fullmatch(r"[A-Za-z0-9_]+", database):
            die(f"cannot create database '{database}' from DATABASE_URL: use letters, digits and _ only, "
                f"or create it yourself")
        admin_url = with_db(url, "postgres")

        def connect() -> psycopg.Connection:
            return psycopg.connect(admin_url, autocommit=True)
        for attempt in range(30):
            try:
                connect().close()
                break
            except psycopg.Error:
                if attempt == 0:
                    say(f"waiting for PostgreSQL at {server} ...")
                time.sleep(1)
        try:
            conn = connect()
        except psycopg.Error as exc:
            print(exc, file=sys.stderr)
            die(f"cannot connect to PostgreSQL ({server}/postgres)")
        with conn:
            if conn.execute(SQL.database_exists, {"database": database}).fetchone():
                say(f"database {database} exists")
            else:
                conn.execute(compose(SQL.database_create, database=database))
                say(f"created database {database}")

    def start_private_redis(self) -> str:
        if not shutil.which("redis-server"):
            die("no Redis answers at CELERY_BROKER_URL and redis-server is not installed (e.g. apt-get install "
                "redis-server), or set CELERY_BROKER_URL to a running one")
        server = PrivateRedis(Path(f"{self.log_dir}/redis.log"))
        answered = True
        try:
            self.launch(server)
        except (RuntimeError, AssertionError):
            answered = False
        os.environ["CELERY_BROKER_URL"] = server.url
        if not answered or redis_state(server.url)[0] != 0:
            self.report_exited("redis")
            die("the private Redis did not start")
        return f"private Redis {server.url}"

    def ensure_broker(self) -> str:
        url = os.environ["CELERY_BROKER_URL"]
        if url.startswith(broker_scheme_prefixes("amqp")):
            # RabbitMQ is never started privately: it must answer, or nothing starts.
            host, _, port = url.split("@")[-1].split("/")[0].partition(":")
            if not answers(int(port or 5672), host=host or "127.0.0.1"):
                die(f"no RabbitMQ answers at {host}:{port or 5672} (CELERY_BROKER_URL); start one, or run "
                    "ops/devstack --broker redis")
            say(f"using RabbitMQ at {host}:{port or 5672}")
            return "RabbitMQ (publisher confirms on)"
        if not url.startswith(("redis://", "rediss://")):
            return ""  # another broker: used as configured
        state, message = redis_state(url)
        if state == 0:
            say(f"using Redis at {url}")
            return ""
        if state == 2:
            say(f"no Redis answers at {url}: starting a private one")
            return self.start_private_redis()
        die(f"Redis at {url} answers but refuses: {message}")

    def migrate(self, ledgerctl: str) -> None:
        say("ledgerctl migrate")
        with open(f"{self.log_dir}/migrate.log", "ab") as log:
            proc = subprocess.Popen([ledgerctl, "migrate"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for line in proc.stdout:
                log.write(line)
                print(f"    | {line.decode(errors='replace').rstrip(chr(10))}", flush=True)
            failed = proc.wait()
        if failed:
            die(f"ledgerctl migrate failed (see {self.log_dir}/migrate.log)")

    def start_console(self, ledgerctl: str) -> str:
        """The operator console; without LEDGER_CONSOLE_USERS, a dev-only operator (its note says which)."""
        import secrets

        if port_in_use(self.console_port):
            return f"not started: 127.0.0.1:{self.console_port} is in use (set CONSOLE_PORT)"
        login = "the users of LEDGER_CONSOLE_USERS"
        if not os.environ.get("LEDGER_CONSOLE_USERS"):
            user, password = DEV_CONSOLE_LOGIN
            hashed = subprocess.run([ledgerctl, "console", "hash-password"], input=password + "\n", text=True,
                                    capture_output=True, check=True).stdout.strip()
            os.environ["LEDGER_CONSOLE_USERS"] = f"{user}:{hashed}"
            os.environ.setdefault("LEDGER_CONSOLE_OPERATORS", user)
            login = f"log in {user}:{password}, dev only"
        os.environ.setdefault("LEDGER_CONSOLE_SECRET_KEY", secrets.token_urlsafe(48))
        self.command("console", [ledgerctl, "console", "--port", self.console_port])
        return f"http://127.0.0.1:{self.console_port}  ({login})"

    def write_env(self, receiver_port: str) -> None:
        """The effective settings, for `. $DEVSTACK_DIR/env` in another shell and for scripts."""
        lines = ["# Written by ops/devstack up; removed by ops/devstack stop. "
                 f"In another shell: . {rel(self.env_file)}"]
        venv = os.environ.get("VIRTUAL_ENV")
        if venv:
            lines += [f"export VIRTUAL_ENV={shlex.quote(venv)}", f'export PATH={shlex.quote(venv + "/bin")}:"$PATH"']
        for name in sorted(n for n in os.environ if ENV_FILE_VARIABLES.fullmatch(n)):
            lines.append(f"export {name}={shlex.quote(os.environ[name])}")
        lines.append(f"export DEVSTACK_RECEIVER_URL={shlex.quote(f'http://127.0.0.1:{receiver_port}')}")
        previous = os.umask(0o077)
        try:
            Path(self.env_file).write_text("\n".join(lines) + "\n")
        finally:
            os.umask(previous)

    def print_send_instructions(self, ledgerctl: str, webhook_url: str) -> None:
        """How to deliver a real, signed event to the receiver."""
        url_opt = "" if webhook_url == DEFAULT_WEBHOOK_URL else f" --url {webhook_url}"
        fixture, file_opt, event_id = "", [], "<event_id from the answer>"
        if os.path.isfile(FIXTURE):
            fixture = os.path.abspath(FIXTURE)
            file_opt = ["--file", fixture]
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                import json

                event_id = json.loads(Path(fixture).read_text())["id"]
        venv = os.environ.get("VIRTUAL_ENV")
        print()
        say(f"send a real event, from another shell in {os.getcwd()}:")
        print(f"    . {rel(self.env_file)}   # the settings above" + (f", and {rel(venv)}/bin on PATH" if venv else ""))
        print(f"    ledgerctl send-test-event{url_opt}" + (f" --file {rel(fixture)}" if fixture else ""))
        print(f"    ledgerctl events show {event_id}")
        if not fixture:
            print("  (no ../shared/stripe-fixtures here: send-test-event sends a fresh customer.created)")
        curl = subprocess.run([ledgerctl, "send-test-event", "--print-curl", "--url", webhook_url, *file_opt],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = curl.stdout.rstrip("\n")
        if curl.returncode != 0:
            warn(f"ledgerctl send-test-event --print-curl failed: {output}")
            return
        tolerance = os.environ.get("STRIPE_SIGNATURE_TOLERANCE_S") or "300"
        try:
            until = f" (until {time.strftime('%H:%M:%S', time.localtime(time.time() + float(tolerance)))})"
        except ValueError:
            until = ""
        say(f"or paste this curl; its signature is valid for {tolerance} s{until}, after that use "
            f"ledgerctl send-test-event:")
        print(output, flush=True)

    # -- up ------------------------------------------------------------------------------------
    def up(self, args: list[str]) -> None:
        detach = False
        broker = None
        args = list(args)
        while args:
            arg = args.pop(0)
            if arg in ("-d", "--detach"):
                detach = True
            elif arg in ("-h", "--help"):
                usage()
                raise SystemExit(0)
            elif arg == "--broker" or arg.startswith("--broker="):
                broker = arg.partition("=")[2] or (args.pop(0) if args else "")
                if broker not in BROKER_URLS:
                    die(f"--broker is one of {', '.join(BROKER_URLS)}, not '{broker}'")
            else:
                die(f"unknown option for up: {arg}")
        if broker is not None:
            configured = os.environ.get("CELERY_BROKER_URL")
            if configured and not configured.startswith(broker_scheme_prefixes(broker)):
                die(f"--broker {broker} but CELERY_BROKER_URL is {configured.split('@')[-1]}: unset it or agree")
            os.environ.setdefault("CELERY_BROKER_URL", BROKER_URLS[broker])

        os.makedirs(self.pid_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        self.adopt_postgres()
        already = self.running_names()
        if already:
            die(f"already running: {''.join(n + ' ' for n in already)}(ops/devstack stop first)")
        for name in self.names():
            self.forget(name)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.env_file)

        self.workers = env_default("WORKERS", "2")
        self.concurrency = env_default("WORKER_CONCURRENCY", "2")
        self.gunicorn_workers = env_default("GUNICORN_WORKERS", "2")
        self.gunicorn_threads = env_default("GUNICORN_THREADS", "16")
        self.receiver_port = env_default("RECEIVER_PORT", "8000")
        self.flower_port = env_default("FLOWER_PORT", "5555")
        self.console_port = env_default("CONSOLE_PORT", "8100")
        if not self.workers.isdigit():
            die(f"WORKERS must be a number, got '{self.workers}'")
        if port_in_use(self.receiver_port):
            die(f"127.0.0.1:{self.receiver_port} is already in use (set RECEIVER_PORT)")
        self.programs = {}
        for name in ("ledgerctl", "gunicorn", "celery"):
            self.programs[name] = tool(name) or die(f"'{name}' not found (activate the project's virtualenv, "
                                                    f"or put it on PATH)")

        environ = os.environ
        environ["DATABASE_URL"] = env_default("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/ledger")
        environ["CELERY_BROKER_URL"] = env_default("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
        self.secret_note = ""
        if not environ.get("STRIPE_WEBHOOK_SECRET"):
            environ["STRIPE_WEBHOOK_SECRET"] = DEV_WEBHOOK_SECRET
            self.secret_note = " (dev default; set STRIPE_WEBHOOK_SECRET to override)"
        environ["LOG_LEVEL"] = env_default("LOG_LEVEL", "INFO")
        environ["FLOWER_BASIC_AUTH"] = env_default("FLOWER_BASIC_AUTH", DEV_FLOWER_AUTH)
        # The dev stack runs Flower, whose task view needs the workers' task events.
        environ["LEDGER_TASK_EVENTS"] = env_default("LEDGER_TASK_EVENTS", "true")
        # Per-process metric files for gunicorn's workers; stale files from a previous run are removed.
        # Workers and the sweep write theirs here too, so the receiver's /metrics shows the whole stack.
        environ["PROMETHEUS_MULTIPROC_DIR"] = env_default("PROMETHEUS_MULTIPROC_DIR", f"{self.run_dir}/prometheus")
        os.makedirs(environ["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
        for stale in Path(environ["PROMETHEUS_MULTIPROC_DIR"]).glob("*.db"):
            stale.unlink()

        os.chdir(REPO)
        # From here on, a failure or a signal stops whatever was started (private servers included).
        self.armed = True
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, _on_signal)
        try:
            self._up(detach)
        except _Signalled as stop:
            print(flush=True)
            self.stop_all()
            self._forget_supervisor()
            raise SystemExit(stop.code) from None
        except BaseException as exc:
            if self.armed and not (isinstance(exc, SystemExit) and exc.code in (0, None)):
                self.stop_all()
            if self.armed:
                self._forget_supervisor()
            raise

    def _forget_supervisor(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.supervisor_pidfile)

    def _disarm(self) -> None:
        self.armed = False
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)

    def _up(self, detach: bool) -> None:
        """From the servers to the foreground watch; whatever it started is stopped if it fails."""
        ledgerctl, gunicorn, celery = (self.programs[n] for n in ("ledgerctl", "gunicorn", "celery"))
        receiver_port, flower_port = self.receiver_port, self.flower_port
        notes = {"postgres": "", "redis": ""}
        if self.postgres_answers():
            say(f"using PostgreSQL at {os.environ['DATABASE_URL'].split('?', 1)[0]}")
        else:
            say(f"no PostgreSQL answers at {os.environ['DATABASE_URL'].split('?', 1)[0]}: starting a private one")
            notes["postgres"] = self.start_private_postgres()
        self.ensure_database()
        notes["redis"] = self.ensure_broker()
        self.migrate(ledgerctl)
        self.write_env(receiver_port)

        self.command("receiver", [gunicorn, "--bind", f"127.0.0.1:{receiver_port}", "--workers", self.gunicorn_workers,
                                  "--worker-class", "gthread", "--threads", self.gunicorn_threads,
                                  "ingest.app:create_app()"])
        for i in range(1, int(self.workers) + 1):
            # Distinct node names: several workers on one host must not share one.
            self.command(f"worker-{i}", [celery, "-A", "workers", "worker", "--loglevel=INFO",
                                         f"--concurrency={self.concurrency}", "-n", f"devstack-worker-{i}@%h"])
        self.command("sweep", [ledgerctl, "sweep", "--loop"])
        notes["console"] = self.start_console(ledgerctl)

        flower_note = "not installed (pip install -e '.[ops]')"
        if subprocess.run([celery, "flower", "--help"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0:
            if not port_in_use(flower_port):
                self.command("flower", [celery, "-A", "workers", "flower", "--address=127.0.0.1",
                                        f"--port={flower_port}"])
                auth = os.environ["FLOWER_BASIC_AUTH"]
                user, _, password = auth.partition(":")
                flower_note = f"http://127.0.0.1:{flower_port}  (basic auth {user}:{password if _ else auth})"
            else:
                flower_note = f"not started: 127.0.0.1:{flower_port} is in use (set FLOWER_PORT)"
        notes["flower"] = flower_note
        notes["receiver"] = f"http://127.0.0.1:{receiver_port}  (/healthz /readyz /metrics)"

        # The receiver must come up; the rest is reported if it dies during start-up.
        healthy = False
        for _ in range(60):
            if http_ok(int(receiver_port), "/healthz"):
                healthy = True
                break
            if not self.is_up("receiver"):
                break
            time.sleep(0.5)
        if not healthy:
            self.report_exited("receiver")
            die("the receiver did not answer GET /healthz with 200; stopping everything")
        time.sleep(3)  # long enough for an import or configuration error to kill a worker/sweep

        failed = []
        print()
        say(f"up; run dir {self.run_dir}")
        for name in self.started:
            pid = self.read_pid(name)
            if self.is_up(name):
                note = notes.get(name)
                print(f"  {name:<10} pid {pid!s:<7} {note}" if note else f"  {name:<10} pid {pid}")
            else:
                print(f"  {name:<10} EXITED during start-up (log {self.log_dir}/{name}.log)")
                failed.append(name)
        if "flower" not in self.started:
            print(f"  {'flower':<10} {flower_note}")
        if "console" not in self.started:
            print(f"  {'console':<10} {notes['console']}")
        print(f"  webhook:        http://127.0.0.1:{receiver_port}/webhooks/stripe")
        print(f"  webhook secret: {os.environ['STRIPE_WEBHOOK_SECRET']}{self.secret_note}")
        print(f"  database:       {os.environ['DATABASE_URL']}")
        print(f"  broker:         {os.environ['CELERY_BROKER_URL']}")
        print(f"  settings:       {self.env_file}")
        print(f"  logs:           {self.log_dir}/  (ops/devstack logs)", flush=True)
        for name in failed:
            self.report_exited(name)
        self.print_send_instructions(ledgerctl, f"http://127.0.0.1:{receiver_port}/webhooks/stripe")
        print(flush=True)

        if detach:
            self._disarm()
            say("running in the background; stop with: ops/devstack stop")
            if failed:
                warn(f"{len(failed)} process(es) exited during start-up: {' '.join(failed)} (the rest are running)")
                raise SystemExit(1)
            raise SystemExit(0)

        say("Ctrl-C stops everything (or: ops/devstack stop)")
        Path(self.supervisor_pidfile).write_text(f"{os.getpid()}\n")
        self.watch(reported=set(failed))

    def watch(self, reported: set[str]) -> None:
        """Foreground: watch the processes until Ctrl-C, or until `ops/devstack stop` ends them all."""
        while True:
            self.reap()
            live = 0
            for name in self.started:
                pid = self.read_pid(name)
                if pid and group_alive(pid):
                    if name not in SERVICES:  # the private servers alone are not a stack
                        live += 1
                elif name not in reported:
                    if os.path.exists(self.pidfile_of(name)):
                        self.report_exited(name)
                    reported.add(name)
            if not live:
                say("every process has exited")
                self._disarm()
                with contextlib.redirect_stdout(io.StringIO()):
                    self.stop_all()
                self._forget_supervisor()
                raise SystemExit(0)
            time.sleep(2)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # Until `up` installs its handlers, Ctrl-C ends this process as it ends any command.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    stack = Devstack()
    command = args.pop(0) if args else "up"
    if command in ("up", "start"):
        stack.up(args)
    elif command.startswith("-") and command not in ("-h", "--help"):
        stack.up([command, *args])
    elif command in ("stop", "down"):
        stack.stop_supervisor()
        stack.stop_all()
    elif command == "status":
        stack.status()
    elif command == "logs":
        stack.logs()
    elif command in ("-h", "--help", "help"):
        usage()
    else:
        usage(sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
