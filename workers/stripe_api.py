"""Calling Stripe's API: one client, one retry rule, pagination, the collections we list.

Built on stripe-python's ``StripeClient`` (``STRIPE_API_KEY``; ``STRIPE_API_BASE``
points it elsewhere, e.g. at the fake API of the test tooling), with the library's
own retries off: every retry is this module's, so every one is counted
(``stripe_api_retries_total``) and follows one rule.

The retry rule: a 429, a 5xx, a connection error or a timeout is waited out,
exponentially with jitter (``base * 2**(n-1)``, at most ``cap``, each wait drawn
from its upper half), for at most ``attempts`` tries of the call; a ``Retry-After``
header is the least we wait (one asking for more than ``cap`` ends the call at
once: nobody should sleep for an hour inside a command). Any other 4xx is the
request's own fault and is raised at once as ``PermanentApiError``. Error messages
and log lines name the path, the status and Stripe's message, never the API key.

The time an answer's objects are as new as (``Page.fetched_at``, a snapshot's key
under the order guard) is when its request was sent, less ``CLOCK_MARGIN``: never
later than Stripe read them. The arrival time would not do: an object read at
10.9 s, changed at 10.95 s (its event created in second 10), whose answer arrives
at 11.0 s, would carry key 11 and win over the newer event. An earlier key is
always safe (docs/stripe-api.md, "Fetched objects and the order guard"); the margin covers our
clock running ahead of Stripe's.

Nothing here touches Postgres. Callers never hold a transaction (or a pooled
connection) across a call: a call may wait minutes on a rate limit.
"""
from __future__ import annotations

import email.utils
import logging
import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterator, Mapping

import requests
import stripe

from ledger.config import Settings
from ledger.errors import ConfigError, LedgerError
from workers import metrics

log = logging.getLogger(__name__)

PAGE_LIMIT = 100  # Stripe's maximum page size
CLOCK_MARGIN = timedelta(seconds=1)


@dataclass(frozen=True)
class Collection:
    """One listable kind of Stripe object: the name ledgerctl uses, its path, its ``object`` value."""
    name: str
    path: str
    object: str
    # Parameters every listing of it needs: subscriptions are listed with status=all, or
    # Stripe leaves out the canceled ones (a full backfill that skipped them is a known gap).
    list_params: Mapping[str, Any] = field(default_factory=dict)


COLLECTIONS: dict[str, Collection] = {c.name: c for c in (
    Collection("customers", "/v1/customers", "customer"),
    Collection("subscriptions", "/v1/subscriptions", "subscription", {"status": "all"}),
    Collection("invoices", "/v1/invoices", "invoice"),
    Collection("checkout_sessions", "/v1/checkout/sessions", "checkout.session"),
    Collection("products", "/v1/products", "product"),
    Collection("prices", "/v1/prices", "price"),
    Collection("charges", "/v1/charges", "charge"),
    Collection("payment_intents", "/v1/payment_intents", "payment_intent"),
    Collection("refunds", "/v1/refunds", "refund"),
    Collection("disputes", "/v1/disputes", "dispute"),
    Collection("payment_methods", "/v1/payment_methods", "payment_method"),
    Collection("setup_intents", "/v1/setup_intents", "setup_intent"),
    Collection("credit_notes", "/v1/credit_notes", "credit_note"),
    Collection("coupons", "/v1/coupons", "coupon"),
    Collection("promotion_codes", "/v1/promotion_codes", "promotion_code"),
    Collection("tax_rates", "/v1/tax_rates", "tax_rate"),
)}


class StripeApiError(LedgerError):
    """A call that did not succeed; ``recoverable`` says whether trying later may help."""

    def __init__(self, message: str, *, status: int | None = None, recoverable: bool, reason: str,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.recoverable = recoverable
        self.reason = reason
        # Stripe's Retry-After on the answer that failed: the least a later try should wait.
        self.retry_after_s = retry_after_s


class PermanentApiError(StripeApiError):
    """A 4xx other than 429 (bad key, unknown id, bad parameter): trying again cannot help."""

    def __init__(self, message: str, *, status: int | None, reason: str = "rejected"):
        super().__init__(message, status=status, recoverable=False, reason=reason)


class RetriesExhausted(StripeApiError):
    """Every attempt the rule allows failed recoverably (or Stripe asked to wait longer than the cap)."""

    def __init__(self, message: str, *, status: int | None, reason: str, retry_after_s: float | None = None):
        super().__init__(message, status=status, recoverable=True, reason=reason, retry_after_s=retry_after_s)


@dataclass(frozen=True)
class RetryRule:
    """The retry rule's numbers (the module docstring says how they are used)."""
    attempts: int = 8          # tries of one call, the first included
    base_s: float = 0.5
    cap_s: float = 30.0
    timeout_s: float = 30.0    # one HTTP request (connect and read)

    def delay_s(self, failures: int, retry_after_s: float | None, rng: random.Random) -> float:
        """Wait before try ``failures + 1``: the upper half of the exponential step, at least Retry-After."""
        step = min(self.cap_s, self.base_s * 2 ** (failures - 1))
        return max(rng.uniform(step / 2, step), retry_after_s or 0.0)

    def gives_up(self, failures: int, retry_after_s: float | None) -> str | None:
        """Why there is no further try after ``failures`` recoverable failures; None: try again."""
        if retry_after_s is not None and retry_after_s > self.cap_s:
            return f"Stripe asked to wait {retry_after_s:.0f} s, more than the {self.cap_s:.0f} s cap: run it again later"
        if failures >= self.attempts:
            return f"gave up after {failures} attempts"
        return None


@dataclass(frozen=True)
class Page:
    """One page of a list: its objects, and the time they are as new as (a snapshot's fetch time: see
    the module docstring)."""
    data: list[dict[str, Any]]
    has_more: bool
    fetched_at: datetime


def api_livemode(api_key: str) -> bool | None:
    """The mode of the objects a key sees (sk_live_/rk_live_: live); None when the key does not say."""
    for prefix, live in (("sk_live_", True), ("rk_live_", True), ("sk_test_", False), ("rk_test_", False)):
        if api_key.startswith(prefix):
            return live
    return None


class StripeApi:
    """Stripe's API for catch-up, backfill and reconcile. ``account`` selects a connected account
    (the Stripe-Account header); None is the platform."""

    def __init__(self, settings: Settings, *, rule: RetryRule | None = None,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None):
        if not settings.stripe_api_key:
            raise ConfigError("STRIPE_API_KEY is not set: calling Stripe's API needs a secret or restricted key")
        self.rule = rule or RetryRule()
        self.livemode = api_livemode(settings.stripe_api_key)
        self._key = settings.stripe_api_key
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._http = stripe.RequestsClient(timeout=self.rule.timeout_s)
        base = {"api": settings.stripe_api_base.rstrip("/")} if settings.stripe_api_base else None
        # max_network_retries=0: the library retries nothing, this module's rule does (and counts).
        self._client = stripe.StripeClient(settings.stripe_api_key, base_addresses=base, max_network_retries=0,
                                           http_client=self._http)

    def get(self, path: str, params: Mapping[str, Any] | None = None, *,
            account: str | None = None, context: str | None = None) -> tuple[dict[str, Any], datetime]:
        """GET ``path`` under the retry rule: the decoded answer, and the time its objects are as new as
        (when the request that succeeded was sent, less CLOCK_MARGIN). ``context`` is a thin event's
        (the Stripe-Context header, which also reaches v2 paths), ``account`` the Stripe-Account header."""
        options = {"stripe_account": account} if account else {}
        if context:
            options["stripe_context"] = context
        failures = 0
        while True:
            sent_at = datetime.now(timezone.utc)
            try:
                response = self._client.raw_request("get", path, **dict(params or {}), **options)
            except (stripe.StripeError, requests.RequestException) as exc:
                failure = self._classify(exc, path)
                metrics.STRIPE_API_REQUESTS.labels(failure.reason).inc()
                if not failure.recoverable:
                    raise failure from None
                failures += 1
                retry_after = _retry_after_s(exc)
                why_not = self.rule.gives_up(failures, retry_after)
                if why_not:
                    raise RetriesExhausted(f"{failure}; {why_not}", status=failure.status,
                                           reason=failure.reason, retry_after_s=retry_after) from None
                delay = self.rule.delay_s(failures, retry_after, self._rng)
                metrics.STRIPE_API_RETRIES.labels(failure.reason).inc()
                log.warning("Stripe API call failed; retrying", extra={
                    "path": path, "account": account, "status": failure.status, "reason": failure.reason,
                    "attempt": failures, "delay_s": round(delay, 3), "retry_after_s": retry_after})
                self._sleep(delay)
                continue
            metrics.STRIPE_API_REQUESTS.labels("ok").inc()
            return dict(response.data), sent_at - CLOCK_MARGIN

    def pages(self, path: str, params: Mapping[str, Any] | None = None, *, account: str | None = None,
              limit: int = PAGE_LIMIT) -> Iterator[Page]:
        """Every page of a list, in the API's order (newest first), each fetched under the retry rule
        when the caller asks for it: no page is held back, and no connection of the caller's is open
        while the next one is fetched unless the caller keeps one."""
        query = {**dict(params or {}), "limit": limit}
        while True:
            answer, fetched_at = self.get(path, query, account=account)
            data = [dict(obj) for obj in answer.get("data") or []]
            has_more = bool(answer.get("has_more")) and bool(data)
            yield Page(data, has_more, fetched_at)
            if not has_more:
                return
            query = {**query, "starting_after": data[-1]["id"]}

    def list(self, collection: Collection, params: Mapping[str, Any] | None = None, *,
             account: str | None = None) -> Iterator[Page]:
        """The pages of one collection (with the parameters it always needs)."""
        return self.pages(collection.path, {**collection.list_params, **dict(params or {})}, account=account)

    def retrieve(self, path: str, object_id: str, *, account: str | None = None,
                 context: str | None = None) -> tuple[dict | None, datetime]:
        """One object by id (None when Stripe answers 404: it does not exist, or no longer)."""
        try:
            return self.get(f"{path}/{object_id}", account=account, context=context)
        except PermanentApiError as exc:
            if exc.status == 404:
                return None, datetime.now(timezone.utc) - CLOCK_MARGIN
            raise

    def close(self) -> None:
        self._http.close()

    def _classify(self, exc: Exception, path: str) -> StripeApiError:
        status = getattr(exc, "http_status", None)
        if isinstance(exc, stripe.APIConnectionError) or isinstance(exc, requests.RequestException):
            cause = exc.__cause__ or exc
            timeout = isinstance(cause, requests.Timeout)
            if not timeout and not getattr(exc, "should_retry", True):
                # TLS verification and the like: waiting does not fix a configuration.
                return PermanentApiError(f"GET {path}: {self._scrub(type(cause).__name__)}", status=None,
                                         reason="connection_refused")
            reason = "timeout" if timeout else "connection"
            return StripeApiError(f"GET {path}: {reason} ({type(cause).__name__})", status=None,
                                  recoverable=True, reason=reason)
        message = self._scrub(_stripe_message(exc))
        if status == 429:
            return StripeApiError(f"GET {path}: 429 rate limited ({message})", status=429, recoverable=True,
                                  reason="rate_limited")
        if status is None or status >= 500 or status < 400:
            # A 5xx, or an answer that was not Stripe's JSON (a proxy's error page).
            return StripeApiError(f"GET {path}: {status or 'no status'} server error ({message})", status=status,
                                  recoverable=True, reason="server_error")
        return PermanentApiError(f"GET {path}: {status} {message}", status=status)

    def _scrub(self, text: str) -> str:
        return text.replace(self._key, "[api key]") if self._key else text


def _stripe_message(exc: Exception) -> str:
    error = getattr(exc, "error", None)
    message = getattr(error, "message", None) if error is not None else None
    if not message:
        body = getattr(exc, "json_body", None)
        inner = body.get("error") if isinstance(body, dict) else None
        message = inner.get("message") if isinstance(inner, dict) else None
    return (message or type(exc).__name__)[:300]


def _retry_after_s(exc: Exception) -> float | None:
    """Retry-After of an error answer, in seconds (delta-seconds or an HTTP date); None when absent."""
    headers = getattr(exc, "headers", None) or {}
    raw = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
