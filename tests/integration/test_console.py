"""The operator console against a real ledger, through Flask's test client: who may do what, CSRF,
escaping, the event list's keyset pages and capped counts, and bulk replays (the previewed set is
the replayed set; a cancel stops it). The browser tests (tests/e2e/test_console_browser.py) drive
the same pages in chromium."""
from __future__ import annotations

import collections
import json
import re
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from devkit.factories import event
from ledger.console import ConsoleLedger
from ledger.event_query import EventQuery, FilterError
from ledger.states import EventStatus
from ops.console.app import create_app
from ops.console.auth import (FREE_FAILURES, FREE_FAILURES_PER_ADDRESS, WINDOW_S, LoginThrottle, hash_password,
                              wait_after)
from ops.console.replays import ReplayRunner
from ops.console.settings import ConsoleSettings
from tests.support.console import (PASSWORD, app, client_for, confirm_form, console_settings,  # noqa: F401
                                   failed_events, token_of)
from tests.support.receiver import WakeupQueue  # noqa: F401  (the broker_settings fixture's queue)
from tests.support.stripe_api import fake_stripe  # noqa: F401

def test_every_page_sends_a_stranger_to_the_login_page(app):
    client = app.test_client()
    for path in ("/", "/events", "/events/evt_x", "/failures", "/replay/jobs", "/outbox", "/health-alerts", "/drift",
                 "/replay?status=failed_permanent"):
        answer = client.get(path)
        assert answer.status_code == 302 and "/login" in answer.headers["Location"], path



@pytest.mark.parametrize("path", ["/events/evt_x/replay", "/replay", "/replay/jobs/1/cancel", "/outbox/1/replay",
                                  "/drift", "/logout"])
def test_a_post_without_a_login_is_401_whatever_its_token(app, path):
    stranger = app.test_client()
    token = token_of(stranger, "/login")    # a valid token of the stranger's own session
    for data in ({}, {"csrf_token": "forged"}, {"csrf_token": token}):
        answer = stranger.post(path, data=data)
        assert answer.status_code == 401 and "log in first" in answer.text, (path, data, answer.status_code)


def test_a_viewer_sees_but_every_change_is_refused_403_at_the_endpoint(app, kit):
    (evt_id,) = failed_events(kit, 1)
    viewer = client_for(app, "vera")
    assert viewer.get(f"/events/{evt_id}").status_code == 200
    assert 'id="replay"' not in viewer.get(f"/events/{evt_id}").text
    token = token_of(viewer, "/events")
    assert viewer.post(f"/events/{evt_id}/replay", data={"csrf_token": token}).status_code == 403
    assert viewer.get("/replay?status=failed_permanent").status_code == 403
    assert viewer.post("/replay", data={"csrf_token": token}).status_code == 403
    assert viewer.post("/outbox/1/replay", data={"csrf_token": token}).status_code == 403
    assert viewer.post("/drift", data={"csrf_token": token, "object_type": "customers"}).status_code == 403
    assert kit.query("SELECT status FROM ledger.events WHERE id = %s", (evt_id,)) == [{"status": "failed_permanent"}]


def test_a_form_without_its_csrf_token_is_refused_and_changes_nothing(app, kit):
    (evt_id,) = failed_events(kit, 1)
    operator = client_for(app, "olga")
    answer = operator.post(f"/events/{evt_id}/replay", data={"reason": "no token"})
    assert answer.status_code == 400 and "CSRF" in answer.text
    assert kit.query("SELECT status FROM ledger.events WHERE id = %s", (evt_id,)) == [{"status": "failed_permanent"}]
    answer = operator.post(f"/events/{evt_id}/replay", data={"reason": "with token",
                                                             "csrf_token": token_of(operator, f"/events/{evt_id}")})
    assert answer.status_code == 302
    assert kit.query("SELECT status FROM ledger.events WHERE id = %s", (evt_id,)) == [{"status": "received"}]
    assert kit.query("SELECT actor, reason FROM ledger.audit WHERE event_id = %s", (evt_id,)) == [
        {"actor": "console:olga", "reason": "with token"}]


def test_a_payload_holding_html_shows_as_text_and_headers_forbid_script(app, kit):
    evt = event("customer.updated", {"id": "cus_x", "object": "customer", "name": "<script>alert(1)</script>"},
                created=int(time.time()))
    kit.record(evt)
    operator = client_for(app, "olga")
    page = operator.get(f"/events/{evt['id']}")
    assert "<script>alert(1)</script>" not in page.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    listed = operator.get("/events", query_string={"type": "<script>x</script>"})
    assert "<script>x</script>" not in listed.text
    csp = page.headers["Content-Security-Policy"]
    assert "script-src" not in csp and "default-src 'none'" in csp  # no script at all
    cookie = operator.get_cookie("ledger_console")
    assert cookie.http_only and cookie.same_site == "Lax"


@pytest.mark.parametrize("query", [
    {"status": "nope"}, {"source": "carrier-pigeon"}, {"since": "yesterday"}, {"size": "100000"}, {"size": "x"},
    {"since": "2020-01-01", "until": "2020-06-01"}, {"after": "garbage"}, {"livemode": "maybe"}, {"type": "x" * 300},
])
def test_bad_filters_get_a_400_with_the_reason_never_a_500(app, query):
    answer = client_for(app, "vera").get("/events", query_string=query)
    assert answer.status_code == 400, answer.text
    assert 'id="error"' in answer.text


def test_the_wait_grows_per_failure_past_the_free_ones_and_is_capped():
    assert [wait_after(n, 0.0, free=5) for n in (0, 4, 5, 6, 7, 10, 50)] == [0, 0, 15, 30, 60, 300, 300]
    assert wait_after(5, 16.0, free=5) == 0 and wait_after(6, 10.0, free=5) == 20


def test_one_persons_typos_never_reach_the_address_limit():
    """The address limit must stay out of reach of one user: retrying each time the wait ends, for two hours,
    one name never makes FREE_FAILURES_PER_ADDRESS failures within a window."""
    failures, now = [], 0.0
    while now < 7200:
        recent = [t for t in failures if now - t < WINDOW_S]
        wait = wait_after(len(recent), now - recent[-1] if recent else 0.0, free=FREE_FAILURES)
        now += wait
        failures.append(now)
        assert len([t for t in failures if now - t < WINDOW_S]) < FREE_FAILURES_PER_ADDRESS
        now += 1.0


def test_a_name_is_throttled_from_every_address_and_waits_out(kit, console_settings):
    throttle = LoginThrottle(ConsoleLedger(kit.pool("console")), console_settings.secret_key)
    for _ in range(5):
        assert throttle.wait_s("olga", "10.0.0.1") == 0
        throttle.failed("olga", "10.0.0.1")
    assert throttle.wait_s("olga", "10.0.0.1") > 14
    assert throttle.wait_s("olga", "10.0.0.2") > 14       # by name, from another address too
    assert throttle.wait_s("vera", "10.0.0.1") == 0       # another name from the same address: not at all
    kit.execute("UPDATE ledger.login_failures SET failed_at = failed_at - interval '16 seconds'")
    assert throttle.wait_s("olga", "10.0.0.1") == 0       # waited out
    throttle.failed("olga", "10.0.0.1")
    assert throttle.wait_s("olga", "10.0.0.1") >= 29      # and each failure waits longer
    throttle.succeeded("olga")
    assert throttle.wait_s("olga", "10.0.0.1") == 0
    # Names typed are never stored: only keyed digests.
    stored = {row["key"] for row in kit.query("SELECT key FROM ledger.login_failures")}
    assert stored and not any("olga" in key or "10.0.0" in key for key in stored)


def test_guessing_across_names_from_one_address_is_slowed_by_the_address_limit(kit, console_settings):
    throttle = LoginThrottle(ConsoleLedger(kit.pool("console")), console_settings.secret_key)
    for n in range(FREE_FAILURES_PER_ADDRESS):
        assert throttle.wait_s(f"guess{n}", "10.6.6.6") == 0
        throttle.failed(f"guess{n}", "10.6.6.6")
    assert throttle.wait_s("olga", "10.6.6.6") > 14       # the address now waits, whatever the name
    assert throttle.wait_s("olga", "10.0.0.1") == 0       # another address does not


def login(client, name: str, password: str, **kwargs):
    return client.post("/login", data={"name": name, "password": password,
                                       "csrf_token": token_of(client, "/login")}, **kwargs)


def test_the_login_answers_429_once_throttled(app):
    client = app.test_client()
    for _ in range(5):
        assert login(client, "olga", "wrong").status_code == 401
    answer = login(client, "olga", PASSWORD)
    assert answer.status_code == 429 and int(answer.headers["Retry-After"]) >= 1


def test_one_users_typos_never_delay_another_users_login_from_the_same_address(app):
    """Behind a load balancer every user comes from one address: olga's typos slow olga down, not vera."""
    olga, vera = app.test_client(), app.test_client()
    for _ in range(8):
        assert login(olga, "olga", "wrong").status_code in (401, 429)
    assert login(olga, "olga", PASSWORD).status_code == 429
    assert login(vera, "vera", PASSWORD).status_code == 302


def test_behind_a_trusted_proxy_the_forwarded_client_address_is_the_one_limited(broker_settings, kit, console_settings):
    import dataclasses

    from ops.console.auth import FREE_FAILURES_PER_ADDRESS as LIMIT

    app = create_app(broker_settings, dataclasses.replace(console_settings, trusted_proxies=frozenset({"10.0.0.9"})),
                     run_replays=False)
    try:
        def from_(client_addr: str, peer: str = "10.0.0.9"):
            return {"environ_base": {"REMOTE_ADDR": peer},
                    "headers": {"X-Forwarded-For": f"203.0.113.50, {client_addr}"}}

        guesser, olga = app.test_client(), app.test_client()
        for n in range(LIMIT):
            assert login(guesser, f"guess{n}", "x", **from_("198.51.100.7")).status_code == 401
        assert login(guesser, "olga", PASSWORD, **from_("198.51.100.7")).status_code == 429
        # Another client through the same proxy is not held up; the first hop (client-supplied) is not believed.
        assert login(olga, "olga", PASSWORD, **from_("198.51.100.8")).status_code == 302
        # From a peer that is not a trusted proxy the header is ignored: the peer is the address.
        stranger = app.test_client()
        for n in range(LIMIT):
            login(stranger, f"other{n}", "x", **from_("198.51.100.9", peer="192.0.2.1"))
        assert login(stranger, "vera", PASSWORD, **from_("198.51.100.10", peer="192.0.2.1")).status_code == 429
    finally:
        app.extensions["ledger"]["pool"].close()


def test_keyset_pages_are_exact_while_events_arrive(kit):
    base = datetime.now(timezone.utc) - timedelta(hours=1)
    ids = [kit.record(event("customer.created", {"id": f"cus_{i}", "object": "customer"}, created=1_700_000_000))
           for i in range(23)]
    # Three share one received_at: the id breaks the tie.
    for i, evt_id in enumerate(ids):
        kit.execute("UPDATE ledger.events SET received_at = %s WHERE id = %s",
                    (base + timedelta(seconds=min(i, 10)), evt_id))
    console = ConsoleLedger(kit.pool("console"))
    query = EventQuery().checked()
    seen, after = [], None
    while True:
        page = console.page(query, size=5, after=after)
        seen += [row["id"] for row in page.rows]
        # New events arrive between pages; they sort before the first page and never show up later.
        kit.record(event("customer.created", {"id": f"cus_new_{len(seen)}", "object": "customer"}, created=1))
        if page.next_after is None:
            break
        after = page.next_after
    assert len(seen) == len(set(seen)) == 23 and set(seen) == set(ids)


def test_counts_are_capped_and_say_so(kit):
    for i in range(7):
        kit.record(event("invoice.created", {"id": f"in_{i}", "object": "invoice"}, created=1))
    console = ConsoleLedger(kit.pool("console"))
    assert console.count(EventQuery().checked(), cap=5) == (5, True)
    assert console.count(EventQuery(type_glob="invoice.*").checked(), cap=10) == (7, False)
    with pytest.raises(FilterError):
        EventQuery(since=datetime(2020, 1, 1, tzinfo=timezone.utc)).checked()


def test_a_bulk_replay_replays_the_previewed_set_not_later_arrivals_nor_events_outside_its_filter(app, kit):
    failed = failed_events(kit, 6)
    other = failed_events(kit, 2, type_="test.other_permanent")
    operator = client_for(app, "olga")
    # The failure reason in the filter, and the operator's reason for the replay: two things.
    preview = operator.get("/replay", query_string={"status": "failed_permanent", "type": "test.permanent",
                                                    "reason": "rejected_by_handler"})
    assert re.search(r'id="preview-count">6<', preview.text)
    form = {"csrf_token": token_of(operator, "/replay?status=failed_permanent&type=test.permanent"),
            **confirm_form(preview.text), "expected": "6", "confirm": "y", "reason": "bug 42 fixed"}
    # Between preview and confirmation one of them leaves the filter (replayed by someone else): the set
    # the operator confirmed is not the set now, so nothing is created.
    assert app.extensions["ledger"]["operator"].replay(failed[0], actor="someone", reason=None, force=False)
    late = failed_events(kit, 1)  # arrives after the preview: outside the range the preview fixed
    answer = operator.post("/replay", data=form)
    assert answer.status_code == 302 and "/replay?" in answer.headers["Location"]
    assert kit.query("SELECT count(*) AS n FROM ledger.replay_jobs") == [{"n": 0}]
    form["expected"] = "5"
    answer = operator.post("/replay", data=form)
    job_id = int(answer.headers["Location"].rsplit("/", 1)[1])
    arrived_after = failed_events(kit, 2)       # after the job was created: never in it
    woken = []
    runner = ReplayRunner(app.extensions["ledger"]["console"], woken.append, rate_per_s=3)
    while runner.run_once():
        pass
    job = app.extensions["ledger"]["console"].replay_job(job_id)
    assert (job["status"], job["total"], job["replayed"], job["skipped"]) == ("finished", 5, 5, 0)
    assert sorted(woken) == sorted(failed[1:])
    statuses = {r["id"]: r["status"] for r in kit.query("SELECT id, status FROM ledger.events")}
    assert {statuses[i] for i in failed} == {"received"}
    assert {statuses[i] for i in other + late + arrived_after} == {"failed_permanent"}
    assert kit.query("SELECT count(*) AS n FROM ledger.audit WHERE replay_job_id = %s AND actor = 'console:olga' "
                     "AND reason = 'bug 42 fixed'", (job_id,)) == [{"n": 5}]


def test_a_cancelled_replay_stops_before_its_next_batch(app, kit):
    failed = failed_events(kit, 9)
    console: ConsoleLedger = app.extensions["ledger"]["console"]
    query = EventQuery(status="failed_permanent").checked()
    confirmed = console.create_replay_job(query, expected=9, actor="console:olga", reason=None, force=False,
                                          preview_id=uuid.uuid4())
    job_id = confirmed.job_id
    assert confirmed.matched == 9 and not confirmed.already
    runner = ReplayRunner(console, lambda _: None, rate_per_s=4)
    assert runner.run_once()
    assert console.cancel_replay_job(job_id, actor="console:olga")
    while runner.run_once():
        pass
    job = console.replay_job(job_id)
    assert (job["status"], job["replayed"], job["cancelled_by"]) == ("cancelled", 4, "console:olga")
    received = kit.query("SELECT count(*) AS n FROM ledger.events WHERE id = ANY(%s) AND status = 'received'",
                         (failed,))
    assert received == [{"n": 4}]


def test_two_confirms_of_one_preview_at_once_start_one_job(app, kit):
    """A double submit, or the same preview confirmed from two tabs, at the same instant: one job, and both
    confirms land on it. The test holds the jobs table so both confirms are inside their INSERT together."""
    from concurrent.futures import ThreadPoolExecutor

    failed = failed_events(kit, 3)
    tabs = [client_for(app, "olga"), client_for(app, "olga")]
    preview = tabs[0].get("/replay", query_string={"status": "failed_permanent"}).text
    form = {**confirm_form(preview), "expected": "3", "confirm": "y"}
    tokens = [token_of(tab, "/events") for tab in tabs]
    with kit.connect() as holder, ThreadPoolExecutor(2) as threads:
        holder.execute("BEGIN")
        holder.execute("LOCK TABLE ledger.replay_jobs IN SHARE MODE")
        answers = [threads.submit(tab.post, "/replay", data={**form, "csrf_token": token})
                   for tab, token in zip(tabs, tokens)]
        deadline = time.monotonic() + 10
        while kit.query("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%%INSERT INTO ledger.replay_jobs%%'")[0]["n"] < 2:
            assert time.monotonic() < deadline, "the two confirms never met at the INSERT"
            time.sleep(0.02)
        holder.execute("ROLLBACK")
        locations = {answer.result().headers.get("Location") for answer in answers}
    jobs = kit.query("SELECT id FROM ledger.replay_jobs")
    assert len(jobs) == 1, jobs
    assert locations == {f"/replay/jobs/{jobs[0]['id']}"}
    assert kit.query("SELECT count(*) AS n FROM ledger.replay_job_events") == [{"n": len(failed)}]


def test_the_overview_failures_outbox_health_and_drift_pages_render(app, kit, prepared_ledger):
    viewer = client_for(app, "vera")
    for path in ("/", "/failures", "/outbox", "/health-alerts", "/drift", "/replay/jobs", "/events?source=webhook",
                 "/events?source=thin", "/events?account=platform&livemode=test"):
        answer = viewer.get(path)
        assert answer.status_code == 200, (path, answer.text[:500])
    overview = viewer.get("/").text
    assert "failed_permanent" in overview and "<svg" in overview
    failures = viewer.get("/failures").text
    assert "object_without_id" in failures


def test_the_overview_and_the_failure_groups_count_every_event_exactly(app, kit, prepared_ledger):
    """The overview's counts and the failure groups come from index-only reads of migration 0020's covering
    indexes (the heap only for pages the visibility map does not vouch for): exact before a VACUUM, when
    every row is fresh, and after it, when the indexes alone answer."""
    expected = {status.value: prepared_ledger.by_status().get(status.value, 0) for status in EventStatus}
    reasons = {r["id"]: r["failure_reason"] for r in kit.query(
        "SELECT id, failure_reason FROM ledger.events WHERE id = ANY(%s)",
        (sorted(prepared_ledger.ids(status="failed_permanent") | prepared_ledger.ids(status="failed_recoverable")),))}
    groups = collections.Counter((status, reasons[i], type_) for i, (type_, status) in prepared_ledger.rows.items()
                                 if status in ("failed_permanent", "failed_recoverable"))
    assert reasons[prepared_ledger.groups["rejected"][0]] == "rejected_by_handler"
    viewer = client_for(app, "vera")
    for vacuumed in (False, True):
        if vacuumed:
            kit.execute("VACUUM (ANALYZE) ledger.events")
        view = ConsoleLedger(kit.pool("console-counts")).overview(health_alerts=[])
        assert view.by_status == expected and not view.processed_estimated
        assert (view.due_retries, view.expired_leases) == (1, 1)
        assert view.oldest_unprocessed_age_s >= prepared_ledger.oldest_unprocessed_min_age_s
        page = viewer.get("/").text
        for status, n in expected.items():
            assert re.search(rf'status-{status}"[^>]*>\s*<span class="label">{status}</span>\s*'
                             rf'<span class="value">{n:,}</span>', page), (status, n)
        assert re.search(r'due retries</span><span class="value">1<', page)
        assert re.search(r'expired leases</span><span class="value">1<', page)

        found = ConsoleLedger(kit.pool("console-counts")).failure_groups()
        assert {(g["status"], g["reason"], g["type"]): g["events"] for g in found} == dict(groups)
        assert [g["events"] for g in found] == sorted((g["events"] for g in found), reverse=True)
        table = viewer.get("/failures").text
        shown = re.findall(r"<tr><td>([a-z_]+)</td><td>([a-z_]*)</td><td>([a-z._]+)</td>\s*<td><a [^>]*>(\d+)</a>",
                           table)
        assert {(s, r, t): int(n) for s, r, t, n in shown} == dict(groups)


def test_console_settings_refuse_to_run_without_authentication_or_a_secret():
    from ledger.errors import ConfigError

    with pytest.raises(ConfigError, match="LEDGER_CONSOLE_USERS"):
        ConsoleSettings.from_env({"LEDGER_CONSOLE_SECRET_KEY": "s" * 40})
    with pytest.raises(ConfigError, match="SECRET_KEY"):
        ConsoleSettings.from_env({"LEDGER_CONSOLE_USERS": f"a:{hash_password('x')}"})
    with pytest.raises(ConfigError, match="TRUSTED_PROXIES"):
        ConsoleSettings.from_env({"LEDGER_CONSOLE_TRUSTED_HEADER": "X-User", "LEDGER_CONSOLE_SECRET_KEY": "s" * 40})
    ok = ConsoleSettings.from_env({"LEDGER_CONSOLE_USERS": f"a:{hash_password('x')}", "LEDGER_CONSOLE_OPERATORS": "a",
                                   "LEDGER_CONSOLE_SECRET_KEY": "s" * 40})
    assert ok.role("a") == "operator" and ok.role("b") == "viewer"


def test_a_trusted_proxys_header_names_the_user_only_from_the_proxy(broker_settings, kit):
    settings = ConsoleSettings(operators=frozenset({"sso-olga"}), secret_key="s" * 40, trusted_header="X-Forwarded-User",
                               trusted_proxies=frozenset({"10.0.0.9"}))
    app = create_app(broker_settings, settings, run_replays=False)
    try:
        client = app.test_client()
        assert client.get("/", headers={"X-Forwarded-User": "sso-olga"},
                          environ_base={"REMOTE_ADDR": "10.0.0.9"}).status_code == 200
        assert client.get("/", headers={"X-Forwarded-User": "sso-olga"},
                          environ_base={"REMOTE_ADDR": "10.0.0.8"}).status_code == 302
    finally:
        app.extensions["ledger"]["pool"].close()


def test_as_json_round_trips_a_query():
    query = EventQuery(status="failed_permanent", type_glob="invoice.*", account="", livemode=False).checked()
    assert EventQuery.from_json(json.loads(json.dumps(query.as_json()))) == query


@pytest.mark.parametrize("path, form", [
    ("/replay", {"filter": "not json", "expected": "1", "confirm": "y"}),
    ("/replay", {"filter": '{"status": "nope"}', "expected": "1", "confirm": "y"}),
    ("/replay", {"filter": '{"since": "yesterday"}', "expected": "1", "confirm": "y"}),
    ("/replay", {"filter": '{"colour": "red"}', "expected": "1", "confirm": "y"}),
    ("/replay", {"filter": '["a list"]', "expected": "1", "confirm": "y"}),
    ("/replay", {"filter": '{"status": "failed_permanent"}', "expected": "abc", "confirm": "y"}),
    ("/replay", {"filter": '{"status": "failed_permanent"}', "expected": "1"}),
    ("/replay", {"filter": '{"status": "failed_permanent"}', "expected": "999999999", "confirm": "y"}),
    ("/drift", {"object_type": "nope"}),
    ("/drift", {"object_type": "customers", "fix": "y"}),
    ("/events/evt_x/replay", {"reason": "x" * 5000}),
    ("/outbox/1/replay", {"extra": "\x00"}),
    ("/replay", {"filter": '{"status": "failed_permanent"}', "expected": "1", "confirm": "y", "preview": "nope"}),
    ("/replay", {"filter": "[" * 3000 + "]" * 3000, "expected": "1", "confirm": "y"}),
    ("/replay/jobs/1/cancel", {}),
])
def test_bad_form_input_gets_a_4xx_and_changes_nothing(app, kit, path, form):
    operator = client_for(app, "olga")
    preview = {"preview": str(uuid.uuid4())} if path == "/replay" else {}
    answer = operator.post(path, data={**preview, **form, "csrf_token": token_of(operator, "/events")})
    assert 400 <= answer.status_code < 500 or answer.status_code == 302, answer.text[:300]
    # A cancel of no job, a replay of no effect: back to the page, saying so.
    assert answer.status_code != 302 or path.endswith(("/cancel", "/outbox/1/replay"))
    assert kit.query("SELECT count(*) AS n FROM ledger.replay_jobs") == [{"n": 0}]
    assert kit.query("SELECT count(*) AS n FROM ledger.audit") == [{"n": 0}]


def test_the_source_account_and_mode_filters_select_exactly_their_events(kit):
    import dataclasses

    from devkit.factories import incoming, thin_notification

    now = int(time.time())
    platform = kit.record(event("customer.created", {"id": "cus_p", "object": "customer"}, created=now))
    connected = kit.record(event("customer.created", {"id": "cus_c", "object": "customer"}, created=now,
                                 account="acct_1Filter", livemode=True))
    missed = event("invoice.paid", {"id": "in_m", "object": "invoice"}, created=now)
    kit.store().record_delivery(dataclasses.replace(incoming(missed), source="catchup"))
    both = event("invoice.created", {"id": "in_b", "object": "invoice"}, created=now)
    kit.record(both)
    kit.store().record_delivery(dataclasses.replace(incoming(both), source="catchup"))
    thin = thin_notification("v1.customer.updated", related={"id": "cus_p", "object": "customer"}, created=now)
    kit.store().record_delivery(incoming(thin))
    console = ConsoleLedger(kit.pool("console"))

    def ids(**fields) -> set[str]:
        return {row["id"] for row in console.page(EventQuery(**fields).checked(), size=50).rows}

    assert ids(source="catchup") == {missed["id"], both["id"]}
    assert ids(source="webhook") == {platform, connected, both["id"]}
    assert ids(source="thin") == {thin["id"]}
    assert ids(account="acct_1Filter") == {connected}
    assert ids(account="") == {platform, missed["id"], both["id"], thin["id"]}
    assert ids(livemode=True) == {connected}
    assert console.count(EventQuery(source="catchup").checked()) == (2, False)


def test_the_drift_page_runs_reconcile_keeps_its_report_and_fixes_only_when_confirmed(
        broker_settings, console_settings, kit, fake_stripe):
    import dataclasses

    from tests.integration.test_reconcile import stripe_state

    stripe_state(fake_stripe)
    settings = dataclasses.replace(broker_settings, stripe_api_key=fake_stripe.api_key,
                                   stripe_api_base=fake_stripe.base_url)
    app = create_app(settings, console_settings, run_replays=False)
    try:
        operator = client_for(app, "olga")
        token = token_of(operator, "/drift")
        refused = operator.post("/drift", data={"object_type": "customers", "fix": "y", "csrf_token": token})
        assert refused.status_code == 400 and kit.query("SELECT count(*) AS n FROM billing.customers") == [{"n": 0}]
        assert operator.post("/drift", data={"object_type": "customers", "csrf_token": token}).status_code == 302
        page = operator.get("/drift").text
        assert "cus_1" in page and "missing_locally" in page and "console:olga" in page
        assert kit.query("SELECT count(*) AS n FROM billing.customers") == [{"n": 0}]   # compared, not fixed
        fixed = operator.post("/drift", data={"object_type": "customers", "fix": "y", "confirm_fix": "y",
                                              "csrf_token": token})
        assert fixed.status_code == 302
        assert kit.query("SELECT count(*) AS n FROM billing.customers") == [{"n": 2}]
        runs = kit.query("SELECT actor, types, fixed FROM ledger.reconcile_runs ORDER BY id")
        assert runs == [{"actor": "console:olga", "types": ["customers"], "fixed": False},
                        {"actor": "console:olga", "types": ["customers"], "fixed": True}]
    finally:
        app.extensions["ledger"]["pool"].close()


def test_the_latest_reconcile_run_of_each_type_is_the_drift_metric(kit):
    from ledger.operator import OperatorLedger
    from ledger.reconcile_runs import ReconcileRuns
    from workers.metrics import LedgerCollector

    runs = ReconcileRuns(kit.pool("reports"))
    drifted = [{"type": "customers", "id": f"cus_{i}", "kind": "missing_locally"} for i in range(3)]
    runs.record({"account": None, "checked": {}, "drift": drifted, "fixes": []}, actor="a", types=["customers"],
                fixed=False)
    runs.record({"account": None, "checked": {}, "drift": drifted[:1] + [{"type": "invoices", "id": "in_1",
                                                                         "kind": "stale_status"}], "fixes": []},
                actor="a", types=["customers", "invoices", "charges"], fixed=False)
    families = {f.name: f for f in LedgerCollector(OperatorLedger(kit.pool("m")), reconcile=runs).collect()}
    samples = {s.labels["type"]: s.value for s in families["reconcile_drift_objects"].samples}
    assert samples == {"customers": 1, "invoices": 1, "charges": 0}
    assert families["reconcile_last_run_timestamp_seconds"].samples[0].value > time.time() - 60


def test_the_overview_shows_the_latest_retention_runs_and_the_holds(app, kit, mixed_ledger, tmp_path):
    from ledger.archive import DirectoryStore
    from ledger.retention import Retention, RetentionPolicy

    viewer = client_for(app, "vera")
    assert "no retention run yet" in viewer.get("/").text
    report = Retention(kit.pool("retention"), DirectoryStore(tmp_path / "archive"),
                       RetentionPolicy(processed_days=30, failed_days=60)).run()
    overview = viewer.get("/").text
    row = overview[overview.index('<table id="retention">'):overview.index("hold(s) in force")]
    assert f"<td>{report.run_id}</td>" in row and "done" in row and f"<td>{report.removed}</td>" in row
    assert "2 hold(s) in force" in overview
