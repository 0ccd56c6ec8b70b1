"""Grouping's leader/follower rules, with threads and a run function the test holds: a lone item
runs at once, items that arrive meanwhile share the next run, nobody is answered before the run that
holds its item returns, and a failure reaches exactly the items it is theirs."""
from __future__ import annotations

import threading
import time

import pytest

from workers.grouping import Grouping

pytestmark = pytest.mark.timeout(30)


class HeldRun:
    """A run function that records each group and, while ``hold`` is clear, waits before answering."""

    def __init__(self):
        self.groups: list[list] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()

    def __call__(self, items):
        self.groups.append(list(items))
        self.entered.set()
        assert self.hold.wait(10)
        return [f"ok:{item}" for item in items]


def submit_in_threads(group: Grouping, items) -> tuple[list[threading.Thread], dict]:
    answers: dict = {}

    def one(item):
        try:
            answers[item] = group.submit(item)
        except Exception as exc:
            answers[item] = exc

    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    return threads, answers


def wait_for_waiters(group: Grouping, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(group._waiting) < n:
        assert time.monotonic() < deadline, "the submits did not queue"
        time.sleep(0.005)


def test_a_lone_item_runs_at_once_in_a_group_of_its_own():
    run = HeldRun()
    group = Grouping(run)
    started = time.monotonic()
    assert group.submit("a") == "ok:a"
    assert time.monotonic() - started < 0.5
    assert run.groups == [["a"]]


def test_items_that_arrive_while_a_run_is_in_flight_share_the_next_and_none_is_answered_before_it():
    run = HeldRun()
    group = Grouping(run)
    run.hold.clear()
    first, first_answers = submit_in_threads(group, ["first"])
    assert run.entered.wait(5)
    later, answers = submit_in_threads(group, [f"e{n}" for n in range(10)])
    wait_for_waiters(group, 10)
    time.sleep(0.05)
    assert first_answers == {} and answers == {}, "answered before the run that holds it returned"
    run.hold.set()
    for thread in first + later:
        thread.join(10)
    assert first_answers == {"first": "ok:first"}
    assert answers == {f"e{n}": f"ok:e{n}" for n in range(10)}
    assert run.groups[0] == ["first"]
    assert sorted(run.groups[1]) == sorted(f"e{n}" for n in range(10)) and len(run.groups) == 2


def test_a_group_is_bounded_and_the_rest_lead_the_next():
    run = HeldRun()
    group = Grouping(run, max_group=4)
    run.hold.clear()
    first, _ = submit_in_threads(group, ["first"])
    assert run.entered.wait(5)
    later, answers = submit_in_threads(group, [f"e{n}" for n in range(10)])
    wait_for_waiters(group, 10)
    run.hold.set()
    for thread in first + later:
        thread.join(10)
    assert len(answers) == 10 and all(answer == f"ok:{item}" for item, answer in answers.items())
    assert [len(g) for g in run.groups] == [1, 4, 4, 2]


def test_a_failed_run_fails_its_group_alone_and_the_next_group_still_runs():
    calls: list[list] = []
    release = threading.Event()

    def run(items):
        calls.append(list(items))
        if len(calls) == 1:
            release.wait(10)
            raise ConnectionError("the ledger is unavailable")
        return [f"ok:{item}" for item in items]

    group = Grouping(run)
    first, first_answers = submit_in_threads(group, ["first"])
    while not calls:
        time.sleep(0.005)
    later, answers = submit_in_threads(group, ["a", "b"])
    wait_for_waiters(group, 2)
    release.set()
    for thread in first + later:
        thread.join(10)
    assert isinstance(first_answers["first"], ConnectionError)
    assert answers == {"a": "ok:a", "b": "ok:b"}
    assert group.submit("c") == "ok:c", "the group stayed in flight after a failure"


def test_an_item_s_own_failure_reaches_that_item_alone():
    def run(items):
        return [ValueError(f"bad {item}") if item == "bad" else f"ok:{item}" for item in items]

    group = Grouping(run)
    with pytest.raises(ValueError, match="bad bad"):
        group.submit("bad")
    assert group.submit("good") == "ok:good"


def test_up_to_max_in_flight_items_lead_runs_of_their_own_side_by_side():
    run = HeldRun()
    group = Grouping(run, max_in_flight=2)
    run.hold.clear()
    leaders, leader_answers = submit_in_threads(group, ["a", "b"])
    deadline = time.monotonic() + 5
    while len(run.groups) < 2:
        assert time.monotonic() < deadline, "the second item waited for the first's run"
        time.sleep(0.005)
    later, answers = submit_in_threads(group, ["c", "d", "e"])
    wait_for_waiters(group, 3)
    run.hold.set()
    for thread in leaders + later:
        thread.join(10)
    assert sorted(run.groups[:2]) == [["a"], ["b"]]
    assert {answer for answer in {**leader_answers, **answers}.values()} == {f"ok:{x}" for x in "abcde"}
    assert sum(len(g) for g in run.groups) == 5 and len(run.groups) <= 4
