"""wrk, closed-loop (``c`` connections, each sending on the previous answer), replaying deliveries signed beforehand:
no JSON or HMAC work while it measures (its CPU is reported); latency is from sending a request to its answer."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .payloads import SignedDelivery

# Each request is sent once. A thread that has sent all stops at the next answer (an idle connection would pin a sync
# worker; those still in flight are answered, not timed) and leaves a marker file: wrk sleeps out -d whatever its
# threads do, so the driver then interrupts it (SIGINT: wrk prints what it measured and exits).
LUA = r"""
local reqs, n, sent, answered = {}, 0, 0, 0

function setup(thread)
  thread:set("id", tostring(__thread_counter or 0))
  __thread_counter = (__thread_counter or 0) + 1
end

function init(args)
  verifying, marker = (id == "0"), args[2] .. "." .. id
  local f = assert(io.open(args[1] .. "." .. id, "rb"))
  while true do
    local path, sig, len = f:read("*l", "*l", "*l")
    if not path then break end
    local body = f:read(tonumber(len), 1)  -- the body, then its newline
    n = n + 1
    reqs[n] = wrk.format("POST", path, {["Content-Type"] = "application/json", ["Stripe-Signature"] = sig}, body)
  end
  f:close()
end

function request()
  if verifying then  -- wrk calls request() once on thread 0 to check the script and never sends it
    verifying = false
    return reqs[1] or wrk.format("GET", "/healthz")
  end
  if sent >= n then return "" end
  sent = sent + 1
  return reqs[sent]
end

function response(status, headers, body)
  answered = answered + 1
  if sent >= n and not finished then
    finished = true
    local f = io.open(marker, "w")
    f:write(tostring(answered))
    f:close()
    wrk.thread:stop()
  end
end

function done(summary, latency, requests)
  local p, e = function(q) return latency:percentile(q) end, summary.errors
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
        self.work_dir, self.threads, self.binary, self._runs = work_dir, threads, shutil.which("wrk"), 0
        if not self.binary:
            raise RuntimeError("wrk not found: apt-get install -y wrk")
        self.script = work_dir / "replay.lua"
        self.script.write_text(LUA)

    def write_requests(self, deliveries: list[SignedDelivery], threads: int) -> Path:
        """The deliveries split over the threads' files (each: path, signature, length, body); the path prefix."""
        self._runs += 1
        prefix = self.work_dir / f"requests-{self._runs}"
        for t in range(threads):
            with open(f"{prefix}.{t}", "wb") as fh:
                for d in deliveries[t::threads]:
                    data = d.body.encode()
                    fh.write(b"\n".join([d.path.encode(), d.signature.encode(), str(len(data)).encode(), data, b""]))
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
            last_check, interrupted_at, last_sigint = 0.0, None, 0.0
            while not (waited := os.wait4(proc.pid, os.WNOHANG))[0]:
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
                elif time.monotonic() - last_sigint >= 1:  # SIGINT is lost until wrk has its handler: ask again
                    proc.send_signal(signal.SIGINT)
                    last_sigint = time.monotonic()
                time.sleep(0.01)
            _, status, usage = waited
            proc.returncode = os.waitstatus_to_exitcode(status)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        ended = time.time()
        output = proc.stdout.read().decode(errors="replace")
        proc.stdout.close()
        for path in [*markers, *(Path(f"{prefix}.{t}") for t in range(threads))]:
            path.unlink(missing_ok=True)
        line = next((l for l in output.splitlines() if l.startswith("BENCH_JSON ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result (exit {proc.returncode}):\n{output[-2000:]}")
        data = json.loads(line[len("BENCH_JSON "):])
        duration = data["duration_us"] / 1e6
        return WrkResult(connections=connections, requests=data["requests"], duration_s=duration,
                         rps=data["requests"] / duration if duration else 0.0,
                         **{f"{key}_ms": us / 1000 for key, us in data["latency_us"].items()},
                         errors=sum(data["errors"].values()), error_detail=data["errors"],
                         wrk_cpu_s=usage.ru_utime + usage.ru_stime, started_at=started, ended_at=ended)
