"""How a batch's failure is read (workers.batching.failure_of): a pool process that died is billiard's
WorkerLostError inside its ExceptionInfo wrapper, and only that requeues the batch's wake-ups."""
from __future__ import annotations

from billiard.einfo import ExceptionInfo
from billiard.exceptions import WorkerLostError

from workers.batching import failure_of


def _info(exc: BaseException) -> ExceptionInfo:
    try:
        raise exc
    except BaseException:
        return ExceptionInfo()


def test_a_pool_process_that_died_is_seen_through_billiards_wrapper():
    # What billiard's mark_as_worker_lost hands the error callback of a SIGKILLed process's job.
    assert isinstance(failure_of(_info(WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)"))),
                      WorkerLostError)


def test_any_other_failure_is_what_was_raised():
    assert isinstance(failure_of(_info(TimeoutError("hard time limit"))), TimeoutError)
    assert isinstance(failure_of(ValueError("bare")), ValueError)
