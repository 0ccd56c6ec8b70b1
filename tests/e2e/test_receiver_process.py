"""The real receiver, ``ingest.app:create_app()`` under the servers docs/configuration.md runs it with
(devkit.stack.Receiver: gunicorn sync workers, the default command, and gthread workers), as a subprocess."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from devkit.factories import sign
from devkit.procs import run_together, signal_group
from devkit.stack import SUPPORTED_RECEIVER_SERVERS, Receiver, stack_env
from tests.support.constants import WEBHOOK_SECRET
from tests.support.raw_http import read_answer
from tests.support.receiver import count_events, event_body, event_row, receiver_env

COPIES = 20
# Each round is one more chance for copies to meet inside the INSERT.
ROUNDS = 5


def _headers(body: str) -> dict:
    return {"Stripe-Signature": sign(body, WEBHOOK_SECRET)}


def test_every_acknowledged_event_survives_a_kill_9_of_the_receiver_right_after_the_last_200(
        db, redis_url, start_receiver):
    receiver = start_receiver(receiver_env(db, redis_url, WEBHOOK_SECRET), workers=2)
    bodies = [event_body() for _ in range(50)]
    acknowledged = {}

    for body in bodies:
        answer = receiver.post(body.encode(), _headers(body))
        if answer.status_code == 200:
            acknowledged[json.loads(body)["id"]] = (body, answer.json()["outcome"])
    receiver.kill()  # SIGKILL to master and workers: no shutdown, no flush, nothing after the last 200

    assert len(acknowledged) == len(bodies), receiver.log()
    for event_id, (body, outcome) in acknowledged.items():
        row = event_row(db, event_id)
        assert row is not None, f"{event_id} was acknowledged but is not in the ledger"
        assert (outcome, row["status"], row["payload"]) == ("received", "received", body)
    assert count_events(db) == len(bodies)


@pytest.mark.parametrize("worker_args", [
    pytest.param({"server": "gunicorn-sync", "workers": 4}, id="4 sync workers"),
    pytest.param({"server": "gunicorn-gthread", "workers": 2, "threads": 10}, id="2x10 gthread threads"),
])
def test_twenty_concurrent_deliveries_of_one_event_to_the_real_receiver_make_one_row(
        db, redis_url, start_receiver, worker_args):
    # A connection per thread, so every copy a process holds can be inside its INSERT at once.
    receiver = start_receiver(receiver_env(db, redis_url, WEBHOOK_SECRET, DB_POOL_MAX_SIZE="10"), **worker_args)
    bodies = [event_body() for _ in range(ROUNDS)]

    for body in bodies:
        headers = [_headers(body) for _ in range(COPIES)]
        answers = run_together(lambda i: receiver.post(body.encode(), headers[i]), COPIES)

        assert sorted((a.status_code, a.json().get("outcome")) for a in answers) == (
            [(200, "duplicate")] * (COPIES - 1) + [(200, "received")]), receiver.log()
        row = event_row(db, json.loads(body)["id"])
        assert (row["status"], row["deliveries"], row["payload"]) == ("received", COPIES, body)
    assert count_events(db) == ROUNDS


def test_gunicorn_with_a_missing_secret_exits_nonzero_and_prints_the_configuration_error(tmp_path):
    # No STRIPE_WEBHOOK_SECRET (stack_env passes on none of the shell's); the URLs are never connected to.
    receiver = Receiver(stack_env("postgresql://ledger:pg-password-123@127.0.0.1:5432/ledger",
                                  "redis://:broker-password-456@127.0.0.1:6379/0"), tmp_path, workers=2)

    proc = subprocess.Popen(receiver.cmd, cwd=receiver.cwd, env=receiver.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        # A receiver that cannot start must stop, not respawn its workers forever.
        output, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("gunicorn kept running without a webhook secret:\n" + output[-2000:])

    assert proc.returncode != 0
    assert "configuration error: STRIPE_WEBHOOK_SECRET is not set: the receiver cannot verify signatures" in output
    # Not as a traceback of ours. (gunicorn itself may print one when both workers fail to boot at
    # once: its halt reaps the second worker and raises HaltServer again. That is gunicorn's.)
    assert "ConfigError" not in output and "ingest/app.py" not in output and "ledger/config.py" not in output


# compose's stop_grace_period for the receiver (docker-compose.yml): its server's graceful timeout and then some.
GRACEFUL_S = 30


@pytest.mark.parametrize("server", SUPPORTED_RECEIVER_SERVERS)
def test_a_delivery_in_flight_when_the_receiver_gets_sigterm_completes_and_the_receiver_exits_0(
        db, redis_url, start_receiver, server):
    receiver = start_receiver(receiver_env(db, redis_url, WEBHOOK_SECRET), server=server, workers=2)
    body = event_body().encode()
    event_id = json.loads(body)["id"]
    head = (b"POST /webhooks/stripe HTTP/1.1\r\nHost: receiver.test\r\nContent-Type: application/json\r\n"
            b"Stripe-Signature: " + sign(body.decode(), WEBHOOK_SECRET).encode() + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    client = socket.create_connection(("127.0.0.1", receiver.port), timeout=GRACEFUL_S)
    try:
        client.sendall(head + body[:-20])  # a worker is now reading this body
        time.sleep(0.5)
        # What `docker compose stop` does (init: true forwards it to the server's main process alone).
        os.kill(receiver.pid, signal.SIGTERM)
        time.sleep(1.0)  # the stop is under way, the delivery still in flight
        assert receiver.alive, receiver.log(3000)
        client.sendall(body[-20:])
        answer = read_answer(client, GRACEFUL_S)
    finally:
        client.close()

    assert answer.status == 200 and b'"outcome":"received"' in answer.raw, (answer, receiver.log(3000))
    assert event_row(db, event_id)["status"] == "received"
    assert receiver.proc.wait(timeout=GRACEFUL_S + 5) == 0, receiver.log(3000)
