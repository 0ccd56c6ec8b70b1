"""Which events: the one filter of the ledger's event lists, for ledgerctl (``events list``, bulk
``replay``) and the console (its list, counts and replay jobs).

Each field set adds a fixed fragment (``_PREDICATES``), and only a field set adds one. So each
combination gets a plan over the event list's indexes (migrations 0008, 0019), never a generic
plan's scan. ``checked`` is the console's rule: a time range made explicit and bounded. ledgerctl
takes a query as given.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from psycopg import sql as pg_sql

from ledger import inputs
from ledger.states import EventStatus
from ledger.stripe_events import V1_PREFIX, V2_PREFIX


def glob_to_like(pattern: str | None) -> str | None:
    """``invoice.*`` -> ``invoice.%`` (event types never contain % or _ wildcards we must keep)."""
    if pattern is None:
        return None
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%").replace("?", "_")


def glob_prefix_range(pattern: str | None) -> tuple[str, str] | None:
    """The bounds of the types a glob can match, by its literal prefix (``invoice.*`` -> ``invoice.`` up to
    ``invoice/``), in byte order (text_pattern_ops: any collation); None when it starts with a wildcard.
    Given as parameters, not left to LIKE, so that a prepared statement's generic plan reads them in the
    index too."""
    if not pattern:
        return None
    prefix = pattern[:min((i for i in (pattern.find("*"), pattern.find("?")) if i >= 0), default=len(pattern))]
    if not prefix or ord(prefix[-1]) >= 0x10FFFF:
        return None
    return prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)


SOURCES = ("webhook", "catchup", "thin")
MAX_RANGE = timedelta(days=31)
DEFAULT_RANGE = timedelta(days=7)

# Field -> its fragment; a field left empty adds none. e is ledger.events.
_PREDICATES = {
    "status": "e.status = %(status)s",
    "type_like": "e.type LIKE %(type_like)s",
    # Checked inside the list's index (migration 0019: the type in byte order) before any heap row is read;
    # LIKE keeps the exact match.
    "type_from": "e.type ~>=~ %(type_from)s AND e.type ~<~ %(type_to)s",
    "reason": "e.failure_reason = %(reason)s",
    "account": "e.account = %(account)s",
    "platform": "e.account IS NULL",
    "livemode": "e.livemode = %(livemode)s",
    "event_id": "e.id = %(event_id)s",
    "since": "e.received_at >= %(since)s",
    "until": "e.received_at < %(until)s",
    "after": "(e.received_at, e.id) < (%(after_at)s, %(after_id)s)",
}
_SOURCE_PREDICATES = {
    # A thin notification's type is v1.* or v2.* (ledger.stripe_events); the others came as snapshots. Written
    # as migration 0019's index of thin notifications states it, so that the planner can read that index.
    "thin": f"left(e.type, 3) IN ('{V1_PREFIX}', '{V2_PREFIX}')",
    # Nearly every snapshot event came by webhook, and catch-up's deliveries are few: an event none of them
    # names came by webhook (every delivery is one or the other), read as one hashed set; only the few it
    # names are probed for a webhook delivery of their own. A probe for every row of the range costs one
    # index lookup per partition of deliveries on a partitioned ledger (the probe knows no `created`).
    "webhook": ("left(e.type, 3) <> ALL(%(thin_prefixes)s) AND (e.id NOT IN (SELECT d.event_id "
                "FROM ledger.deliveries d WHERE d.source = 'catchup' "
                "AND d.delivered_at >= coalesce(%(since)s, '-infinity'::timestamptz)) "
                "OR (SELECT true FROM ledger.deliveries d WHERE d.event_id = e.id AND d.source = 'webhook' LIMIT 1))"),
    # Catch-up's deliveries are few: read them by time (a delivery comes at or after its event's
    # received_at, so the range's start bounds them too), then the events they name, as one hashed set
    # (by their whole key instead, the planner probes the events once per delivery: 1.5 s p95 against
    # 0.15 on a partitioned 3,000,000-event ledger).
    "catchup": ("e.id IN (SELECT d.event_id FROM ledger.deliveries d WHERE d.source = 'catchup' "
                "AND d.delivered_at >= coalesce(%(since)s, '-infinity'::timestamptz))"),
}


class FilterError(inputs.InputError):
    """A filter refused (a value no event can have, a range too wide): the message says why."""


# Each text field, by the name the console's URL and ledgerctl's options give it.
_TEXT_FIELDS = {"type_glob": "type", "reason": "reason", "account": "account", "event_id": "id"}
_STATUSES = frozenset(s.value for s in EventStatus)


@dataclass(frozen=True)
class EventQuery:
    status: str | None = None
    type_glob: str | None = None
    reason: str | None = None
    source: str | None = None
    account: str | None = None      # '' the platform
    livemode: bool | None = None
    event_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self):
        """Every field is one the ledger can be asked about (ledger.inputs), however the query was made:
        a console URL, ledgerctl's options, a replay job's stored filter. Times become UTC."""
        try:
            for name, label in _TEXT_FIELDS.items():
                if getattr(self, name) is not None:
                    inputs.text(label, getattr(self, name))
            for name in ("since", "until"):
                if getattr(self, name) is not None:
                    object.__setattr__(self, name, inputs.time(name, getattr(self, name)))
        except inputs.InputError as exc:
            raise FilterError(str(exc)) from None
        if self.status is not None and (not isinstance(self.status, str) or self.status not in _STATUSES):
            raise FilterError(f"unknown status {str(self.status)[:40]!r}: one of {', '.join(sorted(_STATUSES))}")
        if self.source is not None and (not isinstance(self.source, str) or self.source not in SOURCES):
            raise FilterError(f"unknown source {str(self.source)[:40]!r}: one of {', '.join(SOURCES)}")
        if self.livemode is not None and not isinstance(self.livemode, bool):
            raise FilterError("livemode is true or false")

    def checked(self, now: datetime | None = None) -> "EventQuery":
        """This query with its time range made explicit and bounded: by default the last seven days, at
        most 31 days. An exact id needs no range."""
        now = now or datetime.now(timezone.utc)
        if self.event_id is not None:
            return self
        until = self.until or now
        since = self.since or until - DEFAULT_RANGE
        if since >= until:
            raise FilterError("the range's start must be before its end")
        if until - since > MAX_RANGE:
            raise FilterError(f"the time range is at most {MAX_RANGE.days} days")
        return EventQuery(**{**asdict(self), "since": since, "until": until})

    def as_json(self) -> dict[str, Any]:
        return {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(self).items()
                if v is not None}

    @classmethod
    def from_json(cls, data: Any) -> "EventQuery":
        """The query ``as_json`` gave; FilterError for anything else."""
        if not isinstance(data, dict):
            raise FilterError("a filter is a JSON object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise FilterError(f"unknown filter field(s): {', '.join(sorted(str(k)[:40] for k in unknown))}")
        return cls(**data)

    def where(self, after: tuple[datetime, str] | None = None) -> tuple[pg_sql.Composable, dict[str, Any]]:
        params: dict[str, Any] = {
            "status": self.status, "type_like": glob_to_like(self.type_glob), "reason": self.reason,
            "account": self.account or None, "platform": True if self.account == "" else None,
            "livemode": self.livemode, "event_id": self.event_id, "since": self.since,
            "until": self.until, "thin_prefixes": [V1_PREFIX, V2_PREFIX]}
        bounds = glob_prefix_range(self.type_glob)
        if bounds is not None:
            params["type_from"], params["type_to"] = bounds
        parts = [_PREDICATES[name] for name, value in params.items() if name in _PREDICATES and value is not None]
        if self.source is not None:
            parts.append(_SOURCE_PREDICATES[self.source])
        if after is not None:
            params["after_at"], params["after_id"] = after
            parts.append(_PREDICATES["after"])
        return pg_sql.SQL(" AND ".join(f"({p})" for p in parts) or "true"), params
