"""ops/devstack: the script parses, and `up -d` brings up a working stack that `stop` ends completely.

The end-to-end test points DATABASE_URL and CELERY_BROKER_URL at ports nothing listens on, so
devstack has to start a PostgreSQL and a Redis of its own (under tmp_path, on free ports): it
never touches the machine's shared servers. It uses the binaries of the virtualenv running pytest.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from devkit.procs import answers, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEVSTACK = ROOT / "ops" / "devstack"
# The virtualenv running pytest (not resolved: a venv's python is a symlink out of it).
VENV = Path(sys.executable).parent.parent
LEDGERCTL = VENV / "bin" / "ledgerctl"

# Settings a developer's shell may carry that must not leak into the stack under test.
INHERITED_PREFIXES = ("DATABASE_URL", "CELERY_", "STRIPE_", "LEDGER_", "PROMETHEUS_", "FLOWER_", "DEVSTACK_",
                      "RECEIVER_PORT", "WORKERS", "WORKER_CONCURRENCY", "GUNICORN_WORKERS",
                      "GUNICORN_THREADS")


def read_env_file(path: Path) -> dict[str, str]:
    """The `export NAME=value` lines devstack writes to $DEVSTACK_DIR/env (shell-quoted values)."""
    values = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            values[name] = value
    return values


def read_pids(pid_dir: Path) -> dict[str, int]:
    return {f.stem: int(f.read_text()) for f in pid_dir.glob("*.pid")}


def processes_of(groups: set[int], marker: str) -> list[str]:
    """Live processes in one of these process groups, or whose environment contains marker."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            stat = (proc / "stat").read_text()
            pgrp = int(stat[stat.rindex(")") + 2:].split()[2])
            state = stat[stat.rindex(")") + 2:].split()[0]
            try:
                in_env = marker.encode() in (proc / "environ").read_bytes().split(b"\0")
            except PermissionError:
                in_env = False
            if state != "Z" and (pgrp in groups or in_env):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name}: {cmdline}")
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return found


def test_devstack_is_valid_bash():
    check = subprocess.run(["bash", "-n", str(DEVSTACK)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_up_starts_private_servers_processes_a_signed_event_and_stop_leaves_nothing_running(tmp_path):
    assert LEDGERCTL.exists(), f"run pytest from the project's virtualenv ({LEDGERCTL} is missing)"
    run_dir = tmp_path / "devstack"
    closed_pg, closed_redis, receiver_port, flower_port = (free_port() for _ in range(4))
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_PREFIXES)}
    env.update(
        VIRTUAL_ENV=str(VENV),
        DEVSTACK_DIR=str(run_dir),
        # Nothing listens on these: devstack must start private servers.
        DATABASE_URL=f"postgresql://postgres@127.0.0.1:{closed_pg}/ledger",
        CELERY_BROKER_URL=f"redis://127.0.0.1:{closed_redis}/0",
        RECEIVER_PORT=str(receiver_port),
        FLOWER_PORT=str(flower_port),
        WORKER_CONCURRENCY="1",
        GUNICORN_WORKERS="1",
        DEVSTACK_STOP_TIMEOUT="10",
    )
    devstack = lambda *args, timeout: subprocess.run(  # noqa: E731
        [str(DEVSTACK), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)

    pids: dict[str, int] = {}
    pg_dir = None
    try:
        up = devstack("up", "-d", timeout=120)
        pids = read_pids(run_dir / "pids")
        pg_dir = Path((run_dir / "postgres.dir").read_text().strip())
        assert up.returncode == 0, up.stdout + up.stderr
        assert {"postgres", "redis", "receiver", "worker-1", "worker-2", "sweep"} <= set(pids), up.stdout

        stack = read_env_file(run_dir / "env")
        pg_port = int(stack["DATABASE_URL"].rsplit(":", 1)[1].split("/")[0])
        redis_port = int(stack["CELERY_BROKER_URL"].rsplit(":", 1)[1].split("/")[0])
        assert pg_port not in (closed_pg, 5432) and answers(pg_port)
        assert redis_port not in (closed_redis, 6379) and answers(redis_port)
        assert stack["DEVSTACK_RECEIVER_URL"] == f"http://127.0.0.1:{receiver_port}"
        with urllib.request.urlopen(f"{stack['DEVSTACK_RECEIVER_URL']}/healthz", timeout=5) as health:
            assert health.status == 200

        client_env = {**env, **stack}
        sent = subprocess.run([str(LEDGERCTL), "send-test-event", "--url",
                               f"{stack['DEVSTACK_RECEIVER_URL']}/webhooks/stripe"],
                              env=client_env, capture_output=True, text=True, timeout=30)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        status, body = sent.stdout.strip().split(" ", 1)
        answer = json.loads(body)
        assert (status, answer["outcome"]) == ("200", "received")

        def processed():
            shown = subprocess.run([str(LEDGERCTL), "events", "show", answer["event_id"], "--json"],
                                   env=client_env, capture_output=True, text=True, timeout=30)
            assert shown.returncode == 0, shown.stderr
            detail = json.loads(shown.stdout)
            return detail if detail["event"]["status"] == "processed" else None

        detail = wait_until(processed, timeout_s=30, interval_s=0.5, what=f"{answer['event_id']} to be processed")
        assert detail["event"]["attempts"] == 1
        assert {row["table_name"] for row in detail["domain_rows"]} == {"billing.customers"}
    finally:
        stop = devstack("stop", timeout=120)

    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert processes_of(set(pids.values()), f"DEVSTACK_DIR={run_dir}") == []
    assert not answers(pg_port) and not answers(redis_port) and not answers(receiver_port)
    assert not (run_dir / "env").exists()
    # Where root's `postgres` user cannot reach tmp_path, the cluster lived in a temporary directory.
    assert pg_dir == run_dir / "postgres" or not pg_dir.exists()
    assert read_pids(run_dir / "pids") == {}
