"""The load generator: wrk replaying pre-signed deliveries through a Lua script.

Every request is built (re-issued event id, body, Stripe-Signature) before wrk
starts, so the load generator does no JSON or HMAC work while it measures: its
own CPU time is reported next to each run. wrk is closed-loop: ``c`` connections,
each sending its next request when the previous answer arrived; latencies are
measured by wrk from sending a request to its complete answer (the ack).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .payloads import SignedDelivery

# Each request is sent once. The receiver's sync workers close every connection after
# answering, so wrk reconnects before each request: a thread that has sent all its
# requests stops at the next answer (an idle connection would pin a sync worker
# until its timeout). The last requests still in flight then (fewer than the
# connections) are answered by the receiver but not timed: callers that need every
# delivery acknowledged wait for the ledger rows. wrk itself sleeps until -d is
# over whatever its threads do, so a finished thread leaves a marker file and the
# driver interrupts wrk (SIGINT: wrk prints what it measured and exits).
LUA = r"""
local reqs = {}
local n = 0
local sent = 0
local answered = 0

function setup(thread)
  thread:set("id", tostring(__thread_counter or 0))
  __thread_counter = (__thread_counter or 0) + 1
end

function init(args)
  verifying = (id == "0")
  marker = args[2] .. "." .. id
  local path = args[1] .. "." .. id
  local f = assert(io.open(path, "rb"))
  while true do
    local path = f:read("*l")
    if not path then break end
    local sig = f:read("*l")
    local len = tonumber(f:read("*l"))
    local body = f:read(len)
    f:read(1)
    n = n + 1
    reqs[n] = wrk.format("POST", path,
                         {["Content-Type"] = "application/json", ["Stripe-Signature"] = sig}, body)
  end
  f:close()
end

function request()
  if verifying then
    -- wrk calls request() once on thread 0 to check the script and never sends it.
    verifying = false
    return reqs[1] or wrk.format("GET", "/healthz")
  end
  if sent >= n then
    return ""
  end
  sent = sent + 1
  return reqs[sent]
end

function response(status, headers, body)
  answered = answered + 1
  if sent >= n and not finished then
    -- wrk's main thread sleeps out the whole -d: the driver sees this file and sends SIGINT.
    finished = true
    local f = io.open(marker, "w")
    f:write(tostring(answered))
    f:close()
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local p = function(q) return latency:percentile(q) end
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},' ..
    '"latency_us":{"p50":%d,"p90":%d,"p95":%d,"p99":%d,"max":%d,"mean":%.1f}}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    p(50), p(90), p(95), p(99), latency.max, latency.mean))
end
"""


@dataclass
class WrkResult:
    connections: int
    requests: int
    duration_s: float
    rps: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    errors: int
    error_detail: dict = field(default_factory=dict)
    wrk_cpu_s: float = 0.0
    started_at: float = 0.0
    ended_at: float = 0.0

    @property
    def wrk_cpu_pct(self) -> float:
        return 100.0 * self.wrk_cpu_s / self.duration_s if self.duration_s else 0.0


class Wrk:
    def __init__(self, work_dir: Path, threads: int = 1):
        self.work_dir = work_dir
        self.threads = threads
        self.binary = shutil.which("wrk")
        if not self.binary:
            raise RuntimeError("wrk not found: apt-get install -y wrk")
        self.script = work_dir / "replay.lua"
        self.script.write_text(LUA)
        self._runs = 0

    def write_requests(self, deliveries: list[SignedDelivery], threads: int) -> Path:
        """Split the deliveries over the threads' files (per request: endpoint, signature, length, body);
        returns the path prefix."""
        self._runs += 1
        prefix = self.work_dir / f"requests-{self._runs}"
        for t in range(threads):
            with open(f"{prefix}.{t}", "wb") as fh:
                for d in deliveries[t::threads]:
                    data = d.body.encode()
                    fh.write(d.path.encode() + b"\n" + d.signature.encode() + b"\n" + str(len(data)).encode()
                             + b"\n" + data + b"\n")
        return prefix

    def run(self, port: int, deliveries: list[SignedDelivery], connections: int, *,
            max_duration_s: float = 600, stop_when=None, poll_s: float = 0.2) -> WrkResult:
        """Send every delivery once over ``connections`` connections; stops early at SIGINT
        when ``stop_when()`` becomes true (wrk then reports what it measured so far)."""
        threads = max(1, min(self.threads, connections))
        prefix = self.write_requests(deliveries, threads)
        markers = [Path(f"{prefix}.done.{t}") for t in range(threads)]
        cmd = [self.binary, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, int(max_duration_s))}s",
               "--timeout", "30s", "-s", str(self.script), f"http://127.0.0.1:{port}", "--", str(prefix),
               f"{prefix}.done"]
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            last_check, interrupted_at, last_sigint, usage, status = 0.0, None, 0.0, None, 0
            while usage is None:
                pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    usage = rusage
                    break
                if interrupted_at is None:
                    done = all(m.exists() for m in markers)
                    if not done and stop_when is not None and time.monotonic() - last_check >= poll_s:
                        last_check = time.monotonic()
                        done = stop_when()
                    if done:
                        proc.send_signal(signal.SIGINT)
                        interrupted_at = last_sigint = time.monotonic()
                elif time.monotonic() - interrupted_at > 60:
                    os.killpg(proc.pid, signal.SIGKILL)
                elif time.monotonic() - last_sigint >= 1:
                    # Until wrk has loaded its requests and installed its handler, SIGINT is
                    # lost (ignored when this runs as a background job): ask again.
                    proc.send_signal(signal.SIGINT)
                    last_sigint = time.monotonic()
                time.sleep(0.01)
            proc.returncode = os.waitstatus_to_exitcode(status)
        except BaseException:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
        ended = time.time()
        output = proc.stdout.read().decode(errors="replace")
        proc.stdout.close()
        for t in range(threads):
            Path(f"{prefix}.{t}").unlink(missing_ok=True)
            markers[t].unlink(missing_ok=True)
        line = next((l for l in output.splitlines() if l.startswith("BENCH_JSON ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result (exit {proc.returncode}):\n{output[-2000:]}")
        data = json.loads(line[len("BENCH_JSON "):])
        duration = data["duration_us"] / 1e6
        lat = data["latency_us"]
        errors = sum(data["errors"].values())
        return WrkResult(connections=connections, requests=data["requests"], duration_s=duration,
                         rps=data["requests"] / duration if duration else 0.0,
                         p50_ms=lat["p50"] / 1000, p90_ms=lat["p90"] / 1000, p95_ms=lat["p95"] / 1000,
                         p99_ms=lat["p99"] / 1000, max_ms=lat["max"] / 1000, mean_ms=lat["mean"] / 1000,
                         errors=errors, error_detail=data["errors"],
                         wrk_cpu_s=usage.ru_utime + usage.ru_stime, started_at=started, ended_at=ended)
