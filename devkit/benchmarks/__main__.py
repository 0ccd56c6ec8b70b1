"""ops/bench <scenario>|all [--quick]: see docs/benchmarks.md."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from devkit.procs import REPO
from devkit.stack import DEFAULT_RECEIVER_SERVER, DEFAULT_THREADS, RECEIVER_SERVERS

from . import brokers, report
from .scenarios import ALL, INTERLEAVED, SCENARIOS, Bench, Options, log

DOCS = REPO / "docs"


def _loadavg() -> tuple[float, float, float]:
    with open("/proc/loadavg") as fh:
        one, five, fifteen = fh.read().split()[:3]
    return float(one), float(five), float(fifteen)


class LoadSampler(threading.Thread):
    """The machine's 1-minute load average every 5 s while the benchmark runs (ours included)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append(_loadavg()[0])
            self._halt.wait(5)

    def stop(self) -> dict:
        self._halt.set()
        self.join(timeout=10)
        s = self.samples or [0.0]
        return {"min": min(s), "mean": sum(s) / len(s), "max": max(s), "samples": len(s)}


def wait_for_quiet(threshold: float, max_wait_s: float) -> tuple[float, float, float]:
    deadline = time.monotonic() + max_wait_s
    while True:
        load = _loadavg()
        if load[0] < threshold or time.monotonic() >= deadline:
            return load
        log(f"load average {load[0]:.2f} >= {threshold}: waiting for a quieter machine "
            f"({deadline - time.monotonic():.0f}s left)")
        time.sleep(min(30, max(1, deadline - time.monotonic())))


def machine() -> dict:
    info = {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()}
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu_model"] = next((l.split(":", 1)[1].strip() for l in fh if l.startswith("model name")), "?")
        with open("/proc/meminfo") as fh:
            info["memory_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    for tool, cmd in (("postgres", ["pgbench", "--version"]), ("wrk", ["wrk", "--version"]),
                      ("redis", ["redis-server", "--version"])):
        try:
            info[tool] = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info[tool] = "?"
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.split("\n")
        info["git_dirty"] = [l[3:] for l in dirty if l.strip()]
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ops/bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="scenarios: " + ", ".join(SCENARIOS) + "; 'all' runs "
                                            + ", ".join(ALL))
    parser.add_argument("scenario", nargs="?", help="all, or one or more of " + ", ".join(SCENARIOS) + " (comma-separated)")
    parser.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                        help="run nothing: write docs/benchmarks.md's results and the plots from a saved results.json")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, every code path (a few minutes): a smoke run, not a measurement")
    parser.add_argument("--out", type=Path, help="directory for results.json, logs and profiles "
                                                 "(default: a new /tmp/ledger-bench-* directory)")
    parser.add_argument("--docs", action=argparse.BooleanOptionalAction, default=None,
                        help="write docs/benchmarks.md's results section and docs/benchmarks*.png "
                             "(default: on for a full 'all' run)")
    parser.add_argument("--wait-load", type=float, default=None, metavar="LOAD",
                        help="first wait (up to --wait-max seconds) until the 1-minute load average is below LOAD")
    parser.add_argument("--wait-max", type=float, default=900)
    parser.add_argument("--levels", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="ingest concurrency levels (default 1,8,32,64)")
    parser.add_argument("--workers", dest="worker_counts", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="drain worker counts (default 1,2,4)")
    parser.add_argument("--drain-events", type=int)
    parser.add_argument("--drain-seconds", dest="drain_s", type=float,
                        help="measuring window of each drain run (default 12; the backlog stays 20,000)")
    parser.add_argument("--full-drain", action="store_true", default=None,
                        help="drain each backlog to the end instead of measuring a window (slow)")
    parser.add_argument("--history-events", type=int)
    parser.add_argument("--ingest-seconds", dest="ingest_s", type=float)
    parser.add_argument("--receiver", dest="receiver_server", choices=RECEIVER_SERVERS,
                        help=f"the receiver's WSGI server (default {DEFAULT_RECEIVER_SERVER}, as documented; "
                             "--receiver-threads alone means gunicorn-gthread)")
    parser.add_argument("--receiver-workers", type=int, help="receiver worker processes (default 2, as documented)")
    parser.add_argument("--receiver-threads", type=int,
                        help="threads per receiver worker: gthread's, or granian's blocking threads "
                             "(default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_THREADS.items()) + ")")
    parser.add_argument("--burst-worker-nice", type=int, help="nice level of the burst's workers (default 0)")
    parser.add_argument("--steady-levels", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="steady concurrency levels (default 1,8,32)")
    parser.add_argument("--steady-events", type=int,
                        help="steady: events per level, plus 5%% redeliveries (default 6000; --quick 600)")
    parser.add_argument("--payload", dest="steady_payload", choices=("snapshot", "thin", "both", "held"),
                        default="snapshot",
                        help="steady: snapshot events (default), their thin twins (POSTed to /webhooks/stripe/thin; "
                             "the workers fetch each from a fake Stripe API process the bench starts), or both, "
                             "taking turns per level; held: snapshot events twice per level, the second time with a "
                             "REPEATABLE READ transaction held open on the ledger for the whole run")
    parser.add_argument("--thin-snapshot-twin", action=argparse.BooleanOptionalAction, default=None,
                        help="steady --payload thin|both: the v2 events the workers fetch name the snapshot event "
                             "of the same change (snapshot_event), as Stripe's do when it has one (default: on)")
    parser.add_argument("--fake-latency-ms", dest="thin_latency_ms", type=float, default=0.0,
                        help="steady --payload thin|both: the fake Stripe API answers each request after this long "
                             "(Stripe takes 100-400 ms; default 0)")
    parser.add_argument("--fetch-concurrency", type=int,
                        help="steady --payload thin|both: the workers' STRIPE_FETCH_CONCURRENCY (default: its default)")
    parser.add_argument("--broker", choices=(*brokers.BROKERS, "both"), default="redis",
                        help="the broker the stack runs on: the private Redis (default, as docs/configuration.md runs it), RabbitMQ "
                             "(the machine's, 127.0.0.1:5672, on a vhost of the run's own; CELERY_BROKER_URL), or "
                             "both: steady and drain then run on each, taking turns, and every other scenario on "
                             "Redis")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=None,
                        help="steady: run Stripe's sync engine (@stripe/sync-engine, npm, on the machine's Node) on "
                             "the same stream at each level, for the ratio to it; installed once into "
                             "~/.cache/stripe-ledger-bench (default: on when node and npm are on PATH; --peer "
                             "requires them)")
    parser.add_argument("--receiver-cost-requests", type=int,
                        help="receiver-cost: deliveries per measured run (default 4000; --quick 1500)")
    parser.add_argument("--compare", metavar="REV",
                        help="also run git revision REV's product (receiver, workers, sweep, migrations) under this "
                             "harness, in the same run: steady takes turns per level, any other scenario runs once "
                             "per revision; tables show both and the ratio current/REV")
    parser.add_argument("--floor", metavar="REV", nargs="?", const="HEAD",
                        help="steady: also run a floor, commit REV's product (default: HEAD's committed tree, "
                             "not the working tree's uncommitted changes) with one '*' handler that writes "
                             "nothing in place of the built-in handlers, taking turns per level with this "
                             "checkout (and --compare's REV); reports the business writes' CPU and statements "
                             "per event as this checkout's minus the floor's. Other scenarios run without it")
    args = parser.parse_args(argv)
    if args.render:
        from .docs import write

        results = json.loads(args.render.read_text())
        results["summaries"] = {name: report.summary(name, results[name])[1]
                                for name in results.get("summaries", {}) if name in results}
        results["targets"] = report.issue_targets(results)
        print(report.targets_table(results["targets"]))
        for line in results["summaries"].values():
            print(line)
        for written in write(results, DOCS):
            log(f"wrote {written}")
        return 0
    if not args.scenario:
        parser.error("name a scenario, or all")
    for flag, given in (("--compare", args.compare), ("--floor", args.floor)):
        if args.steady_payload != "snapshot" and given:
            parser.error(f"--payload thin|both measures this checkout only: it cannot be combined with {flag}")

    out = args.out or Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    opts = Options.make(args.quick, out, levels=args.levels, worker_counts=args.worker_counts,
                        drain_events=args.drain_events, history_events=args.history_events, ingest_s=args.ingest_s,
                        drain_s=args.drain_s, full_drain=args.full_drain,
                        receiver_server=args.receiver_server, receiver_workers=args.receiver_workers,
                        receiver_threads=args.receiver_threads,
                        burst_worker_nice=args.burst_worker_nice, steady_levels=args.steady_levels,
                        steady_events=args.steady_events, steady_payload=args.steady_payload,
                        thin_snapshot_twin=args.thin_snapshot_twin, thin_latency_ms=args.thin_latency_ms,
                        fetch_concurrency=args.fetch_concurrency,
                        compare=args.compare, floor=args.floor, brokers=brokers.choices(args.broker), peer=args.peer,
                        receiver_cost_requests=args.receiver_cost_requests)
    names = list(ALL) if args.scenario == "all" else [n.strip() for n in args.scenario.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        parser.error(f"unknown scenario(s) {', '.join(unknown) or '(none)'}: choose all or "
                     + ", ".join(SCENARIOS))
    # A full 'all' run rewrites the results section; a full steady run beside the sync engine (or with
    # --compare) the opening one.
    write_docs = args.docs if args.docs is not None else (
        not args.quick and (args.scenario == "all"
                            or ("steady" in names and (args.peer is not False or bool(args.compare)))))

    load_before = wait_for_quiet(args.wait_load, args.wait_max) if args.wait_load else _loadavg()
    meta = {"command": "ops/bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "scenarios": names, "all": args.scenario == "all",
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
            "load_before": load_before, "options": {k: (str(v) if isinstance(v, Path) else v)
                                                     for k, v in vars(opts).items()}}
    log(f"results and logs in {out}; load average before: {load_before[0]:.2f} {load_before[1]:.2f} "
        f"{load_before[2]:.2f}")
    bench = Bench(opts)
    bench.cleanup.install_signal_handlers()
    sampler = LoadSampler()
    sampler.start()
    started = time.monotonic()
    summaries: dict[str, str] = {}
    status = 0
    try:
        bench.start()
        for name in names:
            t0 = time.monotonic()
            baseline = bench.baseline
            compared = None
            if baseline is not None and name not in INTERLEAVED:
                with bench.using(baseline):
                    compared = SCENARIOS[name](bench)
                    bench.results[name] = compared
            result = SCENARIOS[name](bench)
            result["wall_s"] = time.monotonic() - t0
            bench.results[name] = result
            text, line = report.summary(name, result)
            summaries[name] = line
            if compared is not None:
                old_line = report.summary(name, compared)[1]
                text += (f"\n\n{baseline.label} (the compared revision):\n{old_line}\n\nbefore/after:\n"
                         + report.compare_table(line, old_line, baseline.label))
            print(f"\n== {name} ({result['wall_s']:.0f}s) ==\n{text}\n{line}\n", flush=True)
    except KeyboardInterrupt:
        log("interrupted: stopping everything this run started")
        status = 130
    finally:
        bench.finish()
        bench.cleanup.run()
        meta["wall_s"] = time.monotonic() - started
        meta["load_during"] = sampler.stop()
        meta["load_after"] = _loadavg()
        baseline = bench.baseline
        if baseline is not None:
            meta["compared"] = {"label": baseline.label, "commit": baseline.revision.commit}
            bench.results["compared"] = {k: v for k, v in baseline.results.items() if not k.startswith("_")}
        floor = next((s.revision for s in bench.sides if s.revision.floor), None)
        if floor is not None:
            meta["floor"] = {"label": floor.label, "commit": floor.commit}
        bench.results["meta"] = meta
        bench.results["summaries"] = summaries
        bench.results["peak_rss_mb"] = bench.peak_rss
        bench.results["targets"] = report.issue_targets(bench.results)
        path = out / "results.json"
        path.write_text(json.dumps(bench.results, indent=2, default=str))
    if status == 0:
        print(f"\n== targets ({report.TARGETS_SOURCE}) ==\n{report.targets_table(bench.results['targets'])}\n")
        for line in summaries.values():
            print(line)
        print(report.targets_summary(bench.results["targets"]))
        ld = meta["load_during"]
        print(f"SUMMARY run wall_s={meta['wall_s']:.0f} load_min={ld['min']:.2f} load_mean={ld['mean']:.2f} "
              f"load_max={ld['max']:.2f} results={path}")
        if write_docs:
            from .docs import write

            for written in write(bench.results, DOCS):
                log(f"wrote {written}")
    return status


if __name__ == "__main__":
    sys.exit(main())
