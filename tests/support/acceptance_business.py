"""The business of the acceptance tests: what a product built on the ledger does with Stripe events.

Plain functions, no registration: ``acceptance_release1`` and ``acceptance_release2``
register them the way a product's handler module would (``LEDGER_HANDLER_MODULES``),
two releases of one product. Importing either elsewhere registers nothing: a registry
holds only the handler modules its ``load_handlers`` call loads.

* ``grant_credits`` (``invoice.paid``): one row in ``public.acceptance_credits`` per
  paid invoice. The table has NO unique constraint on purpose: an invoice whose event
  was applied twice shows two rows. Two injectable faults, switched by rows of
  ``public.acceptance_faults``:
  - ``serialization_failure``: a trigger on the credits table makes the INSERT fail with
    SQLSTATE 40001, a real Postgres error in the business write (recoverable);
  - ``crash``: on the event's first attempt, after the business writes, the handler
    writes its pid into the file named by ``marker`` and stalls (even through Celery's
    soft time limit), so the test can SIGKILL the process before the COMMIT.
* ``provision_workspace_strict`` (release 1, ``checkout.session.completed``): names the
  workspace after ``client_reference_id`` and refuses (``unmappable_payload``) a session
  without one. ``provision_workspace`` (release 2) falls back to the customer.
* ``notice_upcoming_invoice`` (release 2 only, ``invoice.upcoming``): one row in
  ``public.acceptance_upcoming`` per event. Release 1 has no handler for that type, and
  its object (an invoice not created yet) has no id, so not even the generic mirror
  keeps it (``object_without_id``).
"""
from __future__ import annotations

import os
import time

import psycopg

from workers.failures import TransientError, UnmappablePayload
from workers.registry import ApplyContext

DDL = """
CREATE TABLE IF NOT EXISTS public.acceptance_credits (
    invoice_id text NOT NULL, customer_id text, credits bigint NOT NULL, event_id text NOT NULL, n serial);
CREATE TABLE IF NOT EXISTS public.acceptance_workspaces (
    checkout_session_id text NOT NULL, workspace text NOT NULL, event_id text NOT NULL, n serial);
CREATE TABLE IF NOT EXISTS public.acceptance_upcoming (
    customer_id text, amount_due bigint, event_id text NOT NULL, n serial);
CREATE TABLE IF NOT EXISTS public.acceptance_faults (kind text PRIMARY KEY, marker text);
CREATE OR REPLACE FUNCTION public.acceptance_credits_fault() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM public.acceptance_faults WHERE kind = 'serialization_failure') THEN
        RAISE EXCEPTION 'could not serialize access to the credits (fault injected by the acceptance tests)'
              USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN NEW;
END $$;
CREATE OR REPLACE TRIGGER acceptance_credits_fault BEFORE INSERT ON public.acceptance_credits
    FOR EACH ROW EXECUTE FUNCTION public.acceptance_credits_fault();
"""

TABLES = ("acceptance_credits", "acceptance_workspaces", "acceptance_upcoming", "acceptance_faults")


def ensure_tables(conn: psycopg.Connection) -> None:
    """Create (idempotently, outside any apply transaction) and empty the acceptance tables."""
    conn.execute(DDL)
    reset_tables(conn)


def reset_tables(conn: psycopg.Connection) -> None:
    for table in TABLES:
        conn.execute(f"DELETE FROM public.{table}")


def grant_credits(ctx: ApplyContext) -> None:
    invoice = ctx.object
    ctx.conn.execute(
        "INSERT INTO public.acceptance_credits (invoice_id, customer_id, credits, event_id) VALUES (%s, %s, %s, %s)",
        (invoice["id"], invoice.get("customer"), int(invoice.get("amount_paid") or 0) // 100, ctx.event_id))
    crash = ctx.conn.execute("SELECT marker FROM public.acceptance_faults WHERE kind = 'crash'").fetchone()
    if crash and ctx.attempt == 1:
        _stall_until_killed(crash[0])


def _stall_until_killed(marker: str) -> None:
    tmp = f"{marker}.tmp"
    with open(tmp, "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(tmp, marker)  # the test sees the file only once the pid is in it
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            time.sleep(0.2)
        except Exception as exc:  # Celery's soft time limit: keep stalling, the test kills us
            if type(exc).__name__ != "SoftTimeLimitExceeded":
                raise
    raise TransientError("the crash fault was armed but nobody killed the worker")


def provision_workspace_strict(ctx: ApplyContext) -> None:
    session = ctx.object
    reference = session.get("client_reference_id")
    if not isinstance(reference, str) or not reference:
        raise UnmappablePayload("data.object.client_reference_id")
    _provision(ctx, session["id"], reference)


def provision_workspace(ctx: ApplyContext) -> None:
    session = ctx.object
    reference = session.get("client_reference_id")
    customer = session.get("customer")
    if isinstance(customer, dict):
        customer = customer.get("id")
    workspace = reference if isinstance(reference, str) and reference else f"customer:{customer or session['id']}"
    _provision(ctx, session["id"], workspace)


def _provision(ctx: ApplyContext, session_id: str, workspace: str) -> None:
    ctx.conn.execute("INSERT INTO public.acceptance_workspaces (checkout_session_id, workspace, event_id) "
                     "VALUES (%s, %s, %s)", (session_id, workspace, ctx.event_id))


def notice_upcoming_invoice(ctx: ApplyContext) -> None:
    invoice = ctx.object
    customer = invoice.get("customer")
    ctx.conn.execute("INSERT INTO public.acceptance_upcoming (customer_id, amount_due, event_id) VALUES (%s, %s, %s)",
                     (customer if isinstance(customer, str) else None, invoice.get("amount_due"), ctx.event_id))
