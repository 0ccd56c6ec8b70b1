"""The receiver's raw-socket framing cases (tests/e2e/test_receiver_framing.py), sent to the console: a
POST to /login framed every broken way gets a 4xx or a close, never a 5xx (neither in the answer nor in
gunicorn's log), within WAIT_S, and the console keeps serving. gunicorn's own 501 to an unknown
transfer coding is the same strict xfail as the receiver's."""
from __future__ import annotations

import re
import time

import pytest

from devkit.stack import Console, http_request
from ops.console.auth import hash_password
from ledger.http import BODY_IDLE_TIMEOUT_S
from tests.e2e.test_receiver_framing import CASES, CLOSED, GUNICORN_5XX, SERVER_ERROR_SIGNS, SETTLE_S, WAIT_S, Signed
from tests.support.raw_http import exchange
from tests.support.workers import env_for


@pytest.fixture(scope="module")
def console(database_url, redis_url, tmp_path_factory):
    from ledger.config import Settings

    env = env_for(Settings(database_url=database_url, broker_url=redis_url), extra={
        "LEDGER_CONSOLE_USERS": f"olga:{hash_password('pw')}", "LEDGER_CONSOLE_SECRET_KEY": "f" * 40})
    process = Console(env, tmp_path_factory.mktemp("console-framing"))
    try:
        yield process.start()
    finally:
        process.kill()


def _to_login(raw: bytes) -> bytes:
    """The case's bytes aimed at the console's form endpoint instead of the webhook, as a form (so that the
    console parses the body)."""
    raw = re.sub(rb"^(\S+) /webhooks/stripe(/\S*)?", rb"\1 /login", raw, count=1)
    return raw.replace(b"Content-Type: application/json", b"Content-Type: application/x-www-form-urlencoded", 1)


# Over the receiver's small test limit, well under the console's 64 KiB: to the console this client declared
# a body and stopped sending it, so it gets its 400 once BODY_IDLE_TIMEOUT_S passed.
STOPS_MID_BODY = {"a Content-Length over the size limit, body not sent"}


@pytest.mark.parametrize("name", CASES)
def test_the_console_answers_malformed_http_with_a_4xx_or_a_close_never_a_5xx(request, console, name):
    if name in GUNICORN_5XX:
        request.applymarker(pytest.mark.xfail(reason=GUNICORN_5XX[name], strict=True))
    case_ = CASES[name]
    pieces = [_to_login(piece) if n == 0 else piece for n, piece in enumerate(case_.build(Signed.new()))]
    log_start = len(console.log())
    started = time.monotonic()
    wait_s = BODY_IDLE_TIMEOUT_S + WAIT_S if name in STOPS_MID_BODY else WAIT_S
    answer = exchange(console.port, pieces, then=case_.then, wait_s=wait_s)
    elapsed = time.monotonic() - started
    if case_.then == "close":
        time.sleep(SETTLE_S)
    server_log = console.log()[log_start:]
    seen = f"{name}: answered {answer.status!r} closed={answer.closed}\n{server_log[-3000:]}"
    assert not [line for line in server_log.splitlines()
                if any(sign.search(line) for sign in SERVER_ERROR_SIGNS) or re.search(r'" 5\d\d ', line)], seen
    if case_.then != "close":
        assert not answer.waited_out and elapsed < wait_s + 1, seen
        assert (answer.status is not None and 400 <= answer.status < 500) or (
            answer.status is None and answer.closed and CLOSED in case_.expect), seen
    assert http_request(console.port, "GET", "/login", timeout=5).status_code == 200
