"""Stop signals: SIGINT (Ctrl-C) and SIGTERM (SLURM preemption, `docker stop`, torchrun stopping its
workers) end a command the same way (docs/design.md, "Command line"): the running step is abandoned,
the message names the last complete checkpoint and the resume command, the --json line comes, and the
exit code is 128 + the signal (130 for SIGINT, 143 for SIGTERM). Without a handler SIGTERM killed a
run with 143 and no word (issue 28).

Under torchrun the launcher forwards the signal it gets to every worker. Rank 0 raises
KeyboardInterrupt (once: a repeat is the same stop); the other ranks only record the signal and go on
until rank 0's exit ends their collectives, then leave quietly, so the job prints one message and one
JSON line. A leaf module (no torch), so `cli.main` installs it for every command.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130: what shells report for Ctrl-C

_received: list[int] = []  # the stop signals of this command, in order
_reporting = False  # a failure is being reported: a signal now is recorded, not raised
_deferring = 0  # inside `deferred()`: a signal is recorded and raised when the block ends


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE") or 1) > 1


def _not_rank0() -> bool:
    return under_torchrun() and int(os.environ.get("RANK") or 0) != 0


def _on_signal(signum: int, frame: FrameType | None) -> None:
    repeat = bool(_received)
    _received.append(signum)
    if _reporting or _not_rank0() or (repeat and under_torchrun()):
        return
    if _deferring:  # raised when the deferred block ends
        return
    raise KeyboardInterrupt  # every `except KeyboardInterrupt` (the trainer's, data pack's clean-up) applies


@contextmanager
def handled() -> Iterator[None]:
    """SIGINT and SIGTERM handled as above for the duration of one command; the previous handlers
    come back afterwards (tests call `cli.main` many times in one process)."""
    global _reporting
    _received.clear()
    _reporting = False
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """A stop signal during the block is recorded, and raised as KeyboardInterrupt when the block has ended (not
    when it raised something else): a block that must not stop halfway (taking a checkpoint's snapshot and starting
    its writer, so that the stop waits for that write instead of leaving it unnamed) runs to its end first."""
    global _deferring
    before = len(_received)
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and len(_received) > before and not _reporting and not _not_rank0() and \
            not (before and under_torchrun()):
        raise KeyboardInterrupt


def reporting() -> None:
    """From now on a stop signal is only recorded: the command is already reporting how it ended (and
    torchrun's SIGTERM to the survivors of a lost rank must not cut that report short)."""
    global _reporting
    _reporting = True


def received() -> int | None:
    """The first stop signal this command got, or None."""
    return _received[0] if _received else None


def exit_code() -> int:
    """128 + the first stop signal (130 for Ctrl-C or a KeyboardInterrupt raised by code)."""
    return 128 + _received[0] if _received else EXIT_INTERRUPTED


def name() -> str:
    return signal.Signals(_received[0]).name if _received else "SIGINT"


__all__ = ["EXIT_INTERRUPTED", "deferred", "exit_code", "handled", "name", "received", "reporting", "under_torchrun"]
