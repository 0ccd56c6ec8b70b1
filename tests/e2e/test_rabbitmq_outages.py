"""Losing RabbitMQ loses nothing, on a node of the test's own (devkit.servers.PrivateRabbit), never the
machine's: a node blocked by a memory alarm never holds the receiver's answer past BROKER_TIMEOUT_S
(publisher confirms, and a failed producer dropped without the closing handshake), and the event is
processed once the alarm lifts; a node killed mid-run and started again loses no event and
duplicates no business effect."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest

from devkit.factories import event, sign
from devkit.procs import Process, venv_tool, wait_until
from devkit.servers import PrivateRabbit
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import receiver_env
from tests.support.workers import env_for

WHY_NOT = PrivateRabbit.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
BROKER_TIMEOUT_S = 1.0


@pytest.fixture
def rabbit():
    node = PrivateRabbit().start()
    try:
        yield node
    finally:
        node.destroy()


@pytest.fixture
def stack(rabbit, settings, kit, worker_factory, start_receiver, tmp_path):
    """A worker, the sweep and a receiver on the private node."""
    on_rabbit = dataclasses.replace(settings, broker_url=rabbit.url, queue_name=f"q-{uuid.uuid4().hex[:8]}",
                                    broker_timeout_s=BROKER_TIMEOUT_S)
    worker_factory(on_rabbit)
    sweep = Process("sweep", [venv_tool("ledgerctl"), "sweep", "--loop"],
                    env_for(on_rabbit, extra={"LEDGER_SWEEP_INTERVAL_S": "0.5"}), tmp_path / "sweep.log").start()
    receiver = start_receiver(receiver_env(on_rabbit.database_url, rabbit.url, WEBHOOK_SECRET,
                                           LEDGER_QUEUE=on_rabbit.queue_name, BROKER_TIMEOUT_S=str(BROKER_TIMEOUT_S)),
                              workers=1)
    try:
        yield receiver
    finally:
        sweep.kill()


def deliver(receiver, n: int) -> tuple[str, dict, float]:
    evt = event("test.effect", {"id": f"obj_rabbit_{n}_{uuid.uuid4().hex[:6]}"}, created=int(time.time()))
    body = json.dumps(evt, separators=(",", ":"))
    started = time.monotonic()
    answer = receiver.post(body.encode(), {"Stripe-Signature": sign(body, WEBHOOK_SECRET)})
    assert answer.status_code == 200, answer.body
    return evt["id"], answer.json(), time.monotonic() - started


def effects(kit, ids: list[str]) -> tuple[int, int]:
    row = kit.query("SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM public.test_effects "
                    "WHERE event_id = ANY(%s)", (ids,))[0]
    return row["n"], row["d"]


def all_processed(kit, ids: list[str]) -> bool:
    return kit.query("SELECT count(*) AS n FROM ledger.events WHERE id = ANY(%s) AND status = 'processed'",
                     (ids,))[0]["n"] == len(ids)


def test_a_node_blocked_by_a_memory_alarm_never_holds_the_answer_and_the_event_completes_once_it_lifts(
        rabbit, stack, kit):
    before, answer, _ = deliver(stack, 0)
    assert answer["enqueued"] is True
    wait_until(lambda: all_processed(kit, [before]), timeout_s=60, what="the event before the alarm")

    rabbit.block_publishers()
    blocked = [deliver(stack, n) for n in range(1, 4)]
    for event_id, answer, took in blocked:
        assert answer["outcome"] == "received" and answer["enqueued"] is False
        assert took < BROKER_TIMEOUT_S + 2, f"the answer waited {took:.1f} s on a blocked broker"
    rabbit.unblock_publishers()

    ids = [event_id for event_id, _, _ in blocked]
    wait_until(lambda: all_processed(kit, ids), timeout_s=90, interval_s=0.5,
               what="the events the alarm held to be re-driven and processed")
    assert effects(kit, [before, *ids]) == (4, 4)


def test_a_node_killed_mid_run_and_started_again_loses_no_event_and_duplicates_none(rabbit, stack, kit):
    ids = [deliver(stack, n)[0] for n in range(30)]
    rabbit.kill()
    during = [deliver(stack, n) for n in range(30, 45)]   # recorded; their wake-ups are the sweep's
    assert all(answer["outcome"] == "received" and answer["enqueued"] is False for _, answer, _ in during)
    rabbit.start()
    ids += [event_id for event_id, _, _ in during] + [deliver(stack, n)[0] for n in range(45, 60)]
    wait_until(lambda: all_processed(kit, ids), timeout_s=180, interval_s=0.5,
               what="every event to be processed after the node came back")
    assert effects(kit, ids) == (60, 60)
