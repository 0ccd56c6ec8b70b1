"""Catch-up, backfill and reconcile with real processes: ``ledgerctl`` as a subprocess, the real receiver
(gunicorn) and real ``celery`` workers, against the fake Stripe API (devkit.stripe_api) served from the test
process over HTTP. (In-process: tests/integration/test_catchup.py, test_backfill.py, test_reconcile.py.)"""
from __future__ import annotations

import json
import random
import subprocess
import threading
import time

from devkit.factories import SubscriptionHistory, event
from devkit.procs import REPO, free_port, venv_tool, wait_until
from devkit.stripe_sim import Backoff, SimEvent, StripeSimulator
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import receiver_env
from tests.support.stripe_api import env_of, fake_stripe  # noqa: F401
from tests.support.workers import env_for, run_ledgerctl

DAY = 86400


def effect(n: int, created: int, **kw) -> dict:
    return event("test.effect", {"id": f"obj_{n}"}, created=created, event_id=f"evt_e2e_{n:04d}", **kw)


def ledgerctl(settings, fake, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return run_ledgerctl(settings, *args, extra_env=env_of(fake), timeout_s=timeout_s)


def start_ledgerctl(settings, fake, *args: str) -> subprocess.Popen:
    return subprocess.Popen([venv_tool("ledgerctl"), *args], cwd=REPO, env=env_for(settings, extra=env_of(fake)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def wait_processed(kit, n: int, timeout_s: float = 90) -> None:
    wait_until(lambda: kit.query("SELECT count(*) AS n FROM ledger.events WHERE status = 'processed'")[0]["n"] == n,
               timeout_s=timeout_s, interval_s=0.2, what=f"{n} events to be processed "
               f"(now {kit.query('SELECT status, count(*) FROM ledger.events GROUP BY status')})")


def catchup_deliveries(kit) -> dict[str, int]:
    return {r["event_id"]: r["n"] for r in kit.query(
        "SELECT event_id, count(*) AS n FROM ledger.deliveries WHERE source = 'catchup' GROUP BY event_id")}


def final_objects(history: SubscriptionHistory) -> list[dict]:
    """Stripe's current objects after ``history``: the last snapshot of each object its events carried."""
    latest: dict[str, dict] = {}
    for evt in history.events:
        obj = evt["data"]["object"]
        latest[obj["id"]] = {**obj, "created": history.start, "livemode": False}
    return list(latest.values())


def test_a_day_with_the_receiver_down_then_catchup_processes_every_missed_event_exactly_once(
        kit, broker_settings, start_receiver, worker_factory, fake_stripe):
    settings = broker_settings
    now = int(time.time())
    day_start = now - DAY
    effects = [effect(n, day_start + n * 1800) for n in range(48)]        # every half hour, all day
    history = SubscriptionHistory(start=day_start + 900).lifecycle()      # and one customer's billing life
    missed = effects + history.events
    fake_stripe.add_events(missed, delivered=False)
    fake_stripe.put_objects(final_objects(history))

    # All day Stripe delivers to an endpoint that is down, and gives up on every event.
    down = StripeSimulator(url=f"http://127.0.0.1:{free_port()}/webhooks/stripe", secret=WEBHOOK_SECRET,
                           backoff=Backoff(base_s=0.01, cap_s=0.02, max_attempts=2))
    down.run([SimEvent.from_dict(e) for e in missed])
    assert down.gave_up == {e["id"] for e in missed}
    assert kit.query("SELECT count(*) AS n FROM ledger.events")[0]["n"] == 0

    # The endpoint is back; Stripe redelivers some events (a manual resend) at the very moment catch-up runs.
    receiver = start_receiver(receiver_env(settings.database_url, settings.broker_url, WEBHOOK_SECRET,
                                           LEDGER_QUEUE=settings.queue_name), workers=2)
    worker_factory(settings, concurrency=2)
    sim = StripeSimulator(url=f"{receiver.url}/webhooks/stripe", secret=WEBHOOK_SECRET)
    redelivered = [SimEvent.from_dict(e) for e in missed[::4]]
    catchup = start_ledgerctl(settings, fake_stripe, "catchup", "--json")
    sent = 0
    while catchup.poll() is None or sent == 0:
        for evt in redelivered:
            sim.send_concurrently(evt, 2)
            sent += 2
    out, err = catchup.communicate(timeout=60)
    assert catchup.returncode == 0, err
    report = json.loads(out)
    assert report["listed"] == len(missed) and report["recorded"] == len(missed)
    assert report["missed"] + report["duplicates"] == len(missed) and report["missed"] >= len(missed) - len(
        redelivered)
    assert "catch-up found events no webhook had delivered" in err  # the alert-worthy log line

    wait_processed(kit, len(missed))
    # Exactly once: one ledger row and one business effect per event, whoever delivered it and how often.
    assert kit.query("SELECT count(*) AS n FROM ledger.events")[0]["n"] == len(missed)
    assert {e["id"]: kit.effects(e["id"]) for e in effects} == {e["id"]: 1 for e in effects}
    assert catchup_deliveries(kit) == {e["id"]: 1 for e in missed}
    webhook = kit.query("SELECT DISTINCT event_id FROM ledger.deliveries WHERE source = 'webhook'")
    assert {r["event_id"] for r in webhook} <= {e.id for e in redelivered}
    assert kit.query("SELECT status FROM billing.subscriptions WHERE id = %s",
                     (history.subscription_id,)) == [{"status": "canceled"}]
    assert kit.query("SELECT count(*) AS n FROM billing.subscription_transitions")[0]["n"] == 6

    # The tables match Stripe.
    clean = ledgerctl(settings, fake_stripe, "reconcile", "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert json.loads(clean.stdout)["drift"] == []

    # Each drift planted on purpose is found, named, and repaired by --fix.
    kit.execute("UPDATE billing.subscriptions SET status = 'active', "
                "source_event_created = source_event_created - interval '1 day'")
    kit.execute("UPDATE billing.invoices SET amount_paid = amount_paid + 1, "
                "source_event_created = source_event_created - interval '1 day' WHERE status = 'paid'")
    kit.execute("DELETE FROM billing.customers")
    fake_stripe.put_object({"id": "cus_only_at_stripe", "object": "customer", "created": now, "livemode": False})
    found = ledgerctl(settings, fake_stripe, "reconcile", "--json")
    assert found.returncode == 1, found.stderr
    kinds = {(d["type"], d["kind"]) for d in json.loads(found.stdout)["drift"]}
    assert kinds == {("subscriptions", "stale_status"), ("invoices", "wrong_amount"),
                     ("customers", "missing_locally")}
    fixed = ledgerctl(settings, fake_stripe, "reconcile", "--fix")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "not fixed" in fixed.stdout and ", 0 not fixed" in fixed.stdout
    assert ledgerctl(settings, fake_stripe, "reconcile").returncode == 0


def test_two_catchups_started_together_record_nothing_twice_and_the_second_reports_the_lock(
        kit, broker_settings, worker_factory, fake_stripe):
    settings = broker_settings
    now = int(time.time())
    missed = [effect(n, now - 3600 + n * 10) for n in range(30)]
    fake_stripe.add_events(missed, delivered=False)
    fake_stripe.slow_next(1, seconds=3.0, path_prefix="/v1/events")  # the first listing holds its lock a while
    worker_factory(settings, concurrency=2)

    runs = [start_ledgerctl(settings, fake_stripe, "catchup") for _ in range(2)]
    outputs = [run.communicate(timeout=60) for run in runs]
    results = sorted((run.returncode, *output) for run, output in zip(runs, outputs))

    (ok, ok_out, ok_err), (busy, busy_out, busy_err) = results
    assert (ok, busy) == (0, 4), results
    assert "recorded 30 (30 no webhook had delivered" in ok_out
    assert busy_err.strip() == "another catch-up of the platform is running (it holds the advisory lock); " \
                               "nothing was done"
    wait_processed(kit, len(missed))
    assert catchup_deliveries(kit) == {e["id"]: 1 for e in missed}
    assert {e["id"]: kit.effects(e["id"]) for e in missed} == {e["id"]: 1 for e in missed}


def test_a_429_storm_is_waited_out_honouring_retry_after(kit, broker_settings, fake_stripe):
    settings = broker_settings
    now = int(time.time())
    missed = [effect(n, now - 600 + n) for n in range(5)]
    fake_stripe.add_events(missed)
    fake_stripe.fail_next(4, status=429, retry_after=1, path_prefix="/v1/events")

    done = ledgerctl(settings, fake_stripe, "catchup", "--json")

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["recorded"] == 5
    tries = fake_stripe.timed("/v1/events")
    assert [r.status for _, r in tries] == [429, 429, 429, 429, 200]
    waits = [later - earlier for (earlier, _), (later, _) in zip(tries, tries[1:])]
    assert all(w >= 1.0 for w in waits), waits          # Retry-After: 1 is the least wait
    assert done.stderr.count("Stripe API call failed; retrying") == 4


def test_a_backfill_racing_live_events_ends_at_the_newest_state(
        kit, broker_settings, start_receiver, worker_factory, fake_stripe):
    settings = broker_settings
    now = int(time.time())
    rng = random.Random(13)
    subs = {}
    live = []
    for n in range(150):
        history = SubscriptionHistory(start=now - 3600 + n)
        history.add("customer.subscription.created", history._subscription("trialing", history.start))
        history.add("customer.subscription.updated", history._subscription("active", history.start))
        subs[history.subscription_id] = history
        live.extend(history.events)
        fake_stripe.put_object({**history.events[-1]["data"]["object"], "created": history.start, "livemode": False})
    rng.shuffle(live)

    receiver = start_receiver(receiver_env(settings.database_url, settings.broker_url, WEBHOOK_SECRET,
                                           LEDGER_QUEUE=settings.queue_name), workers=2)
    worker_factory(settings, concurrency=2)
    sim = StripeSimulator(url=f"{receiver.url}/webhooks/stripe", secret=WEBHOOK_SECRET)
    fake_stripe.slow_next(2, seconds=1.5, path_prefix="/v1/subscriptions")  # both pages come slowly

    def changes_at_stripe():
        # While the backfill pages: 30 subscriptions change at Stripe, each with its event, created now.
        for sub_id in rng.sample(sorted(subs), 30):
            history = subs[sub_id]
            obj = {**history._subscription("past_due", history.start), "created": history.start, "livemode": False}
            fake_stripe.put_object(obj)
            evt = event("customer.subscription.updated", obj, created=int(time.time()))
            live.append(evt)
            assert sim.send(SimEvent.from_dict(evt)).ok
            time.sleep(0.1)

    changer = threading.Thread(target=changes_at_stripe)
    backfill = start_ledgerctl(settings, fake_stripe, "backfill", "subscriptions", "--json")
    changer.start()
    for evt in list(live[:300]):
        assert sim.send(SimEvent.from_dict(evt)).ok
    changer.join()
    out, err = backfill.communicate(timeout=60)
    assert backfill.returncode == 0, err
    assert json.loads(out)["types"][0]["fetched"] == 150

    wait_processed(kit, len(live))
    result = ledgerctl(settings, fake_stripe, "reconcile", "subscriptions", "--json")
    assert result.returncode == 0, result.stdout
    report = json.loads(result.stdout)
    assert report["drift"] == [] and report["checked"]["subscriptions"] == {"local": 150, "stripe": 150}
    assert kit.query("SELECT count(*) AS n FROM billing.subscriptions WHERE status = 'past_due'")[0]["n"] == 30


def test_a_connected_accounts_events_never_touch_the_platforms_rows(
        kit, broker_settings, start_receiver, worker_factory, fake_stripe):
    settings = broker_settings
    now = int(time.time())
    platform = event("customer.created", {"id": "cus_platform", "object": "customer", "email": "p@example.test",
                                          "metadata": {}}, created=now - 600)
    receiver = start_receiver(receiver_env(settings.database_url, settings.broker_url, WEBHOOK_SECRET,
                                           LEDGER_QUEUE=settings.queue_name), workers=1)
    worker_factory(settings, concurrency=2)
    assert StripeSimulator(url=f"{receiver.url}/webhooks/stripe", secret=WEBHOOK_SECRET).send(
        SimEvent.from_dict(platform)).ok
    fake_stripe.add_event(platform)
    fake_stripe.put_object({**platform["data"]["object"], "created": now - 600, "livemode": False})
    wait_processed(kit, 1)
    before = kit.query("SELECT * FROM billing.customers WHERE id = 'cus_platform'")

    history = SubscriptionHistory(start=now - 500).lifecycle()
    connected = [{**e, "account": "acct_1conn"} for e in history.events]
    fake_stripe.add_events(connected, account="acct_1conn")
    fake_stripe.put_objects(final_objects(history), account="acct_1conn")

    assert ledgerctl(settings, fake_stripe, "catchup").returncode == 0             # the platform: nothing new
    done = ledgerctl(settings, fake_stripe, "catchup", "--account", "acct_1conn", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["missed"] == len(connected)
    wait_processed(kit, 1 + len(connected))

    assert kit.query("SELECT * FROM billing.customers WHERE id = 'cus_platform'") == before
    assert kit.query("SELECT DISTINCT account FROM ledger.events WHERE id <> %s", (platform["id"],)) == [
        {"account": "acct_1conn"}]
    for table in ("customers", "subscriptions", "invoices"):
        rows = kit.query(f"SELECT id, account FROM billing.{table} WHERE id <> 'cus_platform'")
        assert rows and {r["account"] for r in rows} == {"acct_1conn"}, (table, rows)
    for args in ((), ("--account", "acct_1conn")):
        result = ledgerctl(settings, fake_stripe, "reconcile", "--json", *args)
        assert result.returncode == 0 and json.loads(result.stdout)["drift"] == [], result.stdout
