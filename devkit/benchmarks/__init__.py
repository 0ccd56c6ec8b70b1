"""Benchmarks of the receiver, the workers and the ledger, each measured next to
what Postgres itself does with the same statements on the same machine, in the
same run (``ops/bench``; see docs/benchmarks.md).

Not part of the test suite: it starts a private Postgres and Redis, the real
receiver (gunicorn) and real workers (celery), drives them with wrk and pgbench,
and removes everything it started when it ends (also on Ctrl-C).
"""
