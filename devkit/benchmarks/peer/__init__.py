"""The fastest peer, run beside the project by ``ops/bench steady``: Stripe's sync engine.

``@stripe/sync-engine`` (npm) verifies a webhook's signature and upserts its object into
Postgres inline, in the request: no queue, no ledger, no retries of its own. It runs here on
the machine's Node, with no network but the npm registry (for the one-time install):

* the package (``PACKAGE_SPEC``) and express are installed once into a cache directory of
  their own (``$BENCH_VENV_CACHE``, default ``~/.cache/stripe-ledger-bench``, then
  ``sync-engine-<version>``), reused by every later run;
* ``server.mjs`` (beside this file) is the package's own webhook handler behind express,
  with the offline settings it documents; it is copied beside the package's
  ``node_modules`` at each start (where its import resolves);
* the engine (>= 1.0) builds its tables from Stripe's OpenAPI document at migration time and
  would download it: ``openapi_document`` writes a small one instead, from the objects the
  benchmark sends (one schema per object type, every top-level property typed from its JSON
  values), so its tables have the columns the real document would give those fields;
* it gets a database of its own on the benchmark's private Postgres (same server, same
  durability: fsync and synchronous_commit on), and its Stripe client is pointed at a local
  fake Stripe API (``devkit.stripe_api``) that counts any call it makes (none is expected).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import psycopg

from devkit.procs import Process, cpu_seconds, free_port, wait_until
from devkit.sql import SQL as DEVKIT_SQL, compose
from ledger.queries import load

NAME = "@stripe/sync-engine"
VERSION = "1.0.32"
PACKAGE_SPEC = f"{NAME}@{VERSION}"
EXPRESS_SPEC = "express@^4"
# The engine's pg pool size (its own default is 10): the connections its inline upserts share.
POOL_MAX = 10
ACCOUNT_ID = "acct_1LedgerBenchPeer0"
CACHE_ROOT = Path(os.environ.get("BENCH_VENV_CACHE", Path.home() / ".cache" / "stripe-ledger-bench"))
# Written last: an install without it was interrupted and is done again.
_COMPLETE = ".complete"

SQL = load(__name__)

# The settings the docs and the tables name the peer by.
SETTINGS = (f"{PACKAGE_SPEC} on Node {{node}}, its webhook handler behind express (raw body → "
            f"processWebhook → 200), upserting inline; pg pool of {POOL_MAX}; offline: stripeAccountId given, "
            f"revalidateObjectsViaStripeApi [], backfillRelatedEntities false, autoExpandLists false, tables from "
            f"an OpenAPI document built from the objects sent")


def node_version() -> str:
    node = shutil.which("node")
    if node is None:
        return "?"
    return subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout.strip() or "?"


def available() -> str | None:
    """None when node and npm are on PATH; else what is missing."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} not found (Node 18 or later: apt-get install nodejs npm)" if missing else None


def install(log) -> Path:
    """The package and express in the cache directory (npm install there once); returns the directory."""
    home = CACHE_ROOT / f"sync-engine-{VERSION}"
    if (home / _COMPLETE).exists():
        log(f"peer: reusing {PACKAGE_SPEC} installed in {home}")
        return home
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    log(f"peer: npm install {PACKAGE_SPEC} {EXPRESS_SPEC} into {home} (once)")
    (home / "package.json").write_text(json.dumps(
        {"name": "stripe-ledger-bench-peer", "private": True, "type": "module"}, indent=2) + "\n")
    done = subprocess.run([shutil.which("npm") or "npm", "install", "--no-audit", "--no-fund", "--save-exact",
                           PACKAGE_SPEC, EXPRESS_SPEC],
                          cwd=home, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"npm install {PACKAGE_SPEC} failed ({done.returncode}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
    installed = json.loads((home / "node_modules" / NAME / "package.json").read_text())["version"]
    if installed != VERSION:
        raise RuntimeError(f"npm installed {NAME} {installed}, not {VERSION}")
    (home / _COMPLETE).write_text(f"{PACKAGE_SPEC}\n")
    return home


# -- the OpenAPI document ---------------------------------------------------------------------

_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))
# Not tables of the engine's: the envelope and containers.
_SKIPPED_OBJECTS = {"event", "list", "account", None}


def _property(values: list[Any]) -> dict[str, Any]:
    """An OpenAPI property for the values a field took (bool before int: a bool is an int in Python)."""
    kinds = sorted({next(name for kind, name in _JSON_TYPES if isinstance(v, kind)) for v in values if v is not None})
    nullable = any(v is None for v in values)
    if not kinds:
        return {"type": "string", "nullable": True}
    if len(kinds) > 1:
        return {"anyOf": [{"type": k} for k in kinds], "nullable": nullable}
    schema: dict[str, Any] = {"type": kinds[0]}
    if kinds[0] == "array":
        schema["items"] = {}
    if nullable:
        schema["nullable"] = True
    return schema


def _objects(obj: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """The object and the objects the engine also writes from it: a subscription's items and their plans
    and prices."""
    yield obj
    if obj.get("object") == "subscription":
        for item in (obj.get("items") or {}).get("data") or ():
            yield item
            for nested in ("plan", "price"):
                if isinstance(item.get(nested), dict):
                    yield item[nested]


def openapi_document(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A spec3-shaped document with one schema (``x-resourceId``) per object type the events carry."""
    fields: dict[str, dict[str, list[Any]]] = {}
    for evt in events:
        for obj in _objects(evt["data"]["object"]):
            kind = obj.get("object")
            if kind in _SKIPPED_OBJECTS:
                continue
            seen = fields.setdefault(kind, {})
            for key, value in obj.items():
                seen.setdefault(key, []).append(value)
    schemas = {kind: {"type": "object", "x-resourceId": kind,
                      "properties": {key: _property(values) for key, values in sorted(props.items())}}
               for kind, props in sorted(fields.items())}
    return {"openapi": "3.0.0",
            "info": {"title": "Stripe API: the objects ops/bench sends (offline)", "version": "bench"},
            "paths": {}, "components": {"schemas": schemas}}


# -- the server ----------------------------------------------------------------------------------

class SyncEngineDatabase:
    """The peer's own database on the benchmark's server: created empty, migrated by the engine itself."""

    def __init__(self, server_url_for, name: str = "sync_engine_bench"):
        self.name = name
        self.admin_url = server_url_for("postgres")
        self.url = server_url_for(name)

    def create(self) -> "SyncEngineDatabase":
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(compose(DEVKIT_SQL.database_drop, database=self.name))
            conn.execute(compose(DEVKIT_SQL.database_create, database=self.name))
        return self

    def drop(self) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(compose(DEVKIT_SQL.database_drop, database=self.name))

    def rows(self, tables: Iterable[str]) -> dict[str, int]:
        """Rows per table of the engine's schema (``stripe``) that exists."""
        out = {}
        with psycopg.connect(self.url, autocommit=True) as conn:
            present = {r[0] for r in conn.execute(SQL.peer_tables)}
            for table in tables:
                if table in present:
                    out[table] = conn.execute(compose(SQL.peer_rows, table=f"stripe.{table}")).fetchone()[0]
        return out

    def object_ids(self, tables: Iterable[str]) -> set[str]:
        """Every object id the engine wrote into these tables (that exist)."""
        ids: set[str] = set()
        with psycopg.connect(self.url, autocommit=True) as conn:
            present = {r[0] for r in conn.execute(SQL.peer_tables)}
            for table in tables:
                if table in present:
                    ids.update(r[0] for r in conn.execute(compose(SQL.peer_ids, table=f"stripe.{table}")))
        return ids

    def last_write(self, tables: Iterable[str]) -> float | None:
        """The latest row write into these tables (that exist), as a Unix time; None if none."""
        latest = None
        with psycopg.connect(self.url, autocommit=True) as conn:
            present = {r[0] for r in conn.execute(SQL.peer_tables)}
            for table in tables:
                if table in present:
                    at = conn.execute(compose(SQL.peer_last_write, table=f"stripe.{table}")).fetchone()[0]
                    if at is not None and (latest is None or at > latest):
                        latest = at
        return latest

    def empty(self) -> None:
        """Every data table of the engine emptied (its migrations and account rows kept), then VACUUM ANALYZE."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            tables = [f"stripe.{r[0]}" for r in conn.execute(SQL.peer_data_tables)]
            if tables:
                conn.execute(compose(SQL.peer_truncate, tables=tables))
            conn.execute(SQL.peer_vacuum)


# The engine's table for each object type the benchmark sends.
TABLES = {"customer": "customers", "subscription": "subscriptions", "invoice": "invoices",
          "subscription_item": "subscription_items"}


class SyncEngine(Process):
    """``node server.mjs`` in the cache directory: the engine's webhook endpoint on a free port.

    Its handler is mounted at ``path`` (the project's own endpoint path), so the very request
    files the benchmark replays against the receiver are replayed against it unchanged."""

    def __init__(self, home: Path, log_dir: Path, *, database_url: str, secret: str, spec: Path,
                 path: str, stripe_api_url: str | None = None, pool_max: int = POOL_MAX, name: str = "sync-engine"):
        self.port = free_port()
        self.home = home
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STRIPE_", "DATABASE_", "PG"))}
        env.update({"DATABASE_URL": database_url, "PORT": str(self.port), "WEBHOOK_PATH": path,
                    "STRIPE_WEBHOOK_SECRET": secret, "STRIPE_ACCOUNT_ID": ACCOUNT_ID, "POOL_MAX": str(pool_max),
                    "SYNC_OPENAPI_SPEC": str(spec), "NODE_ENV": "production"})
        if stripe_api_url:
            env["STRIPE_API_URL"] = stripe_api_url
        super().__init__(name, [shutil.which("node") or "node", str(home / "bench-server.mjs")], env,
                         Path(log_dir) / f"{name}-{self.port}.log", cwd=home)

    def start(self, timeout_s: float = 120) -> "SyncEngine":
        server = resources.files(__name__).joinpath("server.mjs").read_text()
        (self.home / "bench-server.mjs").write_text(server)
        super().start()

        def ready() -> bool:
            self.ensure_alive()
            return "READY http://" in self.log()
        try:
            wait_until(ready, timeout_s=timeout_s, interval_s=0.1, what="the sync engine to listen")
        except AssertionError:
            self.kill()
            raise RuntimeError(f"the sync engine did not start:\n{self.log(4000)}") from None
        return self

    def cpu_s(self) -> float:
        return cpu_seconds(self.pid) if self.pid else 0.0

    def errors(self) -> list[str]:
        """The handler's processing errors logged so far (a 400 each)."""
        return [line for line in self.log().splitlines() if "[webhook] processing error" in line]

