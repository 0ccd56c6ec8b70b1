"""Liveness beside the lease, on a real Postgres: a claim carries its worker's liveness key; the rescuer takes
over the leases of a worker whose liveness session ended (at once, not after the lease), and never those of a
live one however long it runs; a gone owner that comes back is fenced; a row its open transaction still locks
waits for a later pass; a liveness session ended under a live worker is replaced before the next claim; effects
are rescued like events; the workers' sessions carry the guards that make Postgres end a silent host's session.
(A transaction waiting for an object lock holds none meanwhile: tests/integration/test_worker_locks.py.)

The worker processes of tests/e2e/test_worker_rescue_e2e.py show the same with SIGKILL, SIGSTOP and a cut link.
"""
from __future__ import annotations

import threading
import time

import psycopg
import pytest

from devkit.factories import event
from ledger.attempts import WorkerLedger
from ledger.db import ProcessPool
from ledger.errors import LeaseLost
from ledger.liveness import Liveness
from ledger.outbox import OutboxLedger
from tests.support.workers import RecordingWaker, applying_one, claim_one
from workers import metrics
from workers.rescue import Rescuer

LEASE_S = 300  # far longer than any test: only a rescue can take these leases over


class _EffectWaker(RecordingWaker):
    def __init__(self):
        super().__init__()
        self.effects: list[int] = []

    def wake_effect(self, outbox_id: int) -> bool:
        self.effects.append(outbox_id)
        return True


@pytest.fixture
def worker_process(kit):
    """What a worker process has: its liveness session and a WorkerLedger that stamps its key; close()
    ends the session as the process's death would."""
    made = []

    def make(name: str):
        liveness = Liveness(kit.settings, name=f"{name}-liveness")
        made.append(liveness)
        return liveness, WorkerLedger(kit.pool(name), liveness=liveness)

    yield make
    for liveness in made:
        liveness.close()


@pytest.fixture
def rescuer(kit):
    waker = _EffectWaker()
    return Rescuer(kit.ledger("sweep"), waker, outbox=OutboxLedger(kit.pool("sweep"))), waker


def effect_event(kit, n: int = 0) -> str:
    return kit.record(event("test.effect", {"id": f"obj_rescue_{n}"}, created=int(time.time())))


def test_a_claim_carries_its_workers_liveness_key(kit, worker_process):
    liveness, ledger = worker_process("worker-a")
    evt_id = effect_event(kit)
    assert claim_one(ledger, evt_id, worker="host-a:1", lease_s=LEASE_S)
    [row] = kit.query("SELECT lease_liveness_key FROM ledger.events WHERE id = %s", (evt_id,))
    assert row["lease_liveness_key"] == liveness.key() is not None
    held = kit.query("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND granted "
                     "AND ((classid::bigint << 32) | objid::bigint) = %s", (liveness.key(),))
    assert held == [{"n": 1}]


def test_a_live_worker_keeps_its_lease_however_long_it_runs(kit, worker_process, rescuer):
    _, ledger = worker_process("worker-a")
    evt_id = effect_event(kit)
    claim = claim_one(ledger, evt_id, worker="host-a:1", lease_s=LEASE_S)
    rescue, waker = rescuer
    for _ in range(5):
        result = rescue.run_once()
        assert result.events == [] and waker.ids == []
    with applying_one(ledger, claim) as conn:       # and its attempt completes
        conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (evt_id,))
    assert kit.status(evt_id) == "processed" and kit.effects(evt_id) == 1
    assert [a["outcome"] for a in kit.attempts(evt_id)] == ["processed"]


def test_a_gone_worker_is_taken_over_at_once_and_fenced_when_it_comes_back(kit, worker_process, rescuer):
    liveness, ledger = worker_process("worker-a")
    ids = [effect_event(kit, n) for n in range(3)]
    claims = ledger.claim(ids, worker="host-a:1", lease_s=LEASE_S)
    assert len(claims) == 3
    rescue, waker = rescuer
    before = metrics.WORKER_RESCUES.labels("worker_gone", "event")._value.get()
    liveness.close()                                 # the process died: its session, and its lock, with it

    result = rescue.run_once()
    assert sorted(result.events) == sorted(ids) and sorted(waker.ids) == sorted(ids)
    assert metrics.WORKER_RESCUES.labels("worker_gone", "event")._value.get() == before + 3
    for evt_id in ids:
        row = kit.event(evt_id)
        assert row["status"] == "processing" and row["lease_expires_at"] <= row["db_now"]
        [attempt] = kit.attempts(evt_id)
        assert (attempt["outcome"], attempt["error_class"]) == ("worker_lost", "WorkerGone")
    assert rescue.run_once().events == []            # once

    _, other = worker_process("worker-b")
    taken = other.claim(ids, worker="host-b:2", lease_s=LEASE_S)
    assert len(taken) == 3 and all(c.attempt == 2 for c in taken)
    with pytest.raises(LeaseLost):                   # the gone owner, back late: fenced
        with applying_one(ledger, claims[0]) as conn:
            conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (ids[0],))
    with applying_one(other, taken[0]) as conn:
        conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (ids[0],))
    assert kit.effects(ids[0]) == 1
    assert [a["outcome"] for a in kit.attempts(ids[0])] == ["worker_lost", "processed"]


def test_a_row_the_gone_workers_transaction_still_locks_waits_for_a_later_pass(kit, worker_process, rescuer):
    liveness, ledger = worker_process("worker-a")
    evt_id = effect_event(kit)
    claim = claim_one(ledger, evt_id, worker="host-a:1", lease_s=LEASE_S)
    rescue, _ = rescuer
    with kit.connect() as apply_session:             # its apply transaction, open past its liveness session
        apply_session.execute("BEGIN")
        apply_session.execute("SELECT id FROM ledger.events WHERE id = %s FOR NO KEY UPDATE", (evt_id,))
        liveness.close()
        assert rescue.run_once().events == []        # skipped, not waited for
        apply_session.execute("ROLLBACK")            # Postgres ended that session too
    assert rescue.run_once().events == [evt_id]
    assert claim.lease_owner == kit.event(evt_id)["lease_owner"]   # expired, not reassigned: the claim does that


def test_a_liveness_session_ended_under_a_live_worker_is_replaced_before_its_next_claim(kit, worker_process,
                                                                                         rescuer):
    liveness, ledger = worker_process("worker-a")
    first, second = effect_event(kit, 1), effect_event(kit, 2)
    assert claim_one(ledger, first, worker="host-a:1", lease_s=LEASE_S)
    old_key = liveness.key()
    kit.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                ("worker-a-liveness",))
    time.sleep(0.2)
    assert claim_one(ledger, second, worker="host-a:1", lease_s=LEASE_S)
    new_key = liveness.key()
    assert new_key not in (None, old_key)
    # The claim under the old key is rescued (wasted work, fenced); the one under the new key is not.
    rescue, _ = rescuer
    assert rescue.run_once().events == [first]
    assert kit.query("SELECT lease_liveness_key FROM ledger.events WHERE id = %s", (second,)) == [
        {"lease_liveness_key": new_key}]


def test_an_effect_whose_dispatcher_is_gone_is_rescued_too(kit, rescuer):
    from ledger.outbox import record

    evt_id = effect_event(kit)
    with kit.connect() as conn:
        outbox_id = record(conn, idempotency_key=f"{evt_id}:test", effect="test.effect", event_id=evt_id,
                           ordering_key=None, payload={})
    liveness = Liveness(kit.settings, name="dispatcher-liveness")
    claim = OutboxLedger(kit.pool("dispatcher"), liveness=liveness).claim(outbox_id, lease_s=LEASE_S)
    assert claim is not None
    rescue, waker = rescuer
    assert rescue.run_once().effects == []
    liveness.close()
    assert rescue.run_once().effects == [outbox_id] and waker.effects == [outbox_id]
    assert OutboxLedger(kit.pool("dispatcher-b")).claim(outbox_id, lease_s=LEASE_S) is not None


def test_a_workers_sessions_carry_the_guards_that_end_a_silent_hosts_session(kit):
    pool = ProcessPool(kit.settings, name="guarded-worker", guarded=True)
    liveness = Liveness(kit.settings, name="guarded-liveness")
    try:
        liveness.key()
        with pool.get().connection() as conn:
            conn.execute("SELECT 1")
            shown = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in (
                "tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count", "tcp_user_timeout",
                "client_connection_check_interval", "idle_in_transaction_session_timeout")}
        # LEDGER_DEAD_PEER_S = 10: idle 4 s, then 3 probes 2 s apart; half the lease idle in a transaction.
        assert shown == {"tcp_keepalives_idle": "4", "tcp_keepalives_interval": "2", "tcp_keepalives_count": "3",
                         "tcp_user_timeout": "10000", "client_connection_check_interval": "2s",
                         "idle_in_transaction_session_timeout": f"{kit.settings.lease_s // 2}s"}
        [row] = kit.query("SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = 'guarded-liveness'")
        assert row["n"] == 1
    finally:
        pool.close()
        liveness.close()


def test_the_rescuer_never_takes_over_while_a_slow_handler_runs_in_another_thread(kit, worker_process, rescuer):
    """A handler that runs past several rescue passes (in a thread, as a pool process runs it) keeps its lease."""
    _, ledger = worker_process("worker-a")
    evt_id = effect_event(kit)
    claim = claim_one(ledger, evt_id, worker="host-a:1", lease_s=LEASE_S)
    rescue, _ = rescuer
    done = threading.Event()

    def slow():
        with applying_one(ledger, claim) as conn:
            conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (evt_id,))
            done.wait(10)
    thread = threading.Thread(target=slow)
    thread.start()
    try:
        for _ in range(4):
            assert rescue.run_once().events == []
            time.sleep(0.3)
    finally:
        done.set()
        thread.join()
    assert kit.status(evt_id) == "processed" and [a["outcome"] for a in kit.attempts(evt_id)] == ["processed"]


def test_a_worker_counts_as_alive_while_its_apply_transaction_runs(kit, worker_process, rescuer):
    """Its liveness session may end first (a blip on that one connection): its events are rescued only once
    its apply transaction, which holds their keys and rows, has ended too."""
    liveness, ledger = worker_process("worker-a")
    evt_id = effect_event(kit)
    claim = claim_one(ledger, evt_id, worker="host-a:1", lease_s=LEASE_S)
    rescue, _ = rescuer
    with pytest.raises(RuntimeError):
        with ledger.applying([claim]) as tx:
            tx.try_lock(["obj_rescue_0"])            # the transaction has begun, holding the claim's key
            liveness.close()
            assert rescue.run_once().events == []
            raise RuntimeError("the attempt fails: its transaction rolls back")
    assert rescue.run_once().events == [evt_id]


def test_a_stopped_workers_lease_governs_then_its_sessions_are_ended_so_its_rows_can_be_taken(kit, worker_process,
                                                                                              rescuer):
    """A worker stopped mid-pipeline (SIGSTOP): alive to Postgres, its transaction 'active', which no idle
    timeout ends. Under its lease nothing happens; once the lease ran out its sessions are ended, and the next
    claim takes the event."""
    liveness, ledger = worker_process("worker-a")
    evt_id = effect_event(kit)
    claim = claim_one(ledger, evt_id, worker="host-a:1", lease_s=2)
    rescue, _ = rescuer
    stopped, resumed, outcome = threading.Event(), threading.Event(), []

    def stopped_worker():
        try:
            with ledger.applying([claim]) as tx, tx.member(claim) as conn:
                conn.execute("INSERT INTO public.test_effects (event_id) VALUES (%s)", (evt_id,))
                stopped.set()
                resumed.wait(30)                     # stopped here: statements sent, nothing synced
            outcome.append("committed")
        except Exception as exc:
            outcome.append(type(exc).__name__)
    thread = threading.Thread(target=stopped_worker)
    thread.start()
    stopped.wait(10)
    assert rescue.run_once().events == []            # alive: its lease governs
    time.sleep(2.5)                                  # the lease runs out
    rescue.run_once()
    _, other = worker_process("worker-b")
    taken = claim_one(other, evt_id, worker="host-b:2", lease_s=LEASE_S)
    assert taken is not None and taken.rescued and taken.attempt == 2
    resumed.set()
    thread.join()
    assert outcome and outcome[0] != "committed"     # its connection was ended: nothing of it committed
    assert kit.effects(evt_id) == 0
    assert liveness.key() not in (None, claim.liveness_key)   # a new session and key, should it claim again
