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

``--floor [REV]`` is the same, from a tree edited before it is installed: its only handler
is one ``*`` handler that returns, so the pipeline (receive, record, wake, claim, apply,
finish) is measured without a business write, and what the business writes cost is the
current revision's figure minus the floor's, the two taking turns in the same run.
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
    label: str           # how the tables name it: the short hash, "floor-<short hash>", or "current"
    commit: str | None   # the full hash; None for this checkout (its working tree as it is)
    checkout: Checkout
    floor: bool = False  # the commit's tree with FLOOR_EDIT applied

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


# The floor's edit of a commit's tree: in one file, one exact text (found there exactly once) and what
# replaces it; and the module that then stands for every built-in handler. A v2 event matches no "*"
# (workers.registry): steady sends none.
FLOOR_EDIT = ("workers/registry.py",
              'BUILT_IN_MODULES = ("workers.billing.handlers", "workers.health")\n',
              'BUILT_IN_MODULES = ("workers.floor_handlers",)\n')
FLOOR_MODULE = ("workers/floor_handlers.py",
                '"""ops/bench --floor: every event handled, nothing written."""\n'
                "from workers.handlers import handler\n\n\n"
                '@handler("*")\n'
                "def nothing(ctx):\n"
                "    return None\n")


def _apply_floor(tree: Path) -> None:
    path, old, new = FLOOR_EDIT
    text = (tree / path).read_text()
    if text.count(old) != 1:
        raise RuntimeError(f"--floor: {path} holds {text.count(old)} copies of {old.strip()!r} in this commit, "
                           "not one: the floor's edit does not apply to it")
    (tree / path).write_text(text.replace(old, new))
    module, source = FLOOR_MODULE
    (tree / module).write_text(source)


def _venv(commit: str, tree: Path, log, suffix: str = "") -> Path:
    venv = VENV_CACHE / f"venv-{commit}{suffix}"
    if (venv / _COMPLETE).exists():
        log(f"reusing the virtualenv of {commit[:7]}{suffix}: {venv}")
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log(f"creating a virtualenv for {commit[:7]}{suffix} (pip install of its tree; once per commit): {venv}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(tree)], capture_output=True, text=True,
                          timeout=1800, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"pip install of {commit[:7]} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    (venv / _COMPLETE).write_text(commit + "\n")
    return venv


def prepare(rev: str, work: Path, cleanup: Cleanup, log, *, floor: bool = False) -> Revision:
    """``rev`` checked out in a worktree under ``work`` (removed by ``cleanup``), with its virtualenv;
    ``floor``: with FLOOR_EDIT applied, and a virtualenv of its own (a plain --compare of the same
    commit keeps its own)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    label = f"floor-{commit[:7]}" if floor else commit[:7]
    tree = work / (label if floor else f"rev-{label}")
    log(f"--{'floor' if floor else 'compare'} {rev}: git worktree add --detach {tree} {commit[:7]}")
    _git("worktree", "add", "--detach", str(tree), commit)

    def remove() -> None:
        _git("worktree", "remove", "--force", str(tree))
        _git("worktree", "prune")
    cleanup.add(f"worktree {tree}", remove)
    if floor:  # before the install, so that the virtualenv's copy is the floor's too
        _apply_floor(tree)
    venv = _venv(commit, tree, log, "-floor" if floor else "")
    return Revision(label, commit, Checkout(root=tree, bin_dir=venv / "bin"), floor)
