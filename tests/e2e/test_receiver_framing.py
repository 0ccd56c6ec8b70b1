"""Malformed HTTP from a stranger, over a raw socket, to the real receiver under each server docs/configuration.md
supports (devkit.stack.SUPPORTED_RECEIVER_SERVERS: gunicorn sync workers as docs/configuration.md runs it, and gthread
workers with 4 threads). ``FRAMING_SERVERS=granian`` (comma-separated names of
devkit.stack.RECEIVER_SERVERS) runs the same cases under another server instead: that is how a candidate
is judged (docs/configuration.md, "Running it", has what granian 2.8.9 did).

Every malformed request below carries a correctly signed event, so that a receiver which framed it
wrongly (a truncated body taken as whole, a smuggled second request) would record that event. What is
acceptable, for every case:

* the answer is a 4xx — or, for a request whose head the server cannot even read to its end and whose
  client has gone away (closed, or half-closed so it sends nothing more), the connection closed without
  an answer: there is no request to answer. A client that closed its side entirely cannot read an answer;
  the server's own log then shows what it did (its access log line, gunicorn's "Error handling request",
  the receiver's "unexpected error");
* never a 5xx: neither in the answer nor in the server's log;
* never a hang: the answer (or the close) comes within WAIT_S;
* never a write to the ledger, and no payload in the server's log;
* afterwards the same receiver records a good signed delivery (200 ``received``).

A client that stops sending its body gets 400 once ledger.http.BODY_IDLE_TIMEOUT_S has passed without
a byte of it. A client that stops in the middle of its head (slowloris) gets no answer while it holds the
connection, and holds only its own worker (or thread): the receiver keeps serving others. Bounding that
wait is gunicorn's business, and it does not do it well: a sync worker stuck there is killed after
``--timeout`` (30 s) and answers 500 as it goes; a gthread thread waits for as long as the client keeps
the connection. Hence a proxy with a header timeout in front of the receiver (docs/configuration.md, "Running it").

One answer is gunicorn's and is a 5xx: a transfer coding it does not implement gets 501 (RFC 9112 section
6.1 says SHOULD), before the application sees the request; no setting changes it. Under gunicorn that case
is an xfail (strict, so that it is noticed the day gunicorn answers 400).
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Callable

import pytest

from devkit.factories import body_of, sign, thin_notification
from devkit.stack import RECEIVER_SERVERS, SUPPORTED_RECEIVER_SERVERS, Receiver
from ledger.http import BODY_IDLE_TIMEOUT_S
from tests.support.constants import WEBHOOK_SECRET
from tests.support.raw_http import RawAnswer, Then, exchange, read_answer
from tests.support.receiver import PAYLOAD_MARKER, count_events, drop_queue, event_body, event_row, receiver_env

QUEUE = "framing-tests"
# INGEST_MAX_BODY_BYTES of the receiver under test: small, so "too large" is cheap to send.
MAX_BODY = 8192
# Bound on every answer (or close) of the receiver.
WAIT_S = 5.0
# A client that closed its side cannot read the answer: the server's log is read after this long.
SETTLE_S = 0.5

# The other endpoints' secrets: their framing is the same code's (ledger.http.read_body), tried too.
THIN_SECRET = "whsec_test_framing_thin_0123"
CONNECT_SECRET = "whsec_test_framing_connect_0123"

CLOSED = "closed without an answer"
# Each server's options for an access log line per answered request: the status, nothing of the request.
ACCESS_LOG_ARGS = {
    "gunicorn-sync": ("--access-logfile", "-", "--access-logformat", "access-log status=%(s)s"),
    "gunicorn-gthread": ("--access-logfile", "-", "--access-logformat", "access-log status=%(s)s"),
    "granian": ("--access-log", "--access-log-fmt", "access-log status=%(status)d"),
}
SERVER_ERROR_SIGNS = (re.compile(r"access-log status=5\d\d"), re.compile("Error handling request"),
                      re.compile("unexpected error in the receiver"), re.compile("Traceback"))


def _servers() -> list[str]:
    """The servers docs/configuration.md supports; FRAMING_SERVERS (comma-separated, of devkit.stack.RECEIVER_SERVERS)
    runs the same cases under others, e.g. a candidate: ``FRAMING_SERVERS=granian``."""
    named = [s.strip() for s in os.environ.get("FRAMING_SERVERS", "").split(",") if s.strip()]
    unknown = sorted(set(named) - set(RECEIVER_SERVERS))
    if unknown:
        raise pytest.UsageError(f"FRAMING_SERVERS: unknown {unknown}; choose from {RECEIVER_SERVERS}")
    return named or list(SUPPORTED_RECEIVER_SERVERS)


@pytest.fixture(scope="module", params=_servers())
def receiver(request, database_url, redis_url, tmp_path_factory):
    env = receiver_env(database_url, redis_url, WEBHOOK_SECRET, INGEST_MAX_BODY_BYTES=str(MAX_BODY),
                       LEDGER_QUEUE=QUEUE, STRIPE_THIN_WEBHOOK_SECRET=THIN_SECRET,
                       STRIPE_CONNECT_WEBHOOK_SECRET=CONNECT_SECRET)
    server = Receiver(env, tmp_path_factory.mktemp("framing"), server=request.param, workers=2,
                      extra_args=ACCESS_LOG_ARGS[request.param])
    try:
        yield server.start()
    finally:
        server.kill()
        drop_queue(redis_url, QUEUE)  # the good deliveries' wake-ups, which no worker takes


# -- requests, byte by byte --------------------------------------------------------------

@dataclass(frozen=True)
class Signed:
    """A correctly signed event for one endpoint: its id, its body, the endpoint's path and secret (its
    Stripe-Signature header line)."""
    event_id: str
    body: bytes
    path: bytes = b"/webhooks/stripe"
    secret: str = WEBHOOK_SECRET

    @classmethod
    def new(cls) -> "Signed":
        text = event_body()
        return cls(json.loads(text)["id"], text.encode())

    @classmethod
    def for_endpoint(cls, endpoint: str) -> "Signed":
        """``snapshot``, ``connect`` (an event of a connected account) or ``thin`` (a thin notification,
        the marker as its context)."""
        if endpoint == "connect":
            text = event_body(account="acct_framing_1")
            return cls(json.loads(text)["id"], text.encode(), b"/webhooks/stripe/connect", CONNECT_SECRET)
        if endpoint == "thin":
            note = thin_notification("v1.customer.updated", related={"id": "cus_test_1", "object": "customer"},
                                     created=time.time(), context=PAYLOAD_MARKER)
            return cls(note["id"], body_of(note).encode(), b"/webhooks/stripe/thin", THIN_SECRET)
        return cls.new()

    @property
    def signature(self) -> bytes:
        return b"Stripe-Signature: " + sign(self.body.decode(), self.secret).encode()


def head(evt: Signed, *lines: bytes, request_line: bytes | None = None, signature: bool = True) -> bytes:
    """A request head: the request line (a POST to the event's endpoint by default), Host, Content-Type,
    the signature, then ``lines``."""
    request_line = request_line if request_line is not None else b"POST " + evt.path + b" HTTP/1.1"
    fields = [request_line, b"Host: receiver.test", b"Content-Type: application/json"]
    if signature:
        fields.append(evt.signature)
    return b"\r\n".join([*fields, *lines]) + b"\r\n\r\n"


def length(evt: Signed, delta: int = 0) -> bytes:
    return b"Content-Length: %d" % (len(evt.body) + delta)


def chunk(data: bytes, size: bytes | None = None) -> bytes:
    return (size if size is not None else b"%x" % len(data)) + b"\r\n" + data + b"\r\n"


CHUNKED = b"Transfer-Encoding: chunked"
LAST_CHUNK = b"0\r\n\r\n"


def big(evt: Signed) -> bytes:
    """A signed-looking body over MAX_BODY (the signature is for evt.body, so it could never be recorded)."""
    return evt.body + b" " * (MAX_BODY + 1 - len(evt.body))


@dataclass(frozen=True)
class Case:
    """One malformed request: its bytes, what the client does after sending them, the acceptable answers
    and, for an answer of the receiver's own, the ``error`` its JSON names."""
    build: Callable[[Signed], list[bytes]]
    expect: frozenset
    then: Then = "keep"
    outcome: str | None = None


def case(build: Callable[[Signed], bytes | list[bytes]], *expect, then: Then = "keep",
         outcome: str | None = None) -> Case:
    def pieces(evt: Signed) -> list[bytes]:
        built = build(evt)
        return built if isinstance(built, list) else [built]
    return Case(pieces, frozenset(expect), then, outcome)


BODY = "incomplete_body"  # the receiver's answer to a body it could not read whole


CASES = {
    # -- chunked encoding ------------------------------------------------------------------
    "chunk size that is not hex": case(lambda e: head(e, CHUNKED) + chunk(e.body, b"zz") + LAST_CHUNK, 400, outcome=BODY),
    "chunk size followed by junk": case(lambda e: head(e, CHUNKED) + chunk(e.body, b"%xjunk" % len(e.body))
                                        + LAST_CHUNK, 400, outcome=BODY),
    "chunk size with a negative sign": case(lambda e: head(e, CHUNKED) + chunk(e.body, b"-%x" % len(e.body))
                                            + LAST_CHUNK, 400, outcome=BODY),
    "chunk size with a control byte in its extension": case(
        lambda e: head(e, CHUNKED) + chunk(e.body, b"%x;\x01" % len(e.body)) + LAST_CHUNK, 400, outcome=BODY),
    "chunk size larger than 64 bits, then half-close": case(
        lambda e: head(e, CHUNKED) + chunk(e.body, b"f" * 40), 400, then="half_close", outcome=BODY),
    "chunk data longer than its size": case(lambda e: head(e, CHUNKED) + chunk(e.body, b"%x" % (len(e.body) - 5))
                                            + LAST_CHUNK, 400, outcome=BODY),
    "chunk without the CRLF after its data": case(
        lambda e: head(e, CHUNKED) + b"%x\r\n" % len(e.body) + e.body + b"XX" + LAST_CHUNK, 400, outcome=BODY),
    "chunk size line without CRLF, over the line limit": case(
        lambda e: head(e, CHUNKED) + b"1" * 20000, 400, outcome=BODY),
    "missing last chunk, then half-close": case(lambda e: head(e, CHUNKED) + chunk(e.body), 400,
                                                then="half_close", outcome=BODY),
    "missing last chunk, then close": case(lambda e: head(e, CHUNKED) + chunk(e.body), then="close"),
    "chunk data shorter than its size, then half-close": case(
        lambda e: head(e, CHUNKED) + b"%x\r\n" % (len(e.body) + 100) + e.body, 400, then="half_close", outcome=BODY),
    "last chunk without the final CRLF, then half-close": case(
        lambda e: head(e, CHUNKED) + chunk(e.body) + b"0\r\n", 400, then="half_close", outcome=BODY),
    "chunked and Content-Length both": case(lambda e: head(e, CHUNKED, length(e)) + chunk(e.body) + LAST_CHUNK,
                                            400),
    "Content-Length and chunked both": case(lambda e: head(e, length(e), CHUNKED) + chunk(e.body) + LAST_CHUNK,
                                            400),
    "chunked twice": case(lambda e: head(e, b"Transfer-Encoding: chunked, chunked") + chunk(e.body) + LAST_CHUNK,
                          400),
    "chunked in HTTP/1.0": case(lambda e: head(e, CHUNKED, request_line=b"POST /webhooks/stripe HTTP/1.0")
                                + chunk(e.body) + LAST_CHUNK, 400),
    "a transfer coding that is not chunked": case(lambda e: head(e, b"Transfer-Encoding: gzip", length(e)) + e.body,
                                                  400),
    "an unknown transfer coding": case(lambda e: head(e, b"Transfer-Encoding: x-unknown, chunked")
                                       + chunk(e.body) + LAST_CHUNK, 400),
    "a forbidden field in the chunked trailer": case(
        lambda e: head(e, CHUNKED) + chunk(e.body) + b"0\r\nContent-Length: 5\r\n\r\n", 400, outcome=BODY),
    "a broken chunked body to a route that does not read it": case(
        lambda e: head(e, CHUNKED, request_line=b"POST /nowhere HTTP/1.1") + chunk(e.body, b"zz") + LAST_CHUNK, 404),
    "a chunked body over the size limit": case(lambda e: head(e, CHUNKED) + chunk(big(e)) + LAST_CHUNK, 413),
    "a chunked body over the size limit, in small chunks": case(
        lambda e: head(e, CHUNKED) + b"".join(chunk(big(e)[i:i + 1000]) for i in range(0, MAX_BODY + 1, 1000))
        + LAST_CHUNK, 413),
    # -- Content-Length -------------------------------------------------------------------------
    "two different Content-Length headers": case(lambda e: head(e, length(e), length(e, -10)) + e.body, 400),
    "two equal Content-Length headers": case(lambda e: head(e, length(e), length(e)) + e.body, 400),
    "a Content-Length list": case(lambda e: head(e, b"Content-Length: %d, %d" % (len(e.body), len(e.body)))
                                  + e.body, 400),
    "a negative Content-Length": case(lambda e: head(e, b"Content-Length: -1") + e.body, 400),
    "a non-numeric Content-Length": case(lambda e: head(e, b"Content-Length: abc") + e.body, 400),
    "a Content-Length with a plus sign": case(lambda e: head(e, b"Content-Length: +%d" % len(e.body)) + e.body, 400),
    "a hexadecimal Content-Length": case(lambda e: head(e, b"Content-Length: 0x%x" % len(e.body)) + e.body, 400),
    "a Content-Length of non-ASCII digits": case(lambda e: head(e, b"Content-Length: \xb2") + e.body, 400),
    "a huge Content-Length": case(lambda e: head(e, b"Content-Length: 99999999999999999999999999") + e.body, 413),
    "a Content-Length over the size limit": case(lambda e: head(e, b"Content-Length: %d" % (MAX_BODY + 1))
                                                 + big(e), 413),
    "a Content-Length over the size limit, body not sent": case(
        lambda e: head(e, b"Content-Length: %d" % (MAX_BODY + 1)), 413),
    "Content-Length larger than the body, then half-close": case(lambda e: head(e, length(e, 10)) + e.body, 400,
                                                                 then="half_close", outcome=BODY),
    "Content-Length larger than the body, then close": case(lambda e: head(e, length(e, 10)) + e.body,
                                                            then="close"),
    "Content-Length smaller than the body": case(lambda e: head(e, length(e, -10)) + e.body, 400),
    "no Content-Length and no chunking, body over the limit, then half-close": case(
        lambda e: head(e) + big(e), 400, then="half_close"),
    # -- header bytes -------------------------------------------------------------------------
    "NUL in a header value": case(lambda e: head(e, length(e), b"X-Note: a\x00b") + e.body, 400),
    "NUL in a header name": case(lambda e: head(e, length(e), b"X-No\x00te: a") + e.body, 400),
    "a control byte in a header value": case(lambda e: head(e, length(e), b"X-Note: a\x01b") + e.body, 400),
    "DEL in a header value": case(lambda e: head(e, length(e), b"X-Note: a\x7fb") + e.body, 400),
    "a bare CR in a header value": case(lambda e: head(e, length(e), b"X-Note: a\rb") + e.body, 400),
    "non-ASCII bytes in a header name": case(lambda e: head(e, length(e), b"X-N\xc3\xb6te: a") + e.body, 400),
    "non-ASCII bytes in the signature": case(lambda e: head(e, length(e), b"Stripe-Signature: t=1,v1=\xc3\xa9\xff",
                                                            signature=False) + e.body, 400),
    "a NUL in the signature": case(lambda e: head(e, length(e), b"Stripe-Signature: t=1,\x00v1=ab",
                                                  signature=False) + e.body, 400),
    # gunicorn drops it rather than map it onto HTTP_STRIPE_SIGNATURE: the request has no signature.
    "the signature under an underscored name": case(
        lambda e: head(e, length(e), e.signature.replace(b"Stripe-", b"Stripe_"), signature=False) + e.body, 400),
    "a space before the colon": case(lambda e: head(e, length(e), b"X-Note : a") + e.body, 400),
    "a header line without a colon": case(lambda e: head(e, length(e), b"X-Note") + e.body, 400),
    "an obs-fold continuation line": case(lambda e: head(e, length(e), b"X-Note: a", b" folded") + e.body, 400),
    "a folded Content-Length": case(lambda e: head(e, b"Content-Length:", b" %d" % len(e.body)) + e.body, 400),
    "bare LF line endings": case(lambda e: head(e, length(e)).replace(b"\r\n", b"\n") + e.body, 400),
    "two Host headers": case(lambda e: head(e, length(e), b"Host: other.test") + e.body, 400),
    "an unknown expectation": case(lambda e: head(e, length(e), b"Expect: 200-ok") + e.body, 417),
    "an absurdly long header line": case(lambda e: head(e, length(e), b"X-Note: " + b"a" * 20000) + e.body, 431),
    "too many headers": case(lambda e: head(e, length(e), *(b"X-N%d: a" % i for i in range(200))) + e.body, 431),
    "a head that never ends, over the buffer limit": case(
        lambda e: head(e, length(e))[:-4] + b"".join(b"\r\nX-N%d: %s" % (i, b"a" * 8000) for i in range(110)), 431),
    # -- request line ----------------------------------------------------------------------------
    "a bad method": case(lambda e: head(e, length(e), request_line=b"P@ST /webhooks/stripe HTTP/1.1") + e.body, 400),
    "a lowercase method": case(lambda e: head(e, length(e), request_line=b"post /webhooks/stripe HTTP/1.1")
                               + e.body, 400),
    "HTTP/0.9": case(lambda e: head(e, length(e), request_line=b"POST /webhooks/stripe HTTP/0.9") + e.body, 400),
    "HTTP/2.0 in an HTTP/1 request line": case(lambda e: head(e, length(e),
                                                              request_line=b"POST /webhooks/stripe HTTP/2.0")
                                               + e.body, 400),
    "a malformed HTTP version": case(lambda e: head(e, length(e), request_line=b"POST /webhooks/stripe HTTP/one")
                                     + e.body, 400),
    "a request line without a version": case(lambda e: head(e, length(e), request_line=b"POST /webhooks/stripe")
                                             + e.body, 400),
    "a request line with extra spaces": case(lambda e: head(e, length(e),
                                                            request_line=b"POST  /webhooks/stripe  HTTP/1.1")
                                             + e.body, 400),
    "a NUL in the request target": case(lambda e: head(e, length(e), request_line=b"POST /webhooks/\x00 HTTP/1.1")
                                        + e.body, 400),
    "non-ASCII bytes in the request target": case(
        lambda e: head(e, length(e), request_line=b"POST /webhooks/str\xc3\xafpe HTTP/1.1") + e.body, 400),
    "an absurdly long request line": case(lambda e: head(e, length(e),
                                                         request_line=b"POST /webhooks/stripe?" + b"a" * 20000
                                                         + b" HTTP/1.1") + e.body, 414),
    "a TLS handshake to the plain-HTTP port, then half-close": case(
        lambda e: bytes.fromhex("16030100a5010000a10303") + b"\x00" * 64, CLOSED, then="half_close"),
    "binary garbage": case(lambda e: bytes(range(256)) * 4, 400),
    # -- clients that stop --------------------------------------------------------------------
    "an empty request, then half-close": case(lambda e: b"", CLOSED, then="half_close"),
    "an empty request, then close": case(lambda e: b"", then="close"),
    "blank lines only, then half-close": case(lambda e: b"\r\n\r\n", CLOSED, 400, then="half_close"),
    "a request line only, then half-close": case(lambda e: b"POST /webhooks/stripe HTTP/1.1\r\n", CLOSED,
                                                 then="half_close"),
    "a head cut in the middle of a header, then half-close": case(
        lambda e: head(e, length(e))[:60], CLOSED, then="half_close"),
    "a head cut in the middle of a header, then close": case(lambda e: head(e, length(e))[:60], then="close"),
    "a head without its blank line, then half-close": case(lambda e: head(e, length(e))[:-2], CLOSED,
                                                           then="half_close"),
}


def _server_error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(sign.search(line) for sign in SERVER_ERROR_SIGNS)]


def _access_statuses(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"access-log status=(\d{3})", text)]


def _outcome(answer: RawAnswer) -> int | str:
    if answer.status is not None:
        return answer.status
    return CLOSED if answer.closed else answer.describe()


def _assert_still_serving(receiver: Receiver, db: str) -> None:
    good = Signed.new()
    answer = receiver.post(good.body, {"Stripe-Signature": sign(good.body.decode(), WEBHOOK_SECRET)})
    assert (answer.status_code, answer.json()["outcome"]) == (200, "received"), receiver.log(3000)
    assert event_row(db, good.event_id)["status"] == "received"


# gunicorn's own 5xx answers, before the application sees the request (see the module's docstring).
GUNICORN_5XX = {"an unknown transfer coding": "gunicorn answers 501 to a transfer coding it does not implement"}


@pytest.mark.parametrize("name", CASES)
def test_malformed_http_gets_a_4xx_or_a_close_never_a_5xx_nor_a_write_and_the_receiver_keeps_serving(
        request, receiver, db, name):
    if name in GUNICORN_5XX and receiver.server.startswith("gunicorn"):
        request.applymarker(pytest.mark.xfail(reason=GUNICORN_5XX[name], strict=True))
    _check_malformed(receiver, db, name, Signed.new())


# The cases of a body the receiver itself must refuse (the others are the server's, before any endpoint).
BODY_CASES = [name for name, case_ in CASES.items() if case_.outcome == BODY]


@pytest.mark.parametrize("endpoint", ["connect", "thin"])
@pytest.mark.parametrize("name", BODY_CASES)
def test_the_connect_and_thin_endpoints_refuse_a_body_they_cannot_read_whole_as_the_snapshot_endpoint(
        receiver, db, name, endpoint):
    _check_malformed(receiver, db, name, Signed.for_endpoint(endpoint))


def _check_malformed(receiver: Receiver, db: str, name: str, evt: Signed) -> None:
    """Send CASES[name] built on ``evt`` and check what the module's docstring says every case must give."""
    case_ = CASES[name]
    log_start = len(receiver.log())

    started = time.monotonic()
    answer = exchange(receiver.port, case_.build(evt), then=case_.then, wait_s=WAIT_S)
    elapsed = time.monotonic() - started
    if case_.then == "close":
        time.sleep(SETTLE_S)
    server_log = receiver.log()[log_start:]

    outcome = _outcome(answer)
    seen = f"{name}: answered {outcome!r}, server logged {_access_statuses(server_log)}\n{server_log[-3000:]}"
    assert not _server_error_lines(server_log), seen
    assert PAYLOAD_MARKER not in server_log, seen
    if case_.then != "close":
        assert not answer.waited_out, f"no answer within {WAIT_S}s; " + seen
        assert elapsed < WAIT_S + 1, seen
        assert outcome in case_.expect, seen
        assert PAYLOAD_MARKER.encode() not in answer.raw, seen
        if case_.outcome:
            assert b'"outcome":"%s"' % case_.outcome.encode() in answer.raw, seen
    assert event_row(db, evt.event_id) is None, f"the malformed request was recorded; {seen}"

    _assert_still_serving(receiver, db)
    assert count_events(db) == 1 and event_row(db, evt.event_id) is None, seen


def test_a_client_that_stops_mid_head_gets_no_answer_and_holds_up_no_one_else(receiver, db):
    evt = Signed.new()
    log_start = len(receiver.log())
    slow = socket.create_connection(("127.0.0.1", receiver.port), timeout=WAIT_S)
    try:
        slow.sendall(head(evt, length(evt))[:70])  # and nothing more, for now
        time.sleep(0.2)

        _assert_still_serving(receiver, db)
        slow.settimeout(1.0)
        with pytest.raises(socket.timeout):
            slow.recv(1)  # nothing to answer yet: the head has not ended
    finally:
        slow.close()
    time.sleep(SETTLE_S)
    server_log = receiver.log()[log_start:]
    assert not _server_error_lines(server_log), server_log
    assert event_row(db, evt.event_id) is None and count_events(db) == 1


def test_a_client_that_stops_mid_body_holds_up_no_one_else_and_is_not_recorded(receiver, db):
    evt = Signed.new()
    log_start = len(receiver.log())
    slow = socket.create_connection(("127.0.0.1", receiver.port), timeout=WAIT_S)
    try:
        slow.sendall(head(evt, length(evt)) + evt.body[:-20])  # the last 20 bytes never come
        time.sleep(0.2)

        _assert_still_serving(receiver, db)
        slow.settimeout(1.0)
        with pytest.raises(socket.timeout):
            slow.recv(1)
        slow.shutdown(socket.SHUT_WR)  # the client gives up: the server must now answer, or close
        slow.settimeout(WAIT_S)
        answer = slow.recv(65536) or b"<closed>"
    finally:
        slow.close()
    time.sleep(SETTLE_S)
    server_log = receiver.log()[log_start:]
    assert answer.startswith(b"HTTP/1.1 400 ") or answer == b"<closed>", answer
    assert not _server_error_lines(server_log), server_log
    assert event_row(db, evt.event_id) is None and count_events(db) == 1


def test_a_body_that_stops_arriving_gets_400_once_the_body_idle_timeout_has_passed(receiver, db):
    evt = Signed.new()
    log_start = len(receiver.log())
    slow = socket.create_connection(("127.0.0.1", receiver.port), timeout=BODY_IDLE_TIMEOUT_S + WAIT_S)
    try:
        slow.sendall(head(evt, length(evt)) + evt.body[:-20])  # the last 20 bytes never come
        started = time.monotonic()
        answer = read_answer(slow, BODY_IDLE_TIMEOUT_S + WAIT_S)  # the client waits, its side open
        elapsed = time.monotonic() - started
    finally:
        slow.close()
    server_log = receiver.log()[log_start:]

    assert answer.status == 400 and b'"incomplete_body"' in answer.raw, (answer, server_log[-2000:])
    assert BODY_IDLE_TIMEOUT_S - 1 < elapsed < BODY_IDLE_TIMEOUT_S + WAIT_S
    assert not _server_error_lines(server_log), server_log
    _assert_still_serving(receiver, db)
    assert event_row(db, evt.event_id) is None and count_events(db) == 1
