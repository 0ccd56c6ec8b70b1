"""The HTTP server of the fake: one thread per connection, keep-alive, Stripe-shaped answers."""
from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Mapping
from urllib.parse import urlsplit

from devkit.stripe_api.params import ApiError, parse_query

if TYPE_CHECKING:
    from devkit.stripe_api.fake import Fault, FakeStripe


class Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    fake: FakeStripe

    def __init__(self, *args, **kwargs):
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        # Keep-alive connections of clients would otherwise hold their handler threads after stop().
        with self._open_lock:
            for request in list(self._open):
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the stripe library's connection pool expects
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms wait for a delayed ACK
    server_version = "FakeStripe/1"
    server: Server

    def log_message(self, format, *args):  # quiet: the request log is the record
        pass

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        fake = self.server.fake
        split = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw_body = self.rfile.read(length) if length else b""
        if split.path.startswith("/_fake/"):
            try:
                body = json.loads(raw_body or b"{}")
                self._send(200, fake._control(method, split.path, body))
            except ApiError as exc:
                self._send(exc.status, exc.body())
            except (KeyError, TypeError, ValueError) as exc:
                self._send(400, ApiError(400, f"bad control request: {exc!r}").body())
            return
        # Errors found before the request is logged are answered after the faults and the key check,
        # in the order Stripe checks them.
        early: ApiError | None = None
        try:
            query = parse_query(split.query)
        except ApiError as exc:
            query, early = {"_raw": split.query}, exc
        try:
            account = account_of(self.headers)
        except ApiError as exc:
            account, early = None, early or exc
        index = fake._log(method, split.path, query, account)
        status = 500
        try:
            slow = fake._take_fault("slow", split.path)
            if slow is not None:
                fake._stopping.wait(slow.seconds)
            elif fake.latency_s:
                fake._stopping.wait(fake.latency_s)  # as long as Stripe takes to answer
            failure = fake._take_fault("fail", split.path)
            if failure is not None:
                raise fault_error(failure)
            fake._authorize(self.headers.get("Authorization"))
            if early is not None:
                raise early
            if method != "GET":
                raise ApiError(404, f"Unrecognized request URL ({method}: {split.path}).")
            status, answer, headers = 200, fake._answer(split.path, query, account), {}
        except ApiError as exc:
            status, answer, headers = exc.status, exc.body(), exc.headers
        except Exception as exc:  # a bug of the fake: still a Stripe-shaped answer, and visible
            status, answer, headers = 500, ApiError(500, f"fake Stripe API bug: {exc!r}", type="api_error").body(), {}
        finally:
            fake._answered(index, status)
        self._send(status, answer, headers)

    def _send(self, status: int, answer: Any, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(answer).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Request-Id", f"req_{secrets.token_hex(7)}")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up (its timeout during a slow fault), or stop() closed the connection


def account_of(headers: Mapping[str, str]) -> str | None:
    """The connected account a request is made for: ``Stripe-Account``, or ``Stripe-Context`` (what
    stripe-python sends for its ``stripe_context`` option); None is the platform. Two different
    accounts in the two headers is a 400."""
    account = headers.get("Stripe-Account") or None
    context = headers.get("Stripe-Context") or None
    if account is not None and context is not None and account != context:
        raise ApiError(400, f"The Stripe-Account header ({account}) and the Stripe-Context header ({context}) "
                            "name different accounts. Send one of them, or the same account in both.")
    return account or context


def fault_error(fault: Fault) -> ApiError:
    headers = {"Retry-After": f"{fault.retry_after:g}"} if fault.retry_after is not None else {}
    if fault.status == 429:
        return ApiError(429, "Request rate limit exceeded. You can learn more about rate limits here "
                             "https://stripe.com/docs/rate-limits.", code="rate_limit", headers=headers)
    if fault.status >= 500:
        return ApiError(fault.status, "An unknown error occurred (injected by the fake).", type="api_error",
                        headers=headers)
    return ApiError(fault.status, "Injected failure.", headers=headers)
