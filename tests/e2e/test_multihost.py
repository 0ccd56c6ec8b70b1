"""Several hosts on one machine (devkit.netns): a receiver host, two worker hosts and the
database-and-broker host (the root namespace, behind a bridge), every packet between them across
the bridge, each host with its own hostname. In the middle of a run one worker host is cut off
(its link down) while it holds leases: its events are taken over once their leases expire, its
late work is fenced when the link returns, and every event ends processed with its business
effect written once. The run prints each host's processed count. Once on Redis, once on a RabbitMQ
vhost. Skipped, with the reason, where namespaces cannot be made (they need root and iproute2).
"""
from __future__ import annotations

import json
import shlex
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from devkit.factories import event, sign
from devkit.netns import Network, Relay
from devkit.procs import Process, free_port, venv_tool, wait_until
from devkit.servers import PrivatePostgres, RabbitVhost
from devkit.stack import receiver_command
from ledger.config import Settings
from ledger.migrate import migrate
from tests.support.constants import WEBHOOK_SECRET
from tests.support.handlers_for_tests import ensure_test_tables
from tests.support.workers import env_for
from workers.app import effects_queue

WHY_NOT = Network.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces here: {WHY_NOT}")

HOSTS = ["receiver", "worker-a", "worker-b"]
EVENTS = 400
LEASE_S = 5
CUT_S = 6 * LEASE_S
SLEEP_S = 0.05            # each event's handler, so that batches are in flight when the link goes


def on_host(net: Network, host: str, cmd: list[str]) -> list[str]:
    """``cmd`` on ``host``: in its namespace, under a hostname of its own (attempts name their worker by it)."""
    return net.run(host, ["unshare", "--uts", "sh", "-c", f"hostname {host} && exec {shlex.join(cmd)}"])


@pytest.fixture
def network():
    with Network(HOSTS) as net:
        yield net


@pytest.fixture
def database(network):
    pg = PrivatePostgres(options={"listen_addresses": f"127.0.0.1,{network.gateway}"}).init()
    with open(pg.data / "pg_hba.conf", "a") as hba:
        hba.write("host all all 10.77.0.0/16 trust\n")
    pg.start()
    try:
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE multihost")
        local = pg.url_for("multihost")
        migrate(local)
        with psycopg.connect(local, autocommit=True) as conn:
            ensure_test_tables(conn)
        yield local, local.replace("127.0.0.1", network.gateway)
    finally:
        pg.destroy()


@pytest.fixture(params=["redis", "amqp"])
def broker(request, network, tmp_path):
    """The broker's URL as the other hosts reach it (the gateway's address)."""
    if request.param == "redis":
        server = Process("redis", ["redis-server", "--port", str(port := free_port()), "--bind",
                                   f"127.0.0.1 {network.gateway}", "--save", "", "--appendonly", "no",
                                   "--protected-mode", "no"], {}, tmp_path / "redis.log").start()
        try:
            wait_until(lambda: "Ready to accept" in server.log(), timeout_s=20, what="redis to start")
            yield f"redis://{network.gateway}:{port}/0"
        finally:
            server.kill()
        return
    if not RabbitVhost.available():
        pytest.skip("no RabbitMQ on 127.0.0.1:5672 that rabbitmqctl can manage")
    # The machine's RabbitMQ listens on loopback: the hosts reach it through a relay on the gateway.
    relay = Relay((network.gateway, 0), ("127.0.0.1", 5672))
    try:
        with RabbitVhost(f"multihost-{uuid.uuid4().hex[:8]}") as vhost:
            yield f"amqp://guest:guest@{network.gateway}:{relay.address[1]}/{vhost.name}"
    finally:
        relay.close()


def post(url: str, body: str) -> int:
    request = urllib.request.Request(url, data=body.encode(), method="POST", headers={
        "Content-Type": "application/json", "Stripe-Signature": sign(body, WEBHOOK_SECRET)})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.status


def test_a_worker_host_cut_off_holding_leases_loses_nothing_and_duplicates_nothing(network, database, broker,
                                                                                   tmp_path):
    local_db, remote_db = database
    settings = Settings(database_url=remote_db, broker_url=broker, webhook_secrets=(WEBHOOK_SECRET,),
                        queue_name=f"mh-{uuid.uuid4().hex[:6]}", lease_s=LEASE_S, retry_base_s=0.2, retry_cap_s=2,
                        sweep_overdue_s=2.0)
    env = env_for(settings, extra={"STRIPE_WEBHOOK_SECRET": WEBHOOK_SECRET, "LEDGER_SWEEP_INTERVAL_S": "1"})
    started: list[Process] = []

    def start(name: str, host: str, cmd: list[str]) -> Process:
        process = Process(name, on_host(network, host, cmd), env, tmp_path / f"{name}.log").start()
        started.append(process)
        return process

    port = 8000
    address = network.addresses["receiver"]
    try:
        start("receiver", "receiver", receiver_command("gunicorn-gthread", host=address, port=port, workers=1,
                                                       threads=8))
        start("sweep", "receiver", [venv_tool("ledgerctl"), "sweep", "--loop"])
        queues = f"{settings.queue_name},{effects_queue(settings.queue_name)}"
        workers = {host: start(host, host, [venv_tool("celery"), "-A", "workers", "worker", "--pool=prefork", "-c",
                                            "2", "--loglevel=INFO", "-Q", queues, "-n", f"{host}@%h",
                                            "--without-mingle", "--without-gossip", "--without-heartbeat"])
                   for host in ("worker-a", "worker-b")}
        for worker in workers.values():
            wait_until(lambda w=worker: " ready." in w.log() or w.ensure_alive(), timeout_s=90,
                       what="a worker host to be ready")
        url = f"http://{address}:{port}/webhooks/stripe"
        wait_until(lambda: _answers(url), timeout_s=60, what="the receiver host to answer")

        now = int(time.time())
        events = [event("test.effect", {"id": f"obj_mh_{n}", "sleep_s": SLEEP_S}, created=now) for n in range(EVENTS)]
        ids = [evt["id"] for evt in events]

        def feed():
            # Faster than the workers apply: wake-ups wait, and each worker takes them in batches.
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda evt: post(url, json.dumps(evt, separators=(",", ":"))), events))
            assert answers == [200] * EVENTS
        feeder = threading.Thread(target=feed)
        feeder.start()

        with psycopg.connect(local_db, autocommit=True) as conn:
            def leases_of(host: str) -> int:
                return conn.execute(
                    "SELECT count(*) FROM ledger.events e JOIN ledger.attempts a ON a.event_id = e.id "
                    "AND a.lease_owner = e.lease_owner WHERE e.status = 'processing' AND a.worker LIKE %s",
                    (f"{host}:%",)).fetchone()[0]
            wait_until(lambda: leases_of("worker-a") >= 4, timeout_s=60, interval_s=0.01,
                       what="worker-a to hold leases")
            held = leases_of("worker-a")
            network.cut("worker-a")
            cut_at = time.monotonic()
            # Well past the leases: the sweep re-drives the expired ones with a doubling backoff, and on
            # RabbitMQ its first re-drives may go to the lost host's open channel (its prefetch window)
            # before one reaches the other host.
            time.sleep(CUT_S)
            network.mend("worker-a")
            feeder.join(timeout=120)

            def all_processed() -> bool:
                return conn.execute("SELECT count(*) FROM ledger.events WHERE status = 'processed'"
                                    ).fetchone()[0] == EVENTS
            wait_until(all_processed, timeout_s=180, interval_s=0.5, what="every event to be processed")

            effects = conn.execute("SELECT count(*), count(DISTINCT event_id) FROM public.test_effects").fetchone()
            recorded = {row[0] for row in conn.execute("SELECT id FROM ledger.events")}
            by_host = dict(conn.execute(
                "SELECT split_part(worker, ':', 1), count(*) FROM ledger.attempts WHERE outcome = 'processed' "
                "GROUP BY 1").fetchall())
            fenced = conn.execute("SELECT count(*) FROM ledger.attempts WHERE worker LIKE 'worker-a:%' "
                                  "AND outcome IN ('lease_lost', 'lease_expired')").fetchone()[0]
            taken_over = conn.execute(
                "SELECT count(DISTINCT a.event_id) FROM ledger.attempts a JOIN ledger.attempts b "
                "ON b.event_id = a.event_id AND b.attempt > a.attempt WHERE a.worker LIKE 'worker-a:%' "
                "AND b.worker LIKE 'worker-b:%' AND b.outcome = 'processed'").fetchone()[0]
        print(f"\n[{broker.split(':')[0]}] processed by host: {by_host}; worker-a held {held} leases when cut "
              f"({time.monotonic() - cut_at:.0f} s ago); taken over by worker-b: {taken_over}; "
              f"worker-a attempts fenced: {fenced}")
        assert recorded == set(ids)
        assert effects == (EVENTS, EVENTS), "an event's business effect was lost or written twice"
        assert fenced >= 1, "worker-a's late attempts were not fenced"
        assert sum(by_host.values()) == EVENTS and set(by_host) <= {"worker-a", "worker-b"}
        assert by_host.get("worker-b", 0) > 0
        assert taken_over >= 1, "no event worker-a held was taken over by worker-b"
    finally:
        for process in reversed(started):
            process.kill()


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url.replace("/webhooks/stripe", "/healthz"), timeout=2)
        return True
    except OSError:
        return False
