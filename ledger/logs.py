"""JSON logs, one object per line.

Lines about an event carry event_id, type, attempt and outcome as fields
(passed with ``extra=``). Payloads and secrets are never logged.
"""
from __future__ import annotations

import logging
import os
import sys

from pythonjsonlogger.json import JsonFormatter

_configured = False


def configure(level: str | None = None) -> None:
    global _configured
    if _configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                       rename_fields={"levelname": "level", "asctime": "ts"}))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("LOG_LEVEL", "INFO"))
    _configured = True
