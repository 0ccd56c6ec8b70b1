"""ledgerctl console: the operator console's process, and the password hashes its users are configured with."""
from __future__ import annotations

import os
import sys

import click

from ops.cli.base import cli

# One process, threads for concurrency: a console has a handful of users. (More processes, on any host,
# share the login throttle's counts and the replay jobs, which live in Postgres.)
THREADS = 8


@cli.group(invoke_without_command=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8100, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--certfile", type=click.Path(exists=True, dir_okay=False), help="Serve TLS with this certificate.")
@click.option("--keyfile", type=click.Path(exists=True, dir_okay=False), help="The certificate's key.")
@click.pass_context
def console(ctx: click.Context, host: str, port: int, certfile: str | None, keyfile: str | None):
    """Serve the operator console (its own process, never the receiver's) under gunicorn.

    Configuration: LEDGER_CONSOLE_USERS, LEDGER_CONSOLE_OPERATORS, LEDGER_CONSOLE_SECRET_KEY (and the
    trusted-proxy mode): docs/console.md.
    """
    if ctx.invoked_subcommand is not None:
        return
    from ops.console.settings import ConsoleSettings

    if bool(certfile) != bool(keyfile):
        raise click.UsageError("--certfile and --keyfile go together")
    ConsoleSettings.from_env()  # a configuration error is reported here, before the server starts
    args = [sys.executable, "-m", "gunicorn", "--workers", "1", "--worker-class", "gthread", "--threads",
            str(THREADS), "--bind", f"{host}:{port}", "--access-logfile", "-", "--name", "ledger-console"]
    if certfile:
        args += ["--certfile", certfile, "--keyfile", keyfile]
        os.environ["LEDGER_CONSOLE_SECURE_COOKIES"] = "1"
    os.execv(sys.executable, args + ["ops.console.app:create_app()"])


@console.command("hash-password")
def hash_password():
    """Read a password from standard input; print the hash for LEDGER_CONSOLE_USERS (name:hash)."""
    from ops.console.auth import hash_password as make_hash

    password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        raise click.UsageError("no password on standard input: echo PASSWORD | ledgerctl console hash-password")
    click.echo(make_hash(password))
