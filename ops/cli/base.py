"""What every ledgerctl command shares: the context (settings, pool, ledgers, the waker), the
parsing of times and durations, the output (tables, or JSON with --json), and the ``cli`` group
the commands of every other module of ops/cli register on."""
from __future__ import annotations

import json
import re
import sys
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable

import click

from ledger import inputs
from ledger.config import Settings
from ledger.states import EventStatus, OutboxStatus

_DURATION = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class _Context:
    def __init__(self):
        self._settings: Settings | None = None
        self._pool = None

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_env()
        return self._settings

    @property
    def pool(self):
        from ledger.db import ProcessPool

        if self._pool is None:
            self._pool = ProcessPool(self.settings, name="ledgerctl", max_size=2)
        return self._pool

    @property
    def operator(self):
        from ledger.operator import OperatorLedger

        return OperatorLedger(self.pool)

    @property
    def outbox(self):
        from ledger.outbox import OutboxLedger

        return OutboxLedger(self.pool)

    @property
    def retention(self):
        from ledger.archive import open_store
        from ledger.retention import Retention

        url = self.settings.archive_url
        return Retention(self.pool, open_store(url) if url else None,
                         self.settings.retention_policy(), budget=self.settings.retention_budget(),
                         runner=f"ledgerctl:{_actor()}")

    def waker(self):
        from workers.app import make_celery
        from workers.wakeup import Waker

        return Waker(make_celery(self.settings, publisher_only=True))

    def stripe_api(self):
        from workers.stripe_api import StripeApi

        return StripeApi(self.settings)


def _duration_s(value: str) -> float:
    match = _DURATION.match(value.strip())
    if not match:
        raise click.BadParameter(f"{value!r} is not a duration like 90d, 12h, 30m or 45s")
    return int(match[1]) * _UNITS[match[2]]


def _when(value: str | None) -> datetime | None:
    """An ISO time, or a duration meaning that long ago (e.g. 24h)."""
    if value is None:
        return None
    if _DURATION.match(value.strip()):
        try:
            return datetime.now(timezone.utc) - timedelta(seconds=_duration_s(value))
        except OverflowError:
            raise click.BadParameter(f"{value!r} reaches back before any time there is") from None
    try:
        return inputs.time(repr(value[:64]), value)
    except inputs.InputError as exc:
        raise click.BadParameter(f"{exc}, or a duration like 24h") from None


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "__float__") and not isinstance(value, (int, float, bool)):
        return float(value)
    return value


def _echo_json(value: Any) -> None:
    click.echo(json.dumps(_plain(value), indent=2, sort_keys=True))


def _found(value, missing: str):
    """``value``, or exit 1 saying what was not found (an unknown id is not a usage error)."""
    if value is None:
        click.echo(missing, err=True)
        sys.exit(1)
    return value


def _table(rows: Iterable[dict[str, Any]], columns: list[str]) -> None:
    rows = [{c: "" if r.get(c) is None else str(_plain(r.get(c))) for c in columns} for r in rows]
    widths = {c: max([len(c)] + [len(r[c]) for r in rows]) for c in columns}
    click.echo("  ".join(c.upper().ljust(widths[c]) for c in columns).rstrip())
    for r in rows:
        click.echo("  ".join(r[c].ljust(widths[c]) for c in columns).rstrip())


def _values(*statuses: EventStatus | OutboxStatus) -> list[str]:
    """Choices as plain strings: click matches an Enum choice by its name, not its value."""
    return [status.value for status in statuses]


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
status_choice = click.Choice(_values(*EventStatus))


class _BadInput(click.ClickException):
    exit_code = 2


class _LedgerctlGroup(click.Group):
    """The root group: every argument is text the ledger can hold (argv cannot carry a NUL, but bytes
    that are not UTF-8 arrive as lone surrogates), and a value a command's filter refuses
    (ledger.inputs.InputError) is a usage error, exit 2 with its message, before anything changed."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for position, arg in enumerate(args, start=1):
            try:
                inputs.usable(f"argument {position}", arg)
            except inputs.InputError as exc:
                raise _BadInput(str(exc)) from None
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except inputs.InputError as exc:
            raise _BadInput(str(exc)) from None


@click.group(cls=_LedgerctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def cli(ctx: click.Context):
    """Operate the Stripe event ledger (configuration comes from the environment)."""
    ctx.obj = _Context()


def _actor() -> str:
    """Who an operator action is recorded as: the shell user at this host."""
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"
