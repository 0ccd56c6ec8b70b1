"""ledgerctl reproject --object / --customer: one object's or customer's rows rewritten from its events
(workers/object_repair.py), as rows, in one transaction, audited; a worker's event of the same objects
during a repair is not lost."""
from __future__ import annotations

import json
import threading

import pytest

from devkit.factories import SubscriptionHistory
from ledger.reprojection import StoredEvent
from workers.object_repair import ObjectRepair
from workers.registry import load_handlers
from workers.reproject import object_rows

HISTORY = SubscriptionHistory(start=1_700_000_000).lifecycle()
SUB, CUS = HISTORY.subscription_id, HISTORY.customer_id
BILLING = ("subscriptions", "subscription_transitions", "invoices", "customers", "entitlements", "objects")


def process(kit, events: list[dict]) -> None:
    processor = kit.processor(waker=None)
    for evt_id in kit.record_many(events):
        assert processor.process(evt_id).value == "processed", kit.event(evt_id)


def repair_cli(ledgerctl_cli, *args: str, code: int = 0) -> dict:
    return json.loads(ledgerctl_cli("reproject", *args, "--json", code=code).stdout)


def billing(kit) -> dict[str, list]:
    """Every billing row, without the columns that only say when a row was written (a DEFAULT now())."""
    out = {}
    for table in BILLING:
        written_at = [r["column_name"] for r in kit.query(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = 'billing' "
            "AND table_name = %s AND column_default LIKE 'now()%%'", (table,))]
        rows = kit.query(f"SELECT to_jsonb(t) - %s::text[] AS r FROM billing.{table} t", (written_at,))
        out[table] = sorted(json.dumps(r["r"], sort_keys=True) for r in rows)
    return out


def reference(kit, fresh_kit, events: list[dict]) -> dict[str, list]:
    """The rows a ledger that processed ``events`` in Stripe's order holds, and nothing else."""
    process(fresh_kit, sorted(events, key=lambda e: (e["created"], e["id"])))
    return billing(fresh_kit)


def test_a_planted_wrong_row_is_shown_then_repaired_and_the_repair_is_audited(kit, ledgerctl_cli):
    events = HISTORY.events[:9]  # ends active, cancel_at_period_end
    process(kit, events)
    before = billing(kit)
    kit.execute("UPDATE billing.subscriptions SET status = 'past_due', cancel_at_period_end = false WHERE id = %s",
                (SUB,))

    plan = repair_cli(ledgerctl_cli, "--object", SUB, "--dry-run")
    [row] = [r for t in plan["tables"] for r in t["rows"]]
    assert (row["kind"], sorted(row["differs"])) == ("changed", ["cancel_at_period_end", "status"])
    assert row["live"]["status"] == "past_due" and row["rebuilt"]["status"] == "active"
    assert kit.query("SELECT count(*) AS n FROM ledger.object_repairs")[0]["n"] == 0  # a dry run writes nothing

    done = repair_cli(ledgerctl_cli, "--object", SUB, "--yes")

    assert done["written"] == {"written": 1, "removed": 0}
    assert billing(kit) == before
    [audit] = kit.query("SELECT scope, object_id, actor, counts, changes FROM ledger.object_repairs")
    assert (audit["scope"], audit["object_id"]) == ("object", SUB) and "@" in audit["actor"]
    assert audit["changes"][0]["before"]["status"] == "past_due" and audit["changes"][0]["after"]["status"] == "active"
    again = repair_cli(ledgerctl_cli, "--object", SUB, "--yes")
    assert again["counts"] == {"changed": 0, "only_rebuilt": 0, "only_live": 0, "kept": 0}
    assert kit.query("SELECT count(*) AS n FROM ledger.object_repairs")[0]["n"] == 1  # nothing to do: no audit


def test_a_customers_repair_restores_every_row_of_it_and_keeps_what_its_events_cannot_show(
        kit, fresh_kit, ledgerctl_cli):
    events = HISTORY.events[:8]  # ends active: entitlements granted
    process(kit, events)
    expected = reference(kit, fresh_kit, events)
    invoice = next(e for e in events if e["type"] == "invoice.paid")["data"]["object"]["id"]
    kit.execute("DELETE FROM billing.entitlements WHERE customer_id = %s", (CUS,))        # derived rows lost
    kit.execute("DELETE FROM billing.invoices WHERE id = %s", (invoice,))                 # a row lost
    kit.execute("UPDATE billing.subscription_transitions SET to_status = 'unpaid' "
                "WHERE subscription_id = %s AND event_type LIKE '%%created'", (SUB,))     # history written wrong
    kit.execute("INSERT INTO billing.invoices (id, customer_id, status, source_event_id, source_event_created, "
                "livemode) SELECT 'in_planted', %s, 'paid', id, stripe_created, false FROM ledger.events "
                "WHERE type = 'customer.created'", (CUS,))                                # no event gives it
    kit.execute("INSERT INTO billing.invoices (id, customer_id, status, source_event_id, source_event_created, "
                "livemode) VALUES ('in_fetched', %s, 'open', 'api_fetch', now(), false)", (CUS,))  # a backfill's

    object_only = repair_cli(ledgerctl_cli, "--object", SUB, "--dry-run")
    assert {t["table"] for t in object_only["tables"]} == {"billing.subscription_transitions"}
    assert any(CUS in line for line in object_only["not_in_scope"])

    done = repair_cli(ledgerctl_cli, "--customer", CUS, "--yes")

    kinds = {(t["table"], r["kind"]) for t in done["tables"] for r in t["rows"]}
    assert kinds == {("billing.entitlements", "only_rebuilt"), ("billing.invoices", "only_rebuilt"),
                     ("billing.subscription_transitions", "changed"), ("billing.invoices", "only_live"),
                     ("billing.invoices", "kept")}
    after = billing(kit)
    kept = [r for r in after["invoices"] if '"in_fetched"' in r]
    assert len(kept) == 1
    after["invoices"].remove(kept[0])
    assert after == expected


def test_hostile_scopes_are_refused_and_an_unknown_object_changes_nothing(kit, ledgerctl_cli):
    process(kit, HISTORY.events[:2])
    for args in (["--object", "sub_a\x00b"], ["--object", "sub_" + "a" * 10_000], ["--customer", SUB],
                 ["--object", HISTORY.events[0]["id"]], ["--object", "../x"], ["--object", SUB, "--customer", CUS],
                 ["--object", SUB, "status"]):
        result = ledgerctl_cli("reproject", *args, "--yes", code=2)
        assert result.stderr.strip() and "Traceback" not in result.output
    result = ledgerctl_cli("reproject", "--object", "sub_nobodyhere", "--yes", code=1)
    assert "sub_nobodyhere is not in the ledger" in result.stderr
    assert kit.query("SELECT count(*) AS n FROM ledger.object_repairs")[0]["n"] == 0


def test_an_event_a_worker_applies_while_a_repair_runs_is_not_lost(kit, monkeypatch):
    """The repair has read the customer's events and made its rows; a worker then applies the subscription's
    cancellation. The worker waits for the repair's locks and applies it on the repaired rows: the
    cancellation and what it derives (no entitlements) stand. Without the locks the repair would write the
    entitlements of the subscription it saw, active, after the worker had removed them."""
    import workers.object_repair as object_repair

    process(kit, HISTORY.events[:-1])  # active, entitlements granted
    kit.execute("UPDATE billing.subscriptions SET quantity = 7 WHERE id = %s", (SUB,))  # something to repair,
    kit.execute("DELETE FROM billing.entitlements WHERE customer_id = %s", (CUS,))       # and derived rows
    planned, release = threading.Event(), threading.Event()
    write = object_repair._write

    def write_when_released(conn, plan):
        planned.set()
        release.wait(10)
        return write(conn, plan)

    monkeypatch.setattr(object_repair, "_write", write_when_released)
    repair = ObjectRepair(kit.pool("repair"), load_handlers(kit.settings))
    repaired: list = []
    repairing = threading.Thread(target=lambda: repaired.append(repair.apply("customer", CUS, actor="test")))
    repairing.start()
    assert planned.wait(10)
    worker = threading.Thread(target=process, args=(kit, HISTORY.events[-1:]))
    worker.start()
    worker.join(1.5)  # it waits for the repair's locks, or (without them) has applied the cancellation
    release.set()
    repairing.join(20)
    worker.join(20)

    assert repaired
    assert kit.event(HISTORY.events[-1]["id"])["status"] == "processed"
    [sub] = kit.query("SELECT status, quantity FROM billing.subscriptions WHERE id = %s", (SUB,))
    assert (sub["status"], sub["quantity"]) == ("canceled", 1)
    assert kit.query("SELECT feature FROM billing.entitlements WHERE customer_id = %s", (CUS,)) == []
    assert repaired and repaired[0]["written"]["written"] >= 2  # the subscription's row, the entitlements
    transitions = kit.query("SELECT count(*) AS n FROM billing.subscription_transitions WHERE subscription_id = %s",
                            (SUB,))[0]["n"]
    assert transitions == sum(e["type"].startswith("customer.subscription.") for e in HISTORY.events)


@pytest.fixture
def fresh_kit(fresh_db, settings):
    """A second, empty ledger: what processing the same events from nothing gives."""
    import dataclasses

    import psycopg

    from ledger.migrate import migrate
    from tests.support.handlers_for_tests import ensure_test_tables
    from tests.support.workers import LedgerKit

    migrate(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        ensure_test_tables(conn)
    k = LedgerKit(dataclasses.replace(settings, database_url=fresh_db))
    yield k
    k.close()


def test_the_rows_a_repair_writes_are_the_rebuilt_handlers_rows(kit):
    """One mapping: what a repair compares with is object_rows' (the page's rebuilt column)."""
    process(kit, HISTORY.events)
    stored = [StoredEvent.from_row(e) for e in kit.query(
        "SELECT id, type, payload, stripe_created, livemode, account, api_version FROM ledger.events")]
    rebuilt = object_rows(load_handlers(kit.settings), stored)
    plan = ObjectRepair(kit.pool("repair"), load_handlers(kit.settings)).diff("customer", CUS)
    assert plan["counts"] == {"changed": 0, "only_rebuilt": 0, "only_live": 0, "kept": 0}
    assert {r["id"] for r in rebuilt["billing.subscriptions"]} == {SUB}


def test_a_repair_that_waits_too_long_for_a_workers_locks_writes_nothing(kit, monkeypatch):
    import psycopg

    import workers.object_repair as object_repair
    from ledger.attempts import WorkerLedger
    from workers.object_repair import RepairBusy

    process(kit, HISTORY.events[:9])
    kit.execute("UPDATE billing.subscriptions SET status = 'past_due' WHERE id = %s", (SUB,))
    monkeypatch.setattr(object_repair, "LOCK_WAIT", "300ms")
    with psycopg.connect(kit.settings.database_url) as worker:  # a batch holding the subscription
        WorkerLedger.lock_objects(worker, [SUB])
        with pytest.raises(RepairBusy, match="held by workers"):
            ObjectRepair(kit.pool("repair"), load_handlers(kit.settings)).apply("object", SUB, actor="test")
    assert kit.query("SELECT status FROM billing.subscriptions") == [{"status": "past_due"}]
    assert kit.query("SELECT count(*) AS n FROM ledger.object_repairs")[0]["n"] == 0
