"""Reading the body, whatever server runs the receiver: a body that cannot be read whole is the
client's doing, answered 400 ``incomplete_body``, never a 500, never recorded.

The server is played by the WSGI environ: ``wsgi.input`` returns short data or raises what a server
raises on broken framing, ``wsgi.input_terminated`` says the server bounds the stream (gunicorn does),
``gunicorn.socket`` is the client socket gunicorn hands over. tests/e2e/test_receiver_framing.py sends
the same to the real gunicorn over a socket.
"""
from __future__ import annotations

import io
import json

import pytest

from devkit.factories import sign
from ledger.http import BODY_IDLE_TIMEOUT_S
from tests.support.constants import WEBHOOK_SECRET
from tests.support.receiver import count_events, event_body


class FramingError(Exception):
    """What a server raises from wsgi.input on a body it cannot frame (gunicorn: InvalidChunkSize...)."""


class FailingInput(io.RawIOBase):
    """A wsgi.input that hands over ``good`` bytes, then raises ``error``."""

    def __init__(self, good: bytes, error: BaseException):
        self._good = io.BytesIO(good)
        self._error = error

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._good.read(size)
        if data:
            return data
        raise self._error


class RecordingSocket:
    """What the receiver does with ``gunicorn.socket``: the timeouts it sets, in order."""

    def __init__(self):
        self.timeout: float | None = None
        self.set: list[float | None] = []

    def gettimeout(self) -> float | None:
        return self.timeout

    def settimeout(self, value: float | None) -> None:
        self.set.append(value)
        self.timeout = value


def _post(client, body: str, wsgi_input, *, length: int | None = None, terminated: bool = True, **environ):
    overrides = {"wsgi.input": wsgi_input, **environ}
    if terminated:
        overrides["wsgi.input_terminated"] = True
    headers = {"Stripe-Signature": sign(body, WEBHOOK_SECRET), "Content-Type": "application/json"}
    overrides["CONTENT_LENGTH"] = str(len(body.encode()) if length is None else length)
    return client.post("/webhooks/stripe", data=b"", headers=headers, environ_overrides=overrides)


@pytest.mark.parametrize("terminated", [True, False], ids=["server bounds the stream", "werkzeug bounds it"])
def test_a_body_shorter_than_its_content_length_gets_400_incomplete_body_and_is_not_recorded(
        receiver_client, db, terminated):
    body = event_body()

    # Every byte of a correctly signed event... but the header promised ten more.
    answer = _post(receiver_client, body, io.BytesIO(body.encode()), length=len(body.encode()) + 10,
                   terminated=terminated)

    assert answer.status_code == 400
    assert answer.get_json()["outcome"] == "incomplete_body"
    assert count_events(db) == 0


@pytest.mark.parametrize("error", [FramingError("invalid chunk size"), OSError("connection reset"),
                                   ValueError("I/O operation on closed file"), TimeoutError("timed out")],
                         ids=lambda e: type(e).__name__)
def test_an_error_of_the_server_while_the_body_is_read_gets_400_not_500(receiver_client, db, error):
    body = event_body()

    answer = _post(receiver_client, body, FailingInput(body.encode()[:100], error))

    assert (answer.status_code, answer.get_json()["outcome"]) == (400, "incomplete_body")
    assert "invalid chunk size" not in answer.get_data(as_text=True)
    assert count_events(db) == 0


def test_the_body_is_read_with_the_idle_timeout_on_gunicorns_socket_and_the_timeout_is_put_back(
        receiver_client, db):
    body = event_body()
    sock = RecordingSocket()
    sock.timeout = 7.5  # whatever the server had set

    answer = _post(receiver_client, body, io.BytesIO(body.encode()), **{"gunicorn.socket": sock})

    assert (answer.status_code, answer.get_json()["outcome"]) == (200, "received")
    assert sock.set == [BODY_IDLE_TIMEOUT_S, 7.5]
    assert count_events(db) == 1


def test_a_whole_body_is_recorded_byte_for_byte(receiver_client, db):
    body = event_body()

    answer = _post(receiver_client, body, io.BytesIO(body.encode()))

    assert (answer.status_code, answer.get_json()["outcome"]) == (200, "received")
    assert answer.get_json()["event_id"] == json.loads(body)["id"]
