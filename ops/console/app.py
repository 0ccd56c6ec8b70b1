"""The console's Flask app: pages over the ledger, for viewers and operators (ops/console/auth.py).

Every page needs a login; every change is a POST with a CSRF token (Flask-WTF) and, for replays and
fixes, the operator role, checked here at each endpoint. Nothing changes on GET. Templates are
Jinja with autoescape on: a payload or a query string shows as text. The Content-Security-Policy
allows no script at all; a running replay's page refreshes itself with a meta tag.
"""
from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime, timedelta, timezone

import psycopg
from flask import Blueprint, Flask, abort, current_app, flash, g, redirect, render_template, request, session, url_for
from flask_wtf import CSRFProtect, FlaskForm
from flask_wtf.csrf import CSRFError
from werkzeug.exceptions import HTTPException
from wtforms import BooleanField, HiddenField, IntegerField, PasswordField, SelectField, StringField
from wtforms.validators import DataRequired, Length, NumberRange, Optional

from ledger import inputs
from ledger.config import Settings
from ledger.console import MAX_PAGE, MAX_REPLAY, ConsoleLedger
from ledger.event_query import DEFAULT_RANGE, SOURCES, EventQuery, FilterError
from ledger.db import ProcessPool
from ledger.errors import LedgerError
from ledger.http import read_body
from ledger.inputs import InputError
from ledger.operator import OperatorLedger
from ledger.outbox import OutboxLedger
from ledger.reconcile_runs import ReconcileRuns
from ledger.states import EventStatus, OutboxStatus
from ops.console import charts
from ops.console.auth import (LoginThrottle, check_password, client_address, current_user, login_required,
                              requires_operator)
from ops.console.settings import ConsoleSettings
from workers.stripe_api import COLLECTIONS

bp = Blueprint("console", __name__)
_CELERY: dict = {}
_CELERY_LOCK = threading.Lock()
csrf = CSRFProtect()

CSP = ("default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; base-uri 'none'; "
       "frame-ancestors 'none'")
PAGE_SIZE = 50
MAX_FORM_BYTES = 64 * 1024
# No page holds the database longer: a filter that would is answered 503, its statement cancelled.
STATEMENT_TIMEOUT_MS = 10_000


class LoginForm(FlaskForm):
    name = StringField("Name", validators=[DataRequired(), Length(max=200)])
    password = PasswordField("Password", validators=[DataRequired(), Length(max=1000)])
    next = HiddenField()


class ReplayOneForm(FlaskForm):
    reason = StringField("Reason", validators=[Optional(), Length(max=500)])
    force = BooleanField("Replay even if processed")


class ReplayJobForm(FlaskForm):
    filter = HiddenField(validators=[DataRequired(), Length(max=4000)])
    expected = IntegerField(validators=[DataRequired(), NumberRange(min=1, max=MAX_REPLAY)])
    preview = HiddenField(validators=[DataRequired(), Length(max=64)])
    reason = StringField("Reason", validators=[Optional(), Length(max=500)])
    confirm = BooleanField("I have checked the count", validators=[DataRequired()])


class PostForm(FlaskForm):
    """A button: no fields but the CSRF token."""


class ReprojectionApplyForm(FlaskForm):
    strict = BooleanField("Refuse while any event could not be rebuilt")
    confirm = BooleanField("I have read the diff", validators=[DataRequired()])


class ReprojectionUndoForm(FlaskForm):
    confirm = BooleanField("Switch the tables from before the apply back in", validators=[DataRequired()])


class ObjectRepairForm(FlaskForm):
    # "customer": its rows and those of its subscriptions, invoices and checkout sessions.
    scope = SelectField("Scope", choices=["object", "customer"])
    confirm = BooleanField("I have read the differences", validators=[DataRequired()])


class ReconcileForm(FlaskForm):
    object_type = SelectField("Object type", choices=list(COLLECTIONS))
    account = StringField("Account", validators=[Optional(), Length(max=255)])
    fix = BooleanField("Apply Stripe's current objects where they drifted")
    confirm_fix = BooleanField("I confirm the fix")


def create_app(settings: Settings | None = None, console: ConsoleSettings | None = None, *,
               run_replays: bool = True) -> Flask:
    settings = settings or Settings.from_env()
    console = console or ConsoleSettings.from_env()
    app = Flask(__name__)
    app.config.update(
        SECRET_KEY=console.secret_key, CONSOLE=console, LEDGER=settings,
        SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Lax", SESSION_COOKIE_SECURE=console.secure_cookies,
        SESSION_COOKIE_NAME="ledger_console", PERMANENT_SESSION_LIFETIME=timedelta(hours=12),
        WTF_CSRF_TIME_LIMIT=None, MAX_CONTENT_LENGTH=MAX_FORM_BYTES)
    # Before CSRFProtect's own hook, which parses the form.
    app.before_request(_form_body_read_whole)
    app.before_request(_refuse_unusable_values)
    app.before_request(_login_before_any_post)
    csrf.init_app(app)
    pool = ProcessPool(settings, name="console", max_size=8, interactive=True,
                       statement_timeout_ms=STATEMENT_TIMEOUT_MS)
    console_ledger = ConsoleLedger(pool)
    app.extensions["ledger"] = {
        "pool": pool, "console": console_ledger, "operator": OperatorLedger(pool),
        "outbox": OutboxLedger(pool), "reconcile_runs": ReconcileRuns(pool),
        "throttle": LoginThrottle(console_ledger, console.secret_key)}
    app.register_blueprint(bp)
    app.after_request(_security_headers)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(CSRFError, _csrf_error)
    app.register_error_handler(psycopg.errors.QueryCanceled, _too_slow)
    app.register_error_handler(InputError, lambda exc: (render_template("error.html", code=400, message=str(exc)), 400))
    app.jinja_env.filters["when"] = _when
    app.jinja_env.filters["age"] = _age
    app.jinja_env.filters["hhmm"] = lambda value: value.astimezone(timezone.utc).strftime("%H:%M")
    if run_replays:
        from ops.console.replays import ReplayRunner

        runner = ReplayRunner(app.extensions["ledger"]["console"], _waker(settings).wake,
                              rate_per_s=console.replay_rate)
        runner.start()
        app.extensions["replay_runner"] = runner
    return app


def _celery(settings: Settings):
    """The process's one publisher-only Celery app (made on first use: a page that never wakes nothing
    makes none)."""
    from workers.app import make_celery

    with _CELERY_LOCK:
        if settings not in _CELERY:
            _CELERY[settings] = make_celery(settings, publisher_only=True)
        return _CELERY[settings]


def _waker(settings: Settings):
    from workers.wakeup import Waker

    return Waker(_celery(settings))


def _ledger(name: str):
    return current_app.extensions["ledger"][name]


def _form_body_read_whole():
    """A POST's body read whole before anything parses it (CSRF, forms): a body the client framed badly,
    cut short or stopped sending is a 400 here, never the server's exception turned 500."""
    if request.method == "POST" and read_body(MAX_FORM_BYTES, cache=True) is None:
        abort(400, "the request body could not be read whole: it ended early or its framing is invalid")


def _refuse_unusable_values():
    """Every value a request carries (its path, query and form, names and values) is text the ledger can
    hold, checked here once for every route: a NUL character is a 400 that names where it was, never
    the database driver's exception turned 500. (Bytes that are not UTF-8 never get this far: werkzeug
    replaces them, or keeps them percent-encoded.) Each route then checks its own values' lengths, kinds
    and ranges."""
    inputs.usable("the path", request.path)
    for key, values in request.args.lists():
        for value in (key, *values):
            inputs.usable(f"the query's {key[:40]!r}", value)
    if request.method == "POST":
        for key, values in request.form.lists():
            for value in (key, *values):
                inputs.usable(f"the form's {key[:40]!r}", value)


def _login_before_any_post():
    """A POST without a login is answered 401, whatever its token: before CSRF's check (a 400), so a
    stranger learns nothing from the form's validity."""
    if request.method == "POST" and request.endpoint not in (None, "console.login") and current_user() is None:
        abort(401)


def _security_headers(response):
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Cache-Control"] = "no-store"
    return response


def _http_error(exc: HTTPException):
    if exc.code == 401:
        return render_template("error.html", code=401, message="log in first"), 401
    return render_template("error.html", code=exc.code, message=exc.description), exc.code or 500


def _too_slow(exc: psycopg.errors.QueryCanceled):
    """A statement past STATEMENT_TIMEOUT_MS (a filter reading a whole range, a re-projection's diff of large
    tables): cancelled, nothing it would have changed was changed."""
    message = (f"the database needed more than {STATEMENT_TIMEOUT_MS:,} ms for this page: narrow the filter, "
               "or use ledgerctl")
    return render_template("error.html", code=503, message=message), 503


def _csrf_error(exc: CSRFError):
    return render_template("error.html", code=400, message=f"refused: {exc.description}"), 400


def _when(value) -> str:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def _age(seconds) -> str:
    if seconds is None:
        return "—"
    seconds = float(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _actor() -> str:
    return f"console:{g.user.name}"


# -- login -----------------------------------------------------------------------------------------
@bp.route("/login", methods=["GET", "POST"])
def login():
    form = LoginForm()
    throttle: LoginThrottle = _ledger("throttle")
    if request.method == "POST":
        name = (form.name.data or "")[:200]
        address = client_address()
        wait = throttle.wait_s(name, address)
        if wait > 0:
            response = current_app.make_response((render_template(
                "login.html", form=form, error=f"too many failed logins: try again in {wait:.0f} s"), 429))
            response.headers["Retry-After"] = str(int(wait) + 1)
            return response
        if form.validate_on_submit() and check_password(current_app.config["CONSOLE"].users, name,
                                                        form.password.data):
            throttle.succeeded(name)
            session.clear()
            session["user"] = name
            session.permanent = True
            target = form.next.data or ""
            # Only a path of this console: never an open redirect.
            return redirect(target if target.startswith("/") and not target.startswith("//") else url_for(".overview"))
        throttle.failed(name, address)
        return render_template("login.html", form=form, error="wrong name or password"), 401
    form.next.data = request.args.get("next", "")
    return render_template("login.html", form=form, error=None)


@bp.post("/logout")
def logout():
    session.clear()
    return redirect(url_for(".login"))


# -- overview --------------------------------------------------------------------------------------
@bp.get("/")
@login_required
def overview():
    from workers.sweep import queue_depth

    settings = current_app.config["LEDGER"]
    view = _ledger("console").overview(health_alerts=_ledger("operator").health_alerts(5))
    view.outbox = _ledger("outbox").stats()
    view.queue_depth = queue_depth(_celery(settings), settings.queue_name)
    bars, top = charts.minute_bars(view.per_minute, [("processed", "ok"), ("failed", "bad")])
    return render_template("overview.html", view=view, bars=bars, top=top, chart=charts)


# -- events ----------------------------------------------------------------------------------------
def _query_from_args(args) -> EventQuery:
    def text(name: str) -> str | None:
        return (args.get(name) or "").strip() or None

    livemode = text("livemode")
    if livemode not in (None, "live", "test"):
        raise FilterError("livemode is live or test")
    account = text("account")
    return EventQuery(status=text("status"), type_glob=text("type"), reason=text("reason"), source=text("source"),
                      account="" if account == "platform" else account,
                      livemode=None if livemode is None else livemode == "live", event_id=text("id"),
                      since=text("since"), until=text("until")).checked()


def _after_arg(args) -> tuple[datetime, str] | None:
    value = args.get("after")
    if not value:
        return None
    at, sep, event_id = value.partition("|")
    if not sep or not event_id:
        raise FilterError("after is the keyset of the last row shown (received_at|id)")
    return inputs.time("after", at), inputs.text("after", event_id)


def _page_size(args) -> int:
    try:
        size = int(args.get("size", PAGE_SIZE))
    except ValueError:
        raise FilterError("size is a number") from None
    if not 1 <= size <= MAX_PAGE:
        raise FilterError(f"size is between 1 and {MAX_PAGE}")
    return size


@bp.get("/events")
@login_required
def events():
    query = _query_from_args(request.args)
    after = _after_arg(request.args)
    page = _ledger("console").page(query, size=_page_size(request.args), after=after)
    count, capped = _ledger("console").count(query)
    args = {k: v for k, v in request.args.items() if k != "after" and v}
    next_url = None
    if page.next_after is not None:
        next_url = url_for(".events", **args, after=f"{page.next_after[0].isoformat()}|{page.next_after[1]}")
    return render_template("events.html", page=page, count=count, capped=capped, query=query, args=args,
                           next_url=next_url, statuses=[s.value for s in EventStatus], sources=SOURCES,
                           default_days=DEFAULT_RANGE.days, replay_url=url_for(".replay_preview", **args))


@bp.get("/events/<event_id>")
@login_required
def event(event_id: str):
    from workers.billing.reads import BillingReads

    if len(event_id) > 255:
        abort(404)
    detail = _ledger("operator").show(event_id)
    if detail is None:
        abort(404, f"no event {event_id}")
    extras = _ledger("console").event_extras(event_id)
    rows = BillingReads(_ledger("pool")).rows_written_by([event_id, *detail["snapshot_twins"]])
    payload = extras.pop("payload")
    pretty = json.dumps(payload, indent=2, sort_keys=True) if payload is not None else None
    timeline = sorted(
        [{"at": d["delivered_at"], "what": f"delivered ({d['source']})", "detail": ""} for d in extras["delivery_list"]]
        + [{"at": a["started_at"], "what": f"attempt {a['attempt']}: {a['outcome']}",
            "detail": " ".join(x for x in (a["worker"], a["error_class"] or "", a["error"] or "") if x)}
           for a in detail["attempts"]]
        + [{"at": a["at"], "what": f"{a['action']} by {a['actor']} (from {a['from_status']})",
            "detail": a["reason"] or ""} for a in detail["audit"]],
        key=lambda item: item["at"])
    return render_template("event.html", event=detail["event"], detail=detail, extras=extras, rows=rows,
                           payload=pretty, timeline=timeline, form=ReplayOneForm())


@bp.get("/objects")
@login_required
def find_object():
    """The search box: any Stripe id; an event's opens the event, any other the object's page."""
    from workers.object_view import object_id

    found = object_id(request.args.get("id", "").strip())
    if found.startswith("evt_"):
        return redirect(url_for(".event", event_id=found))
    return redirect(url_for(".object_page", object_id=found))


@bp.get("/objects/<object_id>")
@login_required
def object_page(object_id: str):
    """One object: its events, its rows live beside rebuilt, and Stripe's when asked (?stripe=1, a button:
    the fetch runs outside any transaction, its failure shown on the page)."""
    from workers.object_view import ObjectView, object_id as checked
    from workers.registry import load_handlers
    from workers.stripe_api import StripeApi

    settings = current_app.config["LEDGER"]
    checked(object_id)
    stripe = request.args.get("stripe") == "1"
    story = ObjectView(_ledger("pool"), load_handlers(settings), stripe_api=lambda: StripeApi(settings)).show(
        object_id, stripe=stripe)
    if story is None:
        abort(404, f"{object_id} is not in the ledger")
    from workers.object_repair import ObjectRepair

    repairs = ObjectRepair(_ledger("pool"), load_handlers(settings)).history(object_id)
    return render_template("object.html", story=story, stripe=stripe, repair_form=ObjectRepairForm(),
                           repairs=repairs)


@bp.post("/objects/<object_id>/repair")
@requires_operator
def object_repair(object_id: str):
    """The object's (or customer's) rows rewritten from its events (workers/object_repair.py): rows in one
    transaction under the objects' locks, audited; the page shows the result."""
    from workers.object_repair import ObjectRepair, RepairBusy, scope_of
    from workers.registry import load_handlers

    form = ObjectRepairForm()
    if not form.validate_on_submit():
        abort(400, "tick the confirmation: a repair rewrites the rows the page shows as differing")
    scope, checked = scope_of(form.scope.data, object_id)
    try:
        done = ObjectRepair(_ledger("pool"), load_handlers(current_app.config["LEDGER"])).apply(
            scope, checked, actor=_actor())
    except RepairBusy as exc:
        abort(409, str(exc))
    if done is None:
        abort(404, f"{checked} is not in the ledger")
    flash(f"repair {done['repair_id']}: {done['written']['written']} row(s) written, "
          f"{done['written']['removed']} removed, {done['counts']['kept']} kept")
    return redirect(url_for(".object_page", object_id=checked))


@bp.post("/events/<event_id>/replay")
@requires_operator
def replay_event(event_id: str):
    form = ReplayOneForm()
    if not form.validate_on_submit():
        abort(400, "a replay needs its form")
    from_status = _ledger("operator").replay(event_id, actor=_actor(), reason=form.reason.data or None,
                                             force=bool(form.force.data))
    if from_status is None:
        flash("not replayed: a worker holds it, it is already waiting, or it is processed (tick the box to replay "
              "a processed event)")
    else:
        _waker(current_app.config["LEDGER"]).wake(event_id)
        flash(f"replayed from {from_status}: it is received again and a worker was woken")
    return redirect(url_for(".event", event_id=event_id))


# -- failures --------------------------------------------------------------------------------------
@bp.get("/failures")
@login_required
def failures():
    return render_template("failures.html", groups=_ledger("console").failure_groups(),
                           since=(datetime.now(timezone.utc) - timedelta(days=30) + timedelta(minutes=1)))


# -- bulk replay -----------------------------------------------------------------------------------
@bp.get("/replay")
@requires_operator
def replay_preview():
    query = _query_from_args(request.args)
    count = _ledger("console").replay_preview(query)
    form = ReplayJobForm(filter=json.dumps(query.as_json()), expected=count, preview=str(uuid.uuid4()))
    return render_template("replay_preview.html", query=query, count=count, form=form, max_replay=MAX_REPLAY,
                           force=query.status == EventStatus.PROCESSED.value)


@bp.post("/replay")
@requires_operator
def replay_create():
    form = ReplayJobForm()
    if not form.validate_on_submit():
        abort(400, "confirm the count first")
    try:
        preview_id = uuid.UUID(form.preview.data)
        query = EventQuery.from_json(json.loads(form.filter.data)).checked()
    except (ValueError, RecursionError) as exc:
        raise FilterError(f"the filter is not one the console made: {str(exc)[:200]}") from None
    confirmed = _ledger("console").create_replay_job(
        query, expected=form.expected.data, actor=_actor(), reason=form.reason.data or None,
        force=query.status == EventStatus.PROCESSED.value, preview_id=preview_id)
    if confirmed.job_id is None:
        flash(f"nothing replayed: the filter matches {confirmed.matched} event(s) now, not the {form.expected.data} "
              "you confirmed; check again")
        return redirect(url_for(".replay_preview", **_query_args(query)))
    if confirmed.already:
        flash("this preview was confirmed already: here is the job it started (preview again for another)")
    return redirect(url_for(".replay_job", job_id=confirmed.job_id))


def _query_args(query: EventQuery) -> dict[str, str]:
    data = query.as_json()
    out = {"status": data.get("status"), "type": data.get("type_glob"), "reason": data.get("reason"),
           "source": data.get("source"), "id": data.get("event_id"), "since": data.get("since"),
           "until": data.get("until")}
    if "account" in data:
        out["account"] = data["account"] or "platform"
    if "livemode" in data:
        out["livemode"] = "live" if data["livemode"] else "test"
    return {k: v for k, v in out.items() if v}


@bp.get("/replay/jobs")
@login_required
def replay_jobs():
    return render_template("replay_jobs.html", jobs=_ledger("console").replay_jobs(limit=50))


@bp.get("/replay/jobs/<int:job_id>")
@login_required
def replay_job(job_id: int):
    job = _ledger("console").replay_job(job_id)
    if job is None:
        abort(404, f"no replay job {job_id}")
    return render_template("replay_job.html", job=job, form=PostForm())


@bp.post("/replay/jobs/<int:job_id>/cancel")
@requires_operator
def replay_cancel(job_id: int):
    if not PostForm().validate_on_submit():
        abort(400)
    if not _ledger("console").cancel_replay_job(job_id, actor=_actor()):
        flash("not cancelled: the job had already ended")
    return redirect(url_for(".replay_job", job_id=job_id))


# -- outbox, health alerts, drift ------------------------------------------------------------------
@bp.get("/outbox")
@login_required
def outbox():
    status = request.args.get("status") or None
    if status is not None and status not in {s.value for s in OutboxStatus}:
        raise FilterError(f"unknown outbox status {status!r}")
    effects = _ledger("outbox").list(status=status, effect_like=None, limit=200)
    return render_template("outbox.html", effects=effects, status=status, statuses=[s.value for s in OutboxStatus],
                           stats=_ledger("outbox").stats(), form=PostForm())


@bp.post("/outbox/<int:outbox_id>/replay")
@requires_operator
def outbox_replay(outbox_id: int):
    if not PostForm().validate_on_submit():
        abort(400)
    if _ledger("outbox").replay(outbox_id, force=False):
        _waker(current_app.config["LEDGER"]).wake_effect(outbox_id)
        flash(f"effect {outbox_id} is pending again")
    else:
        flash(f"effect {outbox_id} not replayed: only failed effects are")
    return redirect(url_for(".outbox"))


@bp.get("/health-alerts")
@login_required
def health_alerts():
    return render_template("health.html", alerts=_ledger("operator").health_alerts(200))


@bp.get("/drift")
@login_required
def drift():
    return render_template("drift.html", runs=_ledger("reconcile_runs").recent(limit=5), form=ReconcileForm())


@bp.post("/drift")
@requires_operator
def drift_run():
    from workers.reconcile import Reconcile
    from workers.stripe_api import StripeApi, StripeApiError

    form = ReconcileForm()
    if not form.validate_on_submit():
        abort(400, "choose an object type")
    if form.fix.data and not form.confirm_fix.data:
        abort(400, "a fix writes Stripe's objects over local rows: tick the confirmation too")
    settings = current_app.config["LEDGER"]
    if not settings.stripe_api_key:
        abort(409, "STRIPE_API_KEY is not set on the console: reconcile reads Stripe's objects")
    collection = COLLECTIONS.get(form.object_type.data)
    if collection is None:
        abort(400, "unknown object type")
    try:
        Reconcile(_ledger("pool"), StripeApi(settings)).run([collection], account=form.account.data or None,
                                                             fix=bool(form.fix.data), actor=_actor())
    except StripeApiError as exc:
        abort(502, f"Stripe's API failed: {exc}")
    except LedgerError as exc:
        abort(400, str(exc))
    return redirect(url_for(".drift"))


# -- re-projection (docs/reprojection.md) ---------------------------------------------------------
# Rows of the diff shown per table: the page compares whole tables, so it is as slow as `ledgerctl
# reproject diff` (seconds on tables built from a million events), and shows the first rows of each.
DIFF_ROWS = 20


def _reprojection():
    from ledger.reprojection import ReprojectionLedger
    from workers.registry import load_handlers
    from workers.reproject import Reprojection

    settings = current_app.config["LEDGER"]
    return Reprojection(ReprojectionLedger(settings, _ledger("pool")), load_handlers(settings))


@bp.get("/reprojection")
@login_required
def reprojection():
    rebuild = _reprojection()
    run = rebuild.ledger.latest()
    diffs = rebuild.ledger.diff(run["tables"], limit=DIFF_ROWS) if run and run["state"] == "built" else []
    return render_template("reprojection.html", run=run, diffs=diffs, not_run=rebuild.handlers_not_run(),
                           skips=rebuild.ledger.skips(run["id"], 50) if run else [],
                           skipped=rebuild.ledger.skip_counts(run["id"]) if run else {},
                           audit=rebuild.ledger.audit_of(run["id"]) if run else [],
                           apply_form=ReprojectionApplyForm(), undo_form=ReprojectionUndoForm())


@bp.post("/reprojection/apply")
@requires_operator
def reprojection_apply():
    form = ReprojectionApplyForm()
    if not form.validate_on_submit():
        abort(400, "tick the confirmation: an apply switches the rebuilt tables in")
    return _reprojection_change(lambda rebuild: rebuild.apply(actor=_actor(), strict=bool(form.strict.data)))


@bp.post("/reprojection/undo")
@requires_operator
def reprojection_undo():
    if not ReprojectionUndoForm().validate_on_submit():
        abort(400, "tick the confirmation: an undo switches the tables from before the apply back in")
    return _reprojection_change(lambda rebuild: rebuild.undo(actor=_actor()))


def _reprojection_change(change):
    from ledger.reprojection import ReprojectionBusy, ReprojectionError

    try:
        change(_reprojection())
    except ReprojectionBusy as exc:
        abort(409, str(exc))
    except ReprojectionError as exc:
        abort(400, str(exc))
    return redirect(url_for(".reprojection"))
