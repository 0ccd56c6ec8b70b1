"""cost: what one event costs the receiver (c=8) and one worker draining alone: statements, round
trips, transactions, broker commands and CPU per event, and every process's peak RSS. The meters are
ingest's and drain's of this run (run first when they have not run)."""
from __future__ import annotations

from typing import Any

from devkit.benchmarks.pg import statement_label
from devkit.benchmarks.runner import Bench, log, scenario, table

HEADLINE = ("receiver_statements", "receiver_cpu_ms", "worker_statements", "worker_transactions", "worker_cpu_ms")


def run(b: Bench) -> dict[str, Any]:
    # Ingest meters the receiver at c=8, drain one worker alone: run here if this run has not run them yet.
    for name, key in (("ingest", "cost_receiver"), ("drain", "cost_worker")):
        if key not in b.results.get("_meters", {}).get("empty", {}):
            log(f"cost: running {name} for its meter")
            b.results.setdefault(name, scenario(name).run(b))
    meters = b.results["_meters"]["empty"]
    missing = [k for k in ("cost_receiver", "cost_worker") if k not in meters]
    if missing:
        raise RuntimeError(f"cost: no {', '.join(missing)}: ingest meters c=8, drain 1 worker (--levels, --workers)")
    b.finish()
    return {"receiver": meters["cost_receiver"], "worker": meters["cost_worker"], "peak_rss_mb": dict(b.peak_rss),
            "rss_target_met": all(v < 150 for v in b.peak_rss.values()) if b.peak_rss else None}


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rc, wk = result["receiver"], result["worker"]
    figures = {"SQL statements": "statements_per_event", "round trips to Postgres": "round_trips_per_event",
               "writes to Postgres": "client_writes_per_event", "transactions": "transactions_per_event",
               "Redis commands": "redis_commands_per_event", "Postgres CPU ms": "postgres_cpu_ms_per_event"}
    rows = [{"per event": k, "receiver": rc[v], "worker": wk[v]} for k, v in figures.items()]
    rows.append({"per event": "process CPU ms", "receiver": sum(rc["cpu_ms_per_event"].values()),
                 "worker": sum(wk["cpu_ms_per_event"].values())})
    text = table(rows, [("per event", "per event", ""), ("receiver", "receiver", ".2f"), ("worker", "worker", ".2f")])
    for who, m in (("receiver", rc), ("worker", wk)):
        text += f"\n{who} statements per event: " + ", ".join(
            f"{statement_label(k)} {v:.2f}" for k, v in m["statements_by_name"].items())
    text += "\npeak RSS MB: " + ", ".join(f"{k} {v:.0f}" for k, v in result["peak_rss_mb"].items())
    # Issue 19's: at most 2 transactions and 4 round trips per processed event (0.05 of counter slack).
    lean = wk["transactions_per_event"] <= 2.05 and wk["round_trips_per_event"] <= 4.05
    values = {"receiver_statements": rc["statements_per_event"], "receiver_transactions": rc["transactions_per_event"],
              "receiver_redis_cmds": rc["redis_commands_per_event"],
              "receiver_cpu_ms": sum(rc["cpu_ms_per_event"].values()),
              "worker_statements": wk["statements_per_event"], "worker_round_trips": wk["round_trips_per_event"],
              "worker_transactions": wk["transactions_per_event"], "worker_redis_cmds": wk["redis_commands_per_event"],
              "worker_cpu_ms": sum(wk["cpu_ms_per_event"].values()),
              "postgres_cpu_ms_receiver": rc["postgres_cpu_ms_per_event"],
              "postgres_cpu_ms_worker": wk["postgres_cpu_ms_per_event"], "worker_2tx_4rt": "met" if lean else "not_met"}
    values.update({"peak_rss_mb_" + k.replace(" ", "_"): v for k, v in result["peak_rss_mb"].items()})
    values["rss_under_150mb"] = "met" if result["rss_target_met"] else "not_met"
    return text, values
