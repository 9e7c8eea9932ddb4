"""Several processes, one run: the torchrun environment, the process group, reductions, and the
data split by global sample index.

`torchrun --nproc-per-node N -m entrenar pretrain|finetune ...` starts N processes with RANK,
WORLD_SIZE and LOCAL_RANK set; `init_from_env` turns that into a process group (NCCL on CUDA,
gloo on CPU) and a 1-D device mesh. Without torchrun (or with WORLD_SIZE=1) nothing is
initialised and every helper here is the identity, so a single process behaves as before.
With `--nnodes N` (several launchers, c10d rendezvous) each rank also learns its node from torchrun's
GROUP_RANK / GROUP_WORLD_SIZE / LOCAL_WORLD_SIZE (`DistContext.node`, `.nodes`, `.local_world`);
`hsdp_mesh` is the 2-D (nodes x GPUs per node) mesh HSDP shards over (train/parallel.py).

Exactness rules (docs/design.md, "Distributed"):
- every rank draws the same *global* micro-batch (world x batch rows, in the loader's seeded
  order) and keeps its own contiguous rows (`RankSlice`), so the samples of step k are the same
  at any world size with the same global batch;
- the loss-token total of a step is summed over ranks before the backward, and each rank
  backpropagates loss_sum / global_total with gradient reduction set to a plain SUM
  (train/parallel.py), which is the single-process update on the global batch.
`DistReduce` is the Trainer's view of the job's reductions (the identity in one process).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import EntrenarError, GuardError, InputError
from ..tensors import IGNORE_INDEX, JOB_COUNTS, batch_counts

T = TypeVar("T")

# A collective that waits longer than this raises instead of hanging forever (seconds).
TIMEOUT_ENV = "ENTRENAR_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 900
# The mesh dimensions of HSDP (train/parallel.py): gradients all-reduced across nodes, parameters sharded
# inside a node (torchtitan's names).
HSDP_DIMS = ("dp_replicate", "dp_shard")


@dataclass
class DistContext:
    """Where this process sits in the job. world == 1: a plain single-process run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh (1-D, "dp") when active
    node: int = 0  # torchrun's GROUP_RANK: which launcher (node) started this process
    nodes: int = 1  # GROUP_WORLD_SIZE: launchers (nodes) in the job
    local_world: int = 1  # LOCAL_WORLD_SIZE: processes this node's launcher started
    _hsdp_mesh: Any = None

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def hsdp_mesh(self) -> Any:
        """The 2-D mesh (HSDP_DIMS: replicate over nodes x shard inside a node) over this job's ranks,
        built on first use (a collective: every rank calls it). torchrun numbers ranks node by node
        (rank = node * local_world + local_rank), so row n of the mesh is node n's processes."""
        if self._hsdp_mesh is None:
            sizes = sorted({tuple(x) for x in self.all_gather_object((self.node, self.local_world))})
            if len({n for _, n in sizes}) > 1 or self.world != self.nodes * self.local_world:
                per_node = ", ".join(f"node {node}: {n}" for node, n in sizes)
                err = InputError(f"HSDP needs the same number of processes on every node, got {per_node} "
                                 f"({self.world} ranks on {self.nodes} nodes). Start every node's torchrun with "
                                 f"the same --nproc-per-node, or use --parallel fsdp")
                err.job_wide = True  # every rank decided it on the same gathered sizes: rank 0 alone prints it
                raise err
            assert self.rank == self.node * self.local_world + self.local_rank, \
                (self.rank, self.node, self.local_world, self.local_rank)
            from torch.distributed.device_mesh import init_device_mesh

            self._hsdp_mesh = init_device_mesh(self.device.type, (self.nodes, self.local_world),
                                               mesh_dim_names=HSDP_DIMS)
        return self._hsdp_mesh

    # ---- reductions (identity when not active) --------------------------------------------
    def _comm_device(self) -> torch.device:
        # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def all_reduce(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Element-wise sum / max / min over ranks, in float64 (token counts stay exact to 2^53)."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                               "min": dist.ReduceOp.MIN}[op])
        return t.cpu().tolist()

    def sum_int(self, n: int) -> int:
        return round(self.all_reduce([n])[0])

    def sum_float(self, x: float) -> float:
        return self.all_reduce([x])[0]

    def any_true(self, flag: bool) -> bool:
        return self.all_reduce([1.0 if flag else 0.0], "max")[0] > 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.active:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    # ---- rank-0-only side effects -------------------------------------------------------------
    def log(self, text: str) -> None:
        """Print on rank 0 only: one message per job, not one per process."""
        if self.is_main:
            print(text, file=sys.stderr, flush=True)

    def run_on_main(self, fn: Callable[[], T]) -> T:
        """Run `fn` on rank 0 only and hand its result to every rank. An EntrenarError (a guard
        verdict, a bad input) raised on rank 0 is raised on every rank, so all exit with its code;
        any other failure on rank 0 reaches the other ranks as a RuntimeError naming it."""
        if not self.active:
            return fn()
        outcome: tuple[str, Any] = ("ok", None)
        if self.is_main:
            try:
                outcome = ("ok", fn())
            except EntrenarError as e:
                outcome = ("error", _encode_error(e))
            except Exception as e:  # reported to the other ranks (they would wait forever), re-raised here
                self.broadcast_object(("crash", f"{type(e).__name__}: {e}"))
                raise
        outcome = self.broadcast_object(outcome)
        kind, value = outcome
        if kind == "error":
            raise _decode_error(value)
        if kind == "crash":
            raise RuntimeError(f"rank 0 failed: {value}")
        return value


class DistReduce:
    """The Trainer's reductions (its `reduce`, from the parallel strategy): a number or tensor summed over
    every rank, returned as the same kind (ints stay ints); the identity in one process."""

    def __init__(self, ctx: DistContext):
        self.ctx, self.rank, self.world_size = ctx, ctx.rank, ctx.world

    def all_reduce_sum(self, value: Any) -> Any:
        if not self.ctx.active:
            return value
        if isinstance(value, torch.Tensor):
            t = value.detach().to(self.ctx._comm_device(), copy=True)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            return t.to(value.device)
        out = self.ctx.all_reduce([value], "sum")[0]
        return round(out) if isinstance(value, int) else out

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        return self.ctx.all_gather_object(obj)


def _encode_error(e: EntrenarError) -> dict[str, Any]:
    # GuardError's constructor takes (guard_id, cause, ...), which pickle's default
    # reconstruction (cls(*args)) does not supply: send its fields instead.
    if isinstance(e, GuardError):
        return {"cls": type(e), "guard": [e.guard_id, e.cause, e.remedy, e.exit_code, e.details]}
    return {"cls": type(e), "message": str(e)}


def _decode_error(d: dict[str, Any]) -> EntrenarError:
    if "guard" in d:
        guard_id, cause, remedy, code, details = d["guard"]
        err = GuardError(guard_id, cause, remedy, exit_code=code, details=details)
        err.__class__ = d["cls"] if issubclass(d["cls"], GuardError) else GuardError
    else:
        err = d["cls"](d["message"])
    err.job_wide = True  # every rank raises it: rank 0 alone prints it (cli/main.py)
    return err


_CURRENT = DistContext()


def current() -> DistContext:
    """The context of this process (single-process until `init_from_env` found torchrun)."""
    return _CURRENT


def env_world() -> tuple[int, int, int]:
    """(rank, world, local_rank) from the torchrun environment; (0, 1, 0) without it."""
    def num(name: str, default: int) -> int:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError as e:
            raise InputError(f"environment variable {name}={raw!r} is not an integer (torchrun sets it)") from e
    return num("RANK", 0), num("WORLD_SIZE", 1), num("LOCAL_RANK", 0)


def env_nodes() -> tuple[int, int, int]:
    """(node, nodes, local_world) from torchrun's environment (GROUP_RANK, GROUP_WORLD_SIZE,
    LOCAL_WORLD_SIZE); a launcher without them (or one process) is one node of WORLD_SIZE processes."""
    _, world, _ = env_world()
    vals = []
    for name, default in (("GROUP_RANK", 0), ("GROUP_WORLD_SIZE", 1), ("LOCAL_WORLD_SIZE", world)):
        raw = os.environ.get(name) or ""
        try:
            vals.append(int(raw) if raw else default)
        except ValueError as e:
            raise InputError(f"environment variable {name}={raw!r} is not an integer (torchrun sets it)") from e
    node, nodes, local_world = vals
    if not (0 <= node < nodes and 1 <= local_world <= world):
        raise InputError(f"GROUP_RANK={node}, GROUP_WORLD_SIZE={nodes}, LOCAL_WORLD_SIZE={local_world} do not "
                         f"describe a job of WORLD_SIZE={world}; start the job with torchrun")
    return node, nodes, local_world


def init_from_env(device: str = "cpu") -> DistContext:
    """Join the job torchrun started (idempotent). `device` is the user's --device: "cuda" becomes
    cuda:LOCAL_RANK (one GPU per process, NCCL); "cpu" uses gloo."""
    global _CURRENT
    rank, world, local_rank = env_world()
    if world <= 1:
        _CURRENT = DistContext(device=torch.device(device))
        return _CURRENT
    if _CURRENT.active:
        return _CURRENT
    if not 0 <= rank < world:
        raise InputError(f"RANK={rank} is outside WORLD_SIZE={world}; start the job with torchrun")
    if str(device).startswith("cuda"):
        if torch.cuda.device_count() <= local_rank:
            raise InputError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} CUDA "
                             f"device(s); use torchrun --nproc-per-node <= the number of GPUs")
        dev, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(dev)
    else:
        dev, backend = torch.device("cpu"), "gloo"
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    node, nodes, local_world = env_nodes()
    _CURRENT = DistContext(rank=rank, world=world, local_rank=local_rank, device=dev, mesh=mesh, node=node,
                           nodes=nodes, local_world=local_world)
    return _CURRENT


def settle_ranks(timeout_s: float = 60.0) -> None:
    """Before exiting on a job-wide verdict (a guard: every rank decided it on the same reduced
    values), wait until every rank holds it: torchrun stops the others at the first non-zero exit, so
    without this a slower rank would be killed instead of exiting with the guard's code. Bounded: a
    rank that never arrives costs `timeout_s`, not the process group's timeout."""
    if not current().active:
        return
    try:
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:  # a peer is gone or stuck: exit anyway, saying so
        print(f"note: not every rank reached the same stop within {timeout_s:.0f} s ({e})", file=sys.stderr,
              flush=True)


def other_rank() -> bool:
    """True in a torchrun process other than rank 0 (from the environment: usable before the group exists)."""
    rank, world, _ = env_world()
    return world > 1 and rank != 0


def shutdown() -> None:
    """Leave the process group (at the end of a command, also after an error)."""
    global _CURRENT
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _CURRENT = DistContext(device=_CURRENT.device)


# ---- the data split by global sample index ------------------------------------------------------
def row_sample_ids(batch: dict[str, Any]) -> list[list]:
    """The sample ids of each row: one per row (pretraining windows, padded SFT), or, for packed
    rows, as many as the row has documents (doc_ids 0, 1, ... with -1 for padding)."""
    ids = list(batch.get("sample_ids") or [])
    rows = int(batch["input_ids"].shape[0])
    if len(ids) == rows:
        return [[i] for i in ids]
    if not ids:
        return [[] for _ in range(rows)]
    if "doc_ids" not in batch:
        raise ValueError(f"batch has {len(ids)} sample ids for {rows} rows and no doc_ids to split them")
    counts = (batch["doc_ids"].max(dim=1).values + 1).clamp(min=0).tolist()
    out, at = [], 0
    for c in counts:
        out.append(ids[at:at + int(c)])
        at += int(c)
    return out


def slice_rows(batch: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """Rows [lo, hi) of a batch with their sample ids. An empty range gives one row whose labels
    are all ignored (0 loss tokens): under FSDP every rank must run the forward, even a rank
    that the last eval batch left without rows."""
    per_row = row_sample_ids(batch)
    if hi <= lo:
        out = {k: v[:1].clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        out["labels"].fill_(IGNORE_INDEX)
        out["sample_ids"] = []
        return out
    out = {k: v[lo:hi] for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out["sample_ids"] = [i for row in per_row[lo:hi] for i in row]
    return out


def slice_spans(batch: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """Samples [lo, hi) of a padding-free batch (one row with cu_seqlens, data/sft.py:collate_padding_free) as a
    padding-free batch of their own: their tokens, spans rebased to 0, doc ids from 0. An empty range gives the
    first sample with every label ignored (0 loss tokens): under FSDP every rank must run the forward."""
    assert "samples" not in batch, "a row padded for CUDA graphs is one process's (varying_shapes under torchrun)"
    idle = hi <= lo
    if idle:
        lo, hi = 0, 1
    cu = batch["cu_seqlens"]
    a, b = int(cu[lo]), int(cu[hi])
    out = {k: batch[k][:, a:b].clone() for k in ("input_ids", "labels", "doc_ids", "position_ids", "kl_mask")
           if k in batch}
    out["doc_ids"] -= lo
    out["cu_seqlens"] = (cu[lo:hi + 1] - a).to(torch.int32)
    out["max_seqlen"] = int((out["cu_seqlens"][1:] - out["cu_seqlens"][:-1]).max())
    out["sample_ids"] = [] if idle else list(batch.get("sample_ids") or [])[lo:hi]
    if idle:
        out["labels"].fill_(IGNORE_INDEX)
    return out


class RankSlice:
    """A loader of this rank's share of every global micro-batch.

    The wrapped loader is switched to draw world x batch rows per `next_batch` (the global
    micro-batch, in its seeded order); rank r keeps rows [r*batch, (r+1)*batch), or of a padding-free batch (one row
    of world x batch samples) samples [r*batch, (r+1)*batch) as a padding-free batch of its own (slice_spans). Its state (epoch,
    position in samples) is therefore the same on every rank and independent of the world size,
    which is what makes resuming on a different world size continue the same sample order.
    Eval (`iter_epoch`) splits each global batch the same way.
    """

    def __init__(self, loader: Any, ctx: DistContext,
                 counts: Callable[[dict[str, Any]], tuple[int, int, int]] = batch_counts):
        self.inner, self.rank, self.world, self.counts = loader, ctx.rank, ctx.world, counts
        self.per_rank = int(loader.batch_size)
        loader.batch_size = self.per_rank * self.world

    def _bounds(self, rows: int, rank: int) -> tuple[int, int]:
        return min(rank * self.per_rank, rows), min((rank + 1) * self.per_rank, rows)

    @staticmethod
    def _units(batch: dict[str, Any]) -> int:
        """What the ranks split: rows, or the samples of a padding-free row."""
        spans = batch.get("cu_seqlens")
        return int(batch["input_ids"].shape[0]) if spans is None else len(spans) - 1

    def _mine(self, batch: dict[str, Any]) -> dict[str, Any]:
        split = slice_rows if batch.get("cu_seqlens") is None else slice_spans
        return split(batch, *self._bounds(self._units(batch), self.rank))

    def _job_counts(self, batch: dict[str, Any]) -> tuple[int, int, int]:
        """batch_counts summed over every rank's share: the shares with rows split the global batch, and
        a rank left without rows runs one dummy row without loss tokens (slice_rows; slice_spans: the first sample)."""
        loss_tokens, empty, tokens = self.counts(batch)  # the objective's (tokens, or pairs)
        units = self._units(batch)
        spans = batch.get("cu_seqlens")
        dummy_tokens = batch["input_ids"][0].numel() if spans is None else int(spans[1] - spans[0])
        idle = sum(1 for r in range(self.world) if self._bounds(units, r)[0] == units)
        return loss_tokens, empty + idle, tokens + idle * int(dummy_tokens)

    def next_batch(self) -> dict[str, Any]:
        """This rank's rows, carrying (JOB_COUNTS) the counts of every rank's rows: each rank holds the
        whole global batch here, so the trainer needs no collective (no device sync) to count the step."""
        batch = self.inner.next_batch()
        mine = self._mine(batch)
        mine[JOB_COUNTS] = self._job_counts(batch)
        return mine

    def iter_epoch(self) -> Iterator[dict[str, Any]]:
        for batch in self.inner.iter_epoch():
            yield self._mine(batch)

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    @property
    def batch_size(self) -> int:
        return self.per_rank

    def __len__(self) -> int:
        return len(self.inner)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.inner.load_state_dict(sd)

    def __getattr__(self, name: str) -> Any:  # kind, seq_len, ... of the wrapped loader
        return getattr(self.inner, name)


def shard_loader(loader: Any, ctx: DistContext | None = None,
                 counts: Callable[[dict[str, Any]], tuple[int, int, int]] = batch_counts) -> Any:
    """`loader` itself in a single process, else its `RankSlice` for this rank (`counts`: the objective's), or what
    a loader that splits itself returns from `shard(ctx)` (GRPO's: each rank rolls out only its share)."""
    ctx = ctx or current()
    if loader is None or not ctx.active:
        return loader
    if hasattr(loader, "shard"):
        return loader.shard(ctx)
    return RankSlice(loader, ctx, counts)


def global_batch(batch_size: int, grad_accum: int, world: int) -> int:
    """Samples (rows) per optimizer step over the whole job."""
    return int(batch_size) * int(grad_accum) * int(world)


__all__ = ["HSDP_DIMS", "DistContext", "DistReduce", "RankSlice", "current", "env_nodes", "env_world",
           "global_batch", "init_from_env", "other_rank", "row_sample_ids", "settle_ranks", "shard_loader", "shutdown",
           "slice_rows", "slice_spans"]
