"""Fencing: a worker whose lease expired and was re-claimed by another must not commit anything."""
from __future__ import annotations

import threading
import time

import psycopg
import pytest

from ledger.errors import LeaseLost
from ledger.queries import SQL
from ledger.states import EventStatus
from ledger.attempts import LEASE_NOT_HELD, FailureRecord, WorkerLedger
from devkit.factories import event
from devkit.procs import wait_until
from workers.processor import Outcome
from tests.support.workers import claim_one, applying_one

EFFECT_SQL = "INSERT INTO public.test_effects (event_id) VALUES (%s)"


def record_effect_event(kit) -> str:
    return kit.record(event("test.effect", {"id": "obj_fence"}, created=int(time.time())))


def wait_lease_expired(kit, event_id: str) -> None:
    wait_until(lambda: (lambda r: r["lease_expires_at"] is not None and r["lease_expires_at"] < r["db_now"])(
        kit.event(event_id)), timeout_s=30, what=f"lease of {event_id} to expire")


def take_over(kit, event_id: str):
    """Worker A claims with a 1 s lease and stalls; the lease expires; worker B re-claims."""
    ledger_a, ledger_b = kit.ledger("worker-a"), kit.ledger("worker-b")
    claim_a = claim_one(ledger_a, event_id, worker="host-a:1", lease_s=1)
    assert claim_a is not None and claim_a.attempt == 1
    assert claim_one(ledger_b, event_id, worker="host-b:2", lease_s=30) is None  # live lease: nobody else
    wait_lease_expired(kit, event_id)
    claim_b = claim_one(ledger_b, event_id, worker="host-b:2", lease_s=30)
    assert claim_b is not None and claim_b.attempt == 2
    assert claim_b.lease_owner != claim_a.lease_owner
    return ledger_a, claim_a, ledger_b, claim_b


def test_a_worker_whose_lease_was_taken_over_cannot_apply_or_finish(kit):
    evt_id = record_effect_event(kit)
    ledger_a, claim_a, ledger_b, claim_b = take_over(kit, evt_id)

    # A sequence is not transactional: a nextval that Postgres ran would show after the rollback.
    kit.execute("CREATE SEQUENCE IF NOT EXISTS public.fence_probe")
    probe_before = kit.query("SELECT last_value FROM public.fence_probe")[0]["last_value"]
    with pytest.raises(LeaseLost):
        with applying_one(ledger_a, claim_a) as conn:
            conn.execute(EFFECT_SQL, (evt_id,))
            conn.execute("SELECT nextval('public.fence_probe')")
    # The fence is the first statement: behind it, no business write even ran.
    assert kit.query("SELECT last_value FROM public.fence_probe")[0]["last_value"] == probe_before
    assert kit.effects(evt_id) == 0
    row = kit.event(evt_id)
    assert row["status"] == "processing" and row["lease_owner"] == claim_b.lease_owner

    # Nor can it record a failure over the new owner's attempt.
    with pytest.raises(LeaseLost):
        ledger_a.fail(claim_a, FailureRecord(EventStatus.FAILED_RECOVERABLE, "transient", "TransientError",
                                             "late", delay_s=1.0))
    row = kit.event(evt_id)
    assert row["status"] == "processing" and row["lease_owner"] == claim_b.lease_owner

    # The new owner finishes normally.
    with applying_one(ledger_b, claim_b) as conn:
        conn.execute(EFFECT_SQL, (evt_id,))
    row = kit.event(evt_id)
    assert row["status"] == "processed" and row["attempts"] == 2
    assert kit.effects(evt_id) == 1
    assert [a["outcome"] for a in kit.attempts(evt_id)] == ["lease_expired", "processed"]


def test_the_processor_reports_lease_lost_and_the_new_owner_finishes_with_one_effect(kit):
    evt_id = record_effect_event(kit)
    takeover: dict = {}

    class StallingLedger(WorkerLedger):
        """Worker A: after claiming, it stalls past its lease and worker B takes over."""

        def claim(self, event_ids, *, worker, lease_s):
            claims = super().claim(event_ids, worker=worker, lease_s=1)
            [event_id] = event_ids
            wait_lease_expired(kit, event_id)
            takeover["b"] = claim_one(kit.ledger("worker-b"), event_id, worker="host-b:2", lease_s=30)
            return claims

    processor_a = kit.processor()
    processor_a.ledger = StallingLedger(kit.pool("worker-a"))
    assert processor_a.process(evt_id) is Outcome.LEASE_LOST
    assert takeover["b"] is not None
    assert kit.effects(evt_id) == 0
    assert kit.event(evt_id)["lease_owner"] == takeover["b"].lease_owner

    with applying_one(kit.ledger("worker-b"), takeover["b"]) as conn:
        conn.execute(EFFECT_SQL, (evt_id,))
    assert kit.status(evt_id) == "processed"
    assert kit.effects(evt_id) == 1
    attempts = kit.attempts(evt_id)
    # Attempt 1 was closed by B's claim; A's own "lease lost" note never overwrites a closed attempt.
    assert [a["outcome"] for a in attempts] == ["lease_expired", "processed"]


def test_the_set_based_fence_leaves_out_a_taken_over_claim_and_its_finish_refuses_one(kit):
    evt_id = record_effect_event(kit)
    ledger_a, claim_a, ledger_b, claim_b = take_over(kit, evt_id)

    with ledger_a.applying_together([claim_a]) as tx:
        assert claim_a.event_id not in tx.held
        with pytest.raises(LeaseLost):
            with tx.member(claim_a):
                pass
    # A member applied past the fence (a defect) is refused by the finish: LL001, nothing commits.
    with pytest.raises(psycopg.Error) as refused:
        with ledger_a.applying_together([claim_a]) as tx:
            tx.held = frozenset({claim_a.event_id})
            with tx.member(claim_a) as conn:
                conn.execute(EFFECT_SQL, (evt_id,))
    assert refused.value.sqlstate == LEASE_NOT_HELD
    assert kit.effects(evt_id) == 0
    row = kit.event(evt_id)
    assert row["status"] == "processing" and row["lease_owner"] == claim_b.lease_owner


def test_marking_a_lost_lease_closes_an_attempt_still_running_as_lease_lost(kit):
    evt_id = record_effect_event(kit)
    ledger_a, claim_a, ledger_b, claim_b = take_over(kit, evt_id)
    # Had B's claim not closed it (e.g. an operator reset), A's note says what happened.
    kit.execute("UPDATE ledger.attempts SET outcome = 'running', finished_at = NULL WHERE event_id = %s AND attempt = 1",
                (evt_id,))
    ledger_a.mark_lease_lost(claim_a, "taken over")
    assert kit.attempts(evt_id)[0]["outcome"] == "lease_lost"


def test_at_the_sql_level_a_stale_lease_owner_cannot_lock_finish_or_fail(kit):
    evt_id = record_effect_event(kit)
    ledger_a, claim_a, ledger_b, claim_b = take_over(kit, evt_id)
    stale = {"id": evt_id, "created": claim_a.created, "lease_owner": claim_a.lease_owner, "attempt": claim_a.attempt}
    fresh = {"id": evt_id, "created": claim_b.created, "lease_owner": claim_b.lease_owner, "attempt": claim_b.attempt}
    before = kit.event(evt_id)

    # The apply transaction's fence and finish refuse with LL001 (it reads nothing back before COMMIT).
    for statement in (SQL.event_lock_if_lease_held, SQL.event_finish_if_lease_held):
        with kit.connect() as conn:
            with pytest.raises(psycopg.Error) as refused:
                with conn.transaction():
                    conn.execute(statement, stale)
            assert refused.value.sqlstate == LEASE_NOT_HELD
    # The failure path runs after a rollback, one statement, and reports no row.
    with kit.connect() as conn:
        with conn.transaction():
            failed = conn.execute(SQL.event_fail_if_lease_held, {
                **stale, "status": "failed_permanent", "reason": "x", "error_class": "X", "error": "x",
                "delay_s": None, "wake_scheduled": False}).fetchone()
            assert failed is None
    after = kit.event(evt_id)
    assert {k: after[k] for k in ("status", "lease_owner", "lease_expires_at", "attempts", "processed_at")} == \
           {k: before[k] for k in ("status", "lease_owner", "lease_expires_at", "attempts", "processed_at")}
    assert [a["outcome"] for a in kit.attempts(evt_id)] == ["lease_expired", "running"]

    # The current owner's statements do move it.
    with kit.connect() as conn:
        with conn.transaction():
            assert conn.execute(SQL.event_lock_if_lease_held, fresh).fetchone() is not None
            assert conn.execute(SQL.event_finish_if_lease_held, fresh).fetchone() == (evt_id,)
    assert kit.status(evt_id) == "processed"


def test_a_reclaim_during_an_apply_in_progress_gets_nothing_and_then_finds_it_done(kit):
    """Holding the row lock to COMMIT means nobody re-claims while we apply, even past the lease:
    the claim skips the locked row (its holder finishes it), and after COMMIT it is done."""
    evt_id = record_effect_event(kit)
    ledger_a, ledger_b = kit.ledger("worker-a"), kit.ledger("worker-b")
    claim_a = claim_one(ledger_a, evt_id, worker="host-a:1", lease_s=1)

    with applying_one(ledger_a, claim_a) as conn:
        conn.execute(EFFECT_SQL, (evt_id,))
        wait_lease_expired(kit, evt_id)  # still applying, lease now expired
        assert claim_one(ledger_b, evt_id, worker="host-b:2", lease_s=30) is None
    assert claim_one(ledger_b, evt_id, worker="host-b:2", lease_s=30) is None
    row = kit.event(evt_id)
    assert row["status"] == "processed" and row["attempts"] == 1
    assert kit.effects(evt_id) == 1


def test_in_the_pipelined_apply_a_savepoint_catches_a_statement_error_and_the_rest_commits_once(kit):
    """Statements are pipelined, so an error surfaces late; a savepoint waits for its own statements."""
    evt_id = record_effect_event(kit)
    ledger = kit.ledger("worker-a")
    claim = claim_one(ledger, evt_id, worker="host-a:1", lease_s=30)

    with applying_one(ledger, claim) as conn:
        conn.execute(EFFECT_SQL, (evt_id,))
        with pytest.raises(psycopg.errors.NotNullViolation):
            with conn.transaction():
                conn.execute("INSERT INTO public.test_effects (event_id) VALUES (NULL)")
        # Not committed yet: the apply transaction is still open around the savepoint.
        assert kit.effects(evt_id) == 0
    assert kit.status(evt_id) == "processed" and kit.effects(evt_id) == 1


def test_an_error_in_the_pipelined_apply_rolls_back_every_statement_before_it(kit):
    evt_id = record_effect_event(kit)
    ledger = kit.ledger("worker-a")
    claim = claim_one(ledger, evt_id, worker="host-a:1", lease_s=30)

    with pytest.raises(psycopg.errors.NotNullViolation):
        with applying_one(ledger, claim) as conn:
            conn.execute(EFFECT_SQL, (evt_id,))
            conn.execute("INSERT INTO public.test_effects (event_id) VALUES (NULL)")
    assert kit.effects(evt_id) == 0 and kit.status(evt_id) == "processing"
    # The connection went back to the pool clean: the next apply on it commits.
    with applying_one(ledger, claim) as conn:
        conn.execute(EFFECT_SQL, (evt_id,))
    assert kit.status(evt_id) == "processed" and kit.effects(evt_id) == 1
