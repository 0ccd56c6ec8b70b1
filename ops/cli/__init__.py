"""ledgerctl: the operator's command line.

Human tables by default, ``--json`` for scripts. Exit codes: 0 done, 1 the
command ran but found nothing / not everything succeeded, 2 bad usage or
configuration; ``catchup`` adds 3 (an unrecoverable gap); 4 means another
process is doing the same work (a catch-up of the account, a retention run, a
partition migration, a rebuild).
"""

import sys

import click

from ledger.errors import ConfigError, LedgerError
# Importing a command group's module registers its commands on ``cli``.
from ops.cli import console, events, objects, outbox, reproject, retention, stripe  # noqa: F401
from ops.cli.base import cli


__all__ = ["cli", "main"]


def main():
    import logging

    import psycopg
    from psycopg_pool import PoolTimeout

    # The pool's own reconnect warnings would bury the one line an operator needs.
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)
    try:
        cli(standalone_mode=True)
    except (ConfigError, LedgerError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except (PoolTimeout, psycopg.OperationalError) as exc:
        click.echo(f"error: {_database_error(exc)}", err=True)
        sys.exit(1)


def _database_error(exc: Exception) -> str:
    """What an operator reads when Postgres stopped a command: unreachable, or a statement it refused
    (a deadlock, a lock timeout) and rolled back, named by class and SQLSTATE only (its message
    may quote a row)."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate is None or sqlstate.startswith(("08", "57P")):
        return f"the ledger database is unreachable ({type(exc).__name__})"
    why = f"{type(exc).__name__}, SQLSTATE {sqlstate}"
    if sqlstate.startswith(("40", "55P03")):
        return (f"the ledger database stopped a statement that met concurrent work ({why}); "
                f"it rolled back: run the command again")
    return f"the ledger database refused a statement ({why})"

