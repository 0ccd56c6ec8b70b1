"""Object locks (ledger/sql/objects.sql, EventProcessor._apply_all) on real Postgres: two workers whose
batches share customers and subscriptions neither deadlock nor hold a batch waiting for another."""
from __future__ import annotations

import random
import threading
import time

import pytest

from devkit.factories import SubscriptionHistory, event
from devkit.procs import wait_until
from ledger.attempts import OBJECT_LOCK_BUDGET_S, OBJECT_WAIT_MS
from workers.processor import BATCH_HOLD_S, Outcome

pytestmark = pytest.mark.timeout(120)


def _deadlocks(kit) -> int:
    return kit.query("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")[0]["deadlocks"]


def _hash(kit, key: str) -> int:
    return kit.query("SELECT hashtextextended('ledger.object:' || %s, 0) AS h", (key,))[0]["h"]


@pytest.fixture
def histories(kit):
    """Six customers' lifecycles (subscription and invoice events), recorded and not processed yet."""
    events = []
    for n in range(6):
        events += SubscriptionHistory(start=1_700_000_000 + n).lifecycle().events
    ids = kit.record_many(events)
    return ids


def test_two_workers_with_interleaved_batches_over_shared_customers_never_deadlock(kit, histories):
    """Wake-ups handed out alternately to two workers (as a broker does with two consumers): each
    batch holds events of every customer, in delivery order, so without one global lock order
    the two would lock customers, subscriptions and entitlements in opposite orders."""
    rng = random.Random(7)
    ids = list(histories)
    rng.shuffle(ids)
    processors = [kit.processor(modules=(), name=f"worker-{n}") for n in range(2)]
    before = _deadlocks(kit)
    outcomes: list = []
    lock = threading.Lock()

    def run(processor, share):
        for start in range(0, len(share), 8):
            got = processor.process_batch(share[start:start + 8])
            with lock:
                outcomes.extend(got)

    threads = [threading.Thread(target=run, args=(processors[n], ids[n::2])) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not any(thread.is_alive() for thread in threads)

    assert _deadlocks(kit) == before
    failed = kit.query("SELECT id, failure_reason FROM ledger.events WHERE status <> 'processed'")
    assert failed == [] and set(outcomes) == {Outcome.PROCESSED}, failed
    assert kit.query("SELECT count(*) AS n FROM ledger.attempts WHERE outcome <> 'processed'")[0]["n"] == 0


def test_a_batch_commits_the_events_whose_objects_are_free_while_another_transaction_holds_one(kit):
    """No lock wait holds a batch: an event whose customer another transaction holds goes to a second
    transaction, and the batch's other events commit without waiting for that one."""
    busy, free = SubscriptionHistory(start=1_700_000_000), SubscriptionHistory(start=1_700_000_100)
    [busy_id, free_id] = kit.record_many([busy.lifecycle().events[0], free.lifecycle().events[0]])
    processor = kit.processor(modules=(), name="worker-a")
    outcomes = _batch_while_held(kit, processor, busy.customer_id, [busy_id, free_id], free_id, busy_id)
    assert outcomes == [Outcome.PROCESSED, Outcome.PROCESSED]
    assert kit.status(busy_id) == "processed"


def _batch_while_held(kit, processor, held: str, batch: list[str], free_id: str, busy_id: str,
                      meanwhile=lambda: None) -> list:
    """``batch`` processed while another transaction holds ``held``: the free event commits meanwhile, the
    busy one is still processing (``meanwhile`` checks more), then the hold ends and the batch's outcomes
    are returned."""
    outcomes: list = []
    with kit.ledger("holder").applying() as tx:
        assert tx.try_lock([held]) == {held}
        worker = threading.Thread(target=lambda: outcomes.extend(processor.process_batch(batch)))
        worker.start()
        wait_until(lambda: kit.status(free_id) == "processed", timeout_s=20,
                   what="the free event to commit while the busy one's customer is held")
        assert kit.status(busy_id) == "processing"
        meanwhile()
    worker.join(30)
    return outcomes


def test_a_member_whose_handler_reaches_for_sql_while_its_objects_are_held_runs_its_sql_once_later(kit):
    """The keys of a set-based round are taken just before anything is written: a handler's own SQL (or an
    effect) too. A member whose keys another transaction holds is stopped there, before its SQL runs, and
    goes in a later transaction; the members before it are written and commit; its SQL runs once."""
    kit.execute("CREATE TABLE IF NOT EXISTS public.raw_sql_runs (event_id text NOT NULL)")
    busy, free = SubscriptionHistory(start=1_700_000_100), SubscriptionHistory(start=1_700_000_000)
    [free_id, busy_id] = kit.record_many([free.lifecycle().events[0], busy.lifecycle().events[0]])
    processor = kit.processor(modules=(), name="worker-a")
    processor.registry.register("customer.created", lambda ctx: ctx.conn.execute(
        "INSERT INTO public.raw_sql_runs (event_id) VALUES (%s)", (ctx.event_id,)))

    def only_the_free_ones_sql_ran() -> None:
        assert kit.query("SELECT event_id FROM public.raw_sql_runs") == [{"event_id": free_id}]
    outcomes = _batch_while_held(kit, processor, busy.customer_id, [free_id, busy_id], free_id, busy_id,
                                 only_the_free_ones_sql_ran)
    assert outcomes == [Outcome.PROCESSED, Outcome.PROCESSED]
    runs = kit.query("SELECT event_id, count(*) AS n FROM public.raw_sql_runs GROUP BY 1 ORDER BY 1")
    assert runs == sorted([{"event_id": free_id, "n": 1}, {"event_id": busy_id, "n": 1}], key=lambda r: r["event_id"])
    assert kit.query("SELECT count(*) AS n FROM billing.customers")[0]["n"] == 2


def test_a_transaction_waiting_for_its_objects_holds_none_of_those_later_in_the_global_order(kit):
    """object_lock waits for its keys in ascending order of their hash: while it waits for the first,
    it holds none of the others, so two waiting transactions never hold what the other waits for."""
    # Two keys whose order by name is the reverse of their order by hash: sorting by name is not enough.
    names = [f"cus_lock_{n}" for n in range(8)]
    low, high = next((a, b) for a in names for b in names if b < a and _hash(kit, a) < _hash(kit, b))
    holder, waiter, prober = kit.ledger("holder"), kit.ledger("waiter"), kit.ledger("prober")
    waiting = threading.Event()
    done: list = []

    def wait_for_both():
        with waiter.applying() as tx:
            waiting.set()
            tx.lock([high, low])  # in the order a batch happened to meet them
            done.append(True)

    with holder.applying() as held:
        assert held.try_lock([low]) == {low}
        thread = threading.Thread(target=wait_for_both)
        thread.start()
        waiting.wait(10)
        wait_until(lambda: kit.query("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' "
                                     "AND NOT granted")[0]["n"] == 1, timeout_s=10, what="the waiter to wait")
        with prober.applying() as probe:
            assert probe.try_lock([high]) == {high}, "the waiter took a later key before the one it waits for"
    thread.join(10)
    assert done == [True]


def test_a_waiter_behind_a_holder_that_does_not_let_go_lets_go_of_its_own_keys_each_wait(kit):
    """A holder that keeps a key (a host gone silent inside its transaction) holds up the transaction that
    waits for it, but nobody behind that one: each wait lasts OBJECT_WAIT_MS, then the waiter lets go of
    the earlier keys it took, and queues for the set again; it gets them all once the holder is gone."""
    names = [f"cus_stuck_{n}" for n in range(8)]
    first, stuck = next((a, b) for a in names for b in names if a != b and _hash(kit, a) < _hash(kit, b))
    holder, waiter, other = kit.ledger("holder"), kit.ledger("waiter"), kit.ledger("other")
    done: list = []

    def wait_for_both():
        with waiter.applying() as tx:
            tx.lock([first, stuck])
            done.append(True)

    with holder.applying() as held:
        assert held.try_lock([stuck]) == {stuck}
        thread = threading.Thread(target=wait_for_both)
        thread.start()
        wait_until(lambda: kit.query("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' "
                                     "AND NOT granted")[0]["n"] == 1, timeout_s=10, what="the waiter to wait")
        # The waiter holds `first` while it waits for `stuck`; another transaction that needs `first` gets it
        # within a wait or two, and commits. It runs in a thread of its own so that a waiter that never lets
        # go fails this test instead of hanging it: the holder lets go below, whatever happened.
        other_took: list = []

        def take_first():
            started = time.monotonic()
            with other.applying() as tx:
                tx.lock([first])
            other_took.append(time.monotonic() - started)

        other_thread = threading.Thread(target=take_first)
        other_thread.start()
        other_thread.join(3 * OBJECT_WAIT_MS / 1000)
        still_waiting = not other_took
        assert not done
    other_thread.join(OBJECT_LOCK_BUDGET_S + 5)
    thread.join(3 * OBJECT_WAIT_MS / 1000 + 5)
    assert not still_waiting, "another transaction waited on the waiter's key past three waits"
    assert done == [True]


def test_a_handler_that_runs_long_never_holds_the_members_after_it_nor_their_objects(kit):
    """A member whose handler runs long holds its own transaction open: once that has lasted
    BATCH_HOLD_S, the batch commits and the members after it go in the next transaction. Meanwhile their
    objects were never locked, so another worker applies an event of the same customer at once."""
    slow_s = 4 * BATCH_HOLD_S
    history = SubscriptionHistory(start=1_700_000_000).lifecycle()
    # First in Stripe's order, the order a batch applies its members in.
    slow = kit.record(event("test.effect", {"id": "obj_slow_first", "sleep_s": slow_s}, created=1_700_000_000 - 10))
    # The second shares the first's customer and subscription.
    after_id, same_customer = kit.record_many(history.events[:2])
    batch, alone = kit.processor(name="worker-batch"), kit.processor(name="worker-alone")
    outcomes: list = []
    worker = threading.Thread(target=lambda: outcomes.extend(batch.process_batch([slow, after_id])))
    worker.start()
    wait_until(lambda: kit.status(slow) == "processing", timeout_s=10, what="the batch to be claimed")
    time.sleep(BATCH_HOLD_S / 2)  # the slow member's handler is running
    started = time.monotonic()
    assert alone.process(same_customer) == Outcome.PROCESSED
    assert time.monotonic() - started < BATCH_HOLD_S, "an object of a member after the slow one was held"
    assert kit.status(after_id) == "processing"
    worker.join(slow_s + 30)
    assert outcomes == [Outcome.PROCESSED, Outcome.PROCESSED]
    commits = kit.query("SELECT count(DISTINCT finished_at) AS n FROM ledger.attempts WHERE event_id = ANY(%s)",
                        ([slow, after_id],))[0]["n"]
    assert commits == 2, "the members after the slow one committed with it"


def test_the_countdown_path_takes_the_same_object_locks(kit):
    """process (a retry's wake-up, alone) is a batch of one: an event whose object another transaction
    holds waits for it in its second transaction rather than writing under it."""
    history = SubscriptionHistory(start=1_700_000_200)
    [event_id] = kit.record_many([history.lifecycle().events[1]])  # customer.subscription.created
    processor = kit.processor(modules=(), name="worker-a")
    holder = kit.ledger("holder")
    outcomes: list = []
    with holder.applying() as tx:
        assert tx.try_lock([history.subscription_id]) == {history.subscription_id}
        worker = threading.Thread(target=lambda: outcomes.append(processor.process(event_id)))
        worker.start()
        worker.join(1.0)
        assert worker.is_alive() and kit.status(event_id) == "processing"
    worker.join(30)
    assert outcomes == [Outcome.PROCESSED]


def test_object_keys_name_the_object_its_customer_and_its_subscription():
    from workers.handlers import object_keys

    assert object_keys({"data": {"object": {"id": "in_1", "customer": "cus_1", "subscription": "sub_1"}}}) == {
        "in_1", "cus_1", "sub_1"}
    assert object_keys({"data": {"object": {"id": "sub_1", "customer": {"id": "cus_2", "object": "customer"}}}}) == {
        "sub_1", "cus_2"}
    assert object_keys({"data": {"object": {"customer": "cus_3", "customer_account": "acct_3"}}}) == {
        "cus_3", "acct_3"}
    assert object_keys({"object": "v2.core.event"}) == set()
