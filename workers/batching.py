"""Wake-ups run in batches: what a worker's consumer does with the event wake-ups it holds.

Celery runs one task per message. For a task declared with ``Strategy=STRATEGY``
(``workers.process_event``) the consumer instead hands the wake-ups it holds to a
pool process together, as one call of the task's ``run_batch(args)`` with every
held message's argument. The message itself is unchanged (one id, so the
receiver's publish stays one command, and a message queued before an upgrade is
consumed like any other); only how the worker runs them is new:

* **A lone wake-up never waits for company.** While a pool process is idle, held
  wake-ups go at once (a batch of one, at low load). While every process is busy
  they gather, up to ``batch_max`` a batch, and the next batch goes when a process
  is free again. The batch size follows the load; no flush interval delays anything.
* **A busy worker does not sit on wake-ups.** A batch is handed to the pool only
  when a process is free, never queued behind running ones. Wake-ups held for
  ``MAX_HOLD_S`` with every process still busy (a handler that runs long: it may run
  up to half the lease) go back to the broker, for another worker to take, and the
  worker stops widening its prefetch window (below) until one of its batches ends.
* **A wake-up with a countdown (a retry's) goes Celery's own way**, through the
  default strategy: its timer, its prefetch accounting, one task for the one
  message. So does any message that is not a plain one-argument call.
* **Prefetch.** Held wake-ups widen the prefetch window by one each, as Celery does
  for the messages it holds for a countdown, up to ``(processes + 1) x batch_max``:
  enough for a batch to gather while every process runs one. Every other message
  (an effect's delivery, a countdown) still sees ``worker_prefetch_multiplier``
  per process, so a worker never hoards what an idle worker on another host could
  take; past the limit, held wake-ups count against that window too, and the
  consumer stops taking more.
* **Acks.** Every message of a batch is acked once the batch ran (task_acks_late).
  A batch whose pool process died (SIGKILL, OOM) is requeued instead
  (task_reject_on_worker_lost), as Celery does for one task (its claims are the
  rescuer's: workers/rescue.py; its wake-ups not claimed yet run elsewhere at once); a batch that failed
  otherwise (its hard time limit) is acked, and the sweep re-drives its events. A
  wake-up is only a pointer: one lost with its worker is re-driven by the sweep,
  a duplicate costs a failed compare-and-set.
* **Time limits** are the task's, for the batch as a whole (task_soft_time_limit,
  task_time_limit): the claims are made when the batch starts, so the soft limit,
  half the lease, still fires well before any of its leases expires.

Celery's view of each message: one ``received`` log line per wake-up, as for any
task, and one line per batch once it ran; task events (Flower's task view) for a
batch's messages are ``task-received``, then ``task-succeeded`` or ``task-failed``.
``inspect reserved`` and revocation do not see held wake-ups (nobody revokes one).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from billiard.exceptions import WorkerLostError
from celery import current_app
from celery.app.trace import LOG_RECEIVED
from celery.worker.strategy import default as default_strategy

log = logging.getLogger(__name__)

# The strategy, by name (Celery's Task.Strategy): ``@app.task(..., Strategy=STRATEGY, run_batch=...)``.
STRATEGY = "workers.batching:strategy"
# A wake-up held this long while every pool process stays busy goes back to the broker.
MAX_HOLD_S = 1.0


def run_batch(task_name: str, args: list) -> list | None:
    """In the pool process: the task's ``run_batch`` over the held wake-ups' arguments.

    Never raises: the solo and thread pools would raise it in the consumer itself. A batch
    that fails is logged and acked; its events are left to their leases and the sweep.
    """
    try:
        return list(current_app.tasks[task_name].run_batch(args))
    except Exception as exc:
        log.error("batch failed; its events are left to their leases and the sweep",
                  extra={"task": task_name, "wakeups": len(args), "error_class": type(exc).__name__},
                  exc_info=True)
        return None


def strategy(task, app, consumer, **options) -> Callable:
    """Celery's strategy for ``task``: its one-argument messages without a countdown are held and
    run in batches (see the module's docstring); any other message goes the default way."""
    one_by_one = default_strategy(task, app, consumer, **options)
    batches = _Batches(task, app, consumer)

    def on_message(message, body, ack, reject, callbacks, **kwargs):
        arg = _plain_argument(message)
        if arg is _NOT_PLAIN:
            return one_by_one(message, body, ack, reject, callbacks, **kwargs)
        batches.hold(_Held(message.headers.get("id"), arg, ack, reject))
        return None

    return on_message


_NOT_PLAIN = object()


def _plain_argument(message) -> Any:
    """The one argument of a protocol-2 message that runs now; _NOT_PLAIN for anything else."""
    headers = message.headers
    if not isinstance(headers, dict) or "task" not in headers or headers.get("eta") or headers.get("expires"):
        return _NOT_PLAIN
    try:
        args, kwargs, _embed = message.decode()
    except Exception:  # the default strategy reports a body it cannot read, as for any task
        return _NOT_PLAIN
    if kwargs or not isinstance(args, (list, tuple)) or len(args) != 1:
        return _NOT_PLAIN
    return args[0]


@dataclass
class _Held:
    task_id: str | None
    arg: Any
    ack: Callable
    reject: Callable
    held_since: float = field(default_factory=time.monotonic)
    qos: Any = None  # the prefetch window this message widened (None: it did not)


class _Batches:
    """One task's held wake-ups and running batches, in one consumer."""

    def __init__(self, task, app, consumer):
        self._task = task
        self._consumer = consumer
        self._pool = consumer.pool
        self._batch_max = max(1, int(getattr(task, "batch_max", 1)))
        self._soft_s = task.soft_time_limit or app.conf.task_soft_time_limit
        self._hard_s = task.time_limit or app.conf.task_time_limit
        requeue = task.reject_on_worker_lost
        self._requeue_lost = app.conf.task_reject_on_worker_lost if requeue is None else requeue
        self._errors = consumer.connection_errors
        self._eventer = consumer.event_dispatcher if task.send_events else None
        # The prefork pool calls back in the consumer's thread; the thread pool from its own threads.
        self._lock = threading.RLock()
        self._held: list[_Held] = []
        self._running = 0   # batches handed to the pool and not back yet
        self._widened = 0   # held messages the prefetch window was widened for
        # Every process stayed busy for MAX_HOLD_S: wake-ups went back to the broker, and the window is not
        # widened again until a batch ends (a process is free).
        self._saturated = False
        self._timer = None

    def hold(self, held: _Held) -> None:
        _log_received(self._task.name, held.task_id, held.arg)
        if self._events_enabled():
            self._eventer.send("task-received", uuid=held.task_id, name=self._task.name, args=repr([held.arg]),
                               kwargs="{}", root_id=held.task_id, parent_id=None, retries=0, eta=None, expires=None)
        with self._lock:
            qos = self._consumer.qos
            if qos is not None and not self._saturated and self._widened < (self._processes() + 1) * self._batch_max:
                qos.increment_eventually()
                held.qos = qos
                self._widened += 1
            self._held.append(held)
            self._flush_ready()
            if self._held and self._timer is None:
                self._timer = self._consumer.timer.call_after(MAX_HOLD_S, self._flush_overdue)

    def _processes(self) -> int:
        return getattr(self._pool, "num_processes", None) or getattr(self._pool, "limit", None) or 1

    def _flush_ready(self) -> None:
        """Hand held wake-ups to the pool, a batch per free process."""
        while self._held and self._running < self._processes():
            self._send(self._take())

    def _flush_overdue(self) -> None:
        with self._lock:
            self._timer = None
            self._flush_ready()
            if self._held and time.monotonic() - self._held[0].held_since >= MAX_HOLD_S:
                self._give_back([held for held in self._held if time.monotonic() - held.held_since >= MAX_HOLD_S])
            if self._held:
                self._timer = self._consumer.timer.call_after(MAX_HOLD_S, self._flush_overdue)

    def _give_back(self, overdue: list[_Held]) -> None:
        """Every process stayed busy: these wake-ups go back to the broker, for a worker that has a free one."""
        returned = {id(held) for held in overdue}
        self._held = [held for held in self._held if id(held) not in returned]
        self._saturated = True
        for held in overdue:
            held.reject(log, self._errors, True)
            if held.qos is not None:
                held.qos.decrement_eventually()
                self._widened -= 1
        log.info("wake-ups back to the broker: every pool process stayed busy",
                 extra={"task": self._task.name, "wakeups": len(overdue), "held_s": MAX_HOLD_S})

    def _take(self) -> list[_Held]:
        """The first held wake-ups up to ``batch_max`` events (a message may carry several), at least one."""
        taken, events = 0, 0
        for held in self._held:
            size = len(event_ids(held.arg))
            if taken and events + size > self._batch_max:
                break
            taken, events = taken + 1, events + size
        batch, self._held = self._held[:taken], self._held[taken:]
        return batch

    def _send(self, batch: list[_Held]) -> None:
        self._running += 1
        started = time.monotonic()
        self._pool.apply_async(
            run_batch, args=(self._task.name, [held.arg for held in batch]),
            callback=lambda result: self._ran(batch, started, result, held_s=started - batch[0].held_since),
            error_callback=lambda exc_info: self._lost(batch, exc_info),
            soft_timeout=self._soft_s, timeout=self._hard_s)

    def _ran(self, batch: list[_Held], started: float, result: list | None, *, held_s: float) -> None:
        runtime_s = time.monotonic() - started
        # held_s: how long the batch's first wake-up was held before the batch went to the pool.
        log.info("batch ran", extra={"task": self._task.name, "wakeups": len(batch), "held_s": round(held_s, 6),
                                     "runtime_s": round(runtime_s, 6),
                                     "outcomes": dict(Counter(map(str, result or ())))})
        if self._events_enabled():
            for held, outcome in zip(batch, result if result is not None else [None] * len(batch)):
                if result is None:
                    self._eventer.send("task-failed", uuid=held.task_id, exception="batch failed", traceback="")
                else:
                    self._eventer.send("task-succeeded", uuid=held.task_id, result=repr(outcome), runtime=runtime_s)
        self._finish(batch, requeue=False)

    def _lost(self, batch: list[_Held], exc_info) -> None:
        exc = failure_of(exc_info)
        requeue = isinstance(exc, WorkerLostError) and self._requeue_lost
        log.warning("batch lost with its pool process" if requeue else "batch did not finish",
                    extra={"task": self._task.name, "wakeups": len(batch), "error_class": type(exc).__name__,
                           "requeued": requeue})
        if self._events_enabled():
            for held in batch:
                self._eventer.send("task-failed", uuid=held.task_id, exception=type(exc).__name__, traceback="")
        self._finish(batch, requeue=requeue)

    def _finish(self, batch: list[_Held], *, requeue: bool) -> None:
        for held in batch:
            if requeue:
                held.reject(log, self._errors, True)
            else:
                held.ack(log, self._errors)
        with self._lock:
            for held in batch:
                if held.qos is not None:
                    held.qos.decrement_eventually()
                    self._widened -= 1
            self._running -= 1
            self._saturated = False
            self._flush_ready()

    def _events_enabled(self) -> bool:
        return self._eventer is not None and self._eventer.enabled


def event_ids(arg: Any) -> list:
    """The events a wake-up's argument names: a list of them (a group's message), or one."""
    return arg if isinstance(arg, list) else [arg]


def failure_of(exc_info) -> BaseException:
    """The exception a pool's error callback reports: billiard hands an ExceptionInfo whose ``exception`` wraps
    the one raised (ExceptionWithTraceback, its ``exc``); a bare exception is taken as it is."""
    exc = getattr(exc_info, "exception", exc_info)
    return getattr(exc, "exc", exc)


def _log_received(name: str, task_id: str | None, arg: Any) -> None:
    if log.isEnabledFor(logging.INFO):
        # Celery's own line for a received task, so that a worker's log reads the same either way.
        context = {"id": task_id, "name": name, "args": repr([arg]), "kwargs": "{}", "eta": None}
        log.info(LOG_RECEIVED, context, extra={"data": context})
