"""Driving a fake Stripe API that runs in another process: its control endpoints, and the process itself."""
from __future__ import annotations

import json
import os
import re
import secrets
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Mapping

from devkit.procs import Process, wait_until
from devkit.stripe_api.fake import DEFAULT_API_KEY, Request


class FakeStripeControl:
    """The control endpoints of a fake at ``base_url``, with FakeStripe's method names."""

    def __init__(self, base_url: str, timeout_s: float = 10.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _call(self, method: str, name: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode() if method == "POST" else None
        request = urllib.request.Request(f"{self.base_url}/_fake/{name}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise RuntimeError(f"fake Stripe control {name}: {exc.code} {detail}") from None

    def reset(self) -> None:
        self._call("POST", "reset")

    def add_event(self, event: dict[str, Any], account: str | None = None, delivered: bool = True) -> None:
        self.add_events([event], account=account, delivered=delivered)

    def add_events(self, events: Iterable[dict[str, Any]], account: str | None = None,
                   delivered: bool = True) -> None:
        self._call("POST", "events", {"events": list(events), "account": account, "delivered": delivered})

    def add_v2_event(self, event: dict[str, Any], account: str | None = None) -> None:
        self._call("POST", "v2_events", {"event": event, "account": account})

    def put_object(self, obj: dict[str, Any], account: str | None = None) -> None:
        self.put_objects([obj], account=account)

    def put_objects(self, objs: Iterable[dict[str, Any]], account: str | None = None) -> None:
        self._call("POST", "objects", {"objects": list(objs), "account": account})

    def delete_object(self, object_id: str, account: str | None = None) -> None:
        self._call("POST", "objects/delete", {"id": object_id, "account": account})

    def fail_next(self, n: int, status: int = 429, retry_after: float | None = None,
                  path_prefix: str | None = None) -> None:
        self._call("POST", "faults", {"kind": "fail", "n": n, "status": status, "retry_after": retry_after,
                                      "path_prefix": path_prefix})

    def slow_next(self, n: int, seconds: float, path_prefix: str | None = None) -> None:
        self._call("POST", "faults", {"kind": "slow", "n": n, "seconds": seconds, "path_prefix": path_prefix})

    def clear_faults(self) -> None:
        self._call("POST", "faults/clear")

    @property
    def now(self) -> float:
        return self._call("GET", "clock")["now"]

    @now.setter
    def now(self, value: float | None) -> None:
        self.set_now(value)

    def set_now(self, now: float | None) -> None:
        self._call("POST", "clock", {"now": now})

    def advance(self, seconds: float) -> float:
        return self._call("POST", "clock", {"advance": seconds})["now"]

    @property
    def requests(self) -> list[Request]:
        return [Request(**r) for r in self._call("GET", "requests")["requests"]]

    def clear_requests(self) -> None:
        self._call("POST", "requests/clear")


class FakeStripeProcess(Process):
    """``python -m devkit.stripe_api`` in a process group of its own, its output in ``log_dir``."""

    def __init__(self, log_dir: Path, *, port: int = 0, api_key: str = DEFAULT_API_KEY,
                 state: Path | None = None, env: Mapping[str, str] | None = None, latency_ms: float = 0.0):
        cmd = [sys.executable, "-m", "devkit.stripe_api", "--port", str(port), "--api-key", api_key]
        if state is not None:
            cmd += ["--state", str(state)]
        if latency_ms:
            cmd += ["--latency-ms", str(latency_ms)]
        self.api_key = api_key
        self.base_url: str | None = None
        super().__init__("fake-stripe", cmd, env if env is not None else os.environ,
                         Path(log_dir) / f"fake-stripe-{port or secrets.token_hex(3)}.log")

    def start(self, timeout_s: float = 30.0) -> "FakeStripeProcess":
        super().start()

        def announced() -> str | None:
            self.ensure_alive()
            found = re.search(r"^(http://127\.0\.0\.1:\d+)$", self.log(), re.MULTILINE)
            return found.group(1) if found else None
        self.base_url = wait_until(announced, timeout_s=timeout_s, what="the fake Stripe API to print its URL")
        return self

    @property
    def control(self) -> FakeStripeControl:
        if self.base_url is None:
            raise RuntimeError("start() the fake Stripe API first")
        return FakeStripeControl(self.base_url)
