"""--compare REV: another revision's product (receiver, workers, sweep, migrations) under this harness in the
same run, from a detached worktree and a virtualenv cached per commit ($BENCH_VENV_CACHE)."""
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
_COMPLETE = ".complete"  # written last: a virtualenv without it was interrupted, and is built again


@dataclass(frozen=True)
class Revision:
    label: str           # "current", or the short hash
    commit: str | None   # None: this checkout's working tree as it is
    checkout: Checkout

    @property
    def current(self) -> bool:
        return self.commit is None

    def migrate(self, database_url: str, broker_url: str) -> None:
        done = subprocess.run([self.checkout.tool("ledgerctl"), "migrate"], cwd=self.checkout.root,
                              env=self.checkout.env(database_url, broker_url),
                              capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"ledgerctl migrate of {self.label} failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _git(*args: str) -> str:
    return subprocess.check_output(["git", *args], cwd=REPO, text=True, timeout=120, stderr=subprocess.PIPE).strip()


def current() -> Revision:
    return Revision("current", None, Checkout())


def prepare(rev: str, work: Path, cleanup: Cleanup, log) -> Revision:
    """``rev`` in a worktree under ``work`` (removed by ``cleanup``) with its virtualenv."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = work / f"rev-{commit[:7]}"
    log(f"--compare {rev}: git worktree add --detach {tree} {commit[:7]}")
    _git("worktree", "add", "--detach", str(tree), commit)
    cleanup.add(f"worktree {tree}",
                lambda: (_git("worktree", "remove", "--force", str(tree)), _git("worktree", "prune")))
    venv = VENV_CACHE / f"venv-{commit}"
    if not (venv / _COMPLETE).exists():
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        log(f"creating a virtualenv for {commit[:7]} (pip install of its tree; once per commit): {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(tree)], capture_output=True, text=True,
                              timeout=1800, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"pip install of {commit[:7]} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        (venv / _COMPLETE).write_text(commit + "\n")
    return Revision(commit[:7], commit, Checkout(root=tree, bin_dir=venv / "bin"))
