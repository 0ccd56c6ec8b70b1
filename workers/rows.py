"""Row changes: what a handler writes, declared once per table, and what a batch of them comes to.

A handler maps its event to rows and hands them to ``ctx.rows``; it does not write SQL. The verbs:

* ``upsert(table, row)`` — a row keyed by its Stripe id, kept only while no newer event wrote it:
  newer by (Stripe's ``created``, then the event id: ``created`` has one-second resolution, the id
  breaks same-second ties the same way every time). Any delivery order ends with the same row.
* ``append(table, row)`` — a row written once per key (a subscription's transition, keyed by its
  event). A table with a ``Chain`` gets two columns filled by the writer: the chained row's value
  before this event (``from_status``) and whether this event's upsert of it applied.
* ``replace(table, scope, rows, guard=...)`` — a scope's whole set (a customer's entitlements from
  Stripe), applied only when its guard row (an upsert of its own) is newer.
* ``derive(derivation, group)`` — a set computed from another table's current rows once the batch's
  writes are known (a customer's entitlements from its subscriptions), once per group per batch.
* ``on_change(table, group, fn)`` — ``fn(before, after)`` with a group's rows of a set table before
  and after the batch (the entitlements.changed effect).

A writer (workers/writers.py) decides how changes reach Postgres: the live one per batch, in one
statement; the rebuild's per slice, with COPY; the memory one into a dict. What they write is decided
here, once for all of them: ``plan`` takes the changes of many events and the current rows they
depend on, and gives each table's rows. Events are taken in Stripe's order, (created, id): a chain
follows the row from the state it was read in, one event after the other, as applying each event in
its own transaction in that order would. A batch reduced by key keeps the newest change of each row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping

from workers.failures import PermanentError

# The kinds of table (``Table.kind``).
LATEST = "latest"   # one row per key, the newest event's (upsert)
ONCE = "once"       # a row per key, written once (append)
SET = "set"         # sets of rows, each replaced whole (replace, derive)

# Where ``upsert`` puts a row's order key by default: the event's own.
STAMP = ("account", "livemode", "source_event_id", "source_event_created")
# The order key of a row written with no event of its own to order it: below every event's.
NEVER = datetime(1, 1, 1, tzinfo=timezone.utc)


class RowOfAnotherOwner(PermanentError):
    """A row of this key belongs to another account or mode than this change: a row never moves
    between accounts or modes (what billing.same_owner raises for a row already stored)."""

    reason = "constraint_violation"

    def __init__(self, table: str):
        # Worded as the error of billing.same_owner is recorded (workers.failures), constraint name included.
        super().__init__(f"a {table} row belongs to another account or mode than this object: "
                         f"table={table.split('.')[-1]}, constraint=billing_row_owner")


class RowShapeError(PermanentError):
    """A handler gave a row that its table's declaration does not describe (a missing or unknown column)."""

    reason = "handler_row_shape"


@dataclass(frozen=True)
class Chain:
    """An ONCE table's link to a LATEST table: the row it names by ``ref`` (its key), and the value of
    ``column`` there before the same event's upsert (into ``before``), and whether that upsert applied
    (into ``applied``)."""
    table: "Table"
    ref: str
    column: str
    before: str
    applied: str


@dataclass(frozen=True, eq=False)
class Table:
    """A table handlers write through ``ctx.rows``.

    ``columns`` are the ones a handler's row gives (its key among them); a LATEST table's ``stamp``
    columns are filled from the event (account, livemode, and its order key ``source_event_id``,
    ``source_event_created``). ``owner``: columns a stored row keeps (a change of another account or
    mode is refused). ``touch``: a column set to now() whenever a row is written again. ``conflict``:
    the ON CONFLICT target when it is not the key's columns (an expression index). ``json``: columns
    stored as json(b). A SET table's rows are grouped in sets by ``scope``; ``group`` names the column
    ``on_change`` groups by."""
    name: str
    kind: str
    key: tuple[str, ...]
    columns: tuple[str, ...]
    stamp: tuple[str, ...] = ()
    owner: tuple[str, ...] = ()
    touch: str | None = None
    conflict: str | None = None
    json: frozenset[str] = frozenset()
    chain: Chain | None = None
    scope: tuple[str, ...] = ()
    group: str | None = None
    # A key whose NULL and '' are one row (billing.objects' coalesce(account, '')).
    null_is_empty: frozenset[str] = frozenset()
    # The column naming the event a row came from (a LATEST table's source_event_id, by default): a rebuild
    # keeps a live row whose event it could not apply (workers/reproject.py, "kept").
    source: str | None = None
    # A SET table's scopes replaced under a guard: (guard table, the rest of the scope), the guard's key
    # naming the scope's columns of the same name (entitlements' stripe scope, by entitlement_summaries).
    guards: tuple[tuple["Table", dict[str, Any]], ...] = ()

    def __post_init__(self):
        if self.kind not in (LATEST, ONCE, SET):
            raise ValueError(f"{self.name}: kind is one of {LATEST}, {ONCE}, {SET}")
        if "." not in self.name:
            raise ValueError(f"{self.name}: a table is named with its schema (schema.table)")
        missing = set(self.key) - set(self.columns) - set(self.stamp)
        if missing:
            raise ValueError(f"{self.name}: key column(s) {sorted(missing)} are not among its columns")
        if self.kind == LATEST and {"source_event_id", "source_event_created"} - set(self.stamp):
            raise ValueError(f"{self.name}: a latest-row table stamps source_event_id and source_event_created")
        if self.kind == SET and (not self.scope or set(self.scope) - set(self.columns)):
            raise ValueError(f"{self.name}: a set table names its scope among its columns")
        if self.owner and ("account" not in self.owner or set(self.owner) - {"account", "livemode"}
                           or set(self.owner) - set(self.stamp)):
            # billing.same_owner (migration 0006) compares an account and, where the table has one, a mode.
            raise ValueError(f"{self.name}: owner is account, or account and livemode, both stamped")
        object.__setattr__(self, "all_columns", tuple(self.columns) + tuple(c for c in self.stamp
                                                                            if c not in self.columns))
        if self.source is None and self.kind == LATEST:
            object.__setattr__(self, "source", "source_event_id")
        object.__setattr__(self, "_needed", frozenset(self.columns) - ({self.chain.before, self.chain.applied}
                                                                      if self.chain else set()))

    @property
    def schema(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def relation(self) -> str:
        return self.name.split(".", 1)[1]

    def key_of(self, row: Mapping[str, Any]) -> tuple:
        if self.null_is_empty:
            return tuple((row[c] or "") if c in self.null_is_empty else row[c] for c in self.key)
        return tuple(row[c] for c in self.key)

    def check(self, row: Mapping[str, Any]) -> None:
        if row.keys() != self._needed:
            missing, unknown = self._needed - row.keys(), row.keys() - self._needed
            raise RowShapeError(f"a row of {self.name}: "
                                + "; ".join(part for part in (
                                    f"missing {', '.join(sorted(missing))}" if missing else "",
                                    f"unknown {', '.join(sorted(map(str, unknown)))}" if unknown else "") if part))

    def __repr__(self) -> str:
        return f"Table({self.name})"


@dataclass(frozen=True, eq=False)
class Derivation:
    """A set of ``table`` computed from ``source``'s current rows of one group (``by``): ``rule(group,
    rows)`` gives the set's rows (without the scope's columns), its scope ``scope(group)``."""
    table: Table
    source: Table
    by: str
    scope: Callable[[Any], dict[str, Any]]
    rule: Callable[[Any, list[dict[str, Any]]], list[dict[str, Any]]]

    def __post_init__(self):
        DERIVED_FROM.setdefault(self.source, []).append(self)


# Each table's derivations, by the table they are derived from (what a rebuild derives again when it
# keeps rows of that table).
DERIVED_FROM: dict[Table, list[Derivation]] = {}


OrderKey = tuple  # (created, event id, sequence in the batch)


@dataclass
class _RowChange:
    """A row an event writes: an upsert's or an append's."""
    order: OrderKey
    event: str
    table: Table
    key: tuple
    row: dict[str, Any]


class _Upsert(_RowChange):
    pass


class _Append(_RowChange):
    pass


@dataclass
class _Replace:
    order: OrderKey
    event: str
    table: Table
    scope: tuple
    scope_row: dict[str, Any]
    rows: list[dict[str, Any]]
    guard: tuple[Table, tuple] | None


@dataclass
class _Derive:
    order: OrderKey
    derivation: Derivation
    group: Any


@dataclass
class _Watch:
    order: OrderKey
    table: Table
    group: Any
    fn: Callable[[list[dict], list[dict]], None]


Change = _Upsert | _Append | _Replace | _Derive | _Watch


class Changes:
    """The changes recorded since the last flush, in the order they were made, with what each needs read."""

    def __init__(self):
        self.items: list[Change] = []
        self._seq = 0
        # Within one batch: the owner each LATEST key was first written with (a second owner is refused).
        self._owners: dict[tuple[Table, tuple], tuple] = {}
        self._owner_log: list[tuple[Table, tuple]] = []

    def __len__(self) -> int:
        return len(self.items)

    def next_order(self, created: datetime, event_id: str) -> OrderKey:
        self._seq += 1
        return (created, event_id, self._seq)

    def owner_seen(self, table: Table, key: tuple, owner: tuple) -> None:
        seen = self._owners.setdefault((table, key), owner)
        if seen is owner:
            self._owner_log.append((table, key))
        elif seen != owner:
            raise RowOfAnotherOwner(table.name)

    def mark(self) -> tuple[int, int]:
        """Where the changes are now: ``rollback`` forgets what was recorded after it (an event that failed)."""
        return len(self.items), len(self._owner_log)

    def rollback(self, mark: tuple[int, int]) -> None:
        items, owners = mark
        del self.items[items:]
        for key in self._owner_log[owners:]:
            del self._owners[key]
        del self._owner_log[owners:]

    def drop(self, spans: list[tuple[int, int]]) -> None:
        """Forget the changes of these spans of ``items`` (events whose rows will not be written now)."""
        gone = set()
        for start, end in spans:
            gone.update(range(start, end))
        self.items = [change for n, change in enumerate(self.items) if n not in gone]
        self._owners.clear()
        self._owner_log.clear()
        for change in self.items:
            if isinstance(change, _Upsert) and change.table.owner:
                self.owner_seen(change.table, change.key, tuple(change.row[c] for c in change.table.owner))

    def take(self) -> list[Change]:
        items, self.items = self.items, []
        self._owners.clear()
        self._owner_log.clear()
        return items


class EventRows:
    """One event's door to a writer: what ``ctx.rows`` is. Records changes; the writer applies them."""

    __slots__ = ("_changes", "_flush", "event_id", "created", "account", "livemode")

    def __init__(self, changes: Changes, *, event_id: str, created: datetime, account: str | None,
                 livemode: bool, flush: Callable[[], None] | None = None):
        self._changes = changes
        self._flush = flush
        self.event_id = event_id
        self.created = created
        self.account = account
        self.livemode = livemode

    def upsert(self, table: Table, row: Mapping[str, Any], *, created: datetime | None = None) -> None:
        """``row`` into ``table`` unless a newer event wrote its key. ``created``: the change's own time
        instead of the event's (NEVER: a row known only by id, which any event of its own overwrites)."""
        if table.kind != LATEST:
            raise TypeError(f"upsert writes a latest-row table, and {table.name} is {table.kind}")
        table.check(row)
        stamped = created or self.created
        if table.stamp is STAMP:
            full = {**row, "account": self.account, "livemode": self.livemode, "source_event_id": self.event_id,
                    "source_event_created": stamped}
        else:
            full = dict(row)
            for column in table.stamp:
                full[column] = self._stamp(column, stamped)
        key = table.key_of(full)
        if table.owner:
            self._changes.owner_seen(table, key, tuple(full[c] for c in table.owner))
        self._changes.items.append(_Upsert(self._changes.next_order(stamped, self.event_id), self.event_id,
                                           table, key, full))

    def append(self, table: Table, row: Mapping[str, Any]) -> None:
        """``row`` into ``table`` once: a second change of its key, in this batch or later, writes nothing."""
        if table.kind != ONCE:
            raise TypeError(f"append writes a written-once table, and {table.name} is {table.kind}")
        table.check(row)
        full = dict(row)
        self._changes.items.append(_Append(self._changes.next_order(self.created, self.event_id), self.event_id,
                                           table, table.key_of(full), full))

    def replace(self, table: Table, scope: Mapping[str, Any], rows: Iterable[Mapping[str, Any]], *,
                guard: tuple[Table, Mapping[str, Any]] | None = None) -> None:
        """The set ``scope`` names becomes ``rows`` (each without the scope's columns). With ``guard``
        (a latest-row table and its row), only if that row, upserted now, is newer than the stored one."""
        if table.kind != SET:
            raise TypeError(f"replace writes a set table, and {table.name} is {table.kind}")
        scope_row = dict(scope)
        if scope_row.keys() != set(table.scope):
            raise RowShapeError(f"a scope of {table.name} names {', '.join(table.scope)}")
        members = [{**scope_row, **r} for r in rows]
        for member in members:
            table.check(member)
        guarded = None
        if guard is not None:
            guard_table, guard_row = guard
            self.upsert(guard_table, guard_row)
            guarded = (guard_table, self._changes.items[-1].key)
        self._changes.items.append(_Replace(self._changes.next_order(self.created, self.event_id), self.event_id,
                                            table, tuple(scope_row[c] for c in table.scope), scope_row, members,
                                            guarded))

    def derive(self, derivation: Derivation, group: Any) -> None:
        """Recompute ``derivation``'s set of ``group`` once this batch's writes are known, and write it: a set that
        drifted from its source rows, or a rebuild's kept rows, is written again by the next event that derives
        it. Where the stored set is read anyway (an ``on_change`` of the group), it is written only if it differs;
        otherwise writing what is there already costs less than reading it first (no statement of its own)."""
        self._changes.items.append(_Derive(self._changes.next_order(self.created, self.event_id), derivation, group))

    def on_change(self, table: Table, group: Any, fn: Callable[[list[dict], list[dict]], None]) -> None:
        """Once the batch's sets are known: ``fn(before, after)``, ``group``'s rows of ``table`` before the
        batch and after it (``fn`` tells whether what it cares about changed). Of several events asking
        for one group, only the newest's is called."""
        if table.group is None:
            raise TypeError(f"{table.name} names no group column")
        self._changes.items.append(_Watch(self._changes.next_order(self.created, self.event_id), table, group, fn))

    def flush(self) -> None:
        """Write what was recorded so far (what ``ctx.conn``'s first use does, so raw SQL sees the rows)."""
        if self._flush is not None:
            self._flush()

    def _stamp(self, column: str, created: datetime) -> Any:
        if column == "source_event_id":
            return self.event_id
        if column == "source_event_created":
            return created
        if column == "account":
            return self.account
        if column == "livemode":
            return self.livemode
        raise ValueError(f"no stamp for column {column}")


# What a plan reads first: the stored rows of some keys of LATEST tables, all of a group's rows of a
# derivation's source, and the rows of a SET table's groups some on_change watches.
@dataclass
class Needs:
    keys: dict[Table, set[tuple]] = field(default_factory=dict)
    groups: dict[tuple[Table, str], set[Any]] = field(default_factory=dict)
    sets: dict[Table, set[Any]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.keys or self.groups or self.sets)


def needs(changes: list[Change]) -> Needs:
    """The stored rows ``plan`` needs for these changes. A LATEST table is tracked when a chain, a guard
    or a derivation reads it: the stored row of every key the batch upserts into it, and all the rows of
    each group a derivation recomputes. The rows of each watched SET group."""
    found = Needs()
    tracked: set[Table] = set()
    for change in changes:
        if isinstance(change, _Append) and change.table.chain is not None:
            chain = change.table.chain
            tracked.add(chain.table)
            found.keys.setdefault(chain.table, set()).add((change.row[chain.ref],))
        elif isinstance(change, _Replace) and change.guard is not None:
            tracked.add(change.guard[0])
        elif isinstance(change, _Derive):
            d = change.derivation
            tracked.add(d.source)
            found.groups.setdefault((d.source, d.by), set()).add(change.group)
        elif isinstance(change, _Watch):
            found.sets.setdefault(change.table, set()).add(change.group)
    for change in changes:
        if isinstance(change, _Upsert) and change.table in tracked:
            found.keys.setdefault(change.table, set()).add(change.key)
    for table in tracked:
        found.keys.setdefault(table, set())
    return found


@dataclass
class Stored:
    """What was read for a plan: LATEST rows by table and key (each with its stamp), and the rows of
    watched SET groups by table."""
    latest: dict[Table, dict[tuple, dict[str, Any]]] = field(default_factory=dict)
    sets: dict[Table, list[dict[str, Any]]] = field(default_factory=dict)


@dataclass
class Plan:
    """What a batch comes to: per table, the rows to write (LATEST: the newest per key; ONCE: the first
    per key; SET: each replaced scope, with its rows) and the on_change calls to make once written."""
    latest: dict[Table, list[dict[str, Any]]] = field(default_factory=dict)
    once: dict[Table, list[dict[str, Any]]] = field(default_factory=dict)
    sets: dict[Table, dict[tuple, tuple[dict[str, Any], list[dict[str, Any]]]]] = field(default_factory=dict)
    announce: list[Callable[[], None]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.latest or self.once or self.sets)

    def tables(self) -> list[Table]:
        return [*self.latest, *self.once, *self.sets]


def order_of(row: Mapping[str, Any]) -> tuple:
    return (row["source_event_created"], row["source_event_id"])


def plan(changes: list[Change], stored: Stored) -> Plan:
    """The rows ``changes`` come to, given the ``stored`` rows they depend on (see ``needs``).

    Changes are taken in Stripe's order of their events (then in the order each event made them).
    A LATEST key keeps its newest change; a chained or guarding key is followed from its stored row,
    event by event: what it held before each event's upsert, and whether that upsert was newer. A
    tracked key's upsert that was not newer than the stored row is not written at all."""
    out = Plan()
    ordered = sorted(changes, key=lambda c: c.order)
    newest: dict[Table, dict[tuple, _Upsert]] = {}
    state = {table: dict(rows) for table, rows in stored.latest.items()}  # tracked keys, as they go
    outcome: dict[tuple[str, Table, tuple], tuple[dict | None, bool]] = {}
    once: dict[Table, dict[tuple, dict]] = {}
    sets: dict[Table, dict[tuple, tuple[dict, list]]] = {}
    derive: dict[Derivation, set[Any]] = {}  # the groups to derive
    watch: dict[tuple[Table, Any], _Watch] = {}
    for change in ordered:
        if isinstance(change, _Upsert):
            table, key = change.table, change.key
            kept = newest.setdefault(table, {})
            previous = kept.get(key)
            if previous is None or change.order > previous.order:
                kept[key] = change
            tracked = state.get(table)
            if tracked is not None:
                before = tracked.get(key)
                applied = before is None or order_of(change.row) > order_of(before)
                outcome[(change.event, table, key)] = (before, applied)
                # A stored row of another owner: the change is written all the same, for the writer to refuse
                # it as it refuses any (billing.same_owner raises, whatever the order).
                if applied or (table.owner and any(before[c] != change.row[c] for c in table.owner)):
                    tracked[key] = change.row
        elif isinstance(change, _Append):
            row = change.row
            chain = change.table.chain
            if chain is not None:
                before, applied = outcome.get((change.event, chain.table, (row[chain.ref],)), (None, False))
                row = {**row, chain.before: before[chain.column] if before is not None else None,
                       chain.applied: applied}
            once.setdefault(change.table, {}).setdefault(change.key, row)
        elif isinstance(change, _Replace):
            if change.guard is not None and not outcome.get((change.event, *change.guard), (None, False))[1]:
                continue  # a newer replacement of this scope was applied already
            sets.setdefault(change.table, {})[change.scope] = (change.scope_row, change.rows)
        elif isinstance(change, _Derive):
            derive.setdefault(change.derivation, set()).add(change.group)
        else:
            watch[(change.table, change.group)] = change
    for derivation, groups in derive.items():
        table = derivation.table
        after = _by_group(derivation, state.get(derivation.source, {}), groups)
        held: dict[tuple, set[tuple]] = {}
        for row in stored.sets.get(table, []):
            held.setdefault(tuple(row[c] for c in table.scope), set()).add(table.key_of(row))
        for group in sorted(groups, key=str):
            scope_row = derivation.scope(group)
            scope = tuple(scope_row[c] for c in table.scope)
            members = [{**scope_row, **r} for r in derivation.rule(group, after.get(group, []))]
            if (table, group) in watch and _keys(table, members) == held.get(scope, set()):
                continue  # the stored set (read for on_change) already: nothing to write
            sets.setdefault(table, {})[scope] = (scope_row, members)
    for table, kept in newest.items():
        tracked = state.get(table)
        if tracked is None:
            rows = [change.row for _, change in sorted(kept.items(), key=_by_key)]
        else:  # written only where this batch changed the row: what it holds now
            before = stored.latest.get(table, {})
            rows = [tracked[key] for key, _ in sorted(kept.items(), key=_by_key) if tracked[key] is not before.get(key)]
        if rows:
            out.latest[table] = rows
    for table, rows in once.items():
        out.once[table] = [row for _, row in sorted(rows.items(), key=_by_key)]
    out.sets = sets
    for (table, group), change in watch.items():
        before = [row for row in stored.sets.get(table, []) if row[table.group] == group]
        after = _replaced(table, before, sets.get(table, {}), group)
        out.announce.append(lambda fn=change.fn, b=before, a=after: fn(b, a))
    return out


def _by_group(derivation: Derivation, rows: Mapping[tuple, dict], groups) -> dict[Any, list[dict]]:
    """The source rows of each of ``groups``, in key order (the order a rule sees them in)."""
    found: dict[Any, list[dict]] = {}
    for key, row in sorted(rows.items(), key=_by_key):
        if row.get(derivation.by) in groups:
            found.setdefault(row[derivation.by], []).append(row)
    return found


def _keys(table: Table, rows: list[dict]) -> set[tuple]:
    return {table.key_of(row) for row in rows}


def _by_key(item: tuple[tuple, Any]) -> tuple:
    """Keys in one order (rows are written, and so locked, in it): None last, other values by their text."""
    return tuple((v is None, v if isinstance(v, str) else repr(v)) for v in item[0])


def _replaced(table: Table, rows: list[dict], replaced: dict[tuple, tuple[dict, list]], group: Any) -> list[dict]:
    """``group``'s rows once the scopes this batch replaced are: a scope replaced takes its new rows,
    a member already there keeping its stored row (a set replaced writes only what it adds)."""
    stored = {table.key_of(row): row for row in rows}
    out = {key: row for key, row in stored.items()
           if tuple(row[c] for c in table.scope) not in replaced}
    for scope, (_, members) in replaced.items():
        for member in members:
            if member[table.group] == group:
                key = table.key_of(member)
                out[key] = stored.get(key, member)
    return list(out.values())
