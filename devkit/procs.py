"""Processes of our own: free ports, process groups, waiting, /proc accounting.

Every child starts in a process group of its own (``start_new_session``), so one
``killpg`` ends it with everything it forked (gunicorn's workers, Celery's
prefork children). Used by the tests, the chaos run, the benchmarks and devstack.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, TypeVar

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")

T = TypeVar("T")


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(port: int, host: str = "127.0.0.1", timeout_s: float = 1.0) -> bool:
    """True if something accepts a TCP connection on host:port now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def venv_tool(name: str) -> str:
    """A console script of the running interpreter's environment (gunicorn, celery, ledgerctl), else PATH's."""
    path = VENV_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found next to {sys.executable} nor on PATH")
    return found


def wait_until(check: Callable[[], T], *, timeout_s: float = 30.0, interval_s: float = 0.05,
               what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy; AssertionError naming ``what`` after the deadline.

    ``check`` may raise to give up early (a process it waits on exited).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


def run_together(call: Callable[[int], T], copies: int) -> list[T]:
    """``call(i)`` for i in range(copies), from that many threads released at the same moment.

    Their results in order; an exception in a thread is re-raised here rather than lost.
    """
    start = threading.Barrier(copies)
    results: list = [None] * copies

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = call(i)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(copies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


# -- /proc --------------------------------------------------------------------------------

def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Every process whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def group_alive(pgid: int) -> bool:
    """True while some member of process group ``pgid`` is alive (zombies are dead)."""
    return any(pid_alive(pid) for pid in group_members(pgid))


def leads_group(pid: int) -> bool:
    """True if ``pid`` is alive and the leader of a process group of its own: the process a
    pid file names, not a recycled pid."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z" and int(fields[2]) == pid


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found.extend(int(p) for p in fh.read().split())
    except OSError:
        pass
    return found


def cpu_seconds(pid: int, *, reaped_children: bool = False) -> float:
    """utime + stime of one process (plus those of its children it has reaped, if asked)."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak resident set) of one process, in KiB."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


# -- process groups -------------------------------------------------------------------------

def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, *, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Signal the process group of ``proc``; SIGKILL whatever is left after ``grace_s``, and reap.

    ``grace_s=0`` with SIGKILL is the crash: no cleanup at all. Reparented
    children may linger as zombies until init reaps them; this waits until
    every member of the group is gone or a zombie (dead is dead).
    """
    if proc.poll() is None:
        signal_group(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    signal_group(proc.pid, signal.SIGKILL)  # also stray children of a leader that already exited
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in group_members(proc.pid)):
        time.sleep(0.05)


class Process:
    """One command in a process group of its own, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], env: Mapping[str, str], log_path: Path, *,
                 cwd: Path = REPO):
        self.name = name
        self.cmd = list(cmd)
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Process":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> list[int]:
        return children_of(self.proc.pid) if self.proc is not None else []

    def log(self, tail_chars: int | None = None) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text[-tail_chars:] if tail_chars else text

    def ensure_alive(self) -> None:
        """Raise with the log's tail when the process has exited (for wait_until checks)."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log(3000)}")

    def kill(self) -> None:
        """SIGKILL the whole process group, no cleanup: what a crash or the OOM killer does."""
        if self.proc is not None:
            stop_group(self.proc, grace_s=0, sig=signal.SIGKILL)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group (a clean shutdown), SIGKILL after ``grace_s``."""
        if self.proc is not None:
            stop_group(self.proc, grace_s=grace_s)


class Cleanup:
    """Stops everything registered, newest first, exactly once; Ctrl-C and SIGTERM end a run through it."""

    def __init__(self, label: str = "devkit"):
        self._label = label
        self._actions: list[tuple[str, Callable[[], None]]] = []

    def add(self, what: str, action: Callable[[], None]) -> None:
        self._actions.append((what, action))

    def remove(self, action: Callable[[], None]) -> None:
        self._actions = [(w, a) for w, a in self._actions if a is not action]

    def run(self) -> None:
        # Ctrl-C during cleanup must not leave the rest running.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            while self._actions:
                what, action = self._actions.pop()
                try:
                    action()
                except Exception as exc:  # keep stopping the others
                    print(f"[{self._label}] cleanup of {what} failed: {exc}", file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous)

    def install_signal_handlers(self) -> None:
        def on_term(signum, _frame):
            raise KeyboardInterrupt(f"signal {signum}")
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGHUP, on_term)
        # Also when started with SIGINT ignored (from a non-interactive shell's background job).
        signal.signal(signal.SIGINT, signal.default_int_handler)
