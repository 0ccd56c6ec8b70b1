"""Who is asking, and what they may do.

A user logs in with a password (LEDGER_CONSOLE_USERS) or is named by a trusted proxy's header; the
session cookie then carries the name, and the role is looked up on every request (a user removed from
LEDGER_CONSOLE_OPERATORS loses it at once). ``requires_operator`` answers 403 to a viewer at the
endpoint itself, whatever the page showed.

Failed logins are throttled per name: after ``FREE_FAILURES`` within ``WINDOW_S`` each further try of
that name waits ``FIRST_WAIT_S``, doubling with each failure up to ``MAX_WAIT_S``. The client's address
is only a second limit, ``FREE_FAILURES_PER_ADDRESS``, far above what one person's typos reach within
the window (5 free, then waits of 15, 30, 60, 120, 240 s and 300 s: at most a dozen). So behind a load balancer, where
every user shares one address, one user's typos never delay another's login, while guessing across
many names from one address is slowed down. Behind a trusted proxy (LEDGER_CONSOLE_TRUSTED_PROXIES)
the address is the client's, from X-Forwarded-For. The counts are rows in Postgres
(ledger.login_failures), shared by every console process.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
from dataclasses import dataclass

from flask import abort, current_app, g, redirect, request, session, url_for
from werkzeug.security import check_password_hash, generate_password_hash

from ledger.console import ConsoleLedger

FREE_FAILURES = 5
FREE_FAILURES_PER_ADDRESS = 30
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


def wait_after(failures: int, since_last_s: float, *, free: int) -> float:
    """How long a key with ``failures`` failed logins in the window, the last ``since_last_s`` ago, must
    still wait: nothing for the first ``free``, then FIRST_WAIT_S doubling per failure up to MAX_WAIT_S."""
    over = failures - free
    if over < 0:
        return 0.0
    return max(0.0, min(MAX_WAIT_S, FIRST_WAIT_S * 2.0 ** min(over, 32)) - since_last_s)


class LoginThrottle:
    """Failed logins per name, and per address with a higher limit, counted in the ledger."""

    def __init__(self, ledger: ConsoleLedger, secret_key: str):
        self._ledger = ledger
        self._secret = secret_key.encode()

    def _key(self, kind: str, value: str) -> str:
        digest = hmac.new(self._secret, f"{kind}:{value}".encode("utf-8", "surrogatepass"), hashlib.sha256)
        return f"{kind}:{digest.hexdigest()}"

    def wait_s(self, name: str, address: str) -> float:
        """How long a login of ``name`` from ``address`` must still wait; 0: it may try now."""
        name_key, address_key = self._key("name", name), self._key("addr", address)
        counts = self._ledger.login_failures([name_key, address_key], window_s=WINDOW_S)
        return max(wait_after(*counts.get(name_key, (0, 0.0)), free=FREE_FAILURES),
                   wait_after(*counts.get(address_key, (0, 0.0)), free=FREE_FAILURES_PER_ADDRESS))

    def failed(self, name: str, address: str) -> None:
        self._ledger.record_login_failure([self._key("name", name), self._key("addr", address)], window_s=WINDOW_S)

    def succeeded(self, name: str) -> None:
        self._ledger.forget_login_failures(self._key("name", name))


def client_address() -> str:
    """The client's address: the peer's, or behind a trusted proxy the nearest address in X-Forwarded-For
    that is not one of the trusted proxies (each proxy appends the peer it saw; only the trusted ones'
    entries can be believed)."""
    trusted = current_app.config["CONSOLE"].trusted_proxies
    peer = request.remote_addr or ""
    if peer not in trusted:
        return peer
    hops = [hop.strip() for hop in request.headers.get("X-Forwarded-For", "")[:2000].split(",")]
    for hop in reversed(hops):
        if hop and hop not in trusted:
            return hop[:64]
    return peer


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
