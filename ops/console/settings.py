"""The console's settings, from the environment, checked at start-up (ConfigError names the variable).

* ``LEDGER_CONSOLE_USERS``: comma-separated ``name:hash`` pairs; the hash is what
  ``echo PASSWORD | ledgerctl console hash-password`` prints (werkzeug's scrypt).
* ``LEDGER_CONSOLE_OPERATORS``: comma-separated names that may replay and fix; everyone else only looks.
* ``LEDGER_CONSOLE_SECRET_KEY``: signs the session cookie and the CSRF tokens; the same on every
  console process, at least 32 characters.
* ``LEDGER_CONSOLE_TRUSTED_HEADER`` with ``LEDGER_CONSOLE_TRUSTED_PROXIES``: single sign-on in front.
  A request from one of those proxy addresses is the user the header names (no password); the header
  is ignored from any other address.
* ``LEDGER_CONSOLE_SECURE_COOKIES``: 1 when a proxy terminates TLS in front (the console sets it itself
  when it serves TLS).
* ``LEDGER_CONSOLE_REPLAY_RATE``: events a second a bulk replay moves (default 50).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from ledger.errors import ConfigError

ROLES = ("viewer", "operator")


@dataclass(frozen=True)
class ConsoleSettings:
    users: dict[str, str] = field(default_factory=dict, repr=False)   # name -> password hash
    operators: frozenset[str] = frozenset()
    secret_key: str = field(default="", repr=False)
    trusted_header: str | None = None
    trusted_proxies: frozenset[str] = frozenset()
    secure_cookies: bool = False
    replay_rate: float = 50.0

    def role(self, name: str) -> str:
        return "operator" if name in self.operators else "viewer"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ConsoleSettings":
        env = os.environ if environ is None else environ
        users: dict[str, str] = {}
        for pair in _items(env.get("LEDGER_CONSOLE_USERS", "")):
            name, sep, hashed = pair.partition(":")
            if not sep or not name or not hashed or ":" not in hashed:
                raise ConfigError("LEDGER_CONSOLE_USERS: each entry is name:hash, the hash from "
                                  "`ledgerctl console hash-password`")
            users[name] = hashed
        header = env.get("LEDGER_CONSOLE_TRUSTED_HEADER") or None
        proxies = frozenset(_items(env.get("LEDGER_CONSOLE_TRUSTED_PROXIES", "")))
        if header and not proxies:
            raise ConfigError("LEDGER_CONSOLE_TRUSTED_HEADER needs LEDGER_CONSOLE_TRUSTED_PROXIES: the addresses "
                              "of the proxies allowed to set it")
        if not users and not header:
            raise ConfigError("LEDGER_CONSOLE_USERS (or LEDGER_CONSOLE_TRUSTED_HEADER) is required: the console "
                              "never runs without authentication")
        secret = env.get("LEDGER_CONSOLE_SECRET_KEY", "")
        if len(secret) < 32:
            raise ConfigError("LEDGER_CONSOLE_SECRET_KEY is required, at least 32 characters, the same on every "
                              "console process")
        try:
            rate = float(env.get("LEDGER_CONSOLE_REPLAY_RATE", "50"))
        except ValueError:
            raise ConfigError("LEDGER_CONSOLE_REPLAY_RATE must be a number") from None
        if not rate > 0:
            raise ConfigError("LEDGER_CONSOLE_REPLAY_RATE must be above 0")
        return cls(users=users, operators=frozenset(_items(env.get("LEDGER_CONSOLE_OPERATORS", ""))),
                   secret_key=secret, trusted_header=header, trusted_proxies=proxies,
                   secure_cookies=env.get("LEDGER_CONSOLE_SECURE_COOKIES", "").strip().lower() in ("1", "true", "yes"),
                   replay_rate=rate)


def _items(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]
