"""The fake's state per account, its clock, faults and request log, and how it answers the Stripe API."""
from __future__ import annotations

import base64
import contextlib
import itertools
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

from devkit.stripe_api.params import (PAGING, ApiError, bad_param, boolean, check_known, copy_json, created_matcher,
                                      missing, page, string, string_list)
from devkit.stripe_api.resources import COLLECTIONS, Collection
from devkit.stripe_api.server import Handler, Server

DEFAULT_API_KEY = "sk_test_fake"
EVENT_RETENTION_S = 30 * 86400  # Stripe lists and retrieves events of the last 30 days only
MAX_TYPES = 20


def _iso_seconds(value: Any) -> float:
    """A v2 time (ISO 8601 with its zone: 2026-11-30T10:00:00.123Z) in unix seconds; ValueError otherwise."""
    when = datetime.fromisoformat(value) if isinstance(value, str) else None
    if when is None or when.tzinfo is None:
        raise ValueError(f"a v2 event's created is an ISO 8601 time with its zone, not {value!r}")
    return when.timestamp()


class Request(NamedTuple):
    """One request the fake answered: query decoded the way Stripe does ({"types": [...], "created": {...}})."""
    method: str
    path: str
    query: dict[str, Any]
    account: str | None  # from Stripe-Account or Stripe-Context; None = the platform
    status: int | None  # None while the answer is still being made (a slow fault)


@dataclass
class _Stored:
    seq: int      # the order the fake received it: the tie-break among equal ``created``
    data: dict
    flag: bool    # events: delivered (delivery_success); objects: deleted

    @property
    def key(self) -> tuple[int, int]:
        return int(self.data.get("created") or 0), self.seq


@dataclass
class Fault:
    kind: str  # "fail" or "slow"
    remaining: int
    path_prefix: str
    status: int = 500
    retry_after: float | None = None
    seconds: float = 0.0


class FakeStripe:
    """The fake's state (per account: events, v2 events, objects), its faults, clock and request log; its server."""

    def __init__(self, api_key: str = DEFAULT_API_KEY, *, latency_s: float = 0.0):
        self.api_key = api_key
        # Every answer waits this long (Stripe takes 100-400 ms): for benchmarks of what waits on it.
        self.latency_s = float(latency_s)
        self._lock = threading.RLock()
        self._seq = itertools.count(1)
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.reset()

    # -- the server --

    @classmethod
    @contextlib.contextmanager
    def serving(cls, api_key: str = DEFAULT_API_KEY, *, port: int = 0) -> Iterator["FakeStripe"]:
        fake = cls(api_key)
        fake.start(port)
        try:
            yield fake
        finally:
            fake.stop()

    def start(self, port: int = 0, host: str = "127.0.0.1") -> "FakeStripe":
        self._stopping.clear()
        self._server = Server((host, port), Handler)
        self._server.fake = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-stripe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._stopping.set()  # wakes answers sleeping in a slow fault
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = self._thread = None

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake Stripe API is not running (start() it first)")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- state --

    def reset(self) -> None:
        """Forget every event, object, fault and request; back to the wall clock."""
        with self._lock:
            self._events: dict[str | None, dict[str, _Stored]] = {}
            self._v2_events: dict[str | None, dict[str, dict]] = {}
            self._objects: dict[str | None, dict[str, _Stored]] = {}
            self._faults: list[Fault] = []
            self._requests: list[Request] = []
            self._frozen_now: float | None = None

    def add_event(self, event: dict[str, Any], account: str | None = None, delivered: bool = True) -> None:
        """Store an event (upsert by id; a new id sorts after every earlier one of the same second).

        ``account`` defaults to the event's own ``account`` field: Stripe lists a connected account's
        events only to requests made with its Stripe-Account header.
        """
        account = account or event.get("account")
        if event.get("account") not in (None, account):
            raise ValueError(f"event {event.get('id')} belongs to {event['account']}, not {account}")
        data = copy_json(event)
        if not isinstance(data.get("id"), str) or not isinstance(data.get("created"), int):
            raise ValueError("an event needs a string id and an integer created")
        if account:
            data["account"] = account
        with self._lock:
            events = self._events.setdefault(account, {})
            old = events.get(data["id"])
            events[data["id"]] = _Stored(old.seq if old else next(self._seq), data, bool(delivered))

    def add_events(self, events: Iterable[dict[str, Any]], account: str | None = None,
                   delivered: bool = True) -> None:
        for event in events:
            self.add_event(event, account=account, delivered=delivered)

    def add_v2_event(self, event: dict[str, Any], account: str | None = None) -> None:
        """Store what ``GET /v2/core/events/{id}`` answers (upsert by id), e.g. ``factories.v2_event(...)``.

        ``account`` defaults to the event's ``context``: Stripe serves it only to requests made in that
        context. Its ``created`` (ISO 8601) puts it in the 30-day window; one without ``created`` is
        served whatever the clock says.
        """
        account = account or event.get("context")
        if event.get("context") not in (None, account):
            raise ValueError(f"v2 event {event.get('id')} belongs to {event['context']}, not {account}")
        data = copy_json(event)
        if not isinstance(data.get("id"), str):
            raise ValueError("a v2 event needs a string id")
        if "created" in data:
            _iso_seconds(data["created"])
        with self._lock:
            self._v2_events.setdefault(account, {})[data["id"]] = data

    def put_object(self, obj: dict[str, Any], account: str | None = None) -> None:
        """Upsert by id; ``obj["object"]`` is its type. An update keeps its place in lists (its ``created``)."""
        data = copy_json(obj)
        if not isinstance(data.get("id"), str) or not isinstance(data.get("object"), str):
            raise ValueError("an object needs a string id and object")
        with self._lock:
            objects = self._objects.setdefault(account, {})
            old = objects.get(data["id"])
            objects[data["id"]] = _Stored(old.seq if old else next(self._seq), data, False)

    def put_objects(self, objs: Iterable[dict[str, Any]], account: str | None = None) -> None:
        for obj in objs:
            self.put_object(obj, account=account)

    def delete_object(self, object_id: str, account: str | None = None) -> None:
        """Gone from lists; a customer then retrieves as Stripe's deleted stub, anything else as 404."""
        with self._lock:
            stored = self._objects.get(account, {}).get(object_id)
            if stored is None:
                raise KeyError(f"no object {object_id} in account {account}")
            stored.flag = True

    def fail_next(self, n: int, status: int = 429, retry_after: float | None = None,
                  path_prefix: str | None = None) -> None:
        """Answer the next ``n`` matching requests with ``status`` (429 rate_limit, 5xx api_error, other 4xx)."""
        if not 400 <= int(status) <= 599:
            raise ValueError(f"a failure status is 4xx or 5xx, not {status}")
        with self._lock:
            self._faults.append(Fault("fail", int(n), path_prefix or "/", status=int(status),
                                       retry_after=retry_after))

    def slow_next(self, n: int, seconds: float, path_prefix: str | None = None) -> None:
        """Sleep ``seconds`` before answering each of the next ``n`` matching requests."""
        with self._lock:
            self._faults.append(Fault("slow", int(n), path_prefix or "/", seconds=float(seconds)))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def now(self) -> float:
        with self._lock:
            return self._frozen_now if self._frozen_now is not None else time.time()

    @now.setter
    def now(self, value: float | None) -> None:
        self.set_now(value)

    def set_now(self, now: float | None) -> None:
        """Freeze the fake's clock at ``now`` (unix seconds); None follows the wall clock again."""
        with self._lock:
            self._frozen_now = None if now is None else float(now)

    def advance(self, seconds: float) -> float:
        """Move the clock forward (freezing it there); returns the new now."""
        with self._lock:
            self._frozen_now = self.now + float(seconds)
            return self._frozen_now

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    def state(self) -> dict[str, Any]:
        """Events and objects as JSON, in the order received (what ``--state FILE`` keeps)."""
        with self._lock:
            accounts = sorted(set(self._events) | set(self._objects) | set(self._v2_events), key=str)
            return {"accounts": {account or "": {
                "events": [{"event": s.data, "delivered": s.flag}
                           for s in sorted(self._events.get(account, {}).values(), key=lambda s: s.seq)],
                "v2_events": list(self._v2_events.get(account, {}).values()),
                "objects": [{"object": s.data, "deleted": s.flag}
                            for s in sorted(self._objects.get(account, {}).values(), key=lambda s: s.seq)],
            } for account in accounts}}

    def load_state(self, state: Mapping[str, Any]) -> None:
        for key, content in state.get("accounts", {}).items():
            account = key or None
            for item in content.get("events", []):
                self.add_event(item["event"], account=account, delivered=item.get("delivered", True))
            for event in content.get("v2_events", []):
                self.add_v2_event(event, account=account)
            for item in content.get("objects", []):
                self.put_object(item["object"], account=account)
                if item.get("deleted"):
                    self.delete_object(item["object"]["id"], account=account)

    # -- answering (called by the handler's threads) --

    def _log(self, method: str, path: str, query: dict, account: str | None) -> int:
        with self._lock:
            self._requests.append(Request(method, path, query, account, None))
            return len(self._requests) - 1

    def _answered(self, index: int, status: int) -> None:
        with self._lock:
            if index < len(self._requests):  # clear_requests() may have run meanwhile
                self._requests[index] = self._requests[index]._replace(status=status)

    def _take_fault(self, kind: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.kind == kind and fault.remaining > 0 and path.startswith(fault.path_prefix):
                    fault.remaining -= 1
                    return fault
            return None

    def _authorize(self, header: str | None) -> None:
        if not header:
            raise ApiError(401, "You did not provide an API key. You need to provide your API key in the Authorization "
                                "header, using Bearer auth (e.g. 'Authorization: Bearer YOUR_SECRET_KEY').")
        scheme, _, credential = header.partition(" ")
        if scheme.lower() == "basic":
            with contextlib.suppress(ValueError):
                credential = base64.b64decode(credential).decode().partition(":")[0]
        if credential.strip() != self.api_key:
            shown = credential.strip()
            raise ApiError(401, f"Invalid API Key provided: {shown[:8]}{'*' * max(len(shown) - 12, 0)}{shown[-4:]}")

    def _answer(self, path: str, params: dict[str, Any], account: str | None) -> dict[str, Any]:
        if path.startswith("/v2/core/events/") and "/" not in path.removeprefix("/v2/core/events/"):
            check_known(params, set())
            return self._retrieve_v2_event(path.removeprefix("/v2/core/events/"), account)
        if not path.startswith("/v1/"):
            raise ApiError(404, f"Unrecognized request URL (GET: {path}).")
        rest = path.removeprefix("/v1/")
        with self._lock:
            if rest == "events":
                return self._list_events(params, account)
            if rest.startswith("events/") and "/" not in rest.removeprefix("events/"):
                check_known(params, {"expand"})
                return self._retrieve_event(rest.removeprefix("events/"), account)
            for name, collection in COLLECTIONS.items():
                if rest == name:
                    return self._list_objects(name, collection, params, account)
                tail = rest.removeprefix(name + "/")
                if rest.startswith(name + "/") and tail and "/" not in tail:
                    check_known(params, {"expand"})
                    return self._retrieve_object(collection, tail, account)
        raise ApiError(404, f"Unrecognized request URL (GET: {path}).")

    def _visible_events(self, account: str | None) -> list[_Stored]:
        oldest = self.now - EVENT_RETENTION_S
        return [s for s in self._events.get(account, {}).values() if s.data["created"] >= oldest]

    def _list_events(self, params: dict[str, Any], account: str | None) -> dict[str, Any]:
        check_known(params, PAGING | {"type", "types", "created", "delivery_success"})
        tests: list[Callable[[_Stored], bool]] = []
        if "type" in params and "types" in params:
            raise ApiError(400, "You may pass either type or types, but not both.", code="parameter_invalid",
                           param="types")
        if "type" in params:
            pattern = re.compile(".*".join(re.escape(part) for part in string("type", params["type"]).split("*")))
            tests.append(lambda s: bool(pattern.fullmatch(s.data.get("type", ""))))
        if "types" in params:
            types = set(string_list("types", params["types"]))
            if len(params["types"]) > MAX_TYPES:
                raise bad_param("types", f"Invalid types: at most {MAX_TYPES} event types")
            tests.append(lambda s: s.data.get("type") in types)
        if "created" in params:
            created = created_matcher(params["created"])
            tests.append(lambda s: created(s.data["created"]))
        if "delivery_success" in params:
            delivered = boolean("delivery_success", params["delivery_success"])
            tests.append(lambda s: s.flag == delivered)
        items = [s for s in self._visible_events(account) if all(test(s) for test in tests)]
        return page(items, self._events.get(account, {}), params, "/v1/events", "event")

    def _retrieve_event(self, event_id: str, account: str | None) -> dict[str, Any]:
        for stored in self._visible_events(account):
            if stored.data["id"] == event_id:
                return copy_json(stored.data)
        raise missing("event", event_id)

    def _retrieve_v2_event(self, event_id: str, account: str | None) -> dict[str, Any]:
        with self._lock:
            found = self._v2_events.get(account, {}).get(event_id)
        if found is not None and ("created" not in found
                                  or _iso_seconds(found["created"]) >= self.now - EVENT_RETENTION_S):
            return copy_json(found)
        # Stripe's v2 error shape: ``type`` and ``code``, no ``param``.
        raise ApiError(404, f"No such event: '{event_id}'", type="not_found", code="not_found")

    def _list_objects(self, name: str, collection: Collection, params: dict[str, Any],
                      account: str | None) -> dict[str, Any]:
        check_known(params, PAGING | {"created"} | set(collection.filters))
        for param in collection.required:
            if param not in params:
                raise ApiError(400, f"Missing required param: {param}.", code="parameter_missing", param=param)
        tests: list[Callable[[dict], bool]] = []
        for param, test in collection.filters.items():
            if param in params:
                test({}, params[param])  # a bad value is a 400 even when no object is there to test it on
                tests.append(lambda obj, test=test, value=params[param]: test(obj, value))
            elif param in collection.defaults:
                tests.append(collection.defaults[param])
        if "created" in params:
            created = created_matcher(params["created"])
            tests.append(lambda obj: created(int(obj.get("created") or 0)))
        objects = self._objects.get(account, {})
        items = [s for s in objects.values() if not s.flag and s.data["object"] == collection.object_type
                 and all(test(s.data) for test in tests)]
        return page(items, objects, params, f"/v1/{name}", collection.object_type)

    def _retrieve_object(self, collection: Collection, object_id: str, account: str | None) -> dict[str, Any]:
        stored = self._objects.get(account, {}).get(object_id)
        if stored is None or stored.data["object"] != collection.object_type:
            raise missing(collection.object_type, object_id)
        if stored.flag:
            if collection.object_type == "customer":
                return {"id": object_id, "object": "customer", "deleted": True}
            raise missing(collection.object_type, object_id)
        return copy_json(stored.data)

    # -- control over HTTP (what FakeStripeControl calls) --

    def _control(self, method: str, path: str, body: dict[str, Any]) -> Any:
        account = body.get("account")
        name = path.removeprefix("/_fake/")
        if method == "GET" and name == "requests":
            return {"requests": [r._asdict() for r in self.requests]}
        if name == "clock":
            if method == "POST":
                if "advance" in body:
                    self.advance(body["advance"])
                else:
                    self.set_now(body.get("now"))
            return {"now": self.now}
        if method != "POST":
            raise ApiError(405, f"{method} {path}: the control endpoints take POST")
        if name == "events":
            self.add_events(body["events"] if "events" in body else [body["event"]], account=account,
                            delivered=body.get("delivered", True))
        elif name == "v2_events":
            self.add_v2_event(body["event"], account=account)
        elif name == "objects":
            self.put_objects(body["objects"] if "objects" in body else [body["object"]], account=account)
        elif name == "objects/delete":
            self.delete_object(body["id"], account=account)
        elif name == "faults" and body.get("kind") == "fail":
            self.fail_next(body["n"], status=body.get("status", 429), retry_after=body.get("retry_after"),
                           path_prefix=body.get("path_prefix"))
        elif name == "faults" and body.get("kind") == "slow":
            self.slow_next(body["n"], body["seconds"], path_prefix=body.get("path_prefix"))
        elif name == "faults/clear":
            self.clear_faults()
        elif name == "requests/clear":
            self.clear_requests()
        elif name == "reset":
            self.reset()
        else:
            raise ApiError(404, f"Unrecognized control request: {method} {path}")
        return {"ok": True}
