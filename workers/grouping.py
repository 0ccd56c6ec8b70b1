"""Leader and followers: what concurrent callers of one process hand in goes out together, in one call,
as Postgres' own group commit shares one WAL flush among the transactions that wait for it.

The receiver's wake-ups use it (``Waker.wake_group``): the events that concurrent requests recorded are
announced by one message, so the workers' consumers, and the broker, pay for one message a group instead
of one per event. A caller that finds fewer than ``max_in_flight`` calls running leads: it takes every
item waiting (its own first) and runs their call at once, so a lone caller never waits out a window.
Callers that arrive while that many are running wait; when one ends, the first of them leads the next
group, with every item that arrived meanwhile. Nobody is answered before the call that holds its item
has returned.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, Sequence, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")

# Past this many, a group leaves the rest for the next: one statement's parameters stay bounded.
MAX_GROUP = 256


class _Slot(Generic[In, Out]):
    __slots__ = ("item", "ready", "leads", "result", "error")

    def __init__(self, item: In):
        self.item = item
        self.ready = threading.Event()  # set when its result (or error) is in, or when it is to lead
        self.leads = False
        self.result: Out | None = None
        self.error: BaseException | None = None


class Grouping(Generic[In, Out]):
    """``submit(item)`` returns ``run(group)``'s answer for ``item``, ``run`` being called with the
    items of every concurrent submit at once (in arrival order) and answering one result per item,
    in the same order. An exception ``run`` raises is raised to every submit of its group; an exception
    among its answers, to that item's submit alone."""

    def __init__(self, run: Callable[[Sequence[In]], Sequence[Out]], max_group: int = MAX_GROUP,
                 max_in_flight: int = 1):
        self._run = run
        self._max_group = max_group
        self._max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._waiting: list[_Slot[In, Out]] = []
        self._in_flight = 0

    def submit(self, item: In) -> Out:
        slot: _Slot[In, Out] = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            leads = self._in_flight < self._max_in_flight
            if leads:
                self._in_flight += 1
        if not leads:
            slot.ready.wait()
            leads = slot.leads
        if leads:
            self._lead()
        if slot.error is not None:
            raise slot.error
        if isinstance(slot.result, BaseException):  # that item's own failure
            raise slot.result
        return slot.result  # type: ignore[return-value]

    def _lead(self) -> None:
        with self._lock:
            group = self._waiting[: self._max_group]
            del self._waiting[: self._max_group]
        try:
            results = self._run([slot.item for slot in group])
            if len(results) != len(group):
                raise RuntimeError(f"a group of {len(group)} got {len(results)} answers")
            for slot, result in zip(group, results):
                slot.result = result
        except BaseException as exc:  # every caller of the group gets it
            for slot in group:
                slot.error = exc
        finally:
            with self._lock:
                successor = self._waiting[0] if self._waiting else None
                if successor is not None:
                    successor.leads = True
                else:
                    self._in_flight -= 1
            for slot in group:
                slot.ready.set()
            if successor is not None:
                successor.ready.set()
