"""profile: py-spy (sampling, non-blocking) on the warmed-up receiver during ingest at c=8, and on one
worker (its main and pool processes) during a drain; frames by inclusive and own share of samples."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

from devkit.benchmarks.runner import Bench, table, wait_drained
from devkit.benchmarks.workload import load_received
from devkit.procs import venv_tool

_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:)]+)(?::\d+)?\)$")
# Waiting, not working (unless under the receiver's or the processor's own frames).
IDLE = ("select (", "poll (", "epoll", "accept (", "wait (selectors", "sleep (", "_wait_for_tstate_lock",
        "readinto (socket", "get (queue", "wait (threading")


def _frame(raw: str) -> str:
    m = _FRAME.match(raw.strip())
    if not m:
        return raw.strip()
    path = m["file"]
    for marker in ("site-packages/", "/work/main/", "lib/python3.11/"):
        path = path.split(marker, 1)[1] if marker in path else path
    return f"{m['func']} ({path})"


def collapse(paths: list[Path]) -> dict[str, Any]:
    """Inclusive and own shares of py-spy raw profiles, idle samples dropped."""
    inclusive: Counter = Counter()
    own: Counter = Counter()
    total = 0
    for line in (l for p in paths if p.exists() for l in p.read_text(errors="replace").splitlines()):
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f]
        if not count.isdigit() or not frames:
            continue
        if any(m in frames[-1] for m in IDLE) and not any("webhooks.py" in f or "processor.py" in f for f in frames):
            continue
        total += int(count)
        for name in {_frame(f) for f in frames}:
            inclusive[name] += int(count)
        own[_frame(frames[-1])] += int(count)
    top = lambda c: [{"frame": k, "share": 100.0 * v / total} for k, v in c.most_common(60)]  # noqa: E731
    return {"samples": total, "inclusive": top(inclusive), "self": top(own)}


def _spy(pids: list[int], seconds: float, out: Path) -> list[tuple[subprocess.Popen, Path]]:
    """One py-spy per process (--subprocesses misses gunicorn's workers)."""
    pyspy = shutil.which("py-spy") or venv_tool("py-spy")
    raws = [(pid, out.with_name(f"{out.stem}-{pid}.txt")) for pid in pids]
    return [(subprocess.Popen([pyspy, "record", "--pid", str(pid), "--nonblocking", "--rate", "100", "--format", "raw",
                               "--duration", str(int(seconds)), "-o", str(raw)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True), raw) for pid, raw in raws]


def _collect(spies: list[tuple[subprocess.Popen, Path]]) -> dict[str, Any]:
    for proc, _ in spies:
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    raws = [raw for _, raw in spies if raw.exists()]
    return {"profile": collapse(raws), "raw": [str(p) for p in raws]}


def run(b: Bench) -> dict[str, Any]:
    rc = b.receiver()
    b.clear()
    seconds = 6 if b.opts.quick else 12
    b.wrk.run(rc.port, b.deliveries(b.templates, 600, seed=30), 8, max_duration_s=30)  # warm-up
    spies = _spy(rc.children(), seconds, b.work / "profile-receiver.txt")
    time.sleep(0.5)
    r = b.wrk.run(rc.port, b.deliveries(b.templates, int(400 * seconds), seed=31), 8, max_duration_s=seconds - 1)
    out = {"receiver": {"rps": r.rps, **_collect(spies)}}
    b.clear()
    n = 3000 if b.opts.quick else 8000
    events = b.source.backlog(n)
    load_received(b.db.url, events)
    with b.fleet(1) as fleet:
        b.push_wakeups([e.id for e in events[:200]])  # warm-up
        wait_drained(b, 120, remaining=n - 200, fail=False, poll_s=0.1)
        pids = fleet.pids()
        spies = _spy(pids["worker main"] + pids["worker pool process"], seconds, b.work / "profile-worker.txt")
        time.sleep(0.5)
        b.push_wakeups([e.id for e in events[200:]])
        out["worker"] = _collect(spies)
    b.clear()
    return out


def report(result: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    parts = []
    for who in ("receiver", "worker"):
        for kind, top in (("inclusive", 25), ("self", 12)):
            parts += [f"{who}: top frames by {kind} share of samples",
                      table(result[who]["profile"][kind][:top], [("share", f"{kind} %", ".1f"), ("frame", "", "")])]
    return "\n".join(parts), {"receiver_samples": result["receiver"]["profile"]["samples"],
                              "worker_samples": result["worker"]["profile"]["samples"],
                              "receiver_rps": result["receiver"]["rps"]}
