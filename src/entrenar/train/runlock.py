"""One writer per run directory: an exclusive `fcntl.flock` on RUN/.lock, held while a command writes it.

Issue 29: a second `pretrain --resume auto` on a directory still being trained resumed alongside the
first; its prune of "superseded temporaries" deleted the checkpoint the first was writing (which died),
and both appended to metrics.jsonl. Now `pretrain` / `finetune` (under torchrun: rank 0, before any rank
writes; the others wait for its verdict) take the lock before they write anything, and a second writer
is refused (exit 2) naming the holder. The OS drops a flock with the process holding it, so a run killed
by anything (SIGKILL, the OOM killer, a lost node's launcher) leaves the directory free at once: a crash
never blocks `--resume auto`. The file's text (pid, host, start time, command) is advice for the
refusal message only: the lock is the flock, never the file's existence, and the file is never deleted
(unlinking a locked file would let a third process lock a new one beside it).
Read-only commands (eval, generate, export, verify, qa, plot) take no lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import InputError

LOCK_FILE = ".lock"


class RunLock:
    """The held lock: an open descriptor of RUN/.lock with LOCK_EX on it (released by `release` or by
    the process's exit)."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1


def _holder_text() -> str:
    launcher = os.getppid() if int(os.environ.get("WORLD_SIZE") or 1) > 1 else None  # torchrun's agent
    argv = ["entrenar" if sys.argv[0].endswith("__main__.py") else sys.argv[0], *sys.argv[1:]] if sys.argv else []
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "launcher_pid": launcher,
                       "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": shlex.join(argv)}) + "\n"


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _refusal(run_dir: Path, holder: dict[str, Any]) -> str:
    who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started_at')}: "
           f"{holder.get('command')}") if holder.get("pid") else f"a process (no holder recorded in {LOCK_FILE})"
    stop = f"kill {holder['launcher_pid']} (its torchrun launcher)" if holder.get("launcher_pid") else \
        f"kill {holder.get('pid', 'PID')}"
    return (f"--out {run_dir} is being written by another run ({who}). One command writes a run directory at a "
            f"time. Wait for that run to end, or stop it ({stop} on {holder.get('host', 'its host')}; its newest "
            f"complete checkpoint stays) and continue with --resume auto; a run that died frees the directory "
            f"at once. To read the run meanwhile, eval/generate/export its complete checkpoints "
            f"({run_dir}/checkpoints/latest)")


def _open(path: Path, create: bool) -> int | None:
    try:
        return os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
    except FileNotFoundError:
        return None


def _try_lock(fd: int, run_dir: Path) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:  # e.g. ENOLCK: a network file system without lock support
        raise InputError(f"--out {run_dir}: cannot lock {run_dir / LOCK_FILE} ({e.strerror}); put the run "
                         f"directory on a file system with flock support") from None
    return True


def acquire(run_dir: Path) -> RunLock:
    """Create run_dir if needed and take its lock, recording this process as the holder; InputError
    naming the holder when another process has it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _open(path, create=True)
    assert fd is not None
    try:
        if not _try_lock(fd, run_dir):
            raise InputError(_refusal(run_dir, _read_holder(path)))
    except InputError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, _holder_text().encode(), 0)
    return RunLock(fd, path)


def check_free(run_dir: Path) -> None:
    """InputError naming the holder when another process writes run_dir now (a probe: nothing is
    created and the lock is not kept), so a refused command says why before any other complaint."""
    fd = _open(Path(run_dir) / LOCK_FILE, create=False)
    if fd is None:
        return
    try:
        if not _try_lock(fd, Path(run_dir)):
            raise InputError(_refusal(Path(run_dir), _read_holder(Path(run_dir) / LOCK_FILE)))
    finally:
        os.close(fd)


@contextmanager
def holding(run_dir: Path, run_on_main: Callable[[Callable[[], None]], None]) -> Iterator[None]:
    """The lock of run_dir for the duration of the block, taken by rank 0 (`run_on_main`: every rank
    waits for it and a refusal stops every rank with exit 2)."""
    held: list[RunLock] = []
    run_on_main(lambda: held.append(acquire(run_dir)))
    try:
        yield
    finally:
        for lock in held:
            lock.release()


__all__ = ["LOCK_FILE", "RunLock", "acquire", "check_free", "holding"]
