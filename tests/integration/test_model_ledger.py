"""Model-based test of the event ledger's state machine (hypothesis ``RuleBasedStateMachine``).

Everything runs in-process against the real Postgres (the session database, wiped
before each example): the real ``EventStore`` (receiver side), ``EventProcessor``
with a real ``WorkerLedger`` (one pool per simulated worker), the real ``Sweeper``
and ``OperatorLedger.replay``. Events are of type ``model.effect``
(tests/support/model_handlers.py): the handler inserts one row into
``public.test_effects`` (no unique constraint) and then fails the attempt if a
fault was armed for the event.

Rules: deliver (new or redelivery; the wake-up may be lost), deliver the same id
from two threads at once, a stray wake-up, a batch of wake-ups run together
(``process_batch``, copies of one id among them), arm a recoverable / permanent fault for
the next attempt, stall a worker after its claim (it may resume later, possibly
after another worker took the event over), kill a worker in the middle of its
apply transaction,
expire one lease, let time pass (every retry due, every lease expired, every
wake-up overdue), run the sweep (and process what it woke), replay.

After every step the database must match a small in-memory model, and:
* an event has an effect iff it is processed, and never more than one;
* every failure state carries the reason the model predicts;
* a lease (and one running attempt) exists exactly while processing;
* the receiver's ``needs_wakeup`` answer follows the table in docs/guarantee.md;
* after a sweep, nothing that could run now is left with an overdue wake-up.

Time is driven with SQL: retries are scheduled 1000 s ahead (never due in real
time), leases last 600 s and a wake-up is overdue after 3600 s, so only the
"expire a lease" and "time passes" rules make anything due.

Profiles: ``model-ci`` (default: 100 examples of up to 30 steps) and
``model-nightly`` (``HYPOTHESIS_PROFILE=nightly``: 400 examples of up to 60 steps).
"""
from __future__ import annotations

import dataclasses
import os
import random
import threading
import uuid
from dataclasses import dataclass

import psycopg
import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from ledger.operator import OperatorLedger
from ledger.queries import SQL
from ledger.deliveries import EventStore
from ledger.attempts import WorkerLedger
from devkit.factories import event, incoming
from tests.support import model_handlers
from tests.support.workers import RecordingWaker, claim_one
from workers.app import make_celery
from workers.processor import Outcome
from workers.retry import RetryPolicy
from workers.sweep import Sweeper

MODEL_HANDLERS = "tests.support.model_handlers"
N_IDS = 4
MAX_ATTEMPTS = 3
RETRY_S = 1000.0      # > MAX_COUNTDOWN_S: no countdown wake-up, and never due in real time
LEASE_S = 600
OVERDUE_S = 3600.0    # 3600 * 2^6 s < the 30 days "time passes" moves wake-ups back
CLAIMABLE_NOW = ("(status = 'received' OR (status = 'failed_recoverable' AND next_attempt_at <= now())"
                 " OR (status = 'processing' AND lease_expires_at < now()))")

_health = list(HealthCheck)
hsettings.register_profile("model-ci", max_examples=100, stateful_step_count=30, deadline=None,
                           suppress_health_check=_health, print_blob=True)
hsettings.register_profile("model-nightly", max_examples=400, stateful_step_count=60, deadline=None,
                           suppress_health_check=_health, print_blob=True)


def profile() -> hsettings:
    name = os.environ.get("HYPOTHESIS_PROFILE", "")
    return hsettings.get_profile({"nightly": "model-nightly", "model-nightly": "model-nightly"}.get(name, "model-ci"))


class _Ceiling(random.Random):
    """Backoff without jitter: every retry is scheduled exactly RETRY_S ahead."""

    def uniform(self, a, b):
        return b


@dataclass
class Expected:
    status: str = "received"
    attempts: int = 0           # attempts ever started (ledger.events.attempts)
    tries: int = 0              # attempts since the last replay (the retry budget)
    reason: str | None = None
    due: bool = False           # failed_recoverable: next_attempt_at <= now()
    lease_expired: bool = False
    owner: str | None = None    # lease owner of the current claim, when a rule made it
    overdue: bool = False       # wakeup_at is older than any sweep threshold

    def claimable(self) -> bool:
        return (self.status == "received" or (self.status == "failed_recoverable" and self.due)
                or (self.status == "processing" and self.lease_expired))


class Env:
    """What the machine needs from the test's fixtures: pools, processors, sweeper, operator."""

    def __init__(self, kit):
        self.kit = kit
        self.settings = dataclasses.replace(
            kit.settings, lease_s=LEASE_S, max_attempts=MAX_ATTEMPTS, retry_base_s=RETRY_S, retry_cap_s=RETRY_S,
            sweep_overdue_s=OVERDUE_S, sweep_batch=500, queue_name=f"q-model-{uuid.uuid4().hex[:8]}",
            handler_modules=(MODEL_HANDLERS,))
        policy = RetryPolicy(base_s=RETRY_S, cap_s=RETRY_S, max_attempts=MAX_ATTEMPTS, rng=_Ceiling())
        self.processors = [dataclasses.replace(kit.processor(self.settings, waker=RecordingWaker(),
                                                             modules=(MODEL_HANDLERS,), name=f"model-{n}"),
                                               policy=policy)
                           for n in ("a", "b")]
        self.stores = [EventStore(kit.pool(f"model-receiver-{n}", self.settings)) for n in ("a", "b")]
        self.ledger = WorkerLedger(kit.pool("model-stalled", self.settings))
        self.waker = RecordingWaker()
        self.celery = make_celery(self.settings, publisher_only=True)
        self.sweeper = Sweeper(WorkerLedger(kit.pool("model-sweep", self.settings)), self.waker, self.celery,
                               self.settings)
        self.operator = OperatorLedger(kit.pool("model-operator", self.settings))

    def close(self):
        self.celery.close()


class LedgerMachine(RuleBasedStateMachine):
    env: Env  # set by the test before the machine runs

    def __init__(self):
        super().__init__()
        kit = self.env.kit
        kit.wipe()
        kit.execute("DELETE FROM public.test_effects")
        model_handlers.disarm_all()
        run = uuid.uuid4().hex[:8]
        self.ids = [f"evt_model_{run}_{n}" for n in range(N_IDS)]
        self.envelopes = {eid: event("model.effect", {"id": f"obj_{n}"}, created=1_700_000_000 + n, event_id=eid)
                          for n, eid in enumerate(self.ids)}
        self.model: dict[str, Expected] = {}
        self.faults: dict[str, str] = {}
        self.stalled: list = []  # claims of workers that stopped after claiming and may come back

    # -- the model's transitions ------------------------------------------------------------
    def _expect_delivery(self, eid: str) -> tuple[bool, str, bool]:
        """(inserted, status answered, needs_wakeup) for one delivery; updates the model."""
        m = self.model.get(eid)
        if m is None:
            self.model[eid] = Expected()
            return True, "received", True
        status = m.status
        if status == "failed_recoverable":
            m.due, m.overdue = True, False  # a redelivery makes a recoverable failure due now
        needs = status in ("received", "failed_recoverable") or (status == "processing" and m.lease_expired)
        return False, status, needs

    def _expect_claim(self, eid: str) -> Expected | None:
        m = self.model.get(eid)
        if m is None or not m.claimable():
            return None
        m.attempts += 1
        m.tries += 1
        m.status, m.lease_expired, m.owner = "processing", False, None
        return m

    def _expect_apply(self, eid: str, m: Expected) -> Outcome:
        """The rest of an attempt whose claim the model already counted."""
        m.owner, m.lease_expired = None, False
        if m.tries > MAX_ATTEMPTS:  # only through abandoned attempts: no handler runs
            return self._expect_fail(m, "failed_permanent", "retries_exhausted")
        fault = self.faults.pop(eid, None)
        if fault is None:
            m.status, m.reason, m.due = "processed", None, False
            return Outcome.PROCESSED
        if fault == "permanent":
            return self._expect_fail(m, "failed_permanent", "rejected_by_handler")
        if m.tries >= MAX_ATTEMPTS:
            return self._expect_fail(m, "failed_permanent", "retries_exhausted")
        return self._expect_fail(m, "failed_recoverable", "transient")

    @staticmethod
    def _expect_fail(m: Expected, status: str, reason: str) -> Outcome:
        m.status, m.reason, m.due = status, reason, False
        return Outcome(status)

    def _expect_attempt(self, eid: str) -> Outcome:
        m = self._expect_claim(eid)
        return Outcome.NOT_CLAIMED if m is None else self._expect_apply(eid, m)

    def _process(self, processor, eid: str) -> None:
        expected = self._expect_attempt(eid)
        got = processor.process(eid)
        assert got is expected, f"{eid}: attempt gave {got}, the model expects {expected}"

    def _deliver(self, store, eid: str):
        return store.record_delivery(incoming(self.envelopes[eid]))

    def _claim_and_abandon(self, eid: str, *, mid_apply: bool):
        if eid not in self.model:  # first delivered, its wake-up lost: the worker below claims it
            expected = self._expect_delivery(eid)
            delivery = self._deliver(self.env.stores[0], eid)
            assert (delivery.inserted, delivery.status.value, delivery.needs_wakeup) == expected
        elif self.model[eid].status == "processing":
            # Held by a worker that stalled or died: this one arrives after that lease ran out
            # (a stalled holder may still come back: resume_stalled_worker).
            self.expire_lease(self.ids.index(eid))
        rescue = self.model[eid].status == "processing"
        m = self._expect_claim(eid)
        claim = claim_one(self.env.ledger, eid, worker="model:gone", lease_s=LEASE_S)
        if m is None:
            assert claim is None, f"{eid} was claimed while the model says it is not claimable"
            return None
        assert claim is not None, f"{eid} could not be claimed while the model says it is claimable"
        assert (claim.attempt, claim.tries, claim.rescued) == (m.attempts, m.tries, rescue)
        m.owner = claim.lease_owner
        if mid_apply:
            # The apply transaction gets as far as its business write, then the process dies:
            # its connection goes away without COMMIT.
            conn = psycopg.connect(self.env.settings.database_url)
            try:
                keys = {"id": eid, "created": claim.created, "lease_owner": claim.lease_owner,
                        "attempt": claim.attempt}
                assert conn.execute(SQL.event_lock_if_lease_held, keys).fetchone() is not None
                conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (eid,))
            finally:
                conn.close()
        return claim

    # -- rules ------------------------------------------------------------------------------
    @rule(n=st.integers(0, N_IDS - 1), wake=st.booleans())
    def deliver(self, n, wake):
        """A delivery (new or redelivered); when the receiver asks for a wake-up, a worker gets it
        (unless ``wake`` is false: the enqueue was lost)."""
        eid = self.ids[n]
        expected = self._expect_delivery(eid)
        delivery = self._deliver(self.env.stores[0], eid)
        got = (delivery.inserted, delivery.status.value, delivery.needs_wakeup)
        assert got == expected, f"{eid}: delivery answered {got}, the model expects {expected}"
        if delivery.needs_wakeup and wake:
            self._process(self.env.processors[0], eid)

    @rule(n=st.integers(0, N_IDS - 1))
    def deliver_concurrently(self, n):
        """Two copies of one event reach two receivers at once, and each wakes its own worker at once."""
        eid = self.ids[n]
        before = self.model.get(eid)
        was_new = before is None
        expected = self._expect_delivery(eid)
        barrier = threading.Barrier(2)
        deliveries: list = [None, None]
        outcomes: list = [None, None]
        errors: list = []

        def run(k):
            try:
                barrier.wait(timeout=30)
                deliveries[k] = self._deliver(self.env.stores[k], eid)
                barrier.wait(timeout=30)
                if deliveries[k].needs_wakeup:
                    outcomes[k] = self.env.processors[k].process(eid)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        if was_new:
            assert sorted(d.inserted for d in deliveries) == [False, True]
            assert all(d.status.value == "received" and d.needs_wakeup for d in deliveries)
        else:
            for d in deliveries:
                assert (d.inserted, d.status.value, d.needs_wakeup) == expected
        if expected[2]:
            one = self._expect_attempt(eid)
            assert sorted(map(str, outcomes)) == sorted([str(one), str(Outcome.NOT_CLAIMED)]), \
                f"{eid}: concurrent attempts gave {outcomes}, the model expects one {one} and one not_claimed"
        else:
            assert outcomes == [None, None]

    @rule(n=st.integers(0, N_IDS - 1))
    def stray_wakeup(self, n):
        """A wake-up arrives whatever the event's state (a duplicate or late broker message)."""
        self._process(self.env.processors[1], self.ids[n])

    @rule(ns=st.lists(st.integers(0, N_IDS - 1), min_size=1, max_size=6))
    def batch_of_wakeups(self, ns):
        """Wake-ups a worker holds, run as one batch whatever the events' states: each id's first copy
        is an attempt like a lone wake-up's, its other copies are not claimed."""
        ids = [self.ids[n] for n in ns]
        expected = [Outcome.NOT_CLAIMED if eid in ids[:k] else self._expect_attempt(eid)
                    for k, eid in enumerate(ids)]
        got = self.env.processors[0].process_batch(ids)
        assert got == expected, f"{ids}: the batch gave {got}, the model expects {expected}"

    @rule(n=st.integers(0, N_IDS - 1), kind=st.sampled_from(["transient", "permanent"]))
    def fail_next_attempt(self, n, kind):
        eid = self.ids[n]
        self.faults[eid] = kind
        model_handlers.arm(eid, kind)

    @rule(n=st.integers(0, N_IDS - 1))
    def stall_worker(self, n):
        """A worker claims the event (delivered first if new; taken over if a stopped worker holds it)
        and stops (a long GC pause, a partition); it may resume later."""
        claim = self._claim_and_abandon(self.ids[n], mid_apply=False)
        if claim is not None:
            self.stalled.append(claim)

    @rule(n=st.integers(0, N_IDS - 1))
    def kill_worker_mid_apply(self, n):
        """A worker claims (the event delivered first if new; taken over if a stopped worker holds it),
        writes its business effect, and dies before COMMIT."""
        self._claim_and_abandon(self.ids[n], mid_apply=True)

    @precondition(lambda self: self.stalled)
    @rule(k=st.integers(0, 1000))
    def resume_stalled_worker(self, k):
        """A stalled worker wakes up and carries on with its attempt, whatever happened meanwhile."""
        claim = self.stalled.pop(k % len(self.stalled))
        m = self.model[claim.event_id]
        if m.status == "processing" and m.owner == claim.lease_owner:
            expected = self._expect_apply(claim.event_id, m)
        else:
            expected = Outcome.LEASE_LOST
        [got] = self.env.processors[1].attempt([claim])
        assert got is expected, f"{claim.event_id}: the resumed attempt gave {got}, the model expects {expected}"
        if expected is Outcome.LEASE_LOST and claim.event_id not in model_handlers.FAULTS:
            # The fence's refusal reaches the pipelined attempt either before its handler
            # runs or after (which used up an armed fault, its write rolled back): both are right.
            self.faults.pop(claim.event_id, None)

    @rule(n=st.integers(0, N_IDS - 1))
    def expire_lease(self, n):
        eid = self.ids[n]
        m = self.model.get(eid)
        if m is None or m.status != "processing":
            return
        self.env.kit.execute("UPDATE ledger.events SET lease_expires_at = now() - interval '1 second' "
                             "WHERE id = %s AND status = 'processing'", (eid,))
        m.lease_expired = True

    @rule()
    def time_passes(self):
        """Long enough that every retry is due, every lease expired and every wake-up overdue."""
        self.env.kit.execute(
            "UPDATE ledger.events SET wakeup_at = now() - interval '30 days',"
            " next_attempt_at = CASE WHEN status = 'failed_recoverable' THEN now() - interval '1 second'"
            "                        ELSE next_attempt_at END,"
            " lease_expires_at = CASE WHEN status = 'processing' THEN now() - interval '1 second'"
            "                         ELSE lease_expires_at END"
            " WHERE id = ANY(%s)", (self.ids,))
        for m in self.model.values():
            m.overdue = True
            m.due = m.status == "failed_recoverable"
            m.lease_expired = m.status == "processing"

    @rule()
    def sweep(self):
        """One sweep pass; its wake-ups are processed; then nothing that could run now is left overdue."""
        seen = len(self.env.waker.ids)
        result = self.env.sweeper.run_once()
        woken = self.env.waker.ids[seen:]
        expected = {eid for eid, m in self.model.items() if m.overdue and m.claimable()}
        assert not result.skipped_backlog
        assert len(woken) == len(set(woken)), f"the sweep woke an event twice: {woken}"
        assert set(woken) == expected, f"the sweep woke {sorted(woken)}, the model expects {sorted(expected)}"
        for eid in woken:
            self.model[eid].overdue = False  # wakeup_at = now()
        for eid in woken:
            self._process(self.env.processors[0], eid)
        stuck = self.env.kit.query(f"SELECT id, status FROM ledger.events WHERE id = ANY(%s) AND {CLAIMABLE_NOW}"
                                   " AND wakeup_at < now() - interval '1 day'", (self.ids,))
        assert not stuck, f"after the sweep, still runnable with an overdue wake-up: {stuck}"

    @rule(n=st.integers(0, N_IDS - 1))
    def replay(self, n):
        eid = self.ids[n]
        m = self.model.get(eid)
        got = self.env.operator.replay(eid, actor="model", reason="model test", force=False)
        if m is not None and m.status in ("failed_permanent", "failed_recoverable"):
            assert got == m.status
            m.status, m.reason, m.tries, m.due, m.overdue = "received", None, 0, False, False
        else:
            assert got is None, f"{eid} in {m and m.status} was replayed"

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def ledger_matches_model(self):
        rows = {r["id"]: r for r in self.env.kit.query(
            "SELECT e.id, e.status, e.attempts, e.attempts - e.attempt_base AS tries, e.failure_reason,"
            "       e.lease_owner, e.lease_expires_at < now() AS lease_expired,"
            "       e.next_attempt_at <= now() AS due,"
            "       (SELECT count(*) FROM public.test_effects f WHERE f.event_id = e.id) AS effects,"
            "       (SELECT count(*) FROM ledger.attempts a WHERE a.event_id = e.id AND a.outcome = 'running')"
            "           AS running"
            "  FROM ledger.events e WHERE e.id = ANY(%s)", (self.ids,))}
        assert set(rows) == set(self.model), f"ledger rows {sorted(rows)} vs model {sorted(self.model)}"
        for eid, m in self.model.items():
            row = rows[eid]
            assert row["effects"] <= 1, f"{eid}: effect applied {row['effects']} times"
            assert row["status"] == m.status, f"{eid}: ledger says {row['status']}, the model {m.status}"
            want_effects = 1 if m.status == "processed" else 0
            assert row["effects"] == want_effects, f"{eid} is {row['status']} with {row['effects']} effect(s)"
            assert (row["attempts"], row["tries"]) == (m.attempts, m.tries), (eid, row, m)
            if m.status.startswith("failed_"):
                assert row["failure_reason"], f"{eid}: {m.status} without a reason"
            assert row["failure_reason"] == m.reason, (eid, row["failure_reason"], m.reason)
            assert row["running"] == (1 if m.status == "processing" else 0), (eid, row)
            assert (row["lease_owner"] is not None) == (m.status == "processing"), (eid, row)
            if m.status == "processing":
                assert row["lease_expired"] == m.lease_expired, (eid, row, m)
                if m.owner is not None:
                    assert row["lease_owner"] == m.owner, (eid, row, m)
            if m.status == "failed_recoverable":
                assert row["due"] == m.due, (eid, row, m)
        total = self.env.kit.query("SELECT count(*) AS n FROM public.test_effects")[0]["n"]
        assert total == sum(1 for m in self.model.values() if m.status == "processed")


@pytest.fixture
def model_env(kit):
    env = Env(kit)
    LedgerMachine.env = env
    yield env
    env.close()
    model_handlers.disarm_all()


@pytest.mark.timeout(3600 if "nightly" in os.environ.get("HYPOTHESIS_PROFILE", "") else 900)
def test_the_ledger_behaves_like_its_model(model_env):
    run_state_machine_as_test(LedgerMachine, settings=profile())


# Fixed sequences of the same rules: the races a random run may need many examples to reach.
SCENARIOS = {
    "a stalled worker resumes after its lease was taken over by a worker that is still applying": [
        ("deliver", dict(n=0, wake=False)), ("stall_worker", dict(n=0)), ("expire_lease", dict(n=0)),
        ("stall_worker", dict(n=0)), ("resume_stalled_worker", dict(k=0)), ("resume_stalled_worker", dict(k=0)),
        ("stray_wakeup", dict(n=0))],
    "a stalled worker resumes after its lease expired, and nobody else took it": [
        ("deliver", dict(n=0, wake=False)), ("stall_worker", dict(n=0)), ("time_passes", {}),
        ("resume_stalled_worker", dict(k=0)), ("deliver", dict(n=0, wake=True))],
    "a worker killed mid-apply, then the sweep": [
        ("deliver", dict(n=1, wake=False)), ("kill_worker_mid_apply", dict(n=1)), ("time_passes", {}),
        ("sweep", {}), ("stray_wakeup", dict(n=1))],
    "a lost wake-up, then a redelivery of the received event": [
        ("deliver", dict(n=0, wake=False)), ("deliver", dict(n=0, wake=True)), ("deliver", dict(n=0, wake=True))],
    "a recoverable failure, redelivered, then a permanent one, replayed": [
        ("fail_next_attempt", dict(n=2, kind="transient")), ("deliver", dict(n=2, wake=True)),
        ("stray_wakeup", dict(n=2)), ("deliver", dict(n=2, wake=True)),
        ("fail_next_attempt", dict(n=2, kind="permanent")), ("replay", dict(n=2)),
        ("time_passes", {}), ("sweep", {}), ("stray_wakeup", dict(n=2))],
    "retries exhausted by failures and by dead workers": [
        ("fail_next_attempt", dict(n=3, kind="transient")), ("deliver", dict(n=3, wake=True)),
        ("kill_worker_mid_apply", dict(n=3)), ("kill_worker_mid_apply", dict(n=3)), ("time_passes", {}),
        ("kill_worker_mid_apply", dict(n=3)), ("time_passes", {}), ("sweep", {}),
        ("replay", dict(n=3)), ("deliver_concurrently", dict(n=3)), ("sweep", {})],
    "a batch with a copy, a fault, a stalled worker's expired lease and a done event": [
        ("deliver", dict(n=0, wake=True)), ("deliver", dict(n=1, wake=False)),
        ("fail_next_attempt", dict(n=1, kind="transient")), ("deliver", dict(n=2, wake=False)),
        ("stall_worker", dict(n=2)), ("expire_lease", dict(n=2)), ("deliver", dict(n=3, wake=False)),
        ("batch_of_wakeups", dict(ns=[3, 1, 0, 2, 3])), ("resume_stalled_worker", dict(k=0)),
        ("time_passes", {}), ("batch_of_wakeups", dict(ns=[1, 1]))],
    "two copies at once, new and after a recoverable failure": [
        ("deliver_concurrently", dict(n=0)), ("fail_next_attempt", dict(n=1, kind="transient")),
        ("deliver_concurrently", dict(n=1)), ("deliver_concurrently", dict(n=1)), ("deliver_concurrently", dict(n=0))],
}


@pytest.mark.parametrize("steps", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_scenario(model_env, steps):
    machine = LedgerMachine()
    try:
        machine.ledger_matches_model()
        for name, kwargs in steps:
            getattr(machine, name)(**kwargs)
            machine.ledger_matches_model()
    finally:
        machine.teardown()
