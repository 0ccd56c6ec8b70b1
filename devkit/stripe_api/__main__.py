"""``python -m devkit.stripe_api``: the fake Stripe API as a process (see the package docstring)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

import devkit.stripe_api
from devkit.stripe_api.fake import DEFAULT_API_KEY, FakeStripe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.stripe_api",
                                     description=devkit.stripe_api.__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (the printed URL tells which)")
    parser.add_argument("--api-key", default=DEFAULT_API_KEY)
    parser.add_argument("--state", type=Path, help="JSON file: loaded at start when present, written at stop")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="every answer waits this long, as Stripe's take 100-400 ms (default 0)")
    args = parser.parse_args(argv)

    fake = FakeStripe(args.api_key, latency_s=args.latency_ms / 1000)
    if args.state is not None and args.state.exists():
        fake.load_state(json.loads(args.state.read_text()))
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    fake.start(args.port, args.host)
    print(fake.base_url, flush=True)
    while not done.wait(0.2):  # a signal sets it; the timeout only bounds how long a missed wakeup could last
        pass
    fake.stop()
    if args.state is not None:
        args.state.write_text(json.dumps(fake.state()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
