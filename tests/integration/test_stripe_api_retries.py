"""The one retry rule of our Stripe API calls (workers/stripe_api.py), against the fake API over HTTP:
what is waited out and how long, what fails at once, and that the library itself retries nothing."""
from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest
from prometheus_client import REGISTRY

from ledger.config import Settings
from ledger.errors import ConfigError
from tests.support.stripe_api import fake_stripe  # noqa: F401
from workers.stripe_api import PermanentApiError, RetriesExhausted, RetryRule, StripeApi


class Sleeps(list):
    """A sleep that notes how long it was asked to wait, and waits nothing."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def client(fake, *, key: str | None = None, sleeps=None, **rule) -> StripeApi:
    settings = Settings(stripe_api_key=key or fake.api_key, stripe_api_base=fake.base_url)
    return StripeApi(settings, rule=RetryRule(**{"base_s": 0.01, "cap_s": 5.0, **rule}),
                     sleep=sleeps if sleeps is not None else Sleeps(), rng=random.Random(7))


def retries(reason: str) -> float:
    return REGISTRY.get_sample_value("stripe_api_retries_total", {"reason": reason}) or 0.0


def api_requests(fake, path: str = "/v1/customers"):
    return [r for r in fake.requests if r.path == path]


def test_a_429_storm_is_waited_out_with_retry_after_as_the_least_wait(fake_stripe):
    sleeps = Sleeps()
    fake_stripe.put_object({"id": "cus_1", "object": "customer", "created": 1_700_000_000})
    fake_stripe.fail_next(4, status=429, retry_after=2, path_prefix="/v1/customers")
    before = retries("rate_limited")

    answer, _ = client(fake_stripe, sleeps=sleeps).get("/v1/customers")

    assert [obj["id"] for obj in answer["data"]] == ["cus_1"]
    assert [r.status for r in api_requests(fake_stripe)] == [429, 429, 429, 429, 200]
    # Backoff alone would wait 0.005-0.08 s; Retry-After says 2: each wait is at least that.
    assert len(sleeps) == 4 and all(2.0 <= s < 2.1 for s in sleeps), sleeps
    assert retries("rate_limited") - before == 4


def test_server_errors_back_off_exponentially_with_jitter_within_the_cap(fake_stripe):
    sleeps = Sleeps()
    fake_stripe.fail_next(5, status=500, path_prefix="/v1/customers")

    client(fake_stripe, sleeps=sleeps, base_s=0.1, cap_s=0.8).get("/v1/customers")

    steps = [0.1, 0.2, 0.4, 0.8, 0.8]  # base * 2**(n-1), capped; each wait in its upper half
    assert len(sleeps) == 5
    assert all(step / 2 <= s <= step for s, step in zip(sleeps, steps)), sleeps
    assert [r.status for r in api_requests(fake_stripe)] == [500] * 5 + [200]


def test_attempts_are_bounded(fake_stripe):
    fake_stripe.fail_next(10, status=503, path_prefix="/v1/customers")
    with pytest.raises(RetriesExhausted) as raised:
        client(fake_stripe, attempts=3).get("/v1/customers")
    assert raised.value.recoverable and raised.value.status == 503 and raised.value.reason == "server_error"
    assert "gave up after 3 attempts" in str(raised.value)
    assert len(api_requests(fake_stripe)) == 3


def test_the_library_retries_nothing_of_its_own(fake_stripe):
    # stripe-python would retry a 500 max_network_retries times by itself; ours is set to 0.
    fake_stripe.fail_next(1, status=500, path_prefix="/v1/customers")
    with pytest.raises(RetriesExhausted):
        client(fake_stripe, attempts=1).get("/v1/customers")
    assert len(api_requests(fake_stripe)) == 1


def test_a_retry_after_longer_than_the_cap_ends_the_call_at_once(fake_stripe):
    sleeps = Sleeps()
    fake_stripe.fail_next(1, status=429, retry_after=3600, path_prefix="/v1/customers")
    with pytest.raises(RetriesExhausted) as raised:
        client(fake_stripe, sleeps=sleeps, cap_s=30).get("/v1/customers")
    assert "asked to wait 3600 s" in str(raised.value) and sleeps == []


def test_a_timeout_is_tried_again(fake_stripe):
    fake_stripe.slow_next(1, seconds=2.0, path_prefix="/v1/customers")
    before = retries("timeout")
    client(fake_stripe, timeout_s=0.3).get("/v1/customers")
    assert retries("timeout") - before == 1
    assert len(api_requests(fake_stripe)) == 2


def test_a_refused_connection_is_tried_again_then_given_up(fake_stripe):
    url = fake_stripe.base_url
    fake_stripe.stop()  # nothing listens on its port any more
    api = StripeApi(Settings(stripe_api_key="sk_test_fake", stripe_api_base=url),
                    rule=RetryRule(attempts=3, base_s=0.01), sleep=Sleeps())
    with pytest.raises(RetriesExhausted) as raised:
        api.get("/v1/customers")
    assert raised.value.reason == "connection" and "gave up after 3 attempts" in str(raised.value)
    fake_stripe.start()


@pytest.mark.parametrize("path, status", [("/v1/customers/cus_missing", 404), ("/v1/customers?bogus=1", 400)])
def test_other_4xx_are_permanent_and_not_tried_again(fake_stripe, path, status):
    sleeps = Sleeps()
    api = client(fake_stripe, sleeps=sleeps)
    with pytest.raises(PermanentApiError) as raised:
        if "?" in path:
            api.get(path.split("?")[0], {"bogus": "1"})
        else:
            api.get(path)
    assert raised.value.status == status and not raised.value.recoverable and sleeps == []
    assert len([r for r in fake_stripe.requests if r.path == path.split("?")[0]]) == 1


def test_a_wrong_key_is_permanent_and_its_message_never_holds_the_key(fake_stripe, caplog):
    key = "sk_test_" + "k3y" * 10
    fake_stripe.api_key = "sk_test_fake"
    with pytest.raises(PermanentApiError) as raised:
        client(fake_stripe, key=key).get("/v1/events")
    assert raised.value.status == 401 and "Invalid API Key" in str(raised.value)
    assert key not in str(raised.value) and key not in caplog.text


def test_no_key_is_a_configuration_error_naming_the_variable():
    with pytest.raises(ConfigError, match="STRIPE_API_KEY"):
        StripeApi(Settings())


def test_pages_follow_starting_after_and_each_page_has_its_fetch_time(fake_stripe):
    for n in range(5):
        fake_stripe.put_object({"id": f"cus_{n}", "object": "customer", "created": 1_700_000_000 + n})
    pages = list(client(fake_stripe).pages("/v1/customers", limit=2))
    assert [[o["id"] for o in p.data] for p in pages] == [["cus_4", "cus_3"], ["cus_2", "cus_1"], ["cus_0"]]
    assert [p.has_more for p in pages] == [True, True, False]
    assert pages[0].fetched_at <= pages[1].fetched_at <= pages[2].fetched_at
    assert [r.query.get("starting_after") for r in api_requests(fake_stripe)] == [None, "cus_3", "cus_1"]


def test_a_pages_fetch_time_is_never_later_than_its_request_was_sent(fake_stripe):
    # The order guard's key for the page's objects: an answer that takes long to come must not make
    # its snapshots look newer than events created while it was on its way.
    fake_stripe.put_object({"id": "cus_1", "object": "customer", "created": 1_700_000_000})
    fake_stripe.slow_next(1, seconds=1.5, path_prefix="/v1/customers")
    sent = datetime.now(timezone.utc)
    [page] = client(fake_stripe).pages("/v1/customers")
    assert page.fetched_at <= sent
