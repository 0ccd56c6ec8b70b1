"""``ops/bench steady``'s peer: Stripe's sync engine (npm), verifying a webhook and upserting its object inline (no
queue, ledger or retries), offline behind express (``server.mjs``) on its own database, tables from the objects sent."""
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

NAME, VERSION, EXPRESS_SPEC = "@stripe/sync-engine", "1.0.32", "express@^4"
PACKAGE_SPEC = f"{NAME}@{VERSION}"
POOL_MAX = 10  # the engine's pg pool (its own default): the connections its inline upserts share
ACCOUNT_ID = "acct_1LedgerBenchPeer0"
CACHE_ROOT = Path(os.environ.get("BENCH_VENV_CACHE", Path.home() / ".cache" / "stripe-ledger-bench"))
_COMPLETE = ".complete"  # written last: an install without it was interrupted, and is done again
SQL = load(__name__)
SETTINGS = (f"{PACKAGE_SPEC} on Node {{node}}, its webhook handler behind express (raw body → processWebhook → 200), "
            f"upserting inline; pg pool of {POOL_MAX}; offline: stripeAccountId given, revalidateObjectsViaStripeApi "
            f"[], backfillRelatedEntities false, autoExpandLists false, tables from an OpenAPI document built from the "
            f"objects sent")
TABLES = {"customer": "customers", "subscription": "subscriptions", "invoice": "invoices",
          "subscription_item": "subscription_items"}  # the engine's table for each object type sent


def node_version() -> str:
    node = shutil.which("node")
    return node and subprocess.run([node, "-v"], capture_output=True, text=True, timeout=30).stdout.strip() or "?"


def available() -> str | None:
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
    done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--save-exact", PACKAGE_SPEC, EXPRESS_SPEC],
                          cwd=home, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"npm install {PACKAGE_SPEC} failed ({done.returncode}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
    if (installed := json.loads((home / "node_modules" / NAME / "package.json").read_text())["version"]) != VERSION:
        raise RuntimeError(f"npm installed {NAME} {installed}, not {VERSION}")
    (home / _COMPLETE).write_text(f"{PACKAGE_SPEC}\n")
    return home


_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))  # bool before int: a bool is an int in Python


def _property(values: list[Any]) -> dict[str, Any]:
    """An OpenAPI property for the values a field took."""
    kinds = sorted({next(name for kind, name in _JSON_TYPES if isinstance(v, kind)) for v in values if v is not None})
    kinds, nullable = kinds or ["string"], any(v is None for v in values)  # all null: a nullable string
    if len(kinds) > 1:
        return {"anyOf": [{"type": k} for k in kinds], "nullable": nullable}
    return {"type": kinds[0], **({"items": {}} if kinds[0] == "array" else {}),
            **({"nullable": True} if nullable else {})}


def _objects(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The object and those the engine also writes from it: a subscription's items and their plans and prices."""
    items = (obj.get("items") or {}).get("data") or () if obj.get("object") == "subscription" else ()
    return [obj, *items, *(item[key] for item in items for key in ("plan", "price") if isinstance(item.get(key), dict))]


def openapi_document(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """A spec3-shaped document with one schema (``x-resourceId``) per object type the events carry."""
    fields: dict[str, dict[str, list[Any]]] = {}
    for obj in (o for evt in events for o in _objects(evt["data"]["object"])):
        if obj.get("object") not in {"event", "list", "account", None}:  # the envelope and containers
            for key, value in obj.items():
                fields.setdefault(obj["object"], {}).setdefault(key, []).append(value)
    schemas = {kind: {"type": "object", "x-resourceId": kind,
                      "properties": {key: _property(values) for key, values in sorted(props.items())}}
               for kind, props in sorted(fields.items())}
    return {"openapi": "3.0.0", "info": {"title": "Stripe API: the objects ops/bench sends (offline)",
                                         "version": "bench"}, "paths": {}, "components": {"schemas": schemas}}


class SyncEngineDatabase:
    """The peer's own database on the benchmark's server: created empty, migrated by the engine itself."""

    def __init__(self, server_url_for, name: str = "sync_engine_bench"):
        self.name, self.admin_url, self.url = name, server_url_for("postgres"), server_url_for(name)

    def create(self) -> "SyncEngineDatabase":
        self.drop()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(compose(DEVKIT_SQL.database_create, database=self.name))
        return self

    def drop(self) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(compose(DEVKIT_SQL.database_drop, database=self.name))

    def _each(self, tables: Iterable[str], statement: str) -> dict[str, list[tuple]]:
        """The statement's rows on each of ``tables`` the engine's schema holds."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            present = {r[0] for r in conn.execute(SQL.peer_tables)}
            return {t: conn.execute(compose(statement, table=f"stripe.{t}")).fetchall() for t in tables if t in present}

    def rows(self, tables: Iterable[str]) -> dict[str, int]:
        return {table: found[0][0] for table, found in self._each(tables, SQL.peer_rows).items()}

    def object_ids(self, tables: Iterable[str]) -> set[str]:
        return {r[0] for found in self._each(tables, SQL.peer_ids).values() for r in found}

    def last_write(self, tables: Iterable[str]) -> float | None:
        """The latest row write into these tables, as a Unix time; None if none."""
        times = [found[0][0] for found in self._each(tables, SQL.peer_last_write).values()]
        return max((t for t in times if t is not None), default=None)

    def empty(self) -> None:
        """Every data table emptied (its migrations and account rows kept), then VACUUM ANALYZE."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            if tables := [f"stripe.{r[0]}" for r in conn.execute(SQL.peer_data_tables)]:
                conn.execute(compose(SQL.peer_truncate, tables=tables))
            conn.execute(SQL.peer_vacuum)


class SyncEngine(Process):
    """``node server.mjs`` in the cache directory, its handler at ``path`` (the receiver's: the same request files)."""

    def __init__(self, home: Path, log_dir: Path, *, database_url: str, secret: str, spec: Path,
                 path: str, stripe_api_url: str | None = None, pool_max: int = POOL_MAX, name: str = "sync-engine"):
        self.port, self.home = free_port(), home
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STRIPE_", "DATABASE_", "PG"))}
        env.update(DATABASE_URL=database_url, PORT=str(self.port), WEBHOOK_PATH=path, POOL_MAX=str(pool_max),
                   STRIPE_WEBHOOK_SECRET=secret, STRIPE_ACCOUNT_ID=ACCOUNT_ID, NODE_ENV="production",
                   SYNC_OPENAPI_SPEC=str(spec), **({"STRIPE_API_URL": stripe_api_url} if stripe_api_url else {}))
        super().__init__(name, [shutil.which("node") or "node", str(home / "bench-server.mjs")], env,
                         Path(log_dir) / f"{name}-{self.port}.log", cwd=home)

    def start(self, timeout_s: float = 120) -> "SyncEngine":
        (self.home / "bench-server.mjs").write_text(resources.files(__name__).joinpath("server.mjs").read_text())
        super().start()
        try:
            wait_until(lambda: self.ensure_alive() or "READY http://" in self.log(), timeout_s=timeout_s,
                       interval_s=0.1, what="the sync engine to listen")
        except AssertionError:
            self.kill()
            raise RuntimeError(f"the sync engine did not start:\n{self.log(4000)}") from None
        return self

    def cpu_s(self) -> float:
        return cpu_seconds(self.pid) if self.pid else 0.0

    def errors(self) -> list[str]:
        """The handler's processing errors logged so far (a 400 each)."""
        return [line for line in self.log().splitlines() if "[webhook] processing error" in line]
