"""HTTP/1.1 over a raw socket, for requests no HTTP client library would send: broken framing, odd
header bytes, a client that half-closes or goes away mid-request.

``exchange`` sends bytes exactly as given, then keeps the connection, half-closes it (``shutdown(SHUT_WR)``:
the client will send nothing more but still reads) or closes it, and reads what the server answers within
a bounded time. The answer is classified, never guessed: a status line, the server closing without a byte,
or nothing yet when the time was up.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Iterable, Literal

Then = Literal["keep", "half_close", "close"]


@dataclass
class RawAnswer:
    """What came back on one connection.

    ``status`` is the final (non-1xx) answer's status code, None when no status line came back.
    ``closed``: the server closed the connection (FIN or RST) by the end of the wait.
    ``waited_out``: the wait ended with the connection still open and no complete answer.
    ``sent_all``: every byte of the request went out (a server may close before reading them all).
    """

    status: int | None
    closed: bool
    waited_out: bool
    sent_all: bool
    raw: bytes = b""
    interim: list[int] = field(default_factory=list)

    def describe(self) -> str:
        if self.status is not None:
            return f"{self.status}"
        if self.closed:
            return "closed without an answer"
        if self.waited_out:
            return "no answer yet, connection open"
        return "nothing read (client closed its side)"


def exchange(port: int, pieces: bytes | Iterable[bytes], *, then: Then = "keep", wait_s: float = 5.0,
             pause_s: float = 0.0, host: str = "127.0.0.1") -> RawAnswer:
    """Send ``pieces`` (``pause_s`` between two pieces), then ``then``, and read the answer for up to ``wait_s``.

    With ``then="close"`` nothing can be read: the answer only says whether the bytes went out.
    """
    if isinstance(pieces, (bytes, bytearray)):
        pieces = [bytes(pieces)]
    sock = socket.create_connection((host, port), timeout=wait_s)
    try:
        sent_all = _send(sock, list(pieces), pause_s)
        if then == "close":
            return RawAnswer(status=None, closed=False, waited_out=False, sent_all=sent_all)
        if then == "half_close":
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        return _read_answer(sock, sent_all, time.monotonic() + wait_s)
    finally:
        sock.close()


def read_answer(sock: socket.socket, wait_s: float) -> RawAnswer:
    """Read what the server answers on a connection the caller holds, for up to ``wait_s``."""
    return _read_answer(sock, True, time.monotonic() + wait_s)


def _send(sock: socket.socket, pieces: list[bytes], pause_s: float) -> bool:
    for index, piece in enumerate(pieces):
        if index and pause_s:
            time.sleep(pause_s)
        try:
            sock.sendall(piece)
        except OSError:  # the server answered and closed before taking everything
            return False
    return True


def _read_answer(sock: socket.socket, sent_all: bool, deadline: float) -> RawAnswer:
    data = b""
    interim: list[int] = []
    closed = False
    while True:
        complete = _complete_answer(data, interim)
        if complete is not None:
            status, used = complete
            return RawAnswer(status=status, closed=False, waited_out=False, sent_all=sent_all,
                             raw=data[:used], interim=interim)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        sock.settimeout(remaining)
        try:
            piece = sock.recv(65536)
        except socket.timeout:
            break
        except OSError:  # ECONNRESET: closed, possibly with an answer we already hold
            closed = True
            break
        if not piece:
            closed = True
            break
        data += piece
    status = _status_of_final(data, interim)
    return RawAnswer(status=status, closed=closed, waited_out=not closed, sent_all=sent_all, raw=data,
                     interim=interim)


def _complete_answer(data: bytes, interim: list[int]) -> tuple[int, int] | None:
    """(status, bytes used) once a whole final answer is in ``data``; 1xx answers are skipped (and noted)."""
    offset = 0
    interim.clear()
    while True:
        end = data.find(b"\r\n\r\n", offset)
        if end < 0:
            return None
        head = data[offset:end]
        status = _status(head)
        if status is None:
            return None
        if 100 <= status < 200:
            interim.append(status)
            offset = end + 4
            continue
        length = _content_length(head)
        if length is None:
            return None  # delimited by the close: wait for it
        if len(data) - (end + 4) >= length:
            return status, end + 4 + length
        return None


def _status_of_final(data: bytes, interim: list[int]) -> int | None:
    offset = 0
    while True:
        line_end = data.find(b"\r\n", offset)
        status = _status(data[offset:line_end if line_end >= 0 else len(data)])
        if status is None or not 100 <= status < 200:
            return status
        end = data.find(b"\r\n\r\n", offset)
        if end < 0:
            return None
        interim.append(status)
        offset = end + 4


def _status(head: bytes) -> int | None:
    parts = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return None


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            return int(value.strip())
    return None
