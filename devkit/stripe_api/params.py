"""The wire rules of the fake: Stripe-shaped errors, Stripe's query decoding and cursor paging."""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable, Mapping, Protocol
from urllib.parse import parse_qsl


class Listed(Protocol):
    """What a list holds: the JSON and its place (created, then the order received)."""
    data: dict

    @property
    def key(self) -> tuple[int, int]: ...


PAGING = {"limit", "starting_after", "ending_before", "expand"}


class ApiError(Exception):
    """An error answer, Stripe-shaped."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.code:
            error["code"] = self.code
        if self.param:
            error["param"] = self.param
        return {"error": error}


def bad_param(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="parameter_invalid", param=param)


def missing(kind: str, object_id: str, param: str = "id") -> ApiError:
    return ApiError(404, f"No such {kind}: '{object_id}'", code="resource_missing", param=param)


# -- query parameters ---------------------------------------------------------------------

_KEY = re.compile(r"([^\[\]]+)(?:\[([^\[\]]*)\])?")


def parse_query(raw: str) -> dict[str, Any]:
    """Stripe's form decoding, one level deep: ``a=1``, ``a[]=x`` / ``a[0]=x`` (a list), ``a[gte]=1`` (a dict)."""
    params: dict[str, Any] = {}
    for key, value in parse_qsl(raw, keep_blank_values=True):
        match = _KEY.fullmatch(key)
        if not match:
            raise ApiError(400, f"Invalid parameter name: {key}", code="parameter_unknown", param=key)
        name, sub = match.group(1), match.group(2)
        if sub is None:
            if isinstance(params.get(name), (list, dict)):
                raise bad_param(name, f"Invalid {name}: mixed scalar and nested values")
            params[name] = value
        elif sub == "" or sub.isdigit():
            target = params.setdefault(name, [])
            if not isinstance(target, list):
                raise bad_param(name, f"Invalid array: {name}")
            target.append(value)
        else:
            target = params.setdefault(name, {})
            if not isinstance(target, dict):
                raise bad_param(name, f"Invalid hash: {name}")
            target[sub] = value
    return params


def integer(param: str, value: Any) -> int:
    if not isinstance(value, str) or not re.fullmatch(r"-?\d+", value):
        raise bad_param(param, f"Invalid integer: {value!r}")
    return int(value)


def boolean(param: str, value: Any) -> bool:
    if value not in ("true", "false"):
        raise bad_param(param, f"Invalid boolean: {value!r}")
    return value == "true"


def string(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise bad_param(param, f"Invalid string: {param} must be a string")
    return value


def string_list(param: str, value: Any) -> list[str]:
    if not isinstance(value, list):
        raise bad_param(param, f"Invalid array: {param} must be an array")
    return value


def created_matcher(value: Any) -> Callable[[int], bool]:
    """created=<int> or created[gt|gte|lt|lte]=<int> (combined with AND)."""
    if isinstance(value, str):
        exact = integer("created", value)
        return lambda created: created == exact
    if not isinstance(value, dict) or not value:
        raise bad_param("created", "Invalid created: an integer or a hash of gt, gte, lt, lte")
    tests = {"gt": lambda c, b: c > b, "gte": lambda c, b: c >= b, "lt": lambda c, b: c < b,
             "lte": lambda c, b: c <= b}
    bounds = []
    for op, raw in value.items():
        if op not in tests:
            raise ApiError(400, f"Received unknown parameter: created[{op}]", code="parameter_unknown",
                           param=f"created[{op}]")
        bounds.append((tests[op], integer(f"created[{op}]", raw)))
    return lambda created: all(test(created, bound) for test, bound in bounds)


def copy_json(value: Any) -> Any:
    """A deep copy that also proves the value is JSON (what the fake will serve)."""
    return json.loads(json.dumps(value))


def page(items: list[Listed], positions: Mapping[str, Listed], params: dict[str, Any], url: str,
         kind: str) -> dict[str, Any]:
    """One page of ``items`` (already filtered) newest first, by Stripe's cursor rules."""
    limit = integer("limit", params.get("limit", "10"))
    if not 1 <= limit <= 100:
        raise bad_param("limit", f"Invalid limit: must be between 1 and 100 (got {limit})")
    after, before = params.get("starting_after"), params.get("ending_before")
    if after is not None and before is not None:
        raise ApiError(400, "You may only specify one of these parameters: ending_before, starting_after.",
                       code="parameter_invalid")
    ordered = sorted(items, key=lambda s: s.key, reverse=True)
    if after is not None:
        cursor = positions.get(string("starting_after", after))
        if cursor is None:
            raise ApiError(400, f"No such {kind}: '{after}'", code="resource_missing", param="starting_after")
        rest = [s for s in ordered if s.key < cursor.key]
        data, has_more = rest[:limit], len(rest) > limit
    elif before is not None:
        cursor = positions.get(string("ending_before", before))
        if cursor is None:
            raise ApiError(400, f"No such {kind}: '{before}'", code="resource_missing", param="ending_before")
        rest = [s for s in ordered if s.key > cursor.key]  # newer than the cursor; the page is the nearest ones
        data, has_more = rest[-limit:], len(rest) > limit
    else:
        data, has_more = ordered[:limit], len(ordered) > limit
    return {"object": "list", "data": [copy_json(s.data) for s in data], "has_more": has_more, "url": url}


def check_known(params: dict[str, Any], allowed: Iterable[str]) -> None:
    allowed = set(allowed)
    for name in params:
        if name not in allowed:
            raise ApiError(400, f"Received unknown parameter: {name}", code="parameter_unknown", param=name)
