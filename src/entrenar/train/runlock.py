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

Several nodes (torchrun --nnodes, issue 37): rank 0 alone takes the lock, so it holds across nodes only
when every node sees the same directory (a shared file system mounted at the same path). `check_shared`
proves it at the start: rank 0 writes a random nonce into RUN/.nodes-check, and the first process of
every node reads it back; a node that does not see it stops the job with exit 2 naming the node, before
a step is trained (else node 1 would resume from a checkpoint it cannot read, or not at all).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..fileio import open_no_follow

LOCK_FILE = ".lock"
SHARED_CHECK = ".nodes-check"  # rank 0's nonce, read back by every node (check_shared); removed after


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
    try:  # never through a link planted as RUN/.lock: its target would be truncated and overwritten (issue 51)
        return open_no_follow(path, os.O_RDWR | (os.O_CREAT if create else 0))
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
    naming the holder when another process has it, or naming a link planted in place of a run's file."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _open(path, create=True)
    assert fd is not None
    try:
        if not _try_lock(fd, run_dir):
            raise InputError(_refusal(run_dir, _read_holder(path)))
        refuse_links(run_dir)  # again under the lock: nothing is written through a link planted since the probe
    except InputError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, _holder_text().encode(), 0)
    return RunLock(fd, path)


# The files a run writes at the top of its directory (docs/design.md "Run directory"); a symbolic link in the place
# of one is refused before anything is written: a file entrenar writes is never written through a link. (Directories
# may be links, checkpoints/ on another disk; final/ and every temporary replace a link, fileio.clear_path.)
RUN_ENTRIES = ("run.json", "data_report.json", "preflight.json", "metrics.jsonl", "eval.jsonl", "profile.json",
               SHARED_CHECK)


def refuse_links(run_dir: Path) -> None:
    """InputError naming the first of RUN_ENTRIES in run_dir that is a symbolic link (issue 51)."""
    for name in RUN_ENTRIES:
        entry = Path(run_dir) / name
        if entry.is_symlink():
            raise InputError(f"--out {run_dir}: {entry} is a symbolic link (to {os.readlink(entry)}), where a run "
                             f"writes its own file; links there are never followed, so nothing was written: remove "
                             f"the link (or choose another --out)")


def check_free(run_dir: Path) -> None:
    """InputError naming the holder when another process writes run_dir now (a probe: nothing is
    created and the lock is not kept), so a refused command says why before any other complaint; or naming a
    symbolic link planted in place of a file the run writes (refuse_links)."""
    fd = _open(Path(run_dir) / LOCK_FILE, create=False)
    if fd is not None:
        try:
            if not _try_lock(fd, Path(run_dir)):
                raise InputError(_refusal(Path(run_dir), _read_holder(Path(run_dir) / LOCK_FILE)))
        finally:
            os.close(fd)
    refuse_links(run_dir)  # before any other check reads them


def _write_nonce(run_dir: Path) -> str:
    nonce = secrets.token_hex(16)
    with os.fdopen(open_no_follow(run_dir / SHARED_CHECK, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
        f.write(nonce)
        f.flush()
        os.fsync(f.fileno())  # on the server before any node looks (NFS: close-to-open)
    return nonce


def _read_nonce(run_dir: Path) -> str:
    try:
        return (run_dir / SHARED_CHECK).read_text()
    except OSError as e:
        return f"<{e.strerror}>"


def check_shared(run_dir: Path, ctx: Any) -> None:
    """Under torchrun with several nodes (`ctx`: the job's DistContext): every node sees the file rank 0
    wrote in run_dir, else InputError on every rank naming the nodes that do not (a collective; nothing
    in one node). The file is removed again by rank 0."""
    if not ctx.active or ctx.nodes <= 1:
        return
    run_dir = Path(run_dir)
    nonce = ctx.run_on_main(lambda: _write_nonce(run_dir))  # every rank gets it after rank 0 wrote it
    seen = _read_nonce(run_dir) if ctx.local_rank == 0 else nonce  # one reader per node
    views = ctx.all_gather_object((ctx.node, socket.gethostname(), seen == nonce, os.path.abspath(run_dir)))
    ctx.run_on_main(lambda: (run_dir / SHARED_CHECK).unlink(missing_ok=True))
    blind = sorted({(node, host, path) for node, host, same, path in views if not same})
    if blind:
        names = "; ".join(f"node {node} (host {host}, --out resolved to {path})" for node, host, path in blind)
        err = InputError(f"--out {run_dir} is not the same directory on every node: {names} does not see the file "
                         f"rank 0 (node 0, host {views[0][1]}) wrote in {views[0][3]}. A run of several nodes "
                         f"writes its run directory from rank 0 and every node reads its checkpoints on resume: "
                         f"put --out on a file system every node mounts at the same path (NFS, Lustre, ...) and "
                         f"give it as an absolute path")
        err.job_wide = True  # every rank raises it: rank 0 alone prints it (cli/main.py)
        raise err


@contextmanager
def holding(run_dir: Path, run_on_main: Callable[[Callable[[], None]], None], ctx: Any = None) -> Iterator[None]:
    """The lock of run_dir for the duration of the block, taken by rank 0 (`run_on_main`: every rank
    waits for it and a refusal stops every rank with exit 2); with `ctx` (the job's DistContext) of
    several nodes, every node is shown to see the same directory first (`check_shared`)."""
    held: list[RunLock] = []
    run_on_main(lambda: held.append(acquire(run_dir)))
    try:
        if ctx is not None:
            check_shared(run_dir, ctx)
        yield
    finally:
        for lock in held:
            lock.release()


__all__ = ["LOCK_FILE", "RUN_ENTRIES", "SHARED_CHECK", "RunLock", "acquire", "check_free", "check_shared", "holding",
           "refuse_links"]
