"""A fake Stripe API: a small stateful HTTP server on 127.0.0.1 for the tests and for local runs.

The product's Stripe client points at it through its api base (``STRIPE_API_BASE``), e.g. with the
real library: ``stripe.StripeClient("sk_test_fake", base_addresses={"api": fake.base_url})``.
Nothing here talks to the internet.

In process::

    with FakeStripe.serving(api_key="sk_test_fake") as fake:   # or fake = FakeStripe(); fake.start(); fake.stop()
        fake.add_event(evt)                          # an event dict as devkit.factories builds it (upsert by id)
        fake.add_events(events, account="acct_1", delivered=False)  # account defaults to evt["account"]
        fake.put_object(factories.customer(created=...))            # upsert by id, obj["object"] is its type
        fake.delete_object("cus_1")                  # a deleted customer retrieves as {"id", "object", "deleted": true}
        fake.fail_next(2, status=429, retry_after=1, path_prefix="/v1/events")     # or 500, 503, any 4xx/5xx
        fake.slow_next(1, seconds=0.5)               # sleep, then answer (or meet a fail_next)
        fake.set_now(1_700_000_000)                  # freezes the clock of the 30-day window; None = wall clock
        fake.advance(86400); fake.now                # move the frozen clock; read it
        fake.requests                                # [Request(method, path, query, account, status), ...]
        fake.clear_requests(); fake.clear_faults(); fake.reset()
        fake.add_v2_event(factories.v2_event(n))     # served at /v2/core/events/{id}; account defaults to its context

``retry_after`` may be a fraction of a second so tests stay fast (Stripe itself sends whole seconds).

Out of process (for ledgerctl or workers started as processes, and for local use)::

    python -m devkit.stripe_api --port 12111 --api-key sk_test_fake [--state FILE]

prints its base URL on one line when it is ready and stops cleanly on SIGTERM or SIGINT (with
``--state``, state is loaded at start when the file exists and written at stop). It is driven over
HTTP under ``/_fake/`` by ``FakeStripeControl(base_url)``, which has the same methods as
``FakeStripe`` (``now`` and ``requests`` too); ``FakeStripeProcess(log_dir).start()`` runs it the way
devkit.stack runs the product (``.base_url``, ``.control``, ``.stop()``).

Control endpoints (JSON bodies; ``account`` null = the platform):
    POST /_fake/events {"events": [...], "account", "delivered"}   POST /_fake/v2_events {"event", "account"}
    POST /_fake/objects {"objects": [...], "account"}               POST /_fake/objects/delete {"id", "account"}
    POST /_fake/faults {"kind": "fail", "n", "status", "retry_after", "path_prefix"}
                       {"kind": "slow", "n", "seconds", "path_prefix"}          POST /_fake/faults/clear
    GET|POST /_fake/clock {"now": ts|null} or {"advance": seconds}
    GET /_fake/requests   POST /_fake/requests/clear   POST /_fake/reset

Stripe API served (GET only, ``Authorization: Bearer <api_key>`` or 401). ``Stripe-Account: acct_...``
or ``Stripe-Context: acct_...`` (what stripe-python sends for ``stripe_context``, as workers do for a
thin notification's ``context``) selects a connected account's state; each account sees only its own
events, v2 events and objects. Both headers naming different accounts is a 400:
    /v1/events            limit (1..100, default 10), starting_after | ending_before, type (``*`` matches
                          any run of characters: ``customer.subscription.*``) | types[] (up to 20 exact names),
                          created=<int> or created[gt|gte|lt|lte], delivery_success=true|false.
                          Only events created within the last 30 days of the fake's clock.
    /v1/events/{id}       404 once older than 30 days, as any unknown id.
    /v1/<collection>      and /v1/<collection>/{id} for the collections in COLLECTIONS (customers,
                          subscriptions, invoices, products, prices, charges, payment_intents, refunds,
                          disputes, payment_methods, checkout/sessions, subscription_items, ...): limit,
                          starting_after | ending_before, created, and the collection's filters
                          (customer=, status=, ...). Subscriptions omit status=canceled unless
                          status=all, canceled or ended, as Stripe does.
    /v2/core/events/{id}  the v2 events added with add_v2_event, 404 once older than 30 days (by their
                          ISO ``created``) or unknown to the account, in Stripe's v2 error shape
                          ``{"error": {"type": "not_found", "code": "not_found", "message"}}``.
Objects have no 30-day window. A deleted object other than a customer is a 404, as Stripe does for
most types; deleted objects leave every list. An unknown parameter, a cursor id the account does not
have, or both cursors at once is a 400.

Lists are newest first: ``created`` descending, ties broken by the order the fake received them
(the later added first); cursors are object ids in that order, and ``has_more`` says whether
more items lie in the direction paged (after the page for starting_after, before it for
ending_before; stripe-python's auto_paging_iter() from ending_before therefore yields oldest
first). Answers are Stripe-shaped: lists ``{"object": "list", "data", "has_more", "url"}``,
errors ``{"error": {"type", "message", "code"?, "param"?}}`` with Stripe's status codes (400 bad or
unknown parameter, 401, 404 ``resource_missing``, 429 ``rate_limit``, 5xx ``api_error``).

Query parameters are decoded as Stripe does for form encoding: ``types[0]=a&types[1]=b`` (what
stripe-python sends), ``types[]=a`` (what Stripe's curl examples send) and ``created[gte]=1``.

Faults count every request to the Stripe API (``/v1/`` and ``/v2/``, not ``/_fake/``), including the
ones the stripe library repeats on its own (it retries 5xx and connection errors
``max_network_retries`` times, not 429). Each fault serves the next ``n`` requests whose path starts
with ``path_prefix``; a slow fault delays the answer and then the request goes on (it may also meet a
failure fault).

What stripe-python 16.1.0 does with these answers: 429 -> stripe.RateLimitError (``e.headers["Retry-After"]``;
its ``e.code`` is None, the body's code is in ``e.json_body``), 5xx -> stripe.APIError, 400/404 ->
stripe.InvalidRequestError (``e.param``, ``e.code``), 401 -> stripe.AuthenticationError, a client
timeout -> stripe.APIConnectionError. On ``/v2/`` paths the library maps errors by the body's ``type``
first and falls back to the v1 mapping by status for types it has no class for: the v2 404
(``not_found``) is a stripe.InvalidRequestError with ``http_status`` 404 and ``code`` "not_found", and the
faults raise the same classes as on /v1. A ``StripeClient`` retries nothing unless built with
``max_network_retries`` (the module-level default of 2 applies to the legacy global API only).

The package: params (errors, query decoding, paging), resources (collections and filters),
fake (FakeStripe), server (the HTTP handler), control (FakeStripeControl, FakeStripeProcess),
__main__ (the command).
"""
from __future__ import annotations

from devkit.stripe_api.control import FakeStripeControl, FakeStripeProcess
from devkit.stripe_api.fake import DEFAULT_API_KEY, EVENT_RETENTION_S, FakeStripe, Request
from devkit.stripe_api.params import ApiError, parse_query
from devkit.stripe_api.resources import COLLECTIONS

__all__ = ["COLLECTIONS", "DEFAULT_API_KEY", "EVENT_RETENTION_S", "ApiError", "FakeStripe", "FakeStripeControl",
           "FakeStripeProcess", "Request", "parse_query"]
