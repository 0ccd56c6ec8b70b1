"""The retry policy: a small pure object.

``decide(failure, attempt)`` returns ``RetryAt(delay_s)`` or ``GiveUp(reason)``.
Delay is exponential backoff with full jitter and a cap:
``delay = uniform(0, min(cap_s, base_s * 2 ** (attempt - 1)))``.
Full jitter spreads a burst of failures (a database restart fails many events at
once) so their retries do not arrive together. After ``max_attempts`` attempts a
recoverable failure gives up with reason ``retries_exhausted``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from workers.failures import Failure, Kind


@dataclass(frozen=True)
class RetryAt:
    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    reason: str


@dataclass(frozen=True)
class RetryPolicy:
    base_s: float = 2.0
    cap_s: float = 3600.0
    max_attempts: int = 8
    rng: random.Random = field(default_factory=random.Random, compare=False)

    @classmethod
    def from_settings(cls, settings) -> "RetryPolicy":
        return cls(base_s=settings.retry_base_s, cap_s=settings.retry_cap_s, max_attempts=settings.max_attempts)

    def ceiling_s(self, attempt: int) -> float:
        return min(self.cap_s, self.base_s * 2 ** (max(attempt, 1) - 1))

    def decide(self, failure: Failure, attempt: int) -> RetryAt | GiveUp:
        if failure.kind is Kind.PERMANENT:
            return GiveUp(failure.reason)
        if attempt >= self.max_attempts:
            return GiveUp("retries_exhausted")
        return RetryAt(self.rng.uniform(0, self.ceiling_s(attempt)))
