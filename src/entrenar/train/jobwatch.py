"""The job around a torchrun worker: its launcher, its peers, and how the job ended.

- A worker whose launcher is gone (the torchrun agent SIGKILLed, its node's session closed) stops at
  once (SIGKILL to itself, no further writes), so the run directory's lock goes with the job and a
  resume can start (issue 29). The launcher is polled (`os.getppid()` changes when the parent dies);
  PR_SET_PDEATHSIG is not used because it fires when the *thread* that started the worker ends.
- Every rank's (host, pid) is gathered when the job is joined, so a survivor of a rank killed by the
  OS (the OOM killer, a crash) names the lost rank instead of gloo/NCCL's "Connection reset by peer",
  with the last complete checkpoint and the resume command: `RankLost`, exit 4 (issue 28). The lowest
  surviving rank speaks for the job.
- Rank 0 marks an orderly end in the job's store before it exits (`announce_end`), so the other ranks,
  whose collectives fail once it is gone, tell "rank 0 reported and left" (quiet exit) from "rank 0
  was killed" (they report it).
- The resume command of a distributed run is the launcher's own command line (its options as typed,
  read from /proc), not a single-process one that the changed global batch would refuse.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import stops
from ..errors import EntrenarError
from .distributed import DistContext, current, init_from_env, shutdown

EXIT_RANK_LOST = 4
WATCH_INTERVAL_S = 0.5  # a worker outlives its launcher by at most this (plus the SIGKILL)
PEER_DEATH_WAIT_S = 3.0  # how long a failed collective waits for the peer's death to show in /proc
END_KEY = "entrenar/rank0-ended"

_peers: list[tuple[str, int]] = []  # (host, pid) of every rank, in rank order


class RankLost(EntrenarError):
    """A rank of the job died under it. `speaks`: this rank prints the job's message (the lowest survivor)."""

    exit_code = EXIT_RANK_LOST

    def __init__(self, lost: list[int], checkpoint: Path | None, resume_command: str | None, speaks: bool):
        self.lost_ranks, self.speaks = sorted(lost), speaks
        self.checkpoint = str(checkpoint) if checkpoint is not None else None
        self.resume_command = resume_command or "the same torchrun command with --resume auto"
        ranks = ", ".join(str(r) for r in self.lost_ranks)
        then = (f"the last complete checkpoint is {self.checkpoint}; continue with: {self.resume_command}"
                if self.checkpoint else "no checkpoint was written yet, so a rerun starts from step 0")
        super().__init__(f"rank {ranks} of this {len(_peers) or '?'}-rank job died (killed by the OS, e.g. the "
                         f"out-of-memory killer, or crashed: see its own output and the launcher's summary), so "
                         f"the job stopped; {then}")


class JobEnded(EntrenarError):
    """On a rank other than 0: rank 0 ended the job in order and reported it; this rank leaves quietly."""

    speaks = False

    def __init__(self, exit_code: int):
        self.exit_code = exit_code
        super().__init__(f"rank 0 ended the job (exit {exit_code})")


def start(ctx: Any) -> None:
    """At join time, on every rank (a collective): record the peers and watch the launcher."""
    global _peers
    _peers = [tuple(p) for p in ctx.all_gather_object((socket.gethostname(), os.getpid()))]
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(WATCH_INTERVAL_S)
        try:
            print(f"entrenar: rank {ctx.rank}: the launcher (pid {launcher}) is gone; this worker stops",
                  file=sys.stderr, flush=True)
        except OSError:  # the launcher's terminal or pipe may be gone with it: stop regardless
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="entrenar-launcher-watch", daemon=True).start()


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a killed child of the launcher is a zombie until the launcher reaps it
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def lost_ranks(wait_s: float = 0.0) -> list[int]:
    """Ranks on this host whose process has died (waiting up to `wait_s` for one to show). Ranks on
    other hosts cannot be seen from here and are not listed."""
    host, me = socket.gethostname(), os.getpid()
    local = [(r, pid) for r, (h, pid) in enumerate(_peers) if h == host and pid != me]
    deadline = time.monotonic() + wait_s
    while True:
        lost = [r for r, pid in local if _dead(pid)]
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.05)


def _store() -> Any:
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None


def announce_end(code: int) -> None:
    """Rank 0, leaving in order: tell the other ranks (through the launcher's store) before exiting."""
    try:
        store = _store()
        if store is not None:
            store.set(END_KEY, str(code))
    except RuntimeError as e:  # the launcher (which hosts the store) is gone: no rank is left to tell
        print(f"note: could not record the job's end for the other ranks ({e})", file=sys.stderr, flush=True)


def _rank0_ended() -> bool:
    try:
        store = _store()
        return store is not None and store.check([END_KEY])
    except RuntimeError:  # the store is gone with the launcher: this worker is being stopped anyway
        return True


def join_job(device: str = "cpu") -> DistContext:
    """`init_from_env` for a command: the process group is left again when the process exits
    (also after an error), so a failed rank does not leave its peers waiting on a dead group."""
    ctx = init_from_env(device)
    if ctx.active:
        atexit.register(shutdown)
        start(ctx)  # the peers' pids, and stop when the launcher is gone
    return ctx


def judge_failure(e: BaseException, checkpoint: Path | None, resume_command: str | None) -> BaseException:
    """What to raise for `e`, which ended this rank's part of a distributed run: RankLost when a peer
    died; JobEnded (quiet) on a rank other than 0 once rank 0 ended the job in order; else `e`. A verdict
    of the command itself (an EntrenarError) and anything outside torchrun stay `e`."""
    ctx = current()
    if not ctx.active or isinstance(e, EntrenarError):
        return e
    stops.reporting()  # torchrun SIGTERMs the survivors of a lost rank: let this report finish
    if ctx.rank != 0 and _rank0_ended():
        return JobEnded(stops.exit_code() if stops.received() is not None else 1)
    lost = lost_ranks(0.0 if isinstance(e, KeyboardInterrupt) else PEER_DEATH_WAIT_S)
    if not lost:
        return e
    alive = [r for r in range(ctx.world) if r not in lost]
    return RankLost(lost, checkpoint, resume_command, speaks=bool(alive) and ctx.rank == min(alive))


def launcher_words() -> list[str]:
    """`torchrun OPTIONS ENTRY` of this job: the launcher's options and entry (`-m entrenar`, a script)
    as typed, read from its /proc/PID/cmdline; rebuilt from torchrun's environment when that cannot be
    read. ENTRY's own arguments (sys.argv[1:]) are the caller's."""
    ours = sys.argv[1:]
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except (OSError, UnicodeDecodeError):
        words = []
    tail = len(words) - len(ours)
    if words[tail:] == ours:
        for i, w in enumerate(words[:tail]):
            if Path(w).name == "torchrun" or (w == "torch.distributed.run" and i and words[i - 1] == "-m"):
                return ["torchrun", *words[i + 1:tail]]
    words = ["torchrun", "--nproc-per-node", os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))]
    nodes = int(os.environ.get("GROUP_WORLD_SIZE") or 1)
    if nodes > 1:
        words += ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"]
    return [*words, "-m", "entrenar"]


__all__ = ["EXIT_RANK_LOST", "JobEnded", "RankLost", "announce_end", "join_job", "judge_failure", "launcher_words",
           "lost_ranks", "start"]
