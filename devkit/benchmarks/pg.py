"""The benchmark database: creation, resets, counters (pg_stat_statements, pg_stat_database), pgbench."""
from __future__ import annotations

import functools
import re
import resource
import statistics
import subprocess
import time
from dataclasses import dataclass, field
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
# The role the benchmark itself reads counters with: its statements are left out of the counts.
MONITOR_ROLE = "bench_monitor"


class BenchDatabase:
    def __init__(self, server_url_for, name: str = "ledger_bench"):
        self.name = name
        self.admin_url = server_url_for("postgres")
        self.url = server_url_for(name)
        self.monitor_url = server_url_for(name, MONITOR_ROLE)
        self._monitor: psycopg.Connection | None = None
        self.monitor_statements = 0

    def create(self, migrate_with: Callable[[str], Any] = migrate) -> "BenchDatabase":
        """A new, migrated database: by this checkout's migrations, or ``migrate_with(url)``
        (an older revision's ``ledgerctl migrate``)."""
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

    # -- the monitor connection ----------------------------------------------------------
    @property
    def monitor(self) -> psycopg.Connection:
        if self._monitor is None or self._monitor.closed:
            self._monitor = psycopg.connect(self.monitor_url, autocommit=True)
        return self._monitor

    def q(self, sql: str | Composable, params: Any = None) -> list[tuple]:
        self.monitor_statements += 1
        cur = self.monitor.execute(sql, params)
        return cur.fetchall() if cur.description else []

    def one(self, sql: str | Composable, params: Any = None) -> Any:
        rows = self.q(sql, params)
        return rows[0][0] if rows else None

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    # -- state ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty every ledger and billing table, then VACUUM ANALYZE (a fresh, empty ledger)."""
        tables = [r[0] for r in self.q(SQL.bench_tables_to_reset)]
        for attempt in range(3):
            try:
                if tables:
                    self.q(compose(SQL.bench_truncate, tables=tables))
                break
            except psycopg.errors.DeadlockDetected:
                # A delivery wrk sent before it stopped may still be inserting: TRUNCATE's
                # exclusive locks then deadlock with its row locks. That request ends in moments.
                if attempt == 2:
                    raise
                time.sleep(1)
        self.vacuum()

    def vacuum(self, *tables: str, index_cleanup: bool = False) -> None:
        # INDEX_CLEANUP ON: a plain VACUUM skips the indexes when under 2% of the table's pages
        # hold dead rows, leaving the entries of rows that left a partial index in it.
        template = SQL.bench_vacuum_analyze_index_cleanup if index_cleanup else SQL.bench_vacuum_analyze
        self.q(compose(template, tables=tables))

    def unfinished(self) -> int:
        return self.one(SQL.bench_unfinished_count)

    def oldest_unfinished_age_s(self) -> float:
        age = self.one(SQL.bench_oldest_unfinished_age_s)
        return float(age) if age is not None else 0.0

    def now(self):
        return self.one(SQL.bench_clock)

    # -- counters ------------------------------------------------------------------------
    def reset_statements(self) -> None:
        self.q(SQL.bench_statements_reset)

    def xact_commits(self) -> int:
        self.q(SQL.bench_stats_clear_snapshot)
        return self.one(SQL.bench_transactions)

    def statements(self) -> list[dict[str, Any]]:
        """pg_stat_statements of this database, without the monitor's own statements."""
        rows = self.q(SQL.bench_statements, {"monitor_role": MONITOR_ROLE})
        return [{"query": q, "name": statement_name(q), "calls": c, "rows": n, "exec_ms": t} for q, c, n, t in rows]


# -- naming pg_stat_statements entries by the project's named SQL -------------------------------

def _normalise(sql: str) -> str:
    sql = re.sub(r"--[^\n]*", " ", sql)
    sql = re.sub(r"::[\w\[\]]+", "", sql)
    sql = re.sub(r"%\(\w+\)s|\$\d+|:\w+|'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b", "?", sql)
    sql = re.sub(r"nullif\(\?,\s*\?\)", "?", sql, flags=re.I)
    return re.sub(r"\s+", " ", sql).strip().lower()


_NAMED = {**{k: _normalise(v) for k, v in LEDGER_SQL.items()},
          **{f"billing.{k}": _normalise(v) for k, v in BILLING_SQL.items()}}


def statement_label(name: str) -> str:
    """A recorded statement name with every named statement that shares its pg_stat_statements entry."""
    if name in _NAMED:
        return " or ".join(n for n, named in _NAMED.items() if named == _NAMED[name])
    return name


_WRITER_TABLE = re.compile(r'(?:insert into|delete from|from) "(\w+)"\."(\w+)"')


@functools.lru_cache(maxsize=4096)
def statement_name(query: str) -> str:
    text = _normalise(query)
    if text in ("begin", "commit", "rollback"):
        return text.upper()
    if text.startswith('with "w0" as (') or text.startswith('select "') and " = any(" in text:
        # The writers' statements (workers/rowsql.py) are composed, not named: named by what they write or read.
        verb = "writer: write" if text.startswith("with") else "writer: read"
        tables = dict.fromkeys(t for s, t in _WRITER_TABLE.findall(text) if s != "ledger")
        return f"{verb} {', '.join(tables)}"
    exact = [name for name, named in _NAMED.items() if text == named]
    if exact:
        # Statements differing only in a constant share one pg_stat_statements entry.
        return " or ".join(exact)
    # pg_stat_statements replaces constants by $n and pgbench's scripts add casts: compare loosely.
    import difflib

    best, score = None, 0.0
    if len(text) > 2000:  # a ratio against every named statement would take seconds
        return text[:60]
    for name, named in _NAMED.items():
        ratio = difflib.SequenceMatcher(None, text, named, autojunk=False).ratio()
        if ratio > score:
            best, score = name, ratio
    return best if best and score > 0.85 else text[:60]


# -- pgbench ---------------------------------------------------------------------------------

@dataclass
class PgbenchResult:
    clients: int
    transactions: int
    duration_s: float
    tps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    failed: int = 0
    cpu_s: float = 0.0
    raw: str = field(default="", repr=False)


def run_pgbench(url_parts: dict, script_files: list[Path], clients: int, *, seconds: float | None = None,
                transactions_per_client: int | None = None, defines: dict[str, str] | None = None,
                log_dir: Path, threads: int | None = None) -> PgbenchResult:
    """pgbench -M prepared (as psycopg prepares repeated statements), one script run per transaction."""
    threads = threads or max(1, min(clients, 2))
    log_prefix = log_dir / f"pgbench-{clients}-{time.monotonic_ns()}"
    cmd = [pg_bin("pgbench"), "-n", "-M", "prepared", "-c", str(clients), "-j", str(threads),
           "-h", url_parts["host"], "-p", str(url_parts["port"]), "-U", url_parts["user"],
           "-l", f"--log-prefix={log_prefix}"]
    if seconds is not None:
        cmd += ["-T", str(max(1, int(round(seconds))))]
    if transactions_per_client is not None:
        cmd += ["-t", str(transactions_per_client)]
    for key, value in (defines or {}).items():
        cmd += ["-D", f"{key}={value}"]
    for path in script_files:
        cmd += ["-f", str(path)]
    cmd.append(url_parts["dbname"])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=1200)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed ({proc.returncode}):\n{err[-3000:]}\n{out[-2000:]}")
    tps_match = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
    done = re.search(r"number of transactions actually processed: (\d+)", out)
    failed = re.search(r"number of failed transactions: (\d+)", out)
    latencies = []
    for log in log_dir.glob(f"{log_prefix.name}*"):
        with open(log) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3:
                    latencies.append(int(parts[2]))
        log.unlink()
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] / 1000 if latencies else 0.0

    tps = float(tps_match[1]) if tps_match else 0.0
    transactions = int(done[1]) if done else len(latencies)
    return PgbenchResult(clients=clients, transactions=transactions,
                         duration_s=transactions / tps if tps else 0.0, tps=tps,
                         p50_ms=pct(0.50), p95_ms=pct(0.95), p99_ms=pct(0.99),
                         mean_ms=statistics.fmean(latencies) / 1000 if latencies else 0.0,
                         failed=int(failed[1]) if failed else 0, cpu_s=cpu_s, raw=out)


def url_parts(url: str) -> dict:
    match = re.match(r"postgresql://(\w+)@([\d.]+):(\d+)/(\w+)", url)
    if not match:
        raise ValueError(url)
    return {"user": match[1], "host": match[2], "port": int(match[3]), "dbname": match[4]}


def pgbench_sql(sql: str, var: Callable[[str], str]) -> str:
    """A named statement as a pgbench command: comments dropped, each ``%(p)s`` replaced by ``var(p)``."""
    body = re.sub(r"--[^\n]*", "", sql)
    body = re.sub(r"%\((\w+)\)s", lambda m: var(m[1]), body)
    body = re.sub(r"\n\s*\n", "\n", body).strip()
    return body + ";"
