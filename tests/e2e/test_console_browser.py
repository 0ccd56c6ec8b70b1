"""The operator console in a real browser (Debian's chromium, driven by selenium through chromedriver),
served by ``ledgerctl console`` (gunicorn) beside a real celery worker, over a ledger holding events in
every state: a subscription's lifecycle, failures of the release before an upgrade, retries, leases, a
payload carrying HTML, a Stripe health alert and a reconcile report.

It logs in, filters to failed_permanent, opens an event, replays it and sees it processed by the
worker; a form without its CSRF token is refused; a stranger is sent to the login page; a payload's
``<script>`` stays text; six wrong passwords are slowed down. With CONSOLE_SCREENSHOTS=<dir> it saves
the main pages there (docs/console/ holds the ones README shows).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from selenium.webdriver.support.ui import WebDriverWait

from devkit.factories import CLOVER_API, SubscriptionHistory, event, new_id
from devkit.procs import wait_until
from devkit.stack import Console
from ledger.attempts import WorkerLedger
from ledger.catchup import CatchupLedger
from ledger.reconcile_runs import ReconcileRuns
from ops.console.auth import hash_password
from tests.support.handlers_for_tests import register_pre_accounts_v2
from tests.support.workers import RecordingWaker, env_for, run_ledgerctl
from workers.processor import EventProcessor, Outcome
from workers.registry import load_handlers

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs Debian's chromium and chromium-driver (apt-get install chromium "
                                       "chromium-driver)")
PASSWORD = "orange-kite-42"
ACCOUNT = "acct_1ConsoleAccountsV2"
SHOTS = os.environ.get("CONSOLE_SCREENSHOTS")


@pytest.fixture
def ledger_with_history(kit, settings, prepared_ledger):
    """prepared_ledger's states, plus two subscription events the release before an upgrade refused, a
    customer whose name is markup, and a reconcile report with drift."""
    ids = {"customer_id": new_id("cus"), "subscription_id": new_id("sub"), "price_id": new_id("price"),
           "product_id": new_id("prod")}
    history = SubscriptionHistory(api_version=CLOVER_API, customer_account=ACCOUNT, **ids).lifecycle()
    old = dataclasses.replace(settings, handler_modules=())
    registry = load_handlers(old)
    register_pre_accounts_v2(registry)
    before_upgrade = EventProcessor.from_settings(old, WorkerLedger(kit.pool("pre-upgrade", old)), registry,
                                                  RecordingWaker())
    refused = kit.record_many(history.events[1:3])
    for evt_id in refused:
        assert before_upgrade.process(evt_id) is Outcome.FAILED_PERMANENT
    # An hour of traffic: customers created and updated, processed over the last hour (times moved, as
    # prepared_ledger moves its own), and a catch-up cursor.
    processor = kit.processor()
    now = int(time.time())
    traffic = [event(kind, {"id": new_id("cus"), "object": "customer", "email": f"c{n}@example.test"},
                     created=now - 3600 + n * 20)
               for n, kind in enumerate(["customer.created", "customer.updated"] * 90)]
    for evt_id in kit.record_many(traffic):
        processor.process(evt_id)
    kit.execute("UPDATE ledger.events SET processed_at = now() - make_interval(secs => (3500 * random())::int), "
                "received_at = now() - make_interval(secs => (3500 * random())::int) WHERE id = ANY(%s)",
                ([e["id"] for e in traffic],))
    cursors = CatchupLedger(settings, kit.pool("catchup"))
    cursors.advance("", traffic[-1]["id"], datetime.fromtimestamp(traffic[-1]["created"], tz=timezone.utc))
    cursors.record_run("", found=3)
    markup = event("customer.updated", {"id": new_id("cus"), "object": "customer", "email": "m@example.test",
                                        "name": "<script>window.__pwned = 1</script><b>bold</b>"},
                   created=int(time.time()))
    kit.processor().process(kit.record(markup))
    ReconcileRuns(kit.pool("reports")).record(
        {"account": None, "checked": {"customers": {"local": 41, "stripe": 42}},
         "drift": [{"type": "customers", "id": "cus_MissingHere1", "kind": "missing_locally", "field": None,
                    "local": None, "stripe": None},
                   {"type": "customers", "id": ids["customer_id"], "kind": "stale_field", "field": "email",
                    "local": "old@example.test", "stripe": "new@example.test"}], "fixes": []},
        actor="console:olga", types=["customers"], fixed=False)
    return {"refused": refused, "subscription": ids["subscription_id"], "markup": markup["id"]}


@pytest.fixture
def console(broker_settings, tmp_path, kit):
    env = env_for(broker_settings, extra={
        "LEDGER_CONSOLE_USERS": f"olga:{hash_password(PASSWORD)},vera:{hash_password(PASSWORD)}",
        "LEDGER_CONSOLE_OPERATORS": "olga", "LEDGER_CONSOLE_SECRET_KEY": "k" * 48})
    process = Console(env, tmp_path).start()
    yield process
    process.kill()


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1360,900",
                "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def shot(driver, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        height = driver.execute_script("return Math.min(document.body.scrollHeight, 2400)")
        driver.set_window_size(1360, max(900, height))
        driver.save_screenshot(str(Path(SHOTS) / f"{name}.png"))
        driver.set_window_size(1360, 900)


def log_in(driver, url: str | None, name: str, password: str = PASSWORD, *, refused: bool = False) -> None:
    """Log in on ``url``'s login page; None: on the login page the browser is on."""
    from selenium.webdriver.common.by import By

    if url is not None:
        driver.get(f"{url}/login")
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")
    driver.find_element(By.ID, "name").send_keys(name)
    driver.find_element(By.ID, "password").send_keys(password)
    submit(driver, driver.find_element(By.ID, "login"))
    if not refused:
        WebDriverWait(driver, 30).until(lambda d: "/login" not in d.current_url)


def submit(driver, element) -> None:
    """Click ``element`` and wait for the page it leads to."""
    from selenium.common.exceptions import WebDriverException

    def left(_) -> bool:
        try:
            element.is_enabled()
            return False
        except WebDriverException:   # stale, or its document already replaced
            return True

    element.click()
    WebDriverWait(driver, 30).until(left)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.readyState") == "complete")


def text(driver, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id).text


def test_an_operator_finds_a_failed_event_replays_it_and_sees_it_processed(
        browser, console, ledger_with_history, broker_settings, worker_factory, kit):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(f"{console.url}/events?status=failed_permanent")
    assert "/login" in browser.current_url          # a stranger is sent to log in
    shot(browser, "login")
    log_in(browser, None, "olga")
    assert browser.current_url.endswith("/events?status=failed_permanent")
    browser.get(console.url + "/")
    assert "failed_permanent" in browser.page_source and browser.find_element(By.CSS_SELECTOR, "svg.chart")
    shot(browser, "overview")

    browser.get(f"{console.url}/events")
    Select(browser.find_element(By.ID, "f-status")).select_by_value("failed_permanent")
    submit(browser, browser.find_element(By.ID, "filter"))
    listed = {a.text for a in browser.find_elements(By.CSS_SELECTOR, "#events a")}
    assert set(ledger_with_history["refused"]) <= listed
    shot(browser, "events")
    browser.get(f"{console.url}/failures")
    assert "unmappable_payload" in browser.page_source
    shot(browser, "failures")

    target = ledger_with_history["refused"][0]
    submit(browser, browser.find_element(By.LINK_TEXT, "Failures"))
    browser.get(f"{console.url}/events/{target}")
    assert text(browser, "field-status") == "failed_permanent"
    assert "data.object.customer" in text(browser, "field-last_error")
    shot(browser, "event")

    worker_factory(broker_settings)                  # the upgraded release: the built-in handlers read customer_account
    browser.find_element(By.ID, "reason").send_keys("upgrade deployed")
    submit(browser, browser.find_element(By.ID, "replay"))
    assert "replayed from failed_permanent" in browser.page_source

    def processed() -> bool:
        browser.refresh()
        return text(browser, "field-status") == "processed"
    wait_until(processed, timeout_s=60, interval_s=0.5, what="the replayed event to be processed")
    assert "console:olga" in text(browser, "timeline")
    assert kit.query("SELECT status FROM billing.subscriptions WHERE id = %s",
                     (ledger_with_history["subscription"],))

    browser.get(f"{console.url}/drift")
    assert "cus_MissingHere1" in browser.page_source
    shot(browser, "drift")


def test_a_bulk_replay_shows_its_preview_and_progress(browser, console, ledger_with_history):
    from selenium.webdriver.common.by import By

    log_in(browser, console.url, "olga")
    browser.get(f"{console.url}/replay?status=failed_permanent&reason=unmappable_payload")
    assert text(browser, "preview-count") == "2"
    shot(browser, "replay-preview")
    browser.find_element(By.ID, "confirm").click()
    submit(browser, browser.find_element(By.ID, "start"))
    wait_until(lambda: "finished" in (browser.refresh() or text(browser, "job-status")), timeout_s=30,
               interval_s=0.5, what="the replay job to finish")
    assert text(browser, "progress") == "2 / 2"
    shot(browser, "replay-job")


def test_a_form_without_its_csrf_token_is_refused(browser, console, ledger_with_history, kit):
    from selenium.webdriver.common.by import By

    log_in(browser, console.url, "olga")
    target = ledger_with_history["refused"][1]
    browser.get(f"{console.url}/events/{target}")
    browser.execute_script("document.querySelector('#replay-form input[name=csrf_token]').remove()")
    submit(browser, browser.find_element(By.ID, "replay"))
    assert "CSRF" in text(browser, "error")
    assert kit.event(target)["status"] == "failed_permanent"


def test_a_payloads_script_stays_text(browser, console, ledger_with_history):
    log_in(browser, console.url, "vera")
    browser.get(f"{console.url}/events/{ledger_with_history['markup']}")
    assert "<script>window.__pwned = 1</script>" in text(browser, "payload")
    assert browser.execute_script("return window.__pwned === undefined")
    assert not browser.find_elements("css selector", "#payload b")


def test_six_wrong_passwords_are_slowed_down(browser, console):
    for _ in range(5):
        log_in(browser, console.url, "olga", "wrong", refused=True)
        assert text(browser, "error") == "wrong name or password"
    log_in(browser, console.url, "olga", refused=True)   # the right one, but too soon
    assert text(browser, "error").startswith("too many failed logins")


def test_an_operator_reads_a_rebuilds_diff_and_applies_it(browser, console, kit, broker_settings, monkeypatch):
    from selenium.webdriver.common.by import By

    from tests.support import reprojection as rp

    rp.plant_bug(monkeypatch)
    processor = kit.processor()
    for evt_id in kit.record_many(rp.lifecycles(6)):
        assert processor.process(evt_id) is Outcome.PROCESSED
    monkeypatch.undo()  # the handler is fixed
    buggy = rp.tables(kit.query)
    started = run_ledgerctl(broker_settings, "reproject", "start")
    assert started.returncode == 0, started.stderr

    log_in(browser, console.url, "vera")
    browser.get(f"{console.url}/reprojection")
    assert "built" in text(browser, "rebuild-state") and not browser.find_elements(By.ID, "reprojection-apply")
    browser.delete_all_cookies()
    log_in(browser, console.url, "olga")
    browser.get(f"{console.url}/reprojection")
    assert "subscriptions" in text(browser, "diff-counts") and "past_due" in browser.page_source
    shot(browser, "reprojection")
    browser.find_element(By.ID, "confirm").click()
    submit(browser, browser.find_element(By.CSS_SELECTOR, "#reprojection-apply button"))
    assert "applied" in text(browser, "rebuild-state") and "console:olga" in text(browser, "reprojection-audit")
    assert rp.tables(kit.query) != buggy


def subscription_with_a_planted_status(kit) -> SubscriptionHistory:
    """A subscription processed to active, whose live row then says past_due: live differs from rebuilt."""
    history = SubscriptionHistory(start=1_700_000_000).lifecycle()
    processor = kit.processor()
    for evt_id in kit.record_many(history.events[:9]):
        assert processor.process(evt_id) is Outcome.PROCESSED
    kit.execute("UPDATE billing.subscriptions SET status = 'past_due' WHERE id = %s", (history.subscription_id,))
    return history


def test_an_operator_searches_an_id_and_reads_its_story_live_beside_rebuilt(browser, console, kit):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    history = subscription_with_a_planted_status(kit)

    log_in(browser, console.url, "vera")
    search = browser.find_element(By.ID, "find-id")
    search.send_keys(history.subscription_id)
    search.send_keys(Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: f"/objects/{history.subscription_id}" in d.current_url)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#object-events tr")) == 1 + 5  # its five events
    assert "differs in status" in browser.page_source
    status = browser.find_element(By.CSS_SELECTOR, 'table[data-table="billing.subscriptions"] tr.differs')
    assert [c.text for c in status.find_elements(By.TAG_NAME, "td")] == ["status", '"past_due"', '"active"']
    assert not browser.find_elements(By.ID, "object-repair")  # a viewer reads; only an operator repairs
    browser.find_element(By.LINK_TEXT, history.customer_id).click()
    WebDriverWait(browser, 30).until(lambda d: f"/objects/{history.customer_id}" in d.current_url)
    assert history.subscription_id in text(browser, "links")

    search = browser.find_element(By.ID, "find-id")
    search.send_keys("cus_nobodyhere")
    search.send_keys(Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: "not in the ledger" in d.page_source)


def test_an_operator_repairs_one_subscriptions_rows_from_its_page(browser, console, kit):
    from selenium.webdriver.common.by import By

    history = subscription_with_a_planted_status(kit)

    log_in(browser, console.url, "olga")
    browser.get(f"{console.url}/objects/{history.subscription_id}")
    assert "1 row(s) differ" in text(browser, "repair-summary")
    shot(browser, "object")
    browser.find_element(By.ID, "confirm").click()
    submit(browser, browser.find_element(By.CSS_SELECTOR, "#object-repair button"))
    WebDriverWait(browser, 30).until(lambda d: "row(s) written" in d.page_source)
    assert "0 row(s) differ" in text(browser, "repair-summary")
    assert "console:olga" in text(browser, "object-repairs")
    assert kit.query("SELECT status FROM billing.subscriptions") == [{"status": "active"}]
