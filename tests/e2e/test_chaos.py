"""The chaos run (devkit/chaos.py) as a test: real receiver, workers, broker and sweep, while things break.

Once per broker: ``redis`` (a private redis-server of the run's own) and ``amqp`` (a
vhost of the run's own on the machine's RabbitMQ, 127.0.0.1:5672; skipped when none
answers or ``rabbitmqctl`` cannot manage it). Small by default (300 distinct
events, ~400 deliveries); ``CHAOS_EVENTS=5000`` makes it as big as you like. The
run is a subprocess of its own: it creates and drops its own databases (on the
server of ``TEST_PG_URL``) and its own broker, and it loads a handler module
(devkit/chaos_handlers.py) that must never be loaded into the test process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from devkit.procs import REPO
from devkit.servers import RabbitVhost
from tests.support.postgres import ADMIN_URL

EVENTS = int(os.environ.get("CHAOS_EVENTS", "300"))

pytestmark = [pytest.mark.chaos, pytest.mark.e2e]


@pytest.mark.timeout(900 + 2 * EVENTS)
@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_exactly_once_outcomes_survive_kills_flushes_restarts_and_faults(tmp_path, broker):
    if broker == "amqp" and not RabbitVhost.available():
        pytest.skip("no RabbitMQ on 127.0.0.1:5672 that rabbitmqctl can manage")
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "devkit.chaos", "--events", str(EVENTS), "--broker", broker,
           "--admin-url", ADMIN_URL, "--json-out", str(out), "--logs-dir", str(tmp_path / "logs")]
    if os.environ.get("CHAOS_SEED"):
        cmd += ["--seed", os.environ["CHAOS_SEED"]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        stdout, stderr = proc.communicate(timeout=800 + 2 * EVENTS)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the run stops its processes and drops its databases
        stdout, stderr = proc.communicate(timeout=120)
    print(stdout)
    assert out.exists(), f"the chaos run did not finish (exit {proc.returncode}):\n{stderr[-6000:]}"
    result = json.loads(out.read_text())
    detail = f"{result['summary']}\n" + "\n".join(result["problems"]) + f"\n{stderr[-4000:]}"

    assert result["events"] == EVENTS and result["broker"] == broker
    assert result["deliveries"] > EVENTS, "some events must have been delivered more than once"
    assert result["faults_injected"] > 0 and any(k.startswith("domain_") for k in result["faults"]), detail
    assert result["faults"].get("flush_broker") and result["faults"].get("restart_broker"), detail
    assert result["lost"] == 0, detail
    assert result["duplicated_effects"] == 0, detail
    assert result["missing_effects"] == 0 and result["phantom_effects"] == 0, detail
    assert result["faults_swallowed"] == 0, detail
    assert result["stuck"] == 0 and result["processing"] == 0, detail
    assert result["failed"] == 0 and result["failed_without_reason"] == 0, detail
    assert result["billing_mismatches"] == 0, detail
    assert result["problems"] == [], detail
    assert result["ok"] and proc.returncode == 0, detail
