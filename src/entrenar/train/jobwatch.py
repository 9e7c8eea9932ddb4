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
- Several nodes (torchrun --nnodes, issue 37): a rank on another host cannot be seen in /proc. A worker
  whose launcher died records that in the job's store (GONE_KEY/NODE) before it kills itself; a survivor
  whose collective failed, or whom its own launcher SIGTERMed (a launcher that loses the rendezvous
  store, hosted by the lost node, stops its workers), names the nodes so recorded. Without such a record
  (the host down at once) the survivors answer a roll call in the store (`roll_call`: its key set, then
  up to ROLL_CALL_S for the others') and the ranks that did not answer are lost. The message names the
  node (host, ranks) when a whole node is gone. The workers' store is served by node 0's launcher
  (torchrun: MASTER_ADDR/PORT of group rank 0's agent), so a store that cannot be reached means node 0 is
  gone; a node-0 launcher that ended in order keeps it up until every node is done (torchrun's exit
  barrier), so this is not mistaken for rank 0's orderly end.
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
ROLL_KEY = "entrenar/roll-call"  # set by the first survivor of a failed collective that calls the roll
ALIVE_KEY = "entrenar/alive"  # + /RANK: a live process's answer (from its watcher thread)
ROLL_CALL_S = 5.0  # how long survivors wait for each other's answers (a node's ranks fail within ~a second)
GONE_KEY = "entrenar/launcher-gone"  # + /NODE: that node's workers saw their launcher die
GONE_WAIT_S = 2.0  # a signalled survivor waits this long for a lost node's record (its watcher polls at 0.5 s)
LOST_KEY = "entrenar/lost"  # the ranks a finished roll call found missing (read by a survivor SIGTERMed meanwhile)

_peers: list[tuple[str, int, int]] = []  # (host, pid, node) of every rank, in rank order


class RankLost(EntrenarError):
    """A rank of the job died under it. `speaks`: this rank prints the job's message (the lowest survivor)."""

    exit_code = EXIT_RANK_LOST

    def __init__(self, lost: list[int], checkpoint: Path | None, resume_command: str | None, speaks: bool):
        self.lost_ranks, self.speaks = sorted(lost), speaks
        self.checkpoint = str(checkpoint) if checkpoint is not None else None
        self.resume_command = resume_command or "the same torchrun command with --resume auto"
        self.lost_nodes = lost_nodes(self.lost_ranks) or None
        if self.lost_nodes:  # the JSON line's "details" (cli/main.py)
            self.details = {"lost_nodes": self.lost_nodes, "hosts": sorted({_peers[r][0] for r in self.lost_ranks})}
        ranks = ", ".join(str(r) for r in self.lost_ranks)
        then = (f"the last complete checkpoint is {self.checkpoint}; continue with: {self.resume_command}"
                if self.checkpoint else "no checkpoint was written yet, so a rerun starts from step 0")
        if self.lost_nodes:
            nodes = len({p[2] for p in _peers})
            which = "; ".join(f"node {n} (host {_peers[rs[0]][0]}, ranks {', '.join(str(r) for r in rs)})"
                              for n, rs in ((n, _node_ranks(n)) for n in self.lost_nodes))
            super().__init__(f"{which} of this {nodes}-node, {len(_peers)}-rank job was lost (its launcher killed, "
                             f"the host down or unreachable), so the job stopped; {then}")
            return
        super().__init__(f"rank {ranks} of this {len(_peers) or '?'}-rank job died (killed by the OS, e.g. the "
                         f"out-of-memory killer, or crashed: see its own output and the launcher's summary), so "
                         f"the job stopped; {then}")


def _node_ranks(node: int) -> list[int]:
    return [r for r, p in enumerate(_peers) if p[2] == node]


def lost_nodes(lost: list[int]) -> list[int]:
    """The nodes of a job of several nodes all of whose ranks are in `lost` (empty on one node)."""
    nodes = sorted({p[2] for p in _peers})
    if len(nodes) < 2:
        return []
    return [n for n in nodes if set(_node_ranks(n)) <= set(lost)]


class JobEnded(EntrenarError):
    """On a rank other than 0: rank 0 ended the job in order and reported it; this rank leaves quietly (with
    rank 0's exit code)."""

    speaks = False

    def __init__(self, exit_code: int):
        self.exit_code = exit_code
        super().__init__(f"rank 0 ended the job (exit {exit_code})")


_launcher: int | None = None  # this worker's launcher (its parent when it joined the job)


def launcher_gone() -> bool:
    """True once this worker's launcher is gone (the worker was re-parented)."""
    return _launcher is not None and os.getppid() != _launcher


def leave_without_launcher(ctx: Any) -> None:
    """This worker's launcher is gone: say so and stop at once (SIGKILL to itself, no further writes). The line goes to
    the process's own stderr (sys.__stderr__), not sys.stderr, which ranks other than 0 point at /dev/null while they
    train: the first rank to notice may be any rank (issue 29)."""
    try:
        print(f"entrenar: rank {ctx.rank}: the launcher (pid {_launcher}) is gone; this worker stops",
              file=sys.__stderr__, flush=True)
    except (OSError, AttributeError):  # the launcher's terminal or pipe may be gone with it: stop regardless
        pass
    if ctx.nodes > 1:  # tell the other nodes which node is gone (they cannot see this host's processes)
        _tell(f"{GONE_KEY}/{ctx.node}", socket.gethostname(), timeout_s=1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def start(ctx: Any) -> None:
    """At join time, on every rank (a collective): record the peers and watch the launcher."""
    global _peers, _launcher
    _peers = [tuple(p) for p in ctx.all_gather_object((socket.gethostname(), os.getpid(), ctx.node))]
    _launcher = os.getppid()

    def watch() -> None:
        answered = ctx.nodes <= 1  # several nodes: this thread answers a roll call (roll_call)
        while not launcher_gone():
            time.sleep(WATCH_INTERVAL_S)
            if not answered:
                answered = _answer_roll_call(ctx.rank)
        leave_without_launcher(ctx)

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
    local = [(r, pid) for r, (h, pid, _) in enumerate(_peers) if h == host and pid != me]
    deadline = time.monotonic() + wait_s
    while True:
        lost = [r for r, pid in local if _dead(pid)]
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.05)


def ranks_gone(ctx: DistContext) -> list[int]:
    """The ranks of the job found gone now, without waiting or calling a roll: those whose process died on this
    host, and those of the other nodes recorded lost (nodes_gone; all of node 0 when its store cannot be reached)."""
    lost = set(lost_ranks(0.0))
    if ctx.nodes > 1:
        gone = nodes_gone(ctx, 0.0)
        lost.update(_node_ranks(0) if gone is None else [r for n in gone for r in _node_ranks(n)])
    return sorted(lost)


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


def _tell(key: str, value: str, timeout_s: float) -> None:
    """Set `key` in the job's store, waiting at most timeout_s (a store whose host is gone may not answer)."""
    def put() -> None:
        try:
            store = _store()
            if store is not None:
                store.set(key, value)
        except RuntimeError as e:  # the store went with node 0's launcher: the others find node 0 gone
            print(f"note: could not record {key} in the job's store ({e})", file=sys.stderr, flush=True)

    t = threading.Thread(target=put, name="entrenar-tell", daemon=True)
    t.start()
    t.join(timeout_s)


def _rank0_ended() -> bool:
    try:
        store = _store()
        return store is not None and store.check([END_KEY])
    except RuntimeError:  # the store is gone with a launcher
        # one node: it was this worker's own launcher, which is stopping it anyway. Several nodes: node 0's
        # launcher serves the store and keeps it until every node is done, unless node 0 was lost
        return current().nodes <= 1


def _rank0_code() -> int:
    """The exit code rank 0 recorded (announce_end); this rank's signal's, or 1, where it cannot be read."""
    fallback = stops.exit_code() if stops.received() is not None else 1
    try:
        store = _store()
        code = store.get(END_KEY).decode() if store is not None else ""
    except RuntimeError:
        return fallback
    return int(code) if code.isdigit() else fallback


def nodes_gone(ctx: DistContext, wait_s: float = 0.0) -> list[int] | None:
    """The other nodes found gone, waiting up to `wait_s` for one: those whose workers recorded their launcher's
    death (GONE_KEY), or all of whose ranks a finished roll call found missing (LOST_KEY: another survivor's
    verdict; its exit makes the launcher SIGTERM this one, possibly before this one's own collective failed).
    None when the store cannot be reached (its host, node 0's launcher, is gone)."""
    try:
        store = _store()
        assert store is not None
        deadline = time.monotonic() + wait_s
        while True:
            gone = [n for n in range(ctx.nodes) if n != ctx.node and store.check([f"{GONE_KEY}/{n}"])]
            if not gone and store.check([LOST_KEY]):
                missing = {int(r) for r in store.get(LOST_KEY).decode().split(",")}
                gone = [n for n in range(ctx.nodes) if n != ctx.node and set(_node_ranks(n)) <= missing]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.1)
    except RuntimeError:
        return None


def _answer_roll_call(rank: int) -> bool:
    """In a live process's watcher thread: answer a roll call once one is called (True once answered). The
    thread answers, not the main one, which may be blocked in a collective with a live peer that waits too
    (a subgroup of the HSDP mesh): alive and answering, not lost."""
    try:
        store = _store()
        if store is None or not store.check([ROLL_KEY]):
            return False
        store.set(f"{ALIVE_KEY}/{rank}", "1")
        return True
    except RuntimeError:  # the store is gone with node 0's launcher: nothing to answer
        return False


def roll_call(ctx: DistContext, wait_s: float = ROLL_CALL_S) -> list[int] | None:
    """After a failed collective of a job of several nodes: the ranks that are gone. Calls the roll (every
    live process's watcher thread answers within WATCH_INTERVAL_S) and answers it, then waits up to
    `wait_s` for every other rank's answer or its process's death on this host (`lost_ranks`). None when
    the store cannot be reached: its host, node 0's launcher, is gone."""
    try:
        store = _store()
        assert store is not None
        store.set(ROLL_KEY, "1")
        store.set(f"{ALIVE_KEY}/{ctx.rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            answered = {r for r in range(ctx.world) if store.check([f"{ALIVE_KEY}/{r}"])}
            dead = set(lost_ranks(0.0))
            if len(answered | dead) == ctx.world or time.monotonic() >= deadline:
                missing = sorted(set(range(ctx.world)) - answered)
                if missing:  # the verdict, for a survivor whose launcher SIGTERMs it before its own roll call ends
                    store.set(LOST_KEY, ",".join(map(str, missing)))
                return missing
            time.sleep(0.1)
    except RuntimeError:  # the TCPStore's host is unreachable (a connection error or a timeout)
        return None


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
    stops.reporting()  # torchrun SIGTERMs the survivors of a lost rank: let this report finish (the caller's
    # except block called it first too: a signal landing while the failure unwinds must not replace the verdict)
    if ctx.rank != 0 and _rank0_ended():
        return JobEnded(_rank0_code())
    if launcher_gone():  # a peer that saw it first is gone already: the launcher is the cause, not that rank
        leave_without_launcher(ctx)
    if ctx.nodes > 1:
        lost = _lost_across_nodes(ctx, signalled=isinstance(e, KeyboardInterrupt))
    else:
        lost = lost_ranks(0.0 if isinstance(e, KeyboardInterrupt) else PEER_DEATH_WAIT_S)
    if not lost:
        return e
    alive = [r for r in range(ctx.world) if r not in lost]
    return RankLost(lost, checkpoint, resume_command, speaks=bool(alive) and ctx.rank == min(alive))


def _lost_across_nodes(ctx: DistContext, signalled: bool) -> list[int]:
    """The lost ranks of a job of several nodes: the nodes whose launcher death (or a finished roll call's
    verdict) was recorded; else those that miss a roll call, also after a signal: a launcher SIGTERMs its workers
    when the rendezvous loses a node, possibly before any collective failed (the CI race of issue 37), while a
    job stopped as a whole (Ctrl-C, scancel) answers the roll call, every process's watcher thread being alive
    until rank 0 has ended it; all of node 0 when the store it serves cannot be reached."""
    gone = nodes_gone(ctx, GONE_WAIT_S if signalled else 0.0)
    if gone is None:
        lost = _node_ranks(0)
    elif gone:
        lost = [r for n in gone for r in _node_ranks(n)]
    else:
        missing = roll_call(ctx)
        lost = _node_ranks(0) if missing is None else missing
    # not joined with this host's dead processes: a survivor that already reported and exited is not lost
    return sorted(lost)


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


__all__ = ["EXIT_RANK_LOST", "JobEnded", "RankLost", "announce_end", "join_job", "judge_failure", "launcher_gone",
           "launcher_words", "leave_without_launcher",
           "lost_nodes", "lost_ranks", "nodes_gone", "roll_call", "start"]
