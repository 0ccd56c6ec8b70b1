"""The acceptance specification (tests/e2e/features/*.feature), run against the real stack.

Every scenario runs on a real gunicorn receiver, real ``celery worker`` processes
running the product's handlers (tests/support/acceptance_release*.py), the session's
Postgres test database and its private Redis. Stripe is ``devkit.stripe_sim``: signed
deliveries over HTTP, redelivered on a non-2xx. Stacks (receiver + workers, per retry
profile) are started once for this module and reused; the ``db`` fixture empties the
ledger and billing tables before every scenario. Assertions are about business
outcomes: credits, workspaces, upcoming invoices and billing.* rows, and the event's final state.
"""
from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from pytest_bdd import given, parsers, scenarios, then, when

from devkit.factories import BASIL_API, OLD_API, SubscriptionHistory, event, new_id
from devkit.procs import free_port, pid_alive, wait_until
from devkit.servers import RabbitVhost
from devkit.stripe_sim import MANUAL, Answer, SimEvent, StripeSimulator, fixture_events
from tests.support import acceptance_business
from tests.support.acceptance import DEADLINE_S, Ledger, Stack, Stacks, kill_pid, sweep_until_redriven
from tests.support.constants import FIXTURES_DIR, WEBHOOK_SECRET
from tests.support.receiver import receiver_env

scenarios("features")


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True, params=["redis", "amqp"])
def acceptance_broker(request, redis_url):
    """Every scenario runs on each broker: Redis, and a RabbitMQ vhost of the run's own. Autouse: the
    scenarios reach the stack through their steps, which pytest cannot see when it parametrizes."""
    if request.param == "redis":
        yield redis_url
        return
    if not RabbitVhost.available():
        pytest.skip("no RabbitMQ on 127.0.0.1:5672 that rabbitmqctl can manage")
    with RabbitVhost(f"acceptance-{uuid.uuid4().hex[:8]}") as vhost:
        yield vhost.url


@pytest.fixture(scope="module")
def acceptance_stacks(acceptance_broker, database_url, tmp_path_factory):
    """Receivers and workers, per retry profile, started on first use and shared by this module's scenarios."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        acceptance_business.ensure_tables(conn)
    stacks = Stacks(database_url, acceptance_broker, WEBHOOK_SECRET, tmp_path_factory.mktemp("acceptance"))
    yield stacks
    stacks.close()


@dataclasses.dataclass
class World:
    """What a scenario has done so far, and the stack it runs on."""
    stacks: Stacks
    ledger: Ledger
    start_receiver: object
    tmp: Path
    profile: str = "quick retries"
    url: str | None = None                 # a receiver of the scenario's own, when it needs one
    event: SimEvent | None = None
    answers: list[Answer] = dataclasses.field(default_factory=list)
    snapshot: dict | None = None
    before: dict | None = None
    killed_pid: int | None = None
    stall_marker: Path | None = None
    replay_reason: str | None = None
    histories: list = dataclasses.field(default_factory=list)
    _stack: Stack | None = None
    _sim: StripeSimulator | None = None

    @property
    def stack(self) -> Stack:
        if self._stack is None:
            self._stack = self.stacks.get(self.profile)
        return self._stack

    def use(self, profile: str) -> None:
        assert self._stack is None, "choose the stack before the scenario uses it"
        self.profile = profile

    @property
    def stripe(self) -> StripeSimulator:
        if self._sim is None:
            self._sim = self.stack.simulator(url=self.url, seed=20240601)
        return self._sim

    @property
    def answer(self) -> Answer:
        return self.answers[-1]

    def wait_status(self, event_id: str, *statuses: str) -> dict:
        return self.ledger.wait_status(event_id, *statuses, logs=self.stack.logs)

    def close(self) -> None:
        if self.stall_marker is not None and self.stall_marker.exists():
            # A stalled attempt must not outlive its scenario (it holds row locks the next TRUNCATE needs).
            pid = int(self.stall_marker.read_text())
            if pid_alive(pid):
                kill_pid(pid)
        self.ledger.execute("DELETE FROM public.acceptance_faults")
        self.ledger.close()


@pytest.fixture
def world(db, acceptance_stacks, start_receiver, tmp_path):
    ledger = Ledger(db)
    ledger.reset_business()
    w = World(acceptance_stacks, ledger, start_receiver, tmp_path)
    yield w
    w.close()


# -- events -------------------------------------------------------------------------------------

def paid_invoice_event() -> SimEvent:
    """The invoice.paid event of a fresh subscription lifecycle, as Stripe sends it."""
    history = SubscriptionHistory(start=int(time.time()) - 86400).lifecycle()
    return SimEvent.from_dict(next(e for e in history.events if e["type"] == "invoice.paid"))


def real_payload(event_type: str, *, without_reference: bool) -> SimEvent:
    """A real Stripe payload of this type from the shared fixtures (real ids preferred), else a generated one."""
    found = [e for e in fixture_events(FIXTURES_DIR, types=[event_type])
             if not without_reference or not e.data["data"]["object"].get("client_reference_id")]
    found.sort(key=lambda e: ("syncengine" not in e.source, e.source))
    if found:
        return found[0]
    # No fixtures on this machine: the same shape, generated.
    obj = {"object": "invoice", "customer": new_id("cus"), "amount_due": 2500,
           "status": "draft"} if event_type == "invoice.upcoming" else {
        "id": new_id("cs"), "object": "checkout.session", "customer": new_id("cus"), "mode": "payment",
        "status": "complete", "payment_status": "paid", "client_reference_id": None}
    return SimEvent.from_dict(event(event_type, obj, created=int(time.time())), source="generated")


def deliver(world: World, evt: SimEvent) -> Answer:
    """Stripe delivers ``evt`` (redelivering on a non-2xx) until acknowledged; the acknowledging answer."""
    world.event = evt
    got = world.stripe.deliver(evt)
    world.answers.extend(got)
    assert got[-1].ok, f"Stripe gave up on {evt.id}: {[(a.status, a.error) for a in got]}\n{world.stack.logs()}"
    return got[-1]


# -- choosing the deployment ----------------------------------------------------------------------

@given("the ledger's own retries wait up to an hour")
def _(world):
    world.use("hour backoff")


@given("the ledger retries failed attempts within a second")
def _(world):
    world.use("quick retries")


@given(parsers.parse("worker leases last {seconds:d} seconds"))
def _(world, seconds):
    world.use("quick retries")
    assert world.stack.settings.lease_s == seconds


@given("release 1 of our handlers is deployed")
def _(world):
    world.stack.ensure_release(1)


@when("release 2 of our handlers, which handles it, is deployed")
def _(world):
    world.stack.deploy(2)


@given("the receiver cannot reach the broker")
def _(world):
    settings = world.stack.settings
    # Nothing listens there, on the stack's own kind of broker.
    dead_broker = (f"amqp://guest:guest@127.0.0.1:{free_port()}//" if settings.broker_url.startswith("amqp")
                   else f"redis://127.0.0.1:{free_port()}/0")
    receiver = world.start_receiver(receiver_env(settings.database_url, dead_broker, WEBHOOK_SECRET,
                                                 LEDGER_QUEUE=settings.queue_name, BROKER_TIMEOUT_S="0.5"),
                                    workers=1)
    world.url = f"http://127.0.0.1:{receiver.port}/webhooks/stripe"


# -- faults -------------------------------------------------------------------------------------

@given("the credits database rejects writes with a serialization failure")
def _(world):
    world.stack  # deployed before the fault is armed
    world.ledger.execute("INSERT INTO public.acceptance_faults (kind) VALUES ('serialization_failure')")


@given("the credits database has recovered")
@when("the credits database has recovered")
def _(world):
    world.ledger.execute("DELETE FROM public.acceptance_faults WHERE kind = 'serialization_failure'")


@given("the worker will stall after its business write, before recording the event processed")
def _(world):
    world.stall_marker = world.tmp / "stalled-attempt.pid"
    world.ledger.execute("INSERT INTO public.acceptance_faults (kind, marker) VALUES ('crash', %s)",
                         (str(world.stall_marker),))


@when("the worker process is killed with SIGKILL while it holds its uncommitted business write")
def _(world):
    marker = world.stall_marker
    pid = int(wait_until(lambda: marker.exists() and marker.read_text(), timeout_s=DEADLINE_S,
                         what="the worker to stall between its business write and the commit"))
    assert pid in world.stack.worker.children() or not pid_alive(pid), "the stalled process is a worker's child"
    kill_pid(pid)
    world.killed_pid = pid
    world.ledger.execute("DELETE FROM public.acceptance_faults WHERE kind = 'crash'")


# -- Stripe -------------------------------------------------------------------------------------

@given("an invoice.paid event is recorded")
@when("Stripe delivers an invoice.paid event")
def _(world):
    answer = deliver(world, paid_invoice_event())
    assert answer.outcome["outcome"] == "received"


@given("an invoice.paid event has been delivered and processed")
def _(world):
    deliver(world, paid_invoice_event())
    world.before = world.wait_status(world.event.id, "processed")
    world.snapshot = world.ledger.snapshot()
    assert world.ledger.credits(world.event.data["data"]["object"]["id"]) == 1


@when("Stripe retries the same event")
@when("Stripe delivers the same event again")
def _(world):
    world.answers.append(world.stripe.send(world.event, MANUAL))
    assert world.answer.ok, world.answer


@when(parsers.parse("Stripe delivers {copies:d} copies of an invoice.paid event at the same moment"))
def _(world, copies):
    world.event = paid_invoice_event()
    world.answers = world.stripe.send_concurrently(world.event, copies)


@when(parsers.re(r"Stripe delivers a real (?P<event_type>[a-z_.]+) payload(?P<without> without client_reference_id)?"))
def _(world, event_type, without):
    answer = deliver(world, real_payload(event_type, without_reference=bool(without)))
    assert answer.outcome["outcome"] == "received"


@then("Stripe's delivery is acknowledged as a duplicate")
def _(world):
    assert (world.answer.status, world.answer.outcome["outcome"]) == (200, "duplicate")


@then("no worker is woken for it")
def _(world):
    assert world.answer.outcome["enqueued"] is False


@then("Stripe's delivery is acknowledged as received, without waking a worker")
def _(world):
    assert (world.answer.status, world.answer.outcome["outcome"]) == (200, "received")
    assert world.answer.outcome["enqueued"] is False


@then("every copy is acknowledged")
def _(world):
    assert all(a.ok for a in world.answers), [(a.status, a.outcome, a.error) for a in world.answers]


@then("exactly one copy is recorded as new and the others as duplicates")
def _(world):
    outcomes = sorted(a.outcome["outcome"] for a in world.answers)
    assert outcomes == ["duplicate"] * (len(world.answers) - 1) + ["received"]
    assert world.ledger.event(world.event.id)["deliveries"] == len(world.answers)


@then("Stripe delivered the event only once")
def _(world):
    assert len(world.stripe.answers_for(world.event.id)) == 1
    assert world.ledger.event(world.event.id)["deliveries"] == 1


# -- the event's life -----------------------------------------------------------------------------

@given("processing fails before completion")
def _(world):
    evt = world.event

    def failed_attempt():
        return [a for a in world.ledger.attempts(evt.id) if a["outcome"] == "failed_recoverable"]
    [first, *_] = wait_until(failed_attempt, timeout_s=DEADLINE_S, what=f"an attempt at {evt.id} to fail")
    assert first["error_class"] == "SerializationFailure" and "40001" in first["error"], first
    # Nothing of the failed attempt is kept: neither the credits nor the built-in invoice write.
    invoice_id = evt.data["data"]["object"]["id"]
    assert world.ledger.credits(invoice_id) == 0
    assert world.ledger.rows("SELECT id FROM billing.invoices WHERE id = %s", (invoice_id,)) == []


@then("processing is attempted again")
def _(world):
    world.wait_status(world.event.id, "processed", "failed_permanent")
    attempts = world.ledger.attempts(world.event.id)
    assert len(attempts) >= 2
    assert attempts[0]["outcome"] == "failed_recoverable"
    assert attempts[-1]["outcome"] == "processed"


@then("processing is attempted again by another process")
def _(world):
    world.wait_status(world.event.id, "processed", "failed_permanent")
    attempts = world.ledger.attempts(world.event.id)
    assert [a["outcome"] for a in attempts] == ["lease_expired", "processed"]
    assert attempts[0]["worker"].endswith(f":{world.killed_pid}")
    assert attempts[1]["worker"] != attempts[0]["worker"]


@then("the event ends processed")
def _(world):
    row = world.wait_status(world.event.id, "processed", "failed_permanent")
    assert row["status"] == "processed", f"{row['failure_reason']}: {row['last_error']}"
    assert row["failure_reason"] is None and row["processed_at"] is not None


@then(parsers.parse('the event ends failed_permanent with reason "{reason}"'))
def _(world, reason):
    row = world.wait_status(world.event.id, "failed_permanent", "processed")
    assert (row["status"], row["failure_reason"]) == ("failed_permanent", reason)


@then(parsers.parse('its recorded error says "{text}"'))
def _(world, text):
    assert text in world.ledger.event(world.event.id)["last_error"]


@then("the event was attempted only once")
def _(world):
    assert len(world.ledger.attempts(world.event.id)) == 1
    assert world.ledger.event(world.event.id)["attempts"] == 1


@then("the recovery sweep does not pick it up")
def _(world):
    done = world.stack.ledgerctl("sweep", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["redriven"] == 0
    assert world.ledger.event(world.event.id)["status"] == "failed_permanent"


@then("the event is waiting as received, with nothing applied")
def _(world):
    row = world.ledger.event(world.event.id)
    assert (row["status"], row["attempts"]) == ("received", 0)
    assert world.ledger.credits(world.event.data["data"]["object"]["id"]) == 0


@then("no credits are visible and the event still shows the dead worker's attempt in progress")
def _(world):
    invoice_id = world.event.data["data"]["object"]["id"]
    assert world.ledger.credits(invoice_id) == 0
    assert world.ledger.rows("SELECT id FROM billing.invoices WHERE id = %s", (invoice_id,)) == []
    row = world.ledger.event(world.event.id)
    assert row["status"] == "processing"
    [attempt] = world.ledger.attempts(world.event.id)
    assert attempt["outcome"] == "running" and attempt["worker"].endswith(f":{world.killed_pid}")


@when(parsers.parse("{rescue} after the dead worker's lease expired"))
def _(world, rescue):
    wait_until(lambda: (lambda r: r["lease_expires_at"] < r["db_now"])(world.ledger.event(world.event.id)),
               timeout_s=DEADLINE_S, what="the dead worker's lease to expire")
    if rescue == "Stripe delivers the event again":
        world.answers.append(world.stripe.send(world.event, MANUAL))
        assert world.answer.ok and world.answer.outcome["enqueued"] is True, world.answer
    elif rescue == "the recovery sweep runs":
        sweep_until_redriven(world.stack, world.event.id)
    else:
        raise AssertionError(f"unknown rescue {rescue!r}")


@when("the operator runs the recovery sweep, ledgerctl sweep")
def _(world):
    sweep_until_redriven(world.stack, world.event.id)


@when(parsers.parse('the operator replays the event with ledgerctl replay --why "{why}"'))
def _(world, why):
    world.replay_reason = why
    done = world.stack.ledgerctl("replay", world.event.id, "--why", why)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"replayed {world.event.id} (was failed_permanent)" in done.stdout


@then("the replay is in the event's history with its reason")
def _(world):
    done = world.stack.ledgerctl("events", "show", world.event.id, "--json")
    assert done.returncode == 0, done.stderr
    audit = json.loads(done.stdout)["audit"]
    assert [(a["action"], a["from_status"], a["reason"]) for a in audit] == [
        ("replay", "failed_permanent", world.replay_reason)]


# -- business outcomes ------------------------------------------------------------------------------

@then("the credits for the invoice are granted exactly once")
def _(world):
    world.wait_status(world.event.id, "processed", "failed_permanent")
    invoice = world.event.data["data"]["object"]
    rows = world.ledger.rows("SELECT * FROM public.acceptance_credits WHERE invoice_id = %s", (invoice["id"],))
    assert [(r["customer_id"], r["credits"], r["event_id"]) for r in rows] == [
        (invoice["customer"], invoice["amount_paid"] // 100, world.event.id)]
    [billed] = world.ledger.rows("SELECT status, amount_paid FROM billing.invoices WHERE id = %s", (invoice["id"],))
    assert billed == {"status": "paid", "amount_paid": invoice["amount_paid"]}


@then("the invoice is recorded paid, once")
def _(world):
    invoice = world.event.data["data"]["object"]
    assert world.ledger.rows("SELECT status, source_event_id FROM billing.invoices") == [
        {"status": "paid", "source_event_id": world.event.id}]


@then("the business rows are exactly as they were")
def _(world):
    assert world.ledger.snapshot() == world.snapshot
    row = world.ledger.event(world.event.id)
    assert (row["status"], row["processed_at"]) == ("processed", world.before["processed_at"])


@then("nothing of it is applied")
def _(world):
    written = {table: rows for table, rows in world.ledger.snapshot().items() if rows}
    assert written == {}


@then("the upcoming invoice is noticed exactly once")
def _(world):
    invoice = world.event.data["data"]["object"]
    customer = invoice.get("customer")
    rows = world.ledger.rows("SELECT customer_id, amount_due, event_id FROM public.acceptance_upcoming")
    assert rows == [{"customer_id": customer if isinstance(customer, str) else None,
                     "amount_due": invoice.get("amount_due"), "event_id": world.event.id}]


@then("a workspace is provisioned for it exactly once")
def _(world):
    session = world.event.data["data"]["object"]
    customer = session.get("customer")
    rows = world.ledger.rows("SELECT checkout_session_id, workspace, event_id FROM public.acceptance_workspaces")
    assert rows == [{"checkout_session_id": session["id"], "workspace": f"customer:{customer or session['id']}",
                     "event_id": world.event.id}]
    assert world.ledger.value("SELECT count(*) FROM billing.checkout_sessions WHERE id = %s", (session["id"],)) == 1


# -- ordering ---------------------------------------------------------------------------------------

API_VERSIONS = {"pre-basil": OLD_API, "basil": BASIL_API}


@given(parsers.parse("two customers going through the same subscription lifecycle with {api} payloads: "
                     "created, trialing, active, past_due, active, canceled, with invoices"))
def _(world, api):
    price, product, start = new_id("price"), new_id("prod"), int(time.time()) - 90 * 86400
    world.histories = [SubscriptionHistory(api_version=API_VERSIONS[api], start=start, price_id=price,
                                           product_id=product).lifecycle() for _ in range(2)]
    statuses = [e["data"]["object"]["status"] for e in world.histories[0].events
                if e["type"].startswith("customer.subscription.")]
    assert statuses == ["trialing", "active", "past_due", "active", "active", "canceled"]


def sim_events(history) -> list[SimEvent]:
    return [SimEvent.from_dict(e) for e in history.events]


@when("Stripe delivers the first customer's events in order, each one processed before the next")
def _(world):
    for evt in sim_events(world.histories[0]):
        deliver(world, evt)
        world.wait_status(evt.id, "processed")


@when(parsers.parse("Stripe delivers the second customer's events {order}"))
def _(world, order):
    events = sim_events(world.histories[1])
    if order == "in reverse order":
        options = {"reverse": True}
    else:
        m = re.fullmatch(r"shuffled within a window of (\d+), with (\d+)% duplicates and (\d+)% sent as "
                         r"simultaneous copies", order)
        assert m, f"unknown order {order!r}"
        options = {"shuffle_window": int(m[1]), "duplicates": int(m[2]) / 100,
                   "concurrent_duplicates": int(m[3]) / 100}
    sim = world.stripe
    sim.run(events, **options)
    assert not sim.gave_up
    sent = sorted((a.sent_at, a.event_id) for e in events for a in sim.answers_for(e.id)[:1])
    assert [event_id for _, event_id in sent] != [e.id for e in events], "the delivery order must differ"


@then("every event of both customers ends processed")
def _(world):
    for history in world.histories:
        for evt in history.events:
            assert world.wait_status(evt["id"], "processed", "failed_permanent")["status"] == "processed"


def _normalized(rows: list[dict], history, *, drop: tuple[str, ...]) -> list[dict]:
    """Rows without the ids that differ between two customers; the writing event as its place in the lifecycle."""
    ids = [e["id"] for e in history.events]
    return [{**{k: v for k, v in row.items() if k not in drop + ("source_event_id", "updated_at")},
             "source_event": ids.index(row["source_event_id"])} for row in rows]


def _invoice_ids(history) -> list[str]:
    return list(dict.fromkeys(e["data"]["object"]["id"] for e in history.events if e["type"].startswith("invoice.")))


@then("the second customer's subscription equals the first customer's")
def _(world):
    subs = [_normalized(world.ledger.rows("SELECT * FROM billing.subscriptions WHERE id = %s", (h.subscription_id,)),
                        h, drop=("id", "customer_id")) for h in world.histories]
    assert len(subs[0]) == 1 and subs[1] == subs[0]


@then("the second customer's invoices and entitlements equal the first customer's")
def _(world):
    def invoices(h):
        return [_normalized(world.ledger.rows("SELECT * FROM billing.invoices WHERE id = %s", (i,)), h,
                            drop=("id", "customer_id", "subscription_id")) for i in _invoice_ids(h)]

    def customer(h):
        return _normalized(world.ledger.rows("SELECT * FROM billing.customers WHERE id = %s", (h.customer_id,)), h,
                           drop=("id", "email"))

    def entitlements(h):
        return world.ledger.rows("SELECT feature, source FROM billing.entitlements WHERE customer_id = %s "
                                 "ORDER BY 1, 2", (h.customer_id,))
    first, second = world.histories
    assert len(invoices(first)) == 2 and all(len(rows) == 1 for rows in invoices(first))
    assert invoices(second) == invoices(first)
    assert customer(second) == customer(first)
    assert entitlements(second) == entitlements(first)


@then(parsers.parse('each subscription\'s status is its last event\'s status, "{status}"'))
def _(world, status):
    for history in world.histories:
        last = history.events[-1]["data"]["object"]["status"]
        row = world.ledger.rows("SELECT status FROM billing.subscriptions WHERE id = %s", (history.subscription_id,))
        assert [r["status"] for r in row] == [last] == [status]


@then("each subscription event is in the subscription's history exactly once")
def _(world):
    for n, history in enumerate(world.histories):
        expected = sorted(e["id"] for e in history.events if e["type"].startswith("customer.subscription."))
        rows = world.ledger.rows("SELECT event_id, applied FROM billing.subscription_transitions "
                                 "WHERE subscription_id = %s ORDER BY event_id", (history.subscription_id,))
        assert [r["event_id"] for r in rows] == expected
        if n == 0:  # in order, each one processed before the next: every event applied
            assert all(r["applied"] for r in rows)
