"""Atomic training checkpoints: RUN/checkpoints/step-NNNNNNN/ and a `latest` symlink.

Write order (so a kill at any point leaves the previous checkpoint usable): every file into a
hidden temporary sibling (fileio.atomic_dir), then each fsynced; meta.json (their sha256), then COMPLETE,
each fsynced; the directory fsynced; renamed to step-N; `latest` replaced atomically (symlink + os.replace).
A directory without COMPLETE (or still temporary) is never resumed from.

When (--save-mode, Checkpointer): async (the default) takes a snapshot at the save step -- weights and
optimizer state copied into host memory (pinned on a GPU; DCP's staging for shards), RNG, trainer state and
config as bytes -- and writes it in the order above from a background thread while training goes on, one write
at a time; its error is raised on the training thread as the synchronous save's exit 2. sync writes in the step.

Contents -- nothing in a checkpoint is unpickled into code on load:
  model.safetensors     the trainable parameters (all of them for full training, the adapter for LoRA)
  optimizer.pt          AdamW state_dict, loaded with torch.load(weights_only=True): tensors and
                        plain containers only, so a checkpoint from someone else cannot run code
  trainer_state.json    step, tokens, schedule, data-loader position, guard state, counters, and the
                        python/numpy RNG states
  rng.safetensors       torch CPU and CUDA RNG states (byte tensors)
  run_config.json       the resolved config
  meta.json             step, tokens and the sha256 of each file above
  COMPLETE

A distributed run (torchrun) writes a sharded checkpoint instead (save_sharded_checkpoint): dcp/ (model and
optimizer through torch.distributed.checkpoint, one file per rank, loadable at any world size) in
place of model.safetensors and optimizer.pt; rng.safetensors and trainer_state.json hold every
rank's RNG; meta.json ("sharded": true, "world_size") hashes every file, the shards included.

`Checkpointer` is the Trainer's checkpoint part: it writes the kind the job needs and restores either
kind into the model and optimizer as they are now (one process, or DDP/FSDP2 at any world size).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import enum
import functools
import inspect
import io
import json
import os
import pickle
import random
import re
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .. import stops
from ..errors import EntrenarError, InputError
from ..fileio import HashingFile, atomic_dir, files_sha256, sha256_file, write_safetensors, written_sha256
from .distributed import DistContext

COMPLETE = "COMPLETE"
STEP_RE = re.compile(r"^step-(\d+)$")
TMP_RE = re.compile(r"^\.?step-(\d+)\.tmp")  # atomic_dir's `.step-N.tmp-PID` (and the older `step-N.tmp`)
MODEL, OPTIMIZER, STATE, RNG, RUN_CONFIG, META = ("model.safetensors", "optimizer.pt", "trainer_state.json",
                                                  "rng.safetensors", "run_config.json", "meta.json")
HASHED = (MODEL, OPTIMIZER, STATE, RNG, RUN_CONFIG)
REQUIRED = (*HASHED, META, COMPLETE)
SHARDED = "dcp"  # torch.distributed.checkpoint directory of a distributed run's checkpoint
SHARDED_REQUIRED = (f"{SHARDED}/.metadata", STATE, RNG, RUN_CONFIG, META, COMPLETE)


def is_sharded(path: Path) -> bool:
    return (Path(path) / SHARDED).is_dir()


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


# ---- RNG state: python/numpy as JSON, torch/CUDA byte states as safetensors --------------------------
def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        # one state per CUDA device visible when it was saved: a resume that sees fewer devices (another
        # machine, CUDA_VISIBLE_DEVICES, torchrun at a smaller world size) restores those it has; the
        # rest have no device to go to (torch's set_rng_state_all would raise IndexError on them)
        for i, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, i)


def _rng_to_files(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    cuda = state.get("cuda")
    as_json = {"python": [version, list(internal), gauss],
               "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
               "cuda_devices": None if cuda is None else len(cuda)}
    tensors = {"torch": state["torch"].contiguous()}
    tensors.update({f"cuda.{i}": t.contiguous() for i, t in enumerate(cuda or [])})
    return as_json, tensors


def _rng_from_files(as_json: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    version, internal, gauss = as_json["python"]
    name, keys, pos, has_gauss, cached = as_json["numpy"]
    n_cuda = as_json.get("cuda_devices")
    return {"python": (version, tuple(internal), gauss),
            "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
            "torch": tensors["torch"],
            "cuda": None if n_cuda is None else [tensors[f"cuda.{i}"] for i in range(n_cuda)]}


# ---- save ------------------------------------------------------------------------------------------
SAVE_MODES = ("async", "sync")  # --save-mode: written in a background thread from a snapshot, or in the step

# Called by a checkpoint's writer as (stage, the temporary directory being written) at "start", before its first
# file (a sharded checkpoint: before this rank's shard files), and "written", when its files are written but not
# yet synced, hashed or marked COMPLETE. None in a run; tests set it to hold a background write at a known point.
WRITE_HOOK: Callable[[str, Path], None] | None = None


def _reached(stage: str, where: Path) -> None:
    if WRITE_HOOK is not None:
        WRITE_HOOK(stage, where)


class Abandoned(Exception):
    """A background write stopped before its commit (the run ended on an error, or a second Ctrl-C)."""


class CommitGate:
    """The point of no return of one checkpoint write: COMPLETE, the rename to step-N, `latest` and the prune
    happen inside it. After `abandon()` (from the training thread) returns, the write has either committed
    (`committed`) or never will: entering the gate then raises Abandoned and the temporary directory goes. A
    local write also stops between its files once abandoned (`check`), so an error exit need not wait for all
    of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.abandoned = self.committed = False

    def __enter__(self) -> None:
        self._lock.acquire()
        if self.abandoned:
            self._lock.release()
            raise Abandoned()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.committed = exc_type is None
        self._lock.release()

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True

    def check(self) -> None:
        """Abandoned from the training thread: stop here (before the next file)."""
        if self.abandoned:
            raise Abandoned()


class HostBuffers:
    """Host memory a checkpoint's snapshot is copied into, kept for the run and reused by every save (a save
    waits for the previous write, so no buffer is overwritten while it is written). Pinned for a tensor on a
    GPU: the copy is queued on the current stream, after the step that produced the values and before the next
    one, and the writer waits for it (`copied`); on the CPU a plain copy."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._pending = False
        self.pin = True  # False: new buffers are pageable (a last save: nothing reuses them, see Checkpointer.save)

    def allocated(self) -> bool:
        return bool(self._bufs)

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        gpu = t.device.type == "cuda"
        buf = self._bufs.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._bufs[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=gpu and self.pin)
        buf.copy_(t, non_blocking=gpu)
        self._pending |= gpu
        return buf

    def copy_tree(self, key: str, obj: Any) -> Any:
        """`obj` (a state dict: dicts, lists, tuples, tensors, plain values) with every tensor copied."""
        if isinstance(obj, torch.Tensor):
            return self.copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.copy_tree(f"{key}.{k}", v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy_tree(f"{key}.{i}", v) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def copied(self) -> Any:
        """A CUDA event the copies queued since the last call are done at (None: they are done already)."""
        if not self._pending:
            return None
        self._pending = False
        event = torch.cuda.Event()
        event.record()
        return event


@dataclasses.dataclass
class Snapshot:
    """One local checkpoint's contents as of its step (Trainer.save): what its write needs. Taken with
    HostBuffers it holds nothing training changes afterwards, so it is written while training goes on."""

    step: int
    tokens: int | None
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, torch.Tensor]
    state_json: bytes
    run_config_json: bytes
    files: Callable[[Path], None] | None = None  # writes the MODEL files (config or adapter, tokenizer)
    copied: Any = None  # a CUDA event the device-to-host copies are done at, or None


def snapshot(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any],
             run_config: dict[str, Any], extra_files: Callable[[torch.nn.Module], Callable[[Path], None]] | None = None,
             buffers: HostBuffers | None = None) -> Snapshot:
    """The checkpoint of `step` as it is now: trainable weights, optimizer state, RNG, trainer state and config
    (as JSON bytes), and the MODEL files' writer. With `buffers` every tensor is copied into host memory; without,
    the live tensors (a synchronous write, finished before training goes on)."""
    state = dict(trainer_state)
    rng_json, rng_tensors = _rng_to_files(state.pop("rng", None) or rng_state())  # a given rng (pre-step) wins
    if buffers is None:
        tensors, optim, copied = trainable_state(model), optimizer.state_dict(), None
    else:
        tensors = {n: buffers.copy(f"model.{n}", p) for n, p in model.named_parameters() if p.requires_grad}
        optim = buffers.copy_tree("optimizer", optimizer.state_dict())
        copied = buffers.copied()
    return Snapshot(step, trainer_state.get("tokens"), tensors, optim, rng_tensors,
                    (json.dumps({**state, "rng": rng_json}, indent=1) + "\n").encode(),
                    (json.dumps(run_config, indent=2, default=str) + "\n").encode(),
                    extra_files(model) if extra_files is not None else None, copied)


def _sync_tree(path: Path) -> None:
    """fsync every file and directory under `path`, then `path` itself."""
    for f in sorted(path.rglob("*")):
        if f.is_dir():
            _fsync_dir(f)
        else:
            _fsync_file(f)
    _fsync_dir(path)


def _write_contents(tmp: Path, snap: Snapshot, gate: CommitGate) -> None:
    """Every file of a local checkpoint but meta.json and COMPLETE (written, not yet synced); an abandoned write
    stops before its next large file."""
    if snap.files is not None:  # config/adapter files, generation_config.json, tokenizer: a runnable MODEL
        snap.files(tmp)
    gate.check()
    write_safetensors(snap.model, tmp / MODEL)  # hashed as written (written_sha256: meta.json takes it)
    gate.check()
    with HashingFile(tmp / OPTIMIZER) as f:
        torch.save(snap.optimizer, f)
    gate.check()
    save_file(snap.rng, str(tmp / RNG))
    (tmp / STATE).write_bytes(snap.state_json)
    (tmp / RUN_CONFIG).write_bytes(snap.run_config_json)


def _point_latest(ckpt_root: Path, target: Path) -> None:
    # a symlink cannot go through fileio.atomic_write; the same tmp-then-os.replace rule by hand
    link_tmp = ckpt_root / "latest.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    os.symlink(target.name, link_tmp)
    os.replace(link_tmp, ckpt_root / "latest")
    _fsync_dir(ckpt_root)


def write_snapshot(ckpt_root: Path, snap: Snapshot, keep: int, gate: CommitGate | None = None) -> Path:
    """Write step-N of `snap` atomically, point `latest` at it, prune to the newest `keep`; returns its path.
    Every file goes into a hidden temporary sibling and is fsynced, then meta.json (the sha256 of each) and
    COMPLETE are written and fsynced, then the directory is renamed to step-N: a kill at any point leaves no
    step-N without every file on disk. `gate`: the commit of a background write (an abandoned one stops there)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(snap.step)
    gate = gate or CommitGate()
    for stale in stale_tmp_dirs(ckpt_root, max_step=snap.step, min_step=snap.step):  # a killed earlier save of step N
        shutil.rmtree(stale)
    with contextlib.ExitStack() as committing:
        with atomic_dir(final) as tmp:
            if snap.copied is not None:  # the device-to-host copies of the snapshot have landed
                snap.copied.synchronize()
            _reached("start", tmp)
            gate.check()
            _write_contents(tmp, snap, gate)
            _reached("written", tmp)
            gate.check()
            _sync_tree(tmp)  # every file durable before meta.json and COMPLETE say it is there
            # every file, the MODEL files of extra_files (config or adapter, tokenizer) too: read-only commands verify
            # what they load (fileio.verify_recorded); resume verifies HASHED
            names = sorted({*HASHED, *(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())})
            meta = {"step": snap.step, "tokens": snap.tokens,
                    "sha256": {name: written_sha256(tmp / name) for name in names}}
            _write_bytes(tmp / META, (json.dumps(meta, indent=2) + "\n").encode())
            committing.enter_context(gate)  # abandoned: no COMPLETE, the temporary goes
            _write_bytes(tmp / COMPLETE, b"ok\n")  # last: its presence means every file above is on disk
            _fsync_dir(tmp)
            if final.exists():  # re-saving a step after resuming from an earlier checkpoint
                shutil.rmtree(final)
        _fsync_dir(ckpt_root)
        _point_latest(ckpt_root, final)
        prune(ckpt_root, keep)
    return final


def save_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], run_config: dict[str, Any], keep: int,
                    extra_files: Callable[[torch.nn.Module], Callable[[Path], None]] | None = None) -> Path:
    """Write step-N from the live model and optimizer now (write_snapshot), point `latest` at it, prune to the
    newest `keep`. Returns its path. `trainer_state` must be JSON-serialisable apart from its optional "rng"
    entry (rng_state())."""
    return write_snapshot(ckpt_root, snapshot(step, model, optimizer, trainer_state, run_config, extra_files), keep)


# ---- sharded (torch.distributed.checkpoint): a distributed run's checkpoints -------------------------
def _state_options(**kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model", "optim"}: FQN-keyed, sharded (DTensor) under FSDP, for torch.distributed.checkpoint.
    Only trainable tensors: a LoRA checkpoint holds the adapter, not the frozen base."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=_state_options(ignore_frozen_params=True))
    return {"model": msd, "optim": osd}


def save_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of model + optimizer into `path` (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(model, optimizer), checkpoint_id=str(path))


def load_sharded(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a torch.distributed.checkpoint directory into the model and optimizer, resharding to the
    current world size (also 1: one process reads every shard)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(model, optimizer)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=not (dist.is_available() and dist.is_initialized()))
    # strict=False: the state holds the trainable tensors only (a LoRA model's frozen base is not in it); dcp.load
    # above already refused a checkpoint that lacks any of them
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_state_options(ignore_frozen_params=True, strict=False))


def _fqn_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         saved: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer state dict keyed by parameter index (what one process saves) rekeyed by
    parameter name, matched through the current optimizer's groups (same model, same order)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise InputError("checkpoint optimizer has a different number of parameter groups than this model")
    index_to_name: dict[int, str] = {}
    groups = []
    for g_saved, g_now in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        if len(g_saved["params"]) != len(g_now["params"]):
            raise InputError("checkpoint optimizer groups do not match this model's trainable parameters")
        names = [name_of[id(p)] for p in g_now["params"]]
        index_to_name.update(zip(g_saved["params"], names, strict=True))
        groups.append({**g_saved, "params": names})
    return {"state": {index_to_name[int(i)]: st for i, st in saved["state"].items()}, "param_groups": groups}


def load_full(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_tensors: dict[str, torch.Tensor],
              optim_state: dict[str, Any]) -> None:
    """Load a single-process checkpoint (full trainable tensors + index-keyed optimizer state) into a
    (possibly sharded) model: each rank keeps its shard. Resuming 1 -> N processes."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    osd = _fqn_optimizer_state(model, optimizer, optim_state)
    set_state_dict(model, optimizer, model_state_dict=dict(model_tensors), optim_state_dict=osd,
                   options=_state_options(full_state_dict=True, strict=False))



# ---- sharded checkpoints ------------------------------------------------------------------------------
@functools.cache
def _hooked_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter

    class HookedWriter(FileSystemWriter):
        """torch.distributed.checkpoint's file writer (one file per rank, each fsynced, .metadata last; its
        stage() copies a state dict into host memory, pinned and reused with cache_staged_state_dict) that
        calls WRITE_HOOK before this rank's shard files are written."""

        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            _reached("start", Path(self.path).parent)
            return super().write_data(*args, **kwargs)

    return HookedWriter


# Files (and threads) a rank's shards are written in by a background sharded save: one writer and one sha256 pass
# per file (files_sha256 hashes them at once), where one file per rank made both single-threaded
DCP_WRITE_THREADS = 4


def dcp_writer(path: Path, pinned: bool) -> Any:
    """The writer of a background sharded save: its stage() is the snapshot (a copy in host memory, pinned and
    reused from save to save on a GPU), and it writes that copy later (DCP's FileSystemWriter), each rank's
    shards in DCP_WRITE_THREADS files by as many threads."""
    return _hooked_writer_class()(str(path), cache_staged_state_dict=pinned, thread_count=DCP_WRITE_THREADS)


def _gather(ctx: DistContext, obj: Any, group: Any) -> list[Any]:
    if not ctx.active:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(ctx: DistContext, obj: Any, group: Any) -> Any:
    if not ctx.active:
        return obj
    import torch.distributed as dist

    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _encoded(e: BaseException, rank: int) -> dict[str, Any]:
    from .distributed import _encode_error

    if isinstance(e, EntrenarError):
        return _encode_error(e)
    return {"cls": RuntimeError, "message": f"rank {rank}: {type(e).__name__}: {e}"}


def _write_own_shards(shards: dict[str, Any], tmp: Path, rank: int, writer: Any, group: Any) -> dict[str, str]:
    """This rank's part of a sharded checkpoint's write (dcp.save over `group`; `writer` None: a synchronous
    writer of the same DCP_WRITE_THREADS files) and the sha256 of the shard files it wrote itself (DCP names them
    __{rank}_{n}.distcp): all ranks hash at once (a 7B run's 85 GiB took rank 0 alone a minute or more); rank 0's
    commit hashes whatever no rank claimed (.metadata, the files it writes, any other naming)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(shards, checkpoint_id=str(tmp / SHARDED), process_group=group,
             storage_writer=writer if writer is not None else FileSystemWriter(str(tmp / SHARDED),
                                                                               thread_count=DCP_WRITE_THREADS))
    own = files_sha256(sorted((tmp / SHARDED).glob(f"__{rank}_*.distcp")))
    return {f"{SHARDED}/{name}": digest for name, digest in own.items()}


def start_sharded_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             trainer_state: dict[str, Any], run_config: dict[str, Any], keep: int,
                             ctx: DistContext, writer: Any = None, group: Any = None
                             ) -> Callable[[CommitGate | None], Path]:
    """step-N of a distributed run, with the single-process checkpoint's atomicity, in two halves. This one, on
    the training thread of every rank: the hidden temporary directory, every rank's RNG gathered, and the
    model/optimizer shards copied into host memory by `writer.stage` (a background save) or taken live
    (`writer` None: a synchronous one). The returned half, `finish(gate)`: every rank writes its shards
    (torch.distributed.checkpoint) and hashes them; rank 0 then adds every rank's RNG, the trainer state,
    meta.json (sha256 of every file) and COMPLETE last, renames it to step-N and points `latest` at it. Its
    collectives run over `group` (a background writer's own process group; None: the job's). A write that fails
    on any rank fails on every rank (exit 2, write_errors' message) and removes the temporary directory; a kill
    at any point leaves no step-N without COMPLETE; --resume never reads the temporary directory."""
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / f".{final.name}.tmp-dist"  # one name every rank agrees on (checkpoint.TMP_RE)
    if ctx.is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in stale_tmp_dirs(ckpt_root, max_step=step, min_step=step):
            shutil.rmtree(stale)
        tmp.mkdir()
    ctx.barrier()
    state = dict(trainer_state)
    rngs = ctx.all_gather_object(_rng_to_files(state.pop("rng", None) or rng_state()))
    state_json = (json.dumps({**state, "rng": {"ranks": [j for j, _ in rngs]}}, indent=1) + "\n").encode()
    run_config_json = (json.dumps(run_config, indent=2, default=str) + "\n").encode()
    shards = sharded_state(model, optimizer)
    if writer is not None:
        shards = writer.stage(shards)  # the snapshot: training may change the live tensors from here on

    def commit(digests: dict[str, str], gate: CommitGate | None) -> Path:
        tensors = {f"rank{r}.{k}": t for r, (_, ts) in enumerate(rngs) for k, t in ts.items()}
        save_file(tensors, str(tmp / RNG))
        (tmp / STATE).write_bytes(state_json)
        (tmp / RUN_CONFIG).write_bytes(run_config_json)
        for name in (RNG, STATE, RUN_CONFIG):  # the shards and .metadata: DCP fsynced them
            _fsync_file(tmp / name)
        _fsync_dir(tmp / SHARDED)
        _fsync_dir(tmp)
        files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        meta = {"step": step, "tokens": trainer_state.get("tokens"), "sharded": True, "world_size": ctx.world,
                "sha256": {name: digests.get(name) or sha256_file(tmp / name) for name in files}}
        _write_bytes(tmp / META, (json.dumps(meta, indent=2) + "\n").encode())
        with gate or contextlib.nullcontext():  # abandoned: no COMPLETE
            _write_bytes(tmp / COMPLETE, b"ok\n")  # last: its presence means every file above is on disk
            _fsync_dir(tmp)
            if final.exists():  # this step saved again after a resume from an earlier checkpoint
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(ckpt_root)
            _point_latest(ckpt_root, final)
            prune(ckpt_root, keep)
        return final

    def finish(gate: CommitGate | None = None) -> Path:
        found: dict[str, str] = {}
        problem: dict[str, Any] | None = None
        try:
            with write_errors(final, ckpt_root):
                found = _write_own_shards(shards, tmp, ctx.rank, writer, group)
                _reached("written", tmp)
        except Exception as e:  # noqa: BLE001 -- every rank learns it (below) and raises it
            problem = _encoded(e, ctx.rank)
        except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            if type(e).__name__ != "CheckpointException":
                raise
            problem = _encoded(e, ctx.rank)
        parts = _gather(ctx, (found, problem), group)
        outcome: tuple[str, Any] = ("ok", None)
        if ctx.is_main:
            errors = [p for _, p in parts if p is not None]
            if errors:
                outcome = ("error", errors[0])
            else:
                try:
                    with write_errors(final, ckpt_root):
                        commit({k: v for d, _ in parts for k, v in d.items()}, gate)
                except Abandoned:
                    outcome = ("abandoned", None)
                except Exception as e:  # noqa: BLE001 -- broadcast, then raised on every rank
                    outcome = ("error", _encoded(e, ctx.rank))
        kind, value = _broadcast(ctx, outcome, group)
        if kind == "ok":
            return final
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if kind == "abandoned":
            raise Abandoned()
        from .distributed import _decode_error

        raise _decode_error(value)

    return finish


def save_sharded_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            trainer_state: dict[str, Any], run_config: dict[str, Any], keep: int,
                            ctx: DistContext) -> Path:
    """step-N of a distributed run written now by every rank (start_sharded_checkpoint, both halves)."""
    return start_sharded_checkpoint(ckpt_root, step, model, optimizer, trainer_state, run_config, keep, ctx)()


# ---- find ------------------------------------------------------------------------------------------
RUN_JSON = "run.json"
RUN_COMMANDS = ("pretrain", "finetune")  # the commands whose run.json makes a directory a run of ours


def run_record_problem(run_dir: Path) -> str | None:
    """Why `run_dir` is not a run directory written by `entrenar pretrain|finetune` (its run.json missing, not
    JSON, or not our record: a JSON object with the command and its config), or None when it is one."""
    path = Path(run_dir) / RUN_JSON
    if not path.is_file():
        return f"it has no {RUN_JSON}"
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"its {RUN_JSON} is not JSON ({type(e).__name__}: {str(e)[:120]})"
    if not (isinstance(record, dict) and record.get("command") in RUN_COMMANDS and isinstance(record.get("config"), dict)):
        return f"its {RUN_JSON} is not the record of an entrenar {' or '.join(RUN_COMMANDS)} run"
    return None


def _holds_nothing(path: Path, ignore: tuple[str, ...]) -> bool:
    return not path.exists() or (path.is_dir() and all(p.name in ignore for p in path.iterdir()))


def resume_problem(out: Path, spec: str, ignore: tuple[str, ...] = ()) -> str | None:
    """Why `--resume spec` may not write into `--out out`, or None when it may (issue 38: following the advice
    "continue it with --resume auto" on a folder that was no run replaced its final/ and its metrics.jsonl).
    `--resume` writes only where nothing can be lost: a missing or empty --out (names in `ignore` aside: the run
    lock's file), where it starts at step 0 (a requeued job's first launch; `--resume PATH` continues there), or a
    run directory of ours (run_record_problem). With `auto`, such a run must have a complete checkpoint to
    continue from, unless it has no final/ either (stopped before its first checkpoint: it starts again at step 0,
    its own logs replaced); a finished run whose checkpoints were deleted is never trained over."""
    out = Path(out)
    if _holds_nothing(out, ignore):
        return None
    if not out.is_dir():
        return f"--out {out} exists and is not a directory"
    why = run_record_problem(out)
    if why is not None:
        return (f"--out {out} is not a run directory written by entrenar pretrain/finetune ({why}), so --resume "
                f"{spec} would write over what is there; nothing was changed. Give --out a new or empty directory "
                f"(or the run directory to continue)")
    if spec == "auto" and not complete_checkpoints(out / "checkpoints") and (out / "final").exists():
        return (f"--resume auto: {out} holds a finished run ({out / 'final'}) but no complete checkpoint under "
                f"{out / 'checkpoints'} to continue from, so a resume would train a new model from step 0 over "
                f"it; nothing was changed. Choose a new --out, or --resume PATH of a checkpoint kept elsewhere")
    return None


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """COMPLETE checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for d in ckpt_root.iterdir():
        m = STEP_RE.match(d.name)
        if m and d.is_dir() and not d.is_symlink() and (d / COMPLETE).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def stale_tmp_dirs(ckpt_root: Path, max_step: int, min_step: int = 0) -> list[Path]:
    """Temporary checkpoint directories of steps in [min_step, max_step] left by a killed save."""
    if not ckpt_root.is_dir():
        return []
    return sorted(d for d in ckpt_root.iterdir() if d.is_dir() and (m := TMP_RE.match(d.name))
                  and min_step <= int(m.group(1)) <= max_step)


def incomplete_checkpoints(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return sorted(d for d in ckpt_root.iterdir()
                  if d.is_dir() and not d.is_symlink() and (d.name.startswith("step-") or TMP_RE.match(d.name))
                  and not (d / COMPLETE).is_file())


def prune(ckpt_root: Path, keep: int) -> None:
    done = complete_checkpoints(ckpt_root)
    if done:  # temporaries of steps up to the newest complete one are superseded
        newest = int(STEP_RE.match(done[-1].name).group(1))
        for d in stale_tmp_dirs(ckpt_root, max_step=newest):
            shutil.rmtree(d)
    if keep <= 0:
        return
    for d in done[:-keep]:
        shutil.rmtree(d)


def missing_files(path: Path) -> list[str]:
    """The files of a checkpoint that are not there (an empty list for an intact one)."""
    return [name for name in (SHARDED_REQUIRED if is_sharded(path) else REQUIRED) if not (path / name).is_file()]


def _missing_message(path: Path, missing: list[str]) -> str:
    legacy = " (written by an older entrenar whose trainer_state.pt is no longer loaded: it was a pickle)" \
        if (path / "trainer_state.pt").is_file() else ""
    return f"{path} is missing {', '.join(missing)}{legacy}"


def _intact_candidates(run_dir: Path, log: Callable[[str], None]) -> tuple[list[Path], list[str]]:
    """Complete checkpoints with every file present, newest first, and what is wrong with the others."""
    root = run_dir / "checkpoints"
    for d in incomplete_checkpoints(root):
        log(f"resume: ignoring incomplete checkpoint {d} (no {COMPLETE} marker: interrupted while "
            f"being written)")
    intact, problems = [], []
    for d in reversed(complete_checkpoints(root)):
        missing = missing_files(d)
        if missing:
            problems.append(_missing_message(d, missing))
            log(f"resume: skipping {problems[-1]}; falling back to the previous complete checkpoint")
        else:
            intact.append(d)
    return intact, problems


def _explicit_checkpoint(spec: str, log: Callable[[str], None]) -> Path:
    path = Path(spec)
    if path.is_dir() and (path / "checkpoints").is_dir() and not (path / COMPLETE).exists():
        done = complete_checkpoints(path / "checkpoints")  # a run directory: its newest checkpoint
        if done:
            log(f"resume: continuing from {done[-1]}")
            path = done[-1]
    if path.is_symlink() or path.is_dir():
        path = path.resolve()
    if not path.is_dir():
        raise InputError(f"--resume {spec}: no such checkpoint directory")
    if not (path / COMPLETE).is_file():
        raise InputError(f"--resume {spec}: {path} has no {COMPLETE} marker, so it was not fully "
                         f"written (the run was killed while saving). Resume from an earlier "
                         f"checkpoint or use --resume auto")
    missing = missing_files(path)
    if missing:
        raise InputError(f"--resume {spec}: {_missing_message(path, missing)}, so it cannot be resumed "
                         f"from. Resume from an earlier checkpoint, or use --resume auto (it falls back "
                         f"to the newest intact one)")
    return path


def find_resume(run_dir: Path, spec: str, log: Callable[[str], None] = print) -> Path | None:
    """`--resume auto`: newest COMPLETE checkpoint of run_dir with every file present (None if there
    is no complete one). `--resume PATH`: that checkpoint, which must be COMPLETE and have every file
    (InputError otherwise). Reads no checkpoint contents (load_resume verifies them)."""
    if spec != "auto":
        return _explicit_checkpoint(spec, log)
    intact, problems = _intact_candidates(Path(run_dir), log)
    if intact:
        log(f"resume: continuing from {intact[0]}")
        return intact[0]
    if problems:
        raise InputError(f"--resume auto: no usable checkpoint under {Path(run_dir) / 'checkpoints'} "
                         f"({'; '.join(problems)}); start a new run (new --out) or restore a checkpoint")
    log(f"resume: no complete checkpoint under {Path(run_dir) / 'checkpoints'}; starting from step 0")
    return None


def load_resume(run_dir: Path, spec: str, log: Callable[[str], None] = print, share: HashShare | None = None
                ) -> tuple[Path | None, dict[str, Any] | None]:
    """(path, load_checkpoint(path, share)) of the checkpoint to resume from, or (None, None) to start at
    step 0. With `auto`, a checkpoint that is missing a file or fails its sha256 / safety checks is skipped
    with a message and the previous complete one is used (the same one on every rank: see HashShare)."""
    if spec != "auto":
        path = _explicit_checkpoint(spec, log)
        return path, load_checkpoint(path, share)
    intact, problems = _intact_candidates(Path(run_dir), log)
    for path in intact:
        try:
            ckpt = load_checkpoint(path, share)
        except InputError as e:
            problems.append(str(e))
            log(f"resume: skipping {path}: {e}; falling back to the previous complete checkpoint")
            continue
        log(f"resume: continuing from {path}")
        return path, ckpt
    if problems:
        raise InputError(f"--resume auto: no usable checkpoint under {Path(run_dir) / 'checkpoints'} "
                         f"({'; '.join(problems)}); start a new run (new --out) or restore a checkpoint")
    log(f"resume: no complete checkpoint under {Path(run_dir) / 'checkpoints'}; starting from step 0")
    return None, None


# ---- load ------------------------------------------------------------------------------------------
def _load_tensors_only(path: Path) -> Any:
    """torch.load that refuses anything but tensors and plain containers (no code runs)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise InputError(f"{path}: refused to load: it holds Python objects other than tensors and plain "
                         f"containers, which unpickling would execute ({str(e).splitlines()[0][:200]}). "
                         f"Only resume from checkpoints you trust, written by entrenar") from None


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's .metadata allowing only its data classes, paths and
    torch dtypes/sizes. torch itself pickle.load()s that file, so a crafted one would run code.
    The module is checked before it is imported (importing a module can itself run code)."""

    PLAIN = frozenset({("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                       ("builtins", "slice"), ("torch.serialization", "_get_layout"),
                       *(("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath",
                                                  "PureWindowsPath"))})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.PLAIN:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if inspect.isclass(obj) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj  # a data holder: constructing it runs no code of the file's choosing
        raise pickle.UnpicklingError(f"{module}.{name} is not a torch.distributed.checkpoint metadata type")


def check_dcp_files(dcp_dir: Path) -> None:
    """InputError unless loading this torch.distributed.checkpoint directory runs no code: its .metadata
    holds only DCP data classes, and every non-tensor entry (which DCP's planner torch.load()s with
    weights_only=False) loads with weights_only=True."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    def refuse(what: str, why: str) -> InputError:
        return InputError(f"{what}: refused to load: {why}, which unpickling would execute. Only resume from "
                          f"checkpoints you trust, written by entrenar")
    try:
        with open(dcp_dir / ".metadata", "rb") as f:
            metadata = _DcpMetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        raise refuse(str(dcp_dir / ".metadata"), f"it holds more than checkpoint metadata ({e})") from None
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, BytesStorageMetadata):
            continue
        info = metadata.storage_data[MetadataIndex(fqn)]
        if getattr(info, "transform_descriptors", None):
            raise refuse(f"{dcp_dir / info.relative_path} ({fqn})", "an entry stored transformed cannot be checked")
        with open(dcp_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise refuse(f"{dcp_dir / info.relative_path} ({fqn})",
                         f"it holds Python objects other than tensors and plain containers "
                         f"({str(e).splitlines()[0][:200]})") from None


# (rank, world, gather): under torchrun each rank hashes every world-th file of a checkpoint and `gather`
# (all_gather_object) hands every rank all ranks' findings, so all reach the same verdict; a 7B sharded
# checkpoint (85 GiB) is hashed once per job, not once per rank. One process: (0, 1, identity).
HashShare = tuple[int, int, Callable[[Any], list[Any]]]


def verify_hashes(path: Path, names: list[str], meta: dict[str, Any], share: HashShare | None = None) -> None:
    """InputError naming the first file whose sha256 differs from the one recorded in meta.json (a
    collective when `share` spans ranks: every rank must call it with the same names)."""
    rank, world, gather = share or (0, 1, lambda found: [found])
    problem = None
    for name in names[rank::world]:
        digest, actual = meta["sha256"].get(name), sha256_file(path / name)
        if actual != digest:
            problem = (f"{path / name}: sha256 {actual[:12]}.. does not match the {(digest or 'none')[:12]}.. "
                       f"recorded when it was written: the checkpoint is corrupt; resume from an earlier one")
            break
    found = [p for p in gather(problem) if p]
    if found:
        raise InputError(found[0])


def load_checkpoint(path: Path, share: HashShare | None = None) -> dict[str, Any]:
    """Read and verify a COMPLETE checkpoint: {'model', 'optimizer', 'trainer_state', 'run_config', 'meta'}.
    Every file must be present and match its recorded sha256 (verified by the ranks together when
    `share` is given); nothing is unpickled into code."""
    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise InputError(f"{path}: checkpoint has no {COMPLETE} marker")
    missing = missing_files(path)
    if missing:
        raise InputError(f"{_missing_message(path, missing)}: the checkpoint is incomplete; resume from "
                         f"an earlier one")
    meta = json.loads((path / META).read_text())
    sharded = is_sharded(path)
    verify_hashes(path, sorted(meta["sha256"]) if sharded else list(HASHED), meta, share)  # sharded: every file
    state = json.loads((path / STATE).read_text())
    if sharded:  # every rank's RNG: rng.safetensors keys "rank{r}.torch", ...; "rng" is rank 0's
        tensors = load_file(str(path / RNG))
        state["rng_ranks"] = [_rng_from_files(j, {k.split(".", 1)[1]: t for k, t in tensors.items()
                                                  if k.startswith(f"rank{r}.")})
                              for r, j in enumerate(state["rng"]["ranks"])]
        state["rng"] = state["rng_ranks"][0]
        check_dcp_files(path / SHARDED)  # before parallel.load_sharded hands it to dcp.load
        return {"model": None, "optimizer": None, "sharded": path / SHARDED, "trainer_state": state,
                "run_config": json.loads((path / RUN_CONFIG).read_text()), "meta": meta}
    state["rng"] = _rng_from_files(state["rng"], load_file(str(path / RNG)))
    return {
        "model": load_file(str(path / MODEL)),
        "optimizer": _load_tensors_only(path / OPTIMIZER),
        "trainer_state": state,
        "run_config": json.loads((path / RUN_CONFIG).read_text()),
        "meta": meta,
    }


def restore_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpointed trainable parameters into the model; every trainable one must be there."""
    params = dict(model.named_parameters())
    want = {n for n, p in params.items() if p.requires_grad}
    missing, unexpected = want - set(tensors), set(tensors) - set(params)
    if missing or unexpected:
        raise InputError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    with torch.no_grad():
        for n, t in tensors.items():
            if params[n].shape != t.shape:
                raise InputError(f"checkpoint tensor {n} has shape {tuple(t.shape)}, model has "
                                 f"{tuple(params[n].shape)}")
            params[n].copy_(t)


# ---- the Trainer's part -------------------------------------------------------------------------------
def _write_failure(e: BaseException) -> BaseException | None:
    """The error of a write the disk refused (fileio.disk_write_error: OSError, SafetensorError, tokenizers' and
    torch.save's texts of it): `e` itself, or the one torch.distributed.checkpoint wrapped into its
    CheckpointException (failures: rank -> (exception, traceback)); None for anything else."""
    from ..fileio import disk_write_error

    if disk_write_error(e) is not None:
        return e
    failures = getattr(e, "failures", None)
    if type(e).__name__ == "CheckpointException" and isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            found = _write_failure(inner) if isinstance(inner, BaseException) else None
            if found is not None:
                return found
    return None


@contextlib.contextmanager
def write_errors(target: Path, ckpt_root: Path) -> Iterator[None]:
    """An OSError (ENOSPC, EFBIG under a file-size limit, EROFS, ...) or a SafetensorError (safetensors' own wrapper
    of one: "File too large") while writing `target` is an InputError (exit 2) naming the path and the cause and
    the newest complete checkpoint under `ckpt_root`, which the atomic write left as it was (issue 38 item 8: a
    full disk during a save was exit 1, "please report it"). Also when torch.distributed.checkpoint wrapped it."""
    try:
        yield
    except BaseException as exc:
        e = _write_failure(exc)
        if e is None:
            raise
        done = complete_checkpoints(ckpt_root)
        kept = (f"the newest complete checkpoint, {done[-1]}, is intact: after freeing space continue with "
                f"--resume auto" if done else "no complete checkpoint was written before")
        cause = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise InputError(f"{target}: could not be written ({type(e).__name__}: {cause}; a full disk or a file-size "
                         f"limit?); nothing of it was kept; {kept}") from None


def _writer_thread_priority() -> None:
    """The writer thread yields the CPU to training (the lowest priority, nice 19; on Linux a thread has its own
    nice value; best effort): on a machine whose cores are busy, a write takes longer, not the steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


# How long an error exit waits for the checkpoint write it abandoned to stop (Trainer.drop_write): a local write
# stops before its next file, a sharded one once its ranks' collectives are done. A write still running after
# that (a disk that hangs, a peer's writer that never arrives) is left behind (leave_past_writers).
ABANDON_WAIT_S = 10.0
WRITER_THREAD = "entrenar-checkpoint-"  # the name of each writer thread, then its step
_WRITES: weakref.WeakSet[_Write] = weakref.WeakSet()  # every background write not yet garbage


def writers_running() -> list[_Write]:
    """The background checkpoint writes of this process whose thread has not ended."""
    return sorted((w for w in list(_WRITES) if not w.done), key=lambda w: w.step)


def _leave(code: int) -> None:
    running = writers_running()
    if not running:
        return
    print(f"note: {', '.join(step_dir_name(w.step) for w in running)}: a checkpoint write abandoned by this "
          f"error exit did not stop; leaving without it (it has no {COMPLETE} marker, --resume ignores it)",
          file=sys.stderr, flush=True)
    for w in running:  # its temporary, never to be committed (gate abandoned), goes with it
        if w.tmp is not None:
            shutil.rmtree(w.tmp, ignore_errors=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def leave_past_writers(code: int) -> None:
    """At the end of a command (cli.main): when a checkpoint writer thread is still running (an abandoned write
    that did not stop within ABANDON_WAIT_S), the process ends with `code` at exit through os._exit, before the
    interpreter's teardown. Under torchrun a process whose writer thread is inside a gloo collective when the
    peer's exit fails it during that teardown aborts in C++ ("terminate called without an active exception",
    SIGABRT) instead of exiting with its code, and torchrun reports a crash (or SIGTERMs the other ranks before
    they exit with theirs); one process's writer returning from C++ I/O then would do the same. Registered last,
    the check runs first among the atexit handlers, and again: a writer that ended meanwhile changes nothing."""
    if writers_running():
        atexit.register(_leave, code)


class _Write:
    """One checkpoint being written by a background thread: its step, its commit gate, and how it ended. Its end
    is its own event (`finished`) and then its thread's: on Python 3.11 a Thread.join interrupted by a signal's
    KeyboardInterrupt (Ctrl-C, torchrun's SIGTERM) can mark the still-running thread stopped (threading's
    bpo-45274 handling), so a write in flight looked finished and was named as the last checkpoint; and a process
    that exits while the writer thread is still ending (its last references dropped, in C++ destructors) can
    abort at exit ("terminate called without an active exception"), so the thread's end is waited for too."""

    def __init__(self, step: int, write: Callable[[CommitGate], Path], tmp: Path | None = None):
        self.step, self.gate, self.tmp = step, CommitGate(), tmp  # tmp: its temporary directory (local writes)
        self.result: Path | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._pending: Callable[[CommitGate], Path] | None = write  # the thread's only reference to it
        _WRITES.add(self)
        self.thread = threading.Thread(target=self._run, name=f"{WRITER_THREAD}{step_dir_name(step)}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        write, self._pending = self._pending, None
        try:
            _writer_thread_priority()
            self.result = write(self.gate)
        except BaseException as e:  # noqa: BLE001 -- raised on the training thread (Checkpointer.poll / wait)
            self.error = e
        finally:
            write = None  # the snapshot (host buffers, DCP's staged copy) let go here, before the end is told
            self.finished.set()

    @property
    def done(self) -> bool:
        """The write ended, and its thread with it."""
        return self.finished.is_set() and not self.thread.is_alive()

    def join(self, timeout_s: float | None = None) -> None:
        """Until the write and its thread ended (or `timeout_s` passed), in slices: a signal (a second Ctrl-C)
        reaches the training thread."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done:
            left = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if left <= 0:
                return
            if self.finished.is_set():
                self.thread.join(left)  # its last moments
            else:
                self.finished.wait(left)


class Checkpointer:
    """The checkpoints of one run under `run_dir`/checkpoints: written as one directory by one process, or
    as DCP shards by every rank together under torchrun; restored from either kind into the model and
    optimizer as they are now. `extra_files(model)` takes what makes a local checkpoint a runnable MODEL (config
    or adapter files, generation_config.json, the tokenizer; set by the commands) and returns its writer.

    mode "async" (--save-mode, the default): `save` takes a snapshot (weights, optimizer state, RNG, trainer
    state: a copy in host memory, pinned on a GPU; DCP's staging for shards) and a background thread writes it
    while training goes on; one write at a time (`save` first waits for the previous one). A write's error
    (a full disk) is raised on the training thread by `poll` (one process: the step after it happened), the
    next `save` or `wait` (every rank at the same step), as the exit-2 InputError a synchronous save raises.
    Under torchrun the writers' collectives run over their own gloo process group, never the training's.
    mode "sync": `save` writes from the live tensors and returns when the checkpoint is COMPLETE."""

    def __init__(self, run_dir: Path, keep: int, ctx: DistContext,
                 extra_files: Callable[[torch.nn.Module], Callable[[Path], None]] | None = None,
                 mode: str = "async"):
        if mode not in SAVE_MODES:
            raise InputError(f"--save-mode {mode!r}: expected one of {', '.join(SAVE_MODES)}")
        self.run_dir, self.root, self.keep, self.ctx = Path(run_dir), Path(run_dir) / "checkpoints", keep, ctx
        self.extra_files, self.mode = extra_files, mode
        self.last_complete: Path | None = None  # the newest checkpoint known COMPLETE (written or resumed from)
        self._write: _Write | None = None
        self._buffers = HostBuffers()
        self._dcp_writer: Any = None
        self._group: Any = None
        if ctx.active and mode == "async":  # every rank builds its Checkpointer at the same point: a collective
            import torch.distributed as dist

            from .distributed import DEFAULT_TIMEOUT_S, TIMEOUT_ENV

            self._group = dist.new_group(backend="gloo", timeout=timedelta(
                seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))))

    @property
    def in_flight(self) -> int | None:
        """The step of the checkpoint being written in the background, or None."""
        return None if self._write is None else self._write.step

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             trainer_state: dict[str, Any], run_config: dict[str, Any], last: bool = False) -> Path:
        """step-N, atomically (a collective under torchrun); returns the path it has (async: will have once
        written). A write that fails (a full disk, a file-size limit) is exit 2 naming the path and the cause;
        the previous checkpoints stay. `last`: the run's last save; when no earlier save made the snapshot's host
        buffers, it copies into pageable memory: pinning is what lets later snapshots queue their copies behind
        the step, and allocating ~45 GB of it for a 7B model's first snapshot held the end of a run 45 s
        (bench/RESULTS.md, "The end of a run")."""
        target = self.root / step_dir_name(step)
        self._buffers.pin = not (last and not self._buffers.allocated() and self._dcp_writer is None)
        if self.mode == "sync":
            with write_errors(target, self.root):
                self.last_complete = self._start(step, model, optimizer, trainer_state, run_config, False)(None)
            return target
        from ..fileio import _tmp_path

        self.wait()  # one write at a time (its buffers are the next snapshot's); its error is raised here
        with stops.deferred():  # a stop signal from here on waits for this write (Trainer.settle_write)
            with write_errors(target, self.root):
                write = self._start(step, model, optimizer, trainer_state, run_config, True)
            self._write = _Write(step, write, None if self.ctx.active else _tmp_path(target))
        return target

    def _start(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               trainer_state: dict[str, Any], run_config: dict[str, Any], copy: bool
               ) -> Callable[[CommitGate | None], Path]:
        """The snapshot (copied into host memory when `copy`), and the function that writes it."""
        if self.ctx.active:
            if copy and self._dcp_writer is None:
                self._dcp_writer = dcp_writer(self.root, pinned=torch.cuda.is_available() and self._buffers.pin
                                              and self.ctx.device.type == "cuda")
            return start_sharded_checkpoint(self.root, step, model, optimizer, trainer_state, run_config, self.keep,
                                            self.ctx, self._dcp_writer if copy else None, self._group if copy else None)
        snap = snapshot(step, model, optimizer, trainer_state, run_config, self.extra_files,
                        self._buffers if copy else None)
        root, keep = self.root, self.keep

        def write(gate: CommitGate | None) -> Path:
            with write_errors(root / step_dir_name(step), root):
                return write_snapshot(root, snap, keep, gate)
        return write

    def poll(self, raise_errors: bool = True) -> None:
        """Take the outcome of a background write that has ended: the checkpoint it made COMPLETE, or (when
        `raise_errors`) its error. Never waits."""
        if self._write is not None and self._write.done and (raise_errors or self._write.error is None):
            self._outcome()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the background write, if any, and take its outcome (raising its error). With `timeout_s`: False
        (the write still running, its outcome not taken) when it has not ended by then."""
        if self._write is not None:
            self._write.join(timeout_s)
            if not self._write.done:
                return False
            self._outcome()
        return True

    def _outcome(self) -> None:
        write, self._write = self._write, None
        if write is None:
            return
        if write.gate.committed:  # COMPLETE even when what follows the commit failed (rank 0's broadcast of it)
            self.last_complete = self.root / step_dir_name(write.step)
        if write.error is not None:
            raise write.error
        self.last_complete = write.result

    def abandon(self, wait_s: float = 0.0) -> BaseException | None:
        """Give up the background write (the run ends on an error, or a second Ctrl-C): it never writes COMPLETE
        from here on (a write that already committed stays). Waits up to `wait_s` for its thread to stop (a local
        write stops before its next file; a sharded one ends its collectives with the other ranks' writers, which
        their own error exits abandon too) so that the process does not exit with it inside a gloo collective (see
        leave_past_writers); a stop signal meanwhile (Ctrl-C, torchrun's SIGTERM) ends the wait, not the error
        exit. Returns its own error if it had failed."""
        write, self._write = self._write, None
        if write is None:
            return None
        write.gate.abandon()
        with contextlib.suppress(KeyboardInterrupt):
            write.join(wait_s)
        if write.gate.committed or (write.done and write.error is None):  # it had finished (another rank's commit)
            self.last_complete = self.root / step_dir_name(write.step)
        return write.error if write.done and not isinstance(write.error, Abandoned) else None

    def load(self, spec: str, log: Callable[[str], None]) -> tuple[Path | None, dict[str, Any] | None]:
        """load_resume with the ranks sharing the hashing (each hashes every world-th file)."""
        return load_resume(self.run_dir, spec, log, (self.ctx.rank, self.ctx.world, self.ctx.all_gather_object))

    def restore(self, ckpt: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Weights and optimizer state of a loaded checkpoint: DCP shards reshard to this world size; a
        one-process checkpoint continued on several ranks leaves each rank its share."""
        if ckpt.get("sharded") is not None:
            load_sharded(ckpt["sharded"], model, optimizer)
        elif not self.ctx.active:
            restore_model(model, ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        else:
            load_full(model, optimizer, ckpt["model"], ckpt["optimizer"])
