"""Fixtures of the two layers on a real database (integration and e2e), imported by their conftest files.

* ``kit``: a LedgerKit (tests/support/workers.py) on the test's clean database, with the test-only tables.
* ``broker_settings``: ``settings`` with a Redis database and a queue of the test's own.
* ``ledgerctl_cli``: ``ops.cli.cli`` in-process (click's CliRunner), configured as ``run_ledgerctl`` would be.
* ``prepared_ledger``: a ledger with events in every state, built through the real code paths.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import time
import traceback
import uuid

import psycopg
import pytest
import redis
from click.testing import CliRunner

import ops.cli
import ops.cli.base
from devkit.factories import SubscriptionHistory, event
from tests.support.handlers_for_tests import ensure_test_tables
from tests.support.workers import LedgerKit, RecordingWaker, env_for

# Redis databases other than 0 (the default) are handed out in turn to tests that run real workers.
_broker_dbs = itertools.count(1)


@pytest.fixture
def effects_table(db):
    """public.test_effects / public.test_locks exist and are empty (the db fixture does not touch them)."""
    with psycopg.connect(db, autocommit=True) as conn:
        ensure_test_tables(conn)
    return db


@pytest.fixture
def kit(settings, effects_table):
    """A LedgerKit on this test's clean database; closes its pools at teardown."""
    k = LedgerKit(settings)
    yield k
    k.close()


# A module runs its tests on both brokers with:
#     pytestmark = pytest.mark.parametrize("broker_settings", BROKERS, indirect=True)
BROKERS = ["redis", "amqp"]


@pytest.fixture
def broker_settings(request, settings, redis_url):
    """settings with a broker of this test's own and a queue of its own: a redis database, flushed before
    and after (the default), or, when the test is parametrized with "amqp", a RabbitMQ vhost, dropped after."""
    if getattr(request, "param", "redis") == "amqp":
        from devkit.servers import RabbitVhost

        if not RabbitVhost.available():
            pytest.skip("no RabbitMQ on 127.0.0.1:5672 that rabbitmqctl can manage")
        with RabbitVhost(f"test-{uuid.uuid4().hex[:10]}") as vhost:
            yield dataclasses.replace(settings, broker_url=vhost.url, queue_name=f"q-{uuid.uuid4().hex[:10]}")
        return
    base = redis_url.rsplit("/", 1)[0]
    with redis.Redis.from_url(redis_url) as probe:
        databases = int(probe.config_get("databases")["databases"])
    number = 1 + next(_broker_dbs) % (databases - 1) if databases > 1 else 0
    url = f"{base}/{number}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield dataclasses.replace(settings, broker_url=url, queue_name=f"q-{uuid.uuid4().hex[:10]}")
    client.flushdb()
    client.close()


@pytest.fixture
def ledgerctl_cli(broker_settings, monkeypatch):
    """Run ``ops.cli.cli`` in-process with click's CliRunner, configured through ``CliRunner(env=...)``.

    The environment is exactly the one ``run_ledgerctl`` gives a subprocess (``env_for(broker_settings)``;
    variables that one drops are unset). ``ledgerctl_cli(*args, code=0)`` asserts the exit code, and that a
    non-zero one came from the command itself (SystemExit / click), not from an unexpected exception.
    The Postgres pools the commands open are closed at teardown (each invocation opens one).
    """
    contexts = []

    class _ClosingContext(ops.cli.base._Context):
        def __init__(self):
            super().__init__()
            contexts.append(self)

    monkeypatch.setattr(ops.cli.base, "_Context", _ClosingContext)
    env = env_for(broker_settings)
    base_env = {**{k: None for k in os.environ if k not in env}, **env}

    def invoke(*args: str, code: int | None = 0, input: str | None = None, env: dict | None = None):
        runner = CliRunner(env={**base_env, **(env or {})})
        result = runner.invoke(ops.cli.cli, list(args), input=input, catch_exceptions=True)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise AssertionError(
                f"ledgerctl {' '.join(args)} raised {result.exception!r}:\n"
                + "".join(traceback.format_exception(*result.exc_info)) + result.output)
        if code is not None:
            assert result.exit_code == code, (
                f"ledgerctl {' '.join(args)} exited {result.exit_code}, expected {code}:\n"
                f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
        return result

    yield invoke
    for ctx in contexts:
        if ctx._pool is not None:
            ctx._pool.close()


@dataclasses.dataclass
class PreparedLedger:
    """What ``prepared_ledger`` built: every event's id, type and status, and the derived expectations."""
    rows: dict[str, tuple[str, str]]          # id -> (type, status)
    groups: dict[str, list[str]]              # name -> ids (see prepared_ledger)
    oldest_unprocessed_min_age_s: float

    def by_status(self) -> dict[str, int]:
        return dict(collections.Counter(status for _, status in self.rows.values()))

    def by_status_and_type(self) -> list[dict]:
        counts = collections.Counter((status, type_) for type_, status in self.rows.values())
        return [{"status": s, "type": t, "events": n} for (s, t), n in sorted(counts.items())]

    def ids(self, *, status: str | None = None, type_prefix: str | None = None) -> set[str]:
        return {i for i, (t, s) in self.rows.items()
                if (status is None or s == status) and (type_prefix is None or t.startswith(type_prefix))}


@pytest.fixture
def prepared_ledger(kit) -> PreparedLedger:
    """A ledger with events in every state, built through the real receiver and worker code paths.

    * ``processed``: a subscription lifecycle (customer.created, customer.subscription.*, invoice.*), 10 events;
    * ``unsupported``: 2 x invoice.upcoming (no id, as Stripe sends it: the mirror cannot keep it, no typed
      handler takes it) -> failed_permanent / object_without_id;
    * ``rejected``: 1 x test.permanent -> failed_permanent / rejected_by_handler;
    * ``due_retry`` / ``scheduled_retry``: test.flaky -> failed_recoverable, next attempt 1 min ago / in 1 h;
    * ``in_progress`` / ``expired_lease``: test.effect claimed, lease ending in 1 h / 1 min ago;
    * ``received``: 2 x invoice.created never processed; ``oldest`` (the first) received 2 h ago;
    * ``old``: one processed customer.created and one unsupported invoice.upcoming received 3 days ago.

    Only timestamps are set directly (received_at, next_attempt_at, lease_expires_at); every state comes from
    the receiver's insert, the processor, or a claim.
    """
    now = int(time.time())
    processor = kit.processor(waker=RecordingWaker())
    rows: dict[str, tuple[str, str]] = {}
    groups: dict[str, list[str]] = {}

    def add(group: str, evt: dict, status: str) -> str:
        kit.record(evt)
        rows[evt["id"]] = (evt["type"], status)
        groups.setdefault(group, []).append(evt["id"])
        return evt["id"]

    for evt in SubscriptionHistory().lifecycle().events:
        processor.process(add("processed", evt, "processed"))
    for n in range(2):
        processor.process(add("unsupported", event("invoice.upcoming", {"object": "invoice", "amount_due": n},
                                                   created=now), "failed_permanent"))
    processor.process(add("rejected", event("test.permanent", {"id": "obj_rejected"}, created=now),
                          "failed_permanent"))
    for group in ("due_retry", "scheduled_retry"):
        processor.process(add(group, event("test.flaky", {"id": f"obj_{group}", "succeed_on_attempt": 99},
                                           created=now), "failed_recoverable"))
    claims = kit.ledger("prepared-claims")
    for group in ("in_progress", "expired_lease"):
        evt_id = add(group, event("test.effect", {"id": f"obj_{group}"}, created=now), "processing")
        assert claims.claim([evt_id], worker="prepared:0", lease_s=3600)
    for n in range(2):
        add("received", event("invoice.created", {"id": f"in_new_{n}", "object": "invoice"}, created=now),
            "received")
    groups["oldest"] = groups["received"][:1]
    groups["old"] = [groups["processed"][0], groups["unsupported"][0]]

    kit.execute("UPDATE ledger.events SET next_attempt_at = now() - interval '1 minute' WHERE id = ANY(%s)",
                (groups["due_retry"],))
    kit.execute("UPDATE ledger.events SET next_attempt_at = now() + interval '1 hour' WHERE id = ANY(%s)",
                (groups["scheduled_retry"],))
    kit.execute("UPDATE ledger.events SET lease_expires_at = now() - interval '1 minute' WHERE id = ANY(%s)",
                (groups["expired_lease"],))
    kit.execute("UPDATE ledger.events SET received_at = now() - interval '2 hours' WHERE id = ANY(%s)",
                (groups["oldest"],))
    kit.execute("UPDATE ledger.events SET received_at = now() - interval '3 days' WHERE id = ANY(%s)",
                (groups["old"],))

    actual = {r["id"]: (r["type"], r["status"]) for r in kit.query("SELECT id, type, status FROM ledger.events")}
    assert actual == rows, "the prepared ledger did not come out as planned"
    return PreparedLedger(rows=rows, groups=groups, oldest_unprocessed_min_age_s=7200.0)
