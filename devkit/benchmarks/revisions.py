"""``ops/bench --compare REV``: an older revision of the product, run beside this checkout under this harness.

What runs from the older revision is the product alone: its receiver (gunicorn), its
workers (celery), its sweep and its migrations (``ledgerctl migrate``), each from a
virtualenv of its own with the revision's tree as working directory and PYTHONPATH.
Everything else (the private servers, the payloads, the load generator, the
accounting, the tables) is this checkout's, so both revisions are measured by the
same harness in the same run, and each figure is a ratio measured side by side.

The tree is a ``git worktree add --detach`` in the run's directory, removed when the
run ends. The virtualenv (``pip install`` of that tree, from the configured index)
is kept under ``$BENCH_VENV_CACHE`` (default ``~/.cache/stripe-ledger-bench``), named
by the full commit hash, so a second run reuses it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from devkit.procs import REPO, Cleanup
from devkit.stack import Checkout

VENV_CACHE = Path(os.environ.get("BENCH_VENV_CACHE", Path.home() / ".cache" / "stripe-ledger-bench"))
# Written last: a virtualenv without it was interrupted while being built and is built again.
_COMPLETE = ".complete"


@dataclass(frozen=True)
class Revision:
    """One revision of the product under measurement."""
    label: str           # how the tables name it: the short hash, or "current"
    commit: str | None   # the full hash; None for this checkout (its working tree as it is)
    checkout: Checkout

    @property
    def current(self) -> bool:
        return self.commit is None

    def migrate(self, database_url: str, broker_url: str) -> None:
        """The revision's own ``ledgerctl migrate`` on ``database_url``."""
        done = subprocess.run([self.checkout.tool("ledgerctl"), "migrate"], cwd=self.checkout.root,
                              env=self.checkout.env(database_url, broker_url),
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"ledgerctl migrate of {self.label} failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()


def current() -> Revision:
    """This checkout, its working tree as it is (uncommitted changes included)."""
    return Revision("current", None, Checkout())


def _venv(commit: str, tree: Path, log) -> Path:
    venv = VENV_CACHE / f"venv-{commit}"
    if (venv / _COMPLETE).exists():
        log(f"reusing the virtualenv of {commit[:7]}: {venv}")
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log(f"creating a virtualenv for {commit[:7]} (pip install of its tree; once per commit): {venv}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(tree)], capture_output=True, text=True,
                          timeout=1800, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"pip install of {commit[:7]} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    (venv / _COMPLETE).write_text(commit + "\n")
    return venv


def prepare(rev: str, work: Path, cleanup: Cleanup, log) -> Revision:
    """``rev`` checked out in a worktree under ``work`` (removed by ``cleanup``), with its virtualenv."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = work / f"rev-{commit[:7]}"
    log(f"--compare {rev}: git worktree add --detach {tree} {commit[:7]}")
    _git("worktree", "add", "--detach", str(tree), commit)

    def remove() -> None:
        _git("worktree", "remove", "--force", str(tree))
        _git("worktree", "prune")
    cleanup.add(f"worktree {tree}", remove)
    venv = _venv(commit, tree, log)
    return Revision(commit[:7], commit, Checkout(root=tree, bin_dir=venv / "bin"))
