"""The fake Stripe API (devkit.stripe_api) for tests of catch-up, backfill and reconcile.

* ``TimedFake``: a FakeStripe that also notes when each request arrived (``arrived_at[i]`` is the
  ``time.monotonic()`` of ``requests[i]``), for assertions on how long a client waited between tries.
* ``fake_stripe`` fixture: one running in the test process on a free port (ledgerctl and workers
  started as processes reach it over HTTP like any other server).
* ``api_settings(settings, fake)``: settings pointing at it.
"""
from __future__ import annotations

import dataclasses
import time

import pytest

from devkit.stripe_api import FakeStripe
from ledger.config import Settings

API_KEY = "sk_test_fake"


class TimedFake(FakeStripe):
    def reset(self) -> None:
        super().reset()
        self.arrived_at: dict[int, float] = {}

    def _log(self, method, path, query, account) -> int:
        index = super()._log(method, path, query, account)
        self.arrived_at[index] = time.monotonic()
        return index

    def clear_requests(self) -> None:
        super().clear_requests()
        self.arrived_at = {}

    def timed(self, path_prefix: str = "/v1/") -> list[tuple[float, object]]:
        """(arrival time, request) of every request to the API under ``path_prefix``, in order."""
        return [(self.arrived_at[i], r) for i, r in enumerate(self.requests)
                if r.path.startswith(path_prefix) and i in self.arrived_at]


@pytest.fixture
def fake_stripe():
    with TimedFake.serving(API_KEY) as fake:
        yield fake


def api_settings(settings: Settings, fake: FakeStripe) -> Settings:
    return dataclasses.replace(settings, stripe_api_key=fake.api_key, stripe_api_base=fake.base_url)


def env_of(fake: FakeStripe) -> dict[str, str]:
    """What a ledgerctl or sweep process needs in its environment to reach ``fake``."""
    return {"STRIPE_API_KEY": fake.api_key, "STRIPE_API_BASE": fake.base_url}
