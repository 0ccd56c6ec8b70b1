"""workers/retry.py: exponential backoff with full jitter, a cap, and a bounded number of attempts."""
from __future__ import annotations

import random

import pytest

from workers.failures import Failure, Kind
from workers.retry import GiveUp, RetryAt, RetryPolicy

RECOVERABLE = Failure(Kind.RECOVERABLE, "transient", "TransientError", "try again")
PERMANENT = Failure(Kind.PERMANENT, "unmappable_payload", "UnmappablePayload", "data.object.status is missing")


def policy(**kw) -> RetryPolicy:
    return RetryPolicy(rng=random.Random(1234), **kw)


@pytest.mark.parametrize("attempt", range(1, 8))
def test_every_delay_lies_between_zero_and_the_exponential_ceiling(attempt):
    p = policy(base_s=2.0, cap_s=3600.0, max_attempts=10)
    ceiling = 2.0 * 2 ** (attempt - 1)
    assert p.ceiling_s(attempt) == ceiling
    delays = [p.decide(RECOVERABLE, attempt).delay_s for _ in range(400)]
    assert all(0 <= d <= ceiling for d in delays)
    # Full jitter: the whole range [0, ceiling] is used, not just a band near the ceiling.
    assert min(delays) < 0.1 * ceiling
    assert max(delays) > 0.9 * ceiling


def test_the_ceiling_doubles_with_each_attempt_until_the_cap():
    p = policy(base_s=0.5, cap_s=10.0, max_attempts=100)
    assert [p.ceiling_s(a) for a in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert p.ceiling_s(60) == 10.0


def test_delays_never_exceed_the_cap_however_many_attempts():
    p = policy(base_s=1.0, cap_s=30.0, max_attempts=1000)
    delays = [p.decide(RECOVERABLE, attempt).delay_s for attempt in range(10, 200)]
    assert all(0 <= d <= 30.0 for d in delays)


def test_attempt_zero_or_below_is_treated_as_the_first_attempt():
    p = policy(base_s=2.0)
    assert p.ceiling_s(0) == p.ceiling_s(1) == 2.0


def test_a_recoverable_failure_is_retried_until_max_attempts_then_gives_up_as_retries_exhausted():
    p = policy(max_attempts=4)
    assert all(isinstance(p.decide(RECOVERABLE, a), RetryAt) for a in (1, 2, 3))
    assert p.decide(RECOVERABLE, 4) == GiveUp("retries_exhausted")
    assert p.decide(RECOVERABLE, 9) == GiveUp("retries_exhausted")


def test_a_single_allowed_attempt_gives_up_on_the_first_recoverable_failure():
    assert policy(max_attempts=1).decide(RECOVERABLE, 1) == GiveUp("retries_exhausted")


def test_a_permanent_failure_gives_up_at_once_with_its_own_reason():
    p = policy(max_attempts=8)
    assert p.decide(PERMANENT, 1) == GiveUp("unmappable_payload")
    assert p.decide(Failure(Kind.PERMANENT, "unsupported_type", "UnsupportedType", "x"), 1) == GiveUp("unsupported_type")


def test_the_same_seed_gives_the_same_schedule():
    a = RetryPolicy(base_s=1, cap_s=60, rng=random.Random(7))
    b = RetryPolicy(base_s=1, cap_s=60, rng=random.Random(7))
    assert [a.decide(RECOVERABLE, n) for n in range(1, 6)] == [b.decide(RECOVERABLE, n) for n in range(1, 6)]
