"""The benchmark database: creation, resets, counters (pg_stat_statements, pg_stat_database), pgbench."""
from __future__ import annotations

import functools
import re
import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psycopg
from psycopg.sql import Composable

from devkit.servers import pg_bin
from devkit.sql import SQL, compose
from ledger.migrate import migrate
from ledger.queries import SQL as LEDGER_SQL
from ledger.queries import load

BILLING_SQL = load("workers.billing")
MONITOR_ROLE = "bench_monitor"  # the role the benchmark reads counters with: left out of the counts


class BenchDatabase:
    def __init__(self, server_url_for, name: str = "ledger_bench"):
        self.name = name
        self.admin_url = server_url_for("postgres")
        self.url = server_url_for(name)
        self.monitor_url = server_url_for(name, MONITOR_ROLE)
        self._monitor: psycopg.Connection | None = None
        self.monitor_statements = 0

    def create(self, migrate_with: Callable[[str], Any] = migrate) -> "BenchDatabase":
        """A new database migrated by this checkout, or by ``migrate_with(url)`` (an older revision's)."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(compose(SQL.database_drop, database=self.name))
            conn.execute(compose(SQL.database_create, database=self.name))
            if not conn.execute(SQL.bench_role_exists, {"role": MONITOR_ROLE}).fetchone():
                conn.execute(compose(SQL.bench_role_create, role=MONITOR_ROLE))
        migrate_with(self.url)
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(SQL.bench_statements_extension)
            conn.execute(SQL.bench_schema_create)
        return self

    def q(self, sql: str | Composable, params: Any = None) -> list[tuple]:
        if self._monitor is None or self._monitor.closed:
            self._monitor = psycopg.connect(self.monitor_url, autocommit=True)
        self.monitor_statements += 1
        cur = self._monitor.execute(sql, params)
        return cur.fetchall() if cur.description else []

    def one(self, sql: str | Composable, params: Any = None) -> Any:
        rows = self.q(sql, params)
        return rows[0][0] if rows else None

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()

    def reset(self) -> None:
        """Empty every ledger and billing table, then VACUUM ANALYZE (a fresh, empty ledger)."""
        self.q_past_deadlocks(compose(SQL.bench_truncate, tables=[r[0] for r in self.q(SQL.bench_tables_to_reset)]))
        self.vacuum()

    def q_past_deadlocks(self, sql: str | Composable) -> list[tuple]:
        """``sql``, again after a deadlock: a delivery wrk sent before it stopped may still be inserting."""
        for attempt in range(3):
            try:
                return self.q(sql)
            except psycopg.errors.DeadlockDetected:
                if attempt == 2:
                    raise
                time.sleep(1)

    def vacuum(self, *tables: str, index_cleanup: bool = False) -> None:
        # INDEX_CLEANUP ON: a plain VACUUM may skip the indexes, leaving entries of rows that left a partial index.
        self.q(compose(SQL.bench_vacuum_analyze_index_cleanup if index_cleanup else SQL.bench_vacuum_analyze,
                       tables=tables))

    def unfinished(self) -> int:
        return self.one(SQL.bench_unfinished_count)

    def reset_statements(self) -> None:
        self.q(SQL.bench_statements_reset)

    def xact_commits(self) -> int:
        self.q(SQL.bench_stats_clear_snapshot)
        return self.one(SQL.bench_transactions)

    def statements(self) -> list[dict[str, Any]]:
        """pg_stat_statements of this database, without the monitor's own statements."""
        rows = self.q(SQL.bench_statements, {"monitor_role": MONITOR_ROLE})
        return [{"query": q, "name": statement_name(q), "calls": c, "rows": n, "exec_ms": t} for q, c, n, t in rows]


def _normalise(sql: str) -> str:
    """The text with every constant and parameter as ``?`` (as pg_stat_statements keeps it), no cast or comment."""
    sql = re.sub(r"--[^\n]*", " ", sql)
    sql = re.sub(r"::[\w\[\]]+", "", sql)
    sql = re.sub(r"%\(\w+\)s|\$\d+|:\w+|'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b|\b(?:true|false|null)\b|(?<=extract\()\w+",
                 "?", sql, flags=re.I)
    sql = re.sub(r"nullif\(\?,\s*\?\)|\?(?:\s+\?)+", "?", sql, flags=re.I)
    return re.sub(r"\s+", " ", sql).strip().lower()


_NAMED = {**{k: _normalise(v) for k, v in LEDGER_SQL.items()},
          **{f"billing.{k}": _normalise(v) for k, v in BILLING_SQL.items()}}
_WRITER_TABLE = re.compile(r'(?:insert into|delete from|from) "(\w+)"\."(\w+)"')


def statement_label(name: str) -> str:
    """A recorded statement name with every named statement that shares its pg_stat_statements entry."""
    return " or ".join(n for n, named in _NAMED.items() if named == _NAMED[name]) if name in _NAMED else name


@functools.lru_cache(maxsize=4096)
def statement_name(query: str) -> str:
    """The named statement(s) a pg_stat_statements entry is; the batch writers' composed ones by their tables."""
    text = _normalise(query)
    if text in ("begin", "commit", "rollback"):
        return text.upper()
    if text.startswith('with "w0" as (') or text.startswith('select "') and " = any(" in text:
        verb = "writer: write" if text.startswith("with") else "writer: read"
        return f"{verb} {', '.join(dict.fromkeys(t for s, t in _WRITER_TABLE.findall(text) if s != 'ledger'))}"
    return " or ".join(name for name, named in _NAMED.items() if text == named) or text[:60]


@dataclass
class PgbenchResult:
    tps: float
    duration_s: float
    p50_ms: float
    p99_ms: float
    failed: int
    cpu_s: float


def run_pgbench(url_parts: dict, script_files: list[Path], clients: int, *, seconds: float | None = None,
                transactions_per_client: int | None = None, defines: dict[str, str] | None = None,
                log_dir: Path, threads: int | None = None) -> PgbenchResult:
    """pgbench -M prepared (as psycopg prepares repeated statements), one script run per transaction."""
    log_prefix = log_dir / f"pgbench-{clients}-{time.monotonic_ns()}"
    cmd = [pg_bin("pgbench"), "-n", "-M", "prepared", "-c", str(clients), "-j", str(threads or max(1, min(clients, 2))),
           "-h", url_parts["host"], "-p", str(url_parts["port"]), "-U", url_parts["user"],
           "-l", f"--log-prefix={log_prefix}", *(f"-D{key}={value}" for key, value in (defines or {}).items()),
           *(f"-f{path}" for path in script_files)]
    cmd += ["-T", str(max(1, int(round(seconds))))] if seconds is not None else []
    cmd += ["-t", str(transactions_per_client)] if transactions_per_client is not None else []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([*cmd, url_parts["dbname"]], capture_output=True, text=True, timeout=1200,
                          start_new_session=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{proc.stdout[-2000:]}")
    logs = list(log_dir.glob(f"{log_prefix.name}*"))
    latencies = sorted(int(p[2]) for log in logs for p in map(str.split, log.read_text().splitlines()) if len(p) >= 3)
    for log in logs:
        log.unlink()
    n = len(latencies)
    p50, p99 = (latencies[min(n - 1, int(q * n))] / 1000 if n else 0.0 for q in (0.50, 0.99))
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", proc.stdout)
    tps = float(tps[1]) if tps else 0.0
    done = re.search(r"number of transactions actually processed: (\d+)", proc.stdout)
    failed = re.search(r"number of failed transactions: (\d+)", proc.stdout)
    return PgbenchResult(tps=tps, duration_s=(int(done[1]) if done else n) / tps if tps else 0.0, p50_ms=p50,
                         p99_ms=p99, failed=int(failed[1]) if failed else 0,
                         cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))


def url_parts(url: str) -> dict:
    match = re.match(r"postgresql://(\w+)@([\d.]+):(\d+)/(\w+)", url)
    return {"user": match[1], "host": match[2], "port": int(match[3]), "dbname": match[4]}


def pgbench_sql(sql: str, var: Callable[[str], str]) -> str:
    """A named statement as a pgbench command: comments dropped, each ``%(p)s`` replaced by ``var(p)``."""
    body = re.sub(r"%\((\w+)\)s", lambda m: var(m[1]), re.sub(r"--[^\n]*", "", sql))
    return re.sub(r"\n\s*\n", "\n", body).strip() + ";"
