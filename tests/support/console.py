"""The console's test fixtures and helpers (tests/integration/test_console*.py): its settings with two users
(olga, an operator; vera, a viewer), the app on the test's ledger, logged-in clients, CSRF tokens, and
events that failed for good through the real processor."""
from __future__ import annotations

import re
import time

import pytest

from devkit.factories import event
from ops.console.app import create_app
from ops.console.auth import hash_password
from ops.console.settings import ConsoleSettings

PASSWORD = "correct horse battery staple"


@pytest.fixture
def console_settings():
    hashed = hash_password(PASSWORD)
    return ConsoleSettings(users={"olga": hashed, "vera": hashed}, operators=frozenset({"olga"}),
                           secret_key="s" * 40)


@pytest.fixture
def app(broker_settings, console_settings, kit):
    app = create_app(broker_settings, console_settings, run_replays=False)
    app.config["TESTING"] = True
    yield app
    app.extensions["ledger"]["pool"].close()


def client_for(app, name: str | None):
    client = app.test_client()
    if name is not None:
        answer = client.post("/login", data={"name": name, "password": PASSWORD, "csrf_token": token_of(client, "/login")})
        assert answer.status_code == 302, answer.text
    return client


def token_of(client, path: str) -> str:
    match = re.search(r'name="csrf_token"[^>]*value="([^"]+)"', client.get(path).text)
    assert match, f"no CSRF token on {path}"
    return match.group(1)


def confirm_form(preview_html: str) -> dict[str, str]:
    """The hidden fields of a replay preview's confirm form (the filter, the preview's id)."""
    def hidden(name: str) -> str:
        return re.search(rf'name="{name}" type="hidden" value="([^"]+)"', preview_html).group(1).replace("&#34;", '"')

    return {"filter": hidden("filter"), "preview": hidden("preview")}


def failed_events(kit, n: int, *, type_: str = "test.permanent", created: int | None = None) -> list[str]:
    processor = kit.processor()
    ids = []
    for i in range(n):
        evt = event(type_, {"id": f"obj_{type_}_{i}_{time.monotonic_ns()}"}, created=created or int(time.time()))
        kit.record(evt)
        processor.process(evt["id"])
        ids.append(evt["id"])
    return ids
