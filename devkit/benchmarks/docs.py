"""docs/benchmarks.md: two blocks are written by runs, the rest of the page (method, profiles,
fixes) by hand. The block between the steady markers opens the page and is rewritten by a
full steady run beside Stripe's sync engine (the side-by-side table of that one run, then
each broker's levels, the drain per broker and the receiver's cost when the run measured
them, and the issue's targets), or with ``--compare`` (this revision against an older one);
the block between the results markers by every full ``ops/bench all``."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .pg import statement_label

from . import report

BEGIN = "<!-- bench:results:begin (written by ops/bench all; do not edit by hand) -->"
END = "<!-- bench:results:end -->"
STEADY_BEGIN = "<!-- bench:steady:begin (written by a full ops/bench steady run; do not edit by hand) -->"
# The opening's begin marker as any earlier version wrote it.
_STEADY_BEGIN_ANY = re.compile(r"<!-- bench:steady:begin \(.*?\) -->")
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
    steady = results.get("steady")
    if steady and (report.steady_peer(steady) or report.steady_sides(steady)[1]):
        text = _STEADY_BEGIN_ANY.sub(STEADY_BEGIN, text, count=1)
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


def _brokers_in_words(st: dict[str, Any]) -> str:
    words = {"redis": "the private Redis", "amqp": "RabbitMQ (the machine's server, a vhost of the run's own)"}
    on = report.steady_brokers(st)
    text = " or ".join(words.get(b, b) for b in on)
    return text + (", taking turns per level (CELERY_BROKER_URL)" if len(on) > 1 else "")


def _steady_method(st: dict[str, Any]) -> str:
    p = st["payload"]
    return (f"The stack as docs/configuration.md runs it: the receiver ("
            f"{report.receiver_kind(st.get('receiver_server'), st['receiver_workers'], st.get('receiver_threads'))}), {st['workers']} "
            f"`celery -A workers worker --concurrency {st['worker_concurrency']}` ({st['workers']} parents, "
            f"{st['workers'] * st['worker_concurrency']} pool children; every queue, Celery's own log level, mingle, "
            f"gossip and heartbeats as by default; `LOG_LEVEL=INFO`) and `ledgerctl sweep --loop`, on the private "
            f"durable Postgres (fsync and synchronous_commit on) and {_brokers_in_words(st)}. Per level: a fresh "
            f"stack, warmed up "
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


def _peer_method(st: dict[str, Any]) -> str:
    pe = st["peer"]
    calls = sum(r.get("stripe_api_requests", 0) for r in pe["runs"])
    return (f"The peer: {pe['settings']}. Per level it gets a fresh database of its own on the same private "
            f"Postgres (same settings: fsync and synchronous_commit on), is warmed up on the same 200 events and "
            f"emptied, then receives the very deliveries the stack received at that level (same bodies, same "
            f"redeliveries at the same places, each run's requests signed just before it starts) from the same "
            f"wrk at the same connections. It applies each event in the request, so acknowledged means applied: "
            f"its events/s is the events over the time from the first send to the last answer (or to its last "
            f"row write, if later), and every event's object is checked present in its tables afterwards. Its "
            f"Stripe client points at a local fake Stripe API, which counted {calls} call(s) in all. Its server "
            f"keeps connections open between requests (express), as the receiver's gthread workers do (gunicorn's "
            f"keep-alive); sync workers close each one.")


def _targets_lines(r: dict[str, Any]) -> list[str]:
    targets = r.get("targets") or report.issue_targets(r)
    return [f"Targets ({report.TARGETS_SOURCE}), each as this run measured it:", "",
            report.targets_table(targets, markdown=True), ""]


def _drain_lines(r: dict[str, Any]) -> list[str]:
    dr = r.get("drain")
    if not dr or not report.drain_broker_ratios(dr):
        return []
    return ["### drain per broker", "",
            f"The same backlog of {dr['events']:,} received events (rows and wake-ups in place before any worker "
            f"starts), drained by each fleet on each broker in turn; events/s and the machine's busy share "
            f"(/proc/stat, 1 - idle/total over every core; on a shared machine other users' work counts too, so the "
            f"share of the workers', Postgres' and the broker's own CPU is given beside it) over "
            + ("the whole drain." if dr.get("full_drain") else f"a {dr['window_s']:.0f} s window.") + "", "",
            report.md_table(report.drain_rows(dr), report.DRAIN_COLUMNS), "",
            *(f"* {line}" for line in report.drain_ratio_lines(dr)), ""]


def _receiver_cost_lines(r: dict[str, Any]) -> list[str]:
    co = r.get("receiver-cost")
    if not co:
        return []
    rows = [{**co["receiver"], "server": "receiver"}, {**co["minimal"], "server": "minimal WSGI app"}]
    return ["### the receiver's CPU against a minimal WSGI app (`receiver-cost`)", "",
            f"Both under {co['server']}, the same wrk load (c={co['connections']}, {co['requests_per_run']:,} new "
            f"deliveries per run, {co['rounds']} run(s) each, taking turns), on Redis. The minimal app "
            f"(`devkit/benchmarks/minimal_wsgi.py`) does the same I/O and nothing else: the HMAC check, the JSON "
            f"parse, the receiver's `event_record_delivery`, one LPUSH of the wake-up. CPU: the server's processes "
            f"(master and workers), per recorded delivery.", "",
            report.md_table(rows, report.RECEIVER_COST_COLUMNS), "",
            f"Ratio: **{co['ratio']:.2f}×**.", ""]


def steady_block(r: dict[str, Any]) -> str:
    """The page's opening: the side-by-side table against the sync engine from this one run, then each
    broker's levels, the drain per broker and the receiver's cost if measured, the targets, and the
    before/after tables when the run compared revisions."""
    st = r["steady"]
    current, baseline = report.steady_sides(st)
    peer_runs = report.steady_peer(st)
    on = report.steady_brokers(st)
    names = " and ".join(report.BROKER_LABELS.get(b, b) for b in on)
    out = []
    if peer_runs:
        out += [f"## The whole stack against Stripe's sync engine (`steady`, on {names})", "",
                f"One run, the same stream for both at each level ({st['events_per_level']:,} events plus "
                f"{100 * st['redelivery_share']:.0f}% redeliveries), the same machine:", "",
                report.steady_side_by_side(st, markdown=True), ""]
    else:
        out += ["## The whole stack, before and after (`steady`)", ""]
    out += [*_run_line(r["meta"])]
    if baseline:
        old = baseline["label"]
        out += [f"Compared revision: `{baseline['commit']}` ({old}): its receiver, workers, sweep and migrations, "
                f"installed from a git worktree into a virtualenv of its own, run under this checkout's harness in "
                f"the same run, taking turns with the current revision per level ({old} c=1, current c=1, {old} "
                f"c=8, ...).", ""]
    out += [_steady_method(st), ""]
    if peer_runs:
        out += [_peer_method(st), "", f"### {st['peer']['package']}", "",
                report.steady_peer_table(st, markdown=True), ""]
    for broker in on:
        out += [f"### steady on {report.BROKER_LABELS.get(broker, broker)}, current revision", "",
                "CPU columns: ms per processed event.", "", report.steady_table(st, markdown=True, broker=broker), ""]
    out += _drain_lines(r) + _receiver_cost_lines(r)
    if baseline:
        old = baseline["label"]
        out += [f"### before/after: throughput and latency (ratio = current / {old})", "",
                report.steady_compare_table(st, report.STEADY_FIGURES, markdown=True), "",
                f"### before/after: CPU ms per processed event (ratio = current / {old})", "",
                report.steady_compare_table(st, report.STEADY_CPU_FIGURES, markdown=True), "",
                f"### before/after: traffic per processed event (ratio = current / {old})", "",
                report.steady_compare_table(st, report.STEADY_TRAFFIC_FIGURES, markdown=True), ""]
    out += [*_top_statements(current["runs"][-1]), *_targets_lines(r),
            "Targets of the earlier passes:", "",
            *(f"* {t}: {what} — **{'met' if ok else 'not met'}**" for t, what, ok in report.steady_targets(st).values()),
            "", "```", *(r.get("summaries", {}).get(name, "") for name in ("steady", "drain", "receiver-cost")
                          if r.get("summaries", {}).get(name)),
            report.targets_summary(r.get("targets") or report.issue_targets(r)), "```"]
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
                + ") processed by N `celery worker --concurrency 1` instances, then by the documented pools "
                  "(2 `celery -A workers worker --concurrency 2`), on each broker in turn; the limit is pgbench "
                  "with as many clients as pool processes running, per transaction, the statements a worker sends "
                  "for one event, on a fresh copy of the backlog. "
                + ("Each backlog drained to the end." if dr.get("full_drain") else
                   f"Rates over a {dr['window_s']:.0f} s window for the workers (after every worker is up) and "
                   f"{dr['pgbench_window_s']:.0f} s for pgbench, with the whole backlog in place."), "",
                report.md_table(report.drain_rows(dr), report.DRAIN_COLUMNS), "",
                *([*(f"* {line}" for line in report.drain_ratio_lines(dr)), ""] if report.drain_ratio_lines(dr)
                  else [])]
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
