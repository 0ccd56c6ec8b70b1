"""Reading a request body whole, for the receiver (ingest/webhooks.py) and the console (ops/console): the
client's framing is the client's business, so a body that cannot be read whole is a 400 of ours, never
the server's exception turned into a 500."""
from __future__ import annotations

import logging

from flask import request
from werkzeug.exceptions import RequestEntityTooLarge

log = logging.getLogger(__name__)


# How long a server of ours waits for the next bytes of a body (between two reads of the socket, like
# nginx's client_body_timeout); a client that stops sending gets 400 then. Stripe (and a browser) sends a
# body at once. Well below gunicorn's worker --timeout (30 s), past which a sync worker is killed mid-request.
BODY_IDLE_TIMEOUT_S = 10.0


def read_body(max_bytes: int, *, cache: bool = False) -> bytes | None:
    """The request body exactly as the client framed it; None when it cannot be read whole.

    A body that ends before its Content-Length (the client went away, or half-closed), whose chunked
    framing the server rejects while we read it (a bad chunk size, a missing terminator), or whose next
    bytes do not come within BODY_IDLE_TIMEOUT_S is the client's doing: None, answered 400, never an
    exception left to the 500 handler. The exception types are the server's own (gunicorn's parse
    errors, werkzeug's ClientDisconnected, OSError), hence the broad except. Past ``max_bytes`` this
    raises RequestEntityTooLarge (413). ``cache``: keep the bytes for the request's form parsing.
    """
    declared = request.content_length
    # gunicorn hands over its client socket (other servers have timeouts of their own); its default
    # is to wait for the next bytes forever.
    sock = request.environ.get("gunicorn.socket")
    previous_timeout = sock.gettimeout() if sock is not None else None
    try:
        if sock is not None:
            sock.settimeout(BODY_IDLE_TIMEOUT_S)
        body = request.get_data(cache=cache)
        if declared is None and len(body) >= max_bytes and request.environ["wsgi.input"].read(1):
            # A streamed (chunked) body is cut at the limit without an error: one byte more is too large.
            raise RequestEntityTooLarge()
    except RequestEntityTooLarge:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to read the client's bytes is the client's
        log.info("request body not read whole; answering 400", extra={"error_class": type(exc).__name__})
        return None
    finally:
        if sock is not None:
            try:
                sock.settimeout(previous_timeout)
            except OSError:
                pass
    if declared is not None and len(body) != declared:
        # A server may hand over a short body without an error when the client stops early
        # (gunicorn does); the signature could even verify, if the bytes that came are all there was.
        log.info("request body shorter than its Content-Length; answering 400",
                 extra={"content_length": declared, "received_bytes": len(body)})
        return None
    return body
