"""Who is asking, and what they may do.

A user logs in with a password (LEDGER_CONSOLE_USERS) or is named by a trusted proxy's header; the
session cookie then carries the name, and the role is looked up on every request (a user removed from
LEDGER_CONSOLE_OPERATORS loses it at once). ``requires_operator`` answers 403 to a viewer at the
endpoint itself, whatever the page showed.

Failed logins are throttled per address and per name: after ``FREE_FAILURES`` within ``WINDOW_S``
each further try must wait ``FIRST_WAIT_S``, doubling with each failure up to ``MAX_WAIT_S``. The counts live in the process: the
console runs as one process (threads for concurrency), so they cover every request.
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass

from flask import abort, current_app, g, redirect, request, session, url_for
from werkzeug.security import check_password_hash, generate_password_hash

FREE_FAILURES = 5
FIRST_WAIT_S = 15.0
WINDOW_S = 900.0
MAX_WAIT_S = 300.0
# A hash to check against for an unknown name, so that both take the same time.
_DUMMY_HASH = generate_password_hash("no such user", method="scrypt")


@dataclass(frozen=True)
class User:
    name: str
    role: str

    @property
    def is_operator(self) -> bool:
        return self.role == "operator"


def hash_password(password: str) -> str:
    return generate_password_hash(password, method="scrypt")


def check_password(users: dict[str, str], name: str, password: str) -> bool:
    hashed = users.get(name)
    ok = check_password_hash(hashed or _DUMMY_HASH, password)
    return ok and hashed is not None


class LoginThrottle:
    def __init__(self, *, clock=time.monotonic):
        self._clock = clock
        self._failures: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def wait_s(self, *keys: str) -> float:
        """How long these keys (an address, a name) must still wait before the next try; 0: may try."""
        now = self._clock()
        with self._lock:
            return max((self._wait(key, now) for key in keys), default=0.0)

    def failed(self, *keys: str) -> None:
        now = self._clock()
        with self._lock:
            for key in keys:
                self._failures.setdefault(key, []).append(now)

    def succeeded(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._failures.pop(key, None)

    def _wait(self, key: str, now: float) -> float:
        recent = [t for t in self._failures.get(key, ()) if now - t < WINDOW_S]
        self._failures[key] = recent
        over = len(recent) - FREE_FAILURES
        if over < 0:
            return 0.0
        return max(0.0, recent[-1] + min(MAX_WAIT_S, FIRST_WAIT_S * 2.0 ** over) - now)


def current_user() -> User | None:
    settings = current_app.config["CONSOLE"]
    if settings.trusted_header and request.remote_addr in settings.trusted_proxies:
        name = (request.headers.get(settings.trusted_header) or "").strip()
        if name:
            return User(name, settings.role(name))
    name = session.get("user")
    if name and name in settings.users:
        return User(name, settings.role(name))
    return None


def login_required(view):
    @functools.wraps(view)
    def wrapped(*args, **kwargs):
        g.user = current_user()
        if g.user is None:
            if request.method == "GET":
                return redirect(url_for("console.login", next=request.full_path.rstrip("?")))
            abort(401)
        return view(*args, **kwargs)
    return wrapped


def requires_operator(view):
    @functools.wraps(view)
    @login_required
    def wrapped(*args, **kwargs):
        if not g.user.is_operator:
            abort(403)
        return view(*args, **kwargs)
    return wrapped
