"""docs/benchmarks.md: two blocks are written by runs, the rest of the page (method, profiles,
fixes) by hand. The block between the steady markers opens the page and is rewritten by a
full steady run with ``--compare`` (the whole stack, this revision against an older one);
the block between the results markers by every full ``ops/bench all``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .pg import statement_label

from . import report

BEGIN = "<!-- bench:results:begin (written by ops/bench all; do not edit by hand) -->"
END = "<!-- bench:results:end -->"
STEADY_BEGIN = "<!-- bench:steady:begin (written by ops/bench steady --compare REV; do not edit by hand) -->"
STEADY_END = "<!-- bench:steady:end -->"


def _replace(text: str, begin: str, end: str, block: str, *, at_top: bool = False) -> str:
    """``text`` with what lies between ``begin`` and ``end`` replaced by ``block``; the markers are
    added (after the page's title when ``at_top``, else at the end) when missing."""
    if begin not in text or end not in text:
        if at_top:
            title, _, body = text.partition("\n")
            text = f"{title}\n\n{begin}\n{end}\n{body}" if title.startswith("# ") else f"{begin}\n{end}\n\n{text}"
        else:
            text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + begin + "\n" + block + "\n" + end + tail


def write(results: dict[str, Any], docs: Path) -> list[Path]:
    """The sections this run measured: the opening steady block if it compared revisions, the
    results block (and the plots) if it ran every scenario."""
    docs.mkdir(exist_ok=True)
    written = []
    full = results["meta"].get("all", True)  # runs recorded before steady existed were all full runs
    if full and report.plot(results, docs / "benchmarks.png"):
        written.append(docs / "benchmarks.png")
    if full and results.get("burst") and report.plot_burst(results["burst"], docs / "benchmarks-burst.png"):
        written.append(docs / "benchmarks-burst.png")
    page = docs / "benchmarks.md"
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    if results.get("steady") and report.steady_sides(results["steady"])[1]:
        text = _replace(text, STEADY_BEGIN, STEADY_END, steady_block(results), at_top=True)
    if full:
        text = _replace(text, BEGIN, END, results_block(results))
    page.write_text(text)
    written.append(page)
    return written


def _run_line(meta: dict[str, Any]) -> list[str]:
    """The run's command, date, duration, machine and load, and the code it measured."""
    m = meta["machine"]
    ld = meta["load_during"]
    lb = meta["load_before"]
    return [f"Latest run: `{meta['command']}`, {meta['started']}, {meta['wall_s'] / 60:.1f} minutes.",
            "",
            f"Machine: {m.get('cpus')} CPUs ({m.get('cpu_model', '?')}), {m.get('memory_gib', '?')} GiB; "
            f"{m.get('postgres')}; {m.get('redis', '?').split(' sha=')[0]}; {m.get('wrk', '?').split(' Copyright')[0]}; "
            f"Python {m.get('python')}; Linux {m.get('kernel')}. Shared with other engineers' test runs: "
            f"1-minute load average {lb[0]:.2f} before the run, {ld['min']:.2f}-{ld['max']:.2f} (mean "
            f"{ld['mean']:.2f}) during it, our own processes included.",
            "",
            f"Code: commit `{m.get('git', '?')}`"
            + (f" with uncommitted changes in {', '.join('`' + f + '`' for f in m['git_dirty'])}" if m.get("git_dirty") else "")
            + ".", ""]


def _steady_method(st: dict[str, Any]) -> str:
    p = st["payload"]
    return (f"The stack as README runs it: the receiver ("
            f"{report.receiver_kind(st.get('receiver_server'), st['receiver_workers'], st.get('receiver_threads'))}), {st['workers']} "
            f"`celery -A workers worker --concurrency {st['worker_concurrency']}` ({st['workers']} parents, "
            f"{st['workers'] * st['worker_concurrency']} pool children; every queue, Celery's own log level, mingle, "
            f"gossip and heartbeats as by default; `LOG_LEVEL=INFO`) and `ledgerctl sweep --loop`, on the private "
            f"durable Postgres (fsync and synchronous_commit on) and Redis. Per level: a fresh stack, warmed up "
            f"(200 events), on an emptied ledger; then {st['events_per_level']:,} basil-era ({st['api_version']}) "
            f"lifecycle events, {p['min_kb']:.1f}-{p['max_kb']:.1f} KB (median {p['median_kb']:.1f} KB, mean "
            f"{p.get('mean_kb', p['median_kb']):.1f} KB; customers are the small ones), plus "
            f"{100 * st['redelivery_share']:.0f}% redeliveries of them, sent by {st['loadgen']} at c connections. "
            f"Ack figures are wrk's; end-to-end events/s is the events over the time from the first send to the "
            f"last `processed_at` (the ledger polled until every event is processed); CPU is each process type's "
            f"(/proc; Postgres: every backend, exited ones included) over the same time, in ms per processed "
            f"event. The client (wrk) is not in the total. \"backlog at last ack\": events not yet processed "
            f"when wrk had its last answer.")


def _scale_target(sc: dict[str, Any]) -> str:
    figures = report.scale_figures(sc)
    below = {k: v for k, v in figures.items() if v < 0.9}
    text = (f"Target (every figure ≥ 0.9 of the empty-ledger figure): **{'not met' if below else 'met'}** "
            f"(lowest {min(figures.values()):.3f}")
    if below:
        text += "; below 0.9: " + ", ".join(f"{k} {v:.3f}" for k, v in below.items())
    return text + ")."


def _f(value: float, spec: str = ".1f") -> str:
    return format(value, spec)


def steady_block(r: dict[str, Any]) -> str:
    """The page's opening: the whole stack at each concurrency, this revision, then before/after."""
    st = r["steady"]
    current, baseline = report.steady_sides(st)
    old = baseline["label"]
    out = ["## The whole stack, before and after (`steady`)", "", *_run_line(r["meta"]),
           f"Compared revision: `{baseline['commit']}` ({old}): its receiver, workers, sweep and migrations, "
           f"installed from a git worktree into a virtualenv of its own, run under this checkout's harness in the "
           f"same run, taking turns with the current revision per level ({old} c=1, current c=1, {old} c=8, ...).",
           "", _steady_method(st), "",
           "### steady, current revision", "",
           "CPU columns: ms per processed event.", "",
           report.steady_table(st, markdown=True), "",
           f"### before/after: throughput and latency (ratio = current / {old})", "",
           report.steady_compare_table(st, report.STEADY_FIGURES, markdown=True), "",
           f"### before/after: CPU ms per processed event (ratio = current / {old})", "",
           report.steady_compare_table(st, report.STEADY_CPU_FIGURES, markdown=True), "",
           f"### before/after: traffic per processed event (ratio = current / {old})", "",
           report.steady_compare_table(st, report.STEADY_TRAFFIC_FIGURES, markdown=True), "",
           *_top_statements(current["runs"][-1]),
           "Targets (from the issue):", "",
           *(f"* {t}: {what} — **{'met' if ok else 'not met'}**" for t, what, ok in report.steady_targets(st).values()),
           "", "```", r.get("summaries", {}).get("steady", ""), "```"]
    return "\n".join(out)


def _top_statements(run: dict[str, Any]) -> list[str]:
    rows = report.steady_top_statements(run)
    if not rows:
        return []
    return [f"Where Postgres' execution time goes, current revision at c={run['concurrency']} (pg_stat_statements, "
            f"per processed event; Postgres' CPU also covers parsing, commits, connections and autovacuum):", "",
            report.md_table(rows, [(k, k, "") for k in rows[0]]), ""]


def results_block(r: dict[str, Any]) -> str:
    out = list(_run_line(r["meta"]))
    if "ingest" in r:
        ing = r["ingest"]
        p = ing["payload"]
        out += ["### ingest", "",
                f"Signed deliveries, {p['min_kb']:.1f}-{p['max_kb']:.1f} KB (median {p['median_kb']:.1f} KB), "
                f"{ing['seconds_per_level']:.0f} s per level, receiver = "
                f"{report.receiver_kind(ing.get('receiver_server'), ing['receiver_workers'], ing.get('receiver_threads'))}; load generator: {ing['loadgen']}.", "",
                report.md_table(ing["levels"], report.INGEST_COLUMNS), ""]
    if "drain" in r:
        dr = r["drain"]
        out += ["### drain", "",
                f"A backlog of {dr['events']:,} received events ({dr['events'] // 10:,} subscription lifecycles: "
                + ", ".join(f"{k} {v:,}" for k, v in dr["mix"].items())
                + ") processed by N `celery worker --concurrency 1` instances; the limit is pgbench with N clients "
                  "running, per transaction, the statements a worker sends for one event, on a fresh copy of the backlog. "
                + ("Each backlog drained to the end." if dr.get("full_drain") else
                   f"Rates over a {dr['window_s']:.0f} s window for the workers (after every worker is up) and "
                   f"{dr['pgbench_window_s']:.0f} s for pgbench, with the whole backlog in place."), "",
                report.md_table(dr["runs"], report.DRAIN_COLUMNS), ""]
    if "burst" in r:
        bu = r["burst"]
        out += ["### burst", "",
                f"{bu['deliveries']:,} deliveries at c={bu['connections']} (10 back-to-back segments of 10%) while "
                f"{bu['workers']} workers run{_nice(bu)}.", "",
                f"* all acknowledged after **{bu['ack_all_s']:.1f} s** ({bu['ack_rps']:.0f}/s); all processed after "
                f"**{bu['processed_all_s']:.1f} s**",
                f"* peak oldest-unprocessed age **{bu['peak_oldest_unprocessed_s']:.1f} s**, peak backlog "
                f"{bu['peak_backlog']:,} events; errors {bu['errors']}",
                f"* ack latency against backlog: corr(backlog, p50) = {bu['corr_backlog_p50']:+.2f}, corr(backlog, "
                f"p99) = {bu['corr_backlog_p99']:+.2f}; median p50 {bu['p50_ms_low_backlog']:.1f} ms in the "
                f"segments with the smaller backlog vs {bu['p50_ms_high_backlog']:.1f} ms with the larger one, p99 "
                f"{bu['p99_ms_low_backlog']:.1f} vs {bu['p99_ms_high_backlog']:.1f} ms",
                *([f"* control, no worker running, c={bu['connections']}: with no backlog "
                   f"{bu['control']['no_backlog']['rps']:.0f} req/s, p50 {bu['control']['no_backlog']['p50_ms']:.1f} ms, "
                   f"p99 {bu['control']['no_backlog']['p99_ms']:.1f} ms; with {bu['control']['backlog']['backlog']:,} "
                   f"unprocessed events waiting {bu['control']['backlog']['rps']:.0f} req/s, p50 "
                   f"{bu['control']['backlog']['p50_ms']:.1f} ms, p99 {bu['control']['backlog']['p99_ms']:.1f} ms "
                   f"(**req/s ratio {bu['control']['rps_ratio']:.2f}**)",
                   f"* target, acknowledgement during the burst within 10% of ingest with no worker running: "
                   f"{bu['ack_rps']:.0f} vs {bu['control']['no_backlog']['rps']:.0f} req/s, "
                   f"**{report.burst_ack_ratio(bu):.2f}, {'met' if report.burst_ack_target(bu) else 'not met'}**"]
                  if bu.get("control") else []),
                f"* deliveries sent again because they never left wrk: {bu.get('resent', 0)}", "",
                report.md_table(bu["segments"], report.BURST_COLUMNS), "",
                "![burst](benchmarks-burst.png)", ""]
    if "replay" in r:
        rp = r["replay"]
        out += ["### replay", "",
                f"`ledgerctl replay --status failed_permanent --yes --rate 1000000` of {rp['events']:,} events: "
                f"**{rp['events_per_s']:.0f} events/s** ({rp['replayed']:,} replayed in {rp['seconds']:.1f} s). "
                f"Live ingest at c=8 alongside: {rp['live_rps_alone']:.0f} → {rp['live_rps_during']:.0f} req/s "
                f"(**{100 * rp['live_slowdown']:.0f}% slower**; deliveries recorded between the first and the last "
                f"replay), p99 {rp['live_p99_ms_alone']:.1f} → {rp['live_p99_ms_during']:.1f} ms (over the live "
                f"run, which starts before the replay and ends with it).", ""]
    if "scale" in r:
        sc = r["scale"]
        h = sc["history"]
        rows = []
        for c, x in sc["ingest_ratio"].items():
            e = next(l for l in r["_empty"]["ingest"]["levels"] if str(l["concurrency"]) == str(c))
            f = next(l for l in sc["ingest"]["levels"] if str(l["concurrency"]) == str(c))
            rows.append({"figure": f"ingest req/s, c={c}", "empty": e["rps"], "full": f["rps"], "ratio": x["rps"],
                         "pg": x["pgbench"]})
        for c, x in sc["ingest_ratio"].items():
            e = next(l for l in r["_empty"]["ingest"]["levels"] if str(l["concurrency"]) == str(c))
            f = next(l for l in sc["ingest"]["levels"] if str(l["concurrency"]) == str(c))
            rows.append({"figure": f"ingest p99 ms, c={c} (ratio empty/1M)", "empty": e["p99_ms"],
                         "full": f["p99_ms"], "ratio": x["p99"], "pg": None})
        for w, x in sc["drain_ratio"].items():
            e = next(l for l in r["_empty"]["drain"]["runs"] if str(l["workers"]) == str(w))
            f = next(l for l in sc["drain"]["runs"] if str(l["workers"]) == str(w))
            rows.append({"figure": f"drain events/s, {w} worker(s)", "empty": e["events_per_s"],
                         "full": f["events_per_s"], "ratio": x["events_per_s"], "pg": x["pgbench"]})
        rows.append({"figure": "sweep query ms, median of 15 (ratio empty/1M)",
                     "empty": sc["sweep_empty"]["query_ms_median"], "full": sc["sweep"]["query_ms_median"],
                     "ratio": sc["sweep_ratio"]["query"], "pg": None})
        rows.append({"figure": "sweep pass ms, 500 re-driven (ratio empty/1M)", "empty": sc["sweep_empty"]["pass_ms"],
                     "full": sc["sweep"]["pass_ms"], "ratio": sc["sweep_ratio"]["pass"], "pg": None})
        out += ["### scale", "",
                f"The same ingest and drain runs and one recovery sweep with {h['events']:,} processed events of "
                f"history (and their deliveries, attempts, {h['rows']['billing.customers']:,} customers, "
                f"{h['rows']['billing.subscriptions']:,} subscriptions, {h['rows']['billing.invoices']:,} invoices, "
                f"{h['rows']['billing.subscription_transitions']:,} transitions, "
                f"{h['rows']['billing.entitlements']:,} entitlements; database {h['database_mb']:,.0f} MB, written "
                f"set-based in {h['total_s']:.0f} s). Ratio = 1M-history figure / empty-ledger figure (for times: "
                f"empty / 1M), so 1.0 means unchanged and the target is ≥ 0.9. The pgbench column is the same "
                f"ratio for the Postgres limit: how much of any change Postgres itself shows.", "",
                report.md_table(rows, [("figure", "figure", ""), ("empty", "empty", ".1f"), ("full", "1M history", ".1f"),
                                       ("ratio", "ratio", ".3f"), ("pg", "pgbench ratio", ".3f")]), "",
                _scale_target(sc), "",
                f"The sweep's query with the history (`EXPLAIN (ANALYZE, BUFFERS)`, rolled back) reads ledger.events "
                f"{'only through the partial indexes of the unprocessed set (' + ', '.join('`' + i + '`' for i in sc['sweep'].get('partial_indexes', [])) + '), plus primary-key lookups for the rows it updates' if report.sweep_uses_partial(sc['sweep']) else '**not only through partial indexes**'}"
                f"; {sc['sweep_empty']['query_ms_median']:.1f} ms on the empty ledger, {sc['sweep']['query_ms_median']:.1f} ms "
                f"with the history (median of 15):", "",
                "```", sc["sweep"]["plan"], "```", ""]
    if "cost" in r:
        co = r["cost"]
        rc, wk = co["receiver"], co["worker"]
        rows = [
            {"what": "SQL statements (pg_stat_statements)", "receiver": rc["statements_per_event"],
             "worker": wk["statements_per_event"]},
            {"what": "round trips to Postgres (answers received: `ss -ti` data segments in)",
             "receiver": rc["round_trips_per_event"], "worker": wk["round_trips_per_event"]},
            {"what": "writes to Postgres (data segments out; pipelined statements go out unanswered)",
             "receiver": rc.get("client_writes_per_event"), "worker": wk.get("client_writes_per_event")},
            {"what": "transactions (pg_stat_database)", "receiver": rc["transactions_per_event"],
             "worker": wk["transactions_per_event"]},
            {"what": "Redis commands (INFO commandstats)", "receiver": rc["redis_commands_per_event"],
             "worker": wk["redis_commands_per_event"]},
        ]
        for k, v in rc["cpu_ms_per_event"].items():
            rows.append({"what": f"CPU ms: {k}", "receiver": v, "worker": None})
        for k, v in wk["cpu_ms_per_event"].items():
            rows.append({"what": f"CPU ms: {k}", "receiver": None, "worker": v})
        rows.append({"what": "CPU ms: Postgres (all its processes)", "receiver": rc["postgres_cpu_ms_per_event"],
                     "worker": wk["postgres_cpu_ms_per_event"]})
        out += ["### cost", "",
                "Per processed event; receiver: the ingest run at c=8; worker: the drain with 1 worker.", "",
                report.md_table(rows, [("what", "per event", ""), ("receiver", "receiver", ".2f"),
                                       ("worker", "worker", ".2f")]), "",
                "Statements per event by name: receiver " + ", ".join(
                    f"`{statement_label(k)}` {v:.2f}" for k, v in rc["statements_by_name"].items()) + "; worker " + ", ".join(
                    f"`{statement_label(k)}` {v:.2f}" for k, v in wk["statements_by_name"].items()) + ".", "",
                "Peak RSS (VmHWM) per process type: " + ", ".join(
                    f"{k} **{v:.0f} MB**" for k, v in co["peak_rss_mb"].items())
                + f" — target < 150 MB each: **{'met' if co['rss_target_met'] else 'not met'}**.", "",
                f"Worker target, at most 2 transactions and 4 round trips per processed event: "
                f"**{'met' if report.worker_round_trip_target(wk) else 'not met'}** "
                f"({wk['transactions_per_event']:.2f} and {wk['round_trips_per_event']:.2f}).", ""]
    if "steady" in r:
        out += ["### steady", "", _steady_method(r["steady"]), "", "CPU columns: ms per processed event.", "",
                report.steady_table(r["steady"], markdown=True), ""]
    out += ["### summary lines", "", "```", *r.get("summaries", {}).values(), "```", "",
            "![throughput against concurrency and worker count, next to the pgbench limit](benchmarks.png)"]
    return "\n".join(out)


def _nice(burst: dict) -> str:
    nice = burst.get("worker_nice", 0)
    return f" at nice {nice} (yielding the CPU to acknowledgements)" if nice else ""
