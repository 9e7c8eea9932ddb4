"""Data parallelism applied from outside the model, in one place: FSDP2 or DDP.

`apply_parallel` takes the built `CausalLM` (fp32 master weights, LoRA already applied) and
returns a `Parallel` handle: `.module` is the model (its config, parameter names, saving),
`.forward_module` is what the trainer calls. Single process: both are the model, no wrapping.

- FSDP2 (`fully_shard`): the decoder blocks in units of consecutive blocks of about
  FSDP_UNIT_PARAMS parameters together (`fsdp_units`: one block per unit once a block is that big,
  e.g. 7B; 4 units of 6 blocks for llama-370m / qwen2.5-0.5b), then the root, which keeps the final
  norm and the head. The embedding gets its own group only when the head is untied; a tied head reads
  `embed_tokens.weight` inside the root's forward, so the embedding must be a root parameter.
  Why units, not one group per block: FSDP2's hooks cost host time per group and pass (all-gather
  copy-in/out, reduce-scatter chunk-cat, stream events: ~2-3 ms per group per step on the H200 host).
  Profiled on 4x H200 (llama-370m, batch 8 x 2048, bf16, steps 5-7, bench/distributed_profile.py),
  one group per block left the GPU busy 95 ms of a 259 ms step: the backward thread alone spent
  139 ms of host time per step (52 ms in one process) and the forward 93 ms (36 ms), so the step
  was host-bound at 48% of the 1-GPU tok/s per GPU while DDP (no per-group hooks) reached 91%.
  The last unit is not resharded after the forward: the backward starts with it.
  Under --dtype bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the sharded fp32
  parameters stay the master weights and AdamW state, compute runs in bf16, gradients are reduced
  in fp32. Forward inputs are not cast (the RoPE tables stay fp32, as in one process).
- DDP: for full training of models whose whole training state fits a card (see DDP_STATE_FRACTION), and
  for the adapter modes. The trainable LoRA tensors are a few MB; sharding them buys no
  memory, and FSDP would shard (all-gather every step) the frozen base, which DDP leaves
  alone: DDP all-reduces only parameters with requires_grad, so the frozen (NF4) base is
  never communicated. `init_sync=False`: every rank loads the same base and seeds LoRA alike.

Both reduce gradients with a plain SUM (FSDP: divide factor 1 with sum reduction; DDP: a SUM
comm hook), because every rank already backpropagates loss_sum / global_loss_tokens: an
averaging reduction would divide the update by the world size a second time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InputError
from ..fileio import sha256_file
from .config import PARALLEL_MODES
from .distributed import DistContext

# --parallel auto trains a model with DDP (no sharding) when one card holds its whole training state
# (fp32 weights, gradients, AdamW moments and DDP's gradient buckets: DDP_BYTES_PER_PARAM per trainable
# parameter) in at most DDP_STATE_FRACTION of its memory, the rest left to activations: e.g. every model
# up to ~1 B parameters on an 80 GB card. DDP has no per-group host work and overlaps one bucketed
# all-reduce with the backward; FSDP2 all-gathers the weights twice per step and runs AdamW through
# DTensor dispatch, which on these small, host-bound steps cost throughput (bench/RESULTS.md, issue 17).
DDP_STATE_FRACTION = 0.25
DDP_BYTES_PER_PARAM = 20


def resolve_parallel(mode: str, adapters: bool, trainable_params: int | None = None,
                     device_memory: int | None = None) -> str:
    """auto: DDP for LoRA/QLoRA (see the module docstring) and for full training of a model whose
    unsharded training state fits DDP_STATE_FRACTION of one card (`device_memory` bytes; None, e.g.
    on the CPU: not known, so FSDP); FSDP2 otherwise: sharded master weights and AdamW state are what
    lets a 7B model train at all."""
    if mode not in PARALLEL_MODES:
        raise InputError(f"--parallel {mode!r} not in {'|'.join(PARALLEL_MODES)}")
    if mode == "auto":
        if adapters:
            return "ddp"
        fits = (trainable_params is not None and device_memory is not None
                and trainable_params * DDP_BYTES_PER_PARAM <= DDP_STATE_FRACTION * device_memory)
        return "ddp" if fits else "fsdp"
    if mode == "fsdp" and adapters:
        raise InputError("--parallel fsdp with --mode lora/qlora: the frozen (NF4) base cannot be sharded "
                         "by fully_shard here; use --parallel ddp (or auto)")
    return mode


def parallel_for(model: torch.nn.Module, device: torch.device, mode: str, adapters: bool) -> str:
    """resolve_parallel with this model's trainable parameters and the card's memory."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return resolve_parallel(mode, adapters, trainable, memory)


@dataclass
class Parallel:
    module: torch.nn.Module  # the model itself: config, names, state for saving
    forward_module: torch.nn.Module  # what to call for forward (the DDP wrapper under DDP)
    kind: str  # "single" | "fsdp" | "ddp"
    ctx: DistContext

    def sync_context(self, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """DDP: skip the all-reduce for all but the last micro-batch of a step (the summed local
        gradients are reduced once). FSDP reduce-scatters per micro-batch (less memory)."""
        if self.kind == "ddp" and not last_micro_batch:
            return self.forward_module.no_sync()
        return contextlib.nullcontext()

    def clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
        return clip_grad_norm(params, max_norm)

    def clip_grad_norm_tensor(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return clip_grad_norm_tensor(params, max_norm)


def _mp_policy(dtype: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from .precision import uses_bf16

    if uses_bf16(dtype):  # bf16 and bf16-weights: FSDP's bf16 all-gather is bf16 copies of fp32 masters
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


# Parameters per FSDP unit of decoder blocks. Big enough that FSDP2's per-group host work is paid a
# handful of times per step on small models (see the module docstring), small enough that a unit's
# unsharded bf16 weights + fp32 gradients (~0.6 GB at 1e8) are a small part of a card's memory.
FSDP_UNIT_PARAMS = 100_000_000


def fsdp_units(blocks: Iterable[torch.nn.Module], unit_params: int | None = None) -> list[list[torch.nn.Module]]:
    """Consecutive blocks split into the fewest near-equal units of about `unit_params` parameters
    (default FSDP_UNIT_PARAMS) each; at least one block per unit, order kept."""
    unit_params = FSDP_UNIT_PARAMS if unit_params is None else unit_params
    blocks = list(blocks)
    if not blocks:
        return []
    total = sum(p.numel() for b in blocks for p in b.parameters())
    n = min(len(blocks), max(1, math.ceil(total / max(1, unit_params))))
    size, extra = divmod(len(blocks), n)  # the first `extra` units hold one block more
    units, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        units.append(blocks[start:end])
        start = end
    return units


def apply_fsdp(model: torch.nn.Module, ctx: DistContext, dtype: str,
               unit_params: int | None = None) -> torch.nn.Module:
    """fully_shard the decoder blocks in units (`fsdp_units`), the untied embedding, then the root
    (in place)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mp = _mp_policy(dtype)
    units = fsdp_units(model.model.layers, unit_params)
    for i, unit in enumerate(units):
        # the last unit's weights are needed again first thing in the backward: keep them gathered
        fully_shard(unit[0] if len(unit) == 1 else unit, mesh=ctx.mesh, mp_policy=mp,
                    reshard_after_forward=i < len(units) - 1)
    if getattr(model, "lm_head", None) is not None:
        fully_shard(model.model.embed_tokens, mesh=ctx.mesh, mp_policy=mp)
    # the root's parameters are needed again right at the start of the backward: keep them gathered
    fully_shard(model, mesh=ctx.mesh, mp_policy=mp, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                # a SUM (then /1.0): gloo has no PREMUL_SUM, and SUM is exact on every backend
                m.set_force_sum_reduction_for_comms(True)
    return model


def _sum_hook(process_group, bucket):  # no annotations: DDP rejects any but GradBucket
    """DDP comm hook: all-reduce SUM without DDP's division by the world size."""
    fut = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# DDP's options (measured on 4x H200, llama-370m, bench/RESULTS.md issue 17 session 4): 100 MB buckets (15
# all-reduces per step instead of 38 at 25 MB: fewer NCCL launches, each past the LL protocol's size) and
# gradients as views into the buckets (no copy of each gradient into its bucket). Without accumulation
# the graph is also declared static (every step uses the same parameters in the same order: DDP skips
# its per-step search for unused parameters); torch's reducer fails an internal assert when no_sync
# (accumulation) runs before the first synchronised backward of a static graph. The math is the same
# (CPU tests compare losses with one process).
DDP_OPTIONS: dict[str, Any] = {"bucket_cap_mb": 100, "gradient_as_bucket_view": True}


def apply_ddp(model: torch.nn.Module, ctx: DistContext, static_graph: bool = False) -> torch.nn.Module:
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    # no buffer sync in forward; torch 2.13 renamed the flag and warns (once per rank) on the old name.
    # Same behaviour: init_sync=False below skips the init sync the new flag would otherwise keep.
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
        else "broadcast_buffers"
    kwargs: dict[str, Any] = {no_sync: False, "static_graph": static_graph, **DDP_OPTIONS}
    if ctx.device.type == "cuda":
        kwargs["device_ids"] = [ctx.device.index]
    try:
        ddp = DDP(model, init_sync=False, **kwargs)
    except TypeError:  # torch without init_sync: the initial broadcast is redundant but harmless
        ddp = DDP(model, **kwargs)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def apply_parallel(model: torch.nn.Module, ctx: DistContext, mode: str = "auto", dtype: str = "fp32",
                   adapters: bool = False, grad_accum: int = 1) -> Parallel:
    """Wrap `model` for data parallelism over ctx's ranks (a no-op handle in one process). `grad_accum`
    micro-batches per step: DDP declares its graph static only without accumulation (see DDP_OPTIONS)."""
    if not ctx.active:
        return Parallel(model, model, "single", ctx)
    kind = parallel_for(model, ctx.device, mode, adapters)
    if kind == "fsdp":
        return Parallel(apply_fsdp(model, ctx, dtype), model, "fsdp", ctx)
    return Parallel(model, apply_ddp(model, ctx, static_graph=grad_accum == 1), "ddp", ctx)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip by the global L2 norm and return it (a host number: one device sync)."""
    return float(clip_grad_norm_tensor(params, max_norm))


def clip_grad_norm_tensor(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global L2 norm; the norm as a device scalar (no host sync). Under FSDP the
    gradients are DTensor shards: the squared norms of the local shards are summed with ONE
    all-reduce over the mesh and the local shards are scaled in place. torch's clip_grad_norm_ on
    DTensors gets the same numbers, but through DTensor dispatch of every foreach op (~10 ms of host
    time per step for llama-370m, in a step that is host-bound under FSDP)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard

    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if not any(isinstance(g, DTensor) for g in grads):  # one process or DDP: torch's own
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    sharded, whole, group = [], [], None
    for g in grads:
        if isinstance(g, DTensor) and any(isinstance(pl, Shard) for pl in g.placements):
            sharded.append(g.to_local())  # a view: scaling it scales the gradient
            group = g.device_mesh.get_group()
        else:  # a replicated DTensor or a plain tensor: every rank holds all of it, count it once
            whole.append(g.to_local() if isinstance(g, DTensor) else g)
    local = sharded + whole
    device = local[0].device

    def squares(ts: list[torch.Tensor]) -> torch.Tensor:
        if not ts:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = torch._foreach_norm(ts, 2.0)
        return torch.stack([n.to(device, torch.float32) for n in norms]).square().sum()

    with torch.no_grad():
        sq = squares(sharded)
        if group is not None:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
        total = (sq + squares(whole)).sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(local, coef)
    return total


# ---- state dicts ------------------------------------------------------------------------------------
def full_model_state(par: Parallel, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The consolidated (unsharded, CPU) state dict, on rank 0 (empty elsewhere). A collective:
    every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if par.kind == "single" or par.kind == "ddp":
        model = par.module
        sd = {n: p.detach().cpu() for n, p in model.state_dict().items()}
    else:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(par.module, options=opts)
    if trainable_only:
        names = {n for n, p in par.module.named_parameters() if p.requires_grad}
        sd = {n: t for n, t in sd.items() if n in names}
    return sd if par.ctx.is_main else {}


def _state_options(**kw: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def sharded_state(par: Parallel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model", "optim"}: FQN-keyed, sharded (DTensor) under FSDP, for torch.distributed.checkpoint.
    Only trainable tensors: a LoRA checkpoint holds the adapter, not the frozen base."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(par.module, optimizer, options=_state_options(ignore_frozen_params=True))
    return {"model": msd, "optim": osd}


def save_sharded(path: Path, par: Parallel, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of model + optimizer into `path` (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state(par, optimizer), checkpoint_id=str(path))


def load_sharded(path: Path, par: Parallel, optimizer: torch.optim.Optimizer) -> None:
    """Load a torch.distributed.checkpoint directory into the model and optimizer, resharding to the
    current world size (also 1: one process reads every shard)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = sharded_state(par, optimizer)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=not par.ctx.active)
    set_state_dict(par.module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_state_options(ignore_frozen_params=True))


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


def load_full(par: Parallel, optimizer: torch.optim.Optimizer, model_tensors: dict[str, torch.Tensor],
              optim_state: dict[str, Any]) -> None:
    """Load a single-process checkpoint (full trainable tensors + index-keyed optimizer state) into a
    (possibly sharded) model: each rank keeps its shard. Resuming 1 -> N processes."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    osd = _fqn_optimizer_state(par.module, optimizer, optim_state)
    set_state_dict(par.module, optimizer, model_state_dict=dict(model_tensors), optim_state_dict=osd,
                   options=_state_options(full_state_dict=True, strict=False))



# ---- sharded checkpoints ------------------------------------------------------------------------------
def save_sharded_checkpoint(ckpt_root: Path, step: int, par: Parallel, optimizer: torch.optim.Optimizer,
                            trainer_state: dict[str, Any], run_config: dict[str, Any], keep: int) -> Path:
    """step-N of a distributed run, with the single-process checkpoint's atomicity: every rank writes
    its model/optimizer shards (torch.distributed.checkpoint) into one hidden temporary directory;
    rank 0 then adds every rank's RNG, the trainer state, meta.json (sha256 of every file) and
    COMPLETE last, renames it to step-N and points `latest` at it. A kill at any point leaves no
    step-N without COMPLETE; --resume never reads the temporary directory."""
    from . import checkpoint as C

    ctx = par.ctx
    final = ckpt_root / C.step_dir_name(step)
    tmp = ckpt_root / f".{final.name}.tmp-dist"  # one name every rank agrees on (checkpoint.TMP_RE)
    if ctx.is_main:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in C.stale_tmp_dirs(ckpt_root, max_step=step, min_step=step):
            shutil.rmtree(stale)
        tmp.mkdir()
    ctx.barrier()
    save_sharded(tmp / C.SHARDED, par, optimizer)
    # each rank hashes the shard files it wrote itself (DCP names them __{rank}_{n}.distcp), all ranks at
    # once: for a 7B run that is 85 GiB, which rank 0 alone took a minute or more to hash; rank 0 hashes
    # whatever no rank claimed (.metadata, the files it writes below, any other naming)
    digests: dict[str, str] = {}
    for part in ctx.all_gather_object({f"{C.SHARDED}/{f.name}": sha256_file(f) for f in
                                       sorted((tmp / C.SHARDED).glob(f"__{ctx.rank}_*.distcp"))}):
        digests.update(part)
    state = dict(trainer_state)
    rngs = ctx.all_gather_object(C._rng_to_files(state.pop("rng", None) or C.rng_state()))

    def finish() -> Path:
        tensors = {f"rank{r}.{k}": t for r, (_, ts) in enumerate(rngs) for k, t in ts.items()}
        C.save_file(tensors, str(tmp / C.RNG))
        C._fsync_file(tmp / C.RNG)
        C._write_bytes(tmp / C.STATE, (json.dumps({**state, "rng": {"ranks": [j for j, _ in rngs]}}, indent=1)
                                       + "\n").encode())
        C._write_bytes(tmp / C.RUN_CONFIG, (json.dumps(run_config, indent=2, default=str) + "\n").encode())
        files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        meta = {"step": step, "tokens": trainer_state.get("tokens"), "sharded": True, "world_size": ctx.world,
                "sha256": {name: digests.get(name) or sha256_file(tmp / name) for name in files}}
        C._write_bytes(tmp / C.META, (json.dumps(meta, indent=2) + "\n").encode())
        C._write_bytes(tmp / C.COMPLETE, b"ok\n")  # last: its presence means every file above is on disk
        C._fsync_dir(tmp / C.SHARDED)
        C._fsync_dir(tmp)
        if final.exists():  # re-saving a step after resuming from an earlier checkpoint
            shutil.rmtree(final)
        os.replace(tmp, final)
        C._fsync_dir(ckpt_root)
        C._point_latest(ckpt_root, final)
        C.prune(ckpt_root, keep)
        return final

    return ctx.run_on_main(finish)


# ---- the Trainer across ranks --------------------------------------------------------------------------
class DistReduce:
    """Trainer.reduce for a distributed run: numbers and tensors summed / maxed over every rank."""

    def __init__(self, ctx: DistContext):
        self.ctx, self.rank, self.world_size = ctx, ctx.rank, ctx.world

    def _reduce(self, value: Any, op: str) -> Any:
        if not self.ctx.active:
            return value
        if isinstance(value, torch.Tensor):
            t = value.detach().to(self.ctx._comm_device(), copy=True)
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
            return t.to(value.device)
        out = self.ctx.all_reduce([value], op)[0]
        return round(out) if isinstance(value, int) else out

    def all_reduce_sum(self, value: Any) -> Any:
        return self._reduce(value, "sum")

    def all_reduce_max(self, value: Any) -> Any:
        return self._reduce(value, "max")

    def gather(self, obj: Any) -> list[Any]:
        return self.ctx.all_gather_object(obj)


class _NullLog:
    """metrics.jsonl / eval.jsonl of ranks other than 0: they write nothing."""

    def truncate_after(self, step: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        pass


def _trainer_base():
    from .loop import Trainer

    return Trainer


class ParallelTrainer(_trainer_base()):
    """The Trainer with its parts made global: the forward/backward through the FSDP/DDP module,
    the clip norm over the shards, guards on reduced values naming the rank that went non-finite,
    sharded checkpoints (resumable at another world size), and only rank 0 writing files. With one
    process it is the plain Trainer, except that it can also resume a sharded checkpoint."""

    def __init__(self, par: Parallel, train_loader: Any, eval_loader: Any, cfg: Any, run_dir: Path, **kw: Any):
        self.par, self.ctx = par, par.ctx
        self._local_loss = 0.0
        super().__init__(par.module, train_loader, eval_loader, cfg, run_dir, reduce=DistReduce(par.ctx), **kw)
        if self.ctx.active:  # recorded in each checkpoint: resuming elsewhere compares global batches
            self.run_config["world_size"] = self.ctx.world
        if not self.ctx.is_main:
            self.metrics_log = self.eval_log = _NullLog()

    # ---- global values ----------------------------------------------------------------------------
    def weights_max_abs(self) -> float:
        if self.par.kind != "fsdp":  # one process, or DDP's identical full replicas
            return super().weights_max_abs()
        from .guards import weights_max_abs

        local = weights_max_abs([p.to_local() for p in self.params])  # this rank's shards
        if self.ctx.any_true(math.isnan(local)):  # MAX over ranks is not NaN-propagating everywhere
            return float("nan")
        return self.ctx.all_reduce([local], "max")[0]

    def forward_backward(self, micro: list[dict], total_tokens: int) -> tuple[float, float]:
        """Each rank backpropagates its loss sums / the global token total (gradients are then
        SUM-reduced, see apply_parallel); the loss is the global sum / global total. One process:
        the Trainer's own step (its --dtype bf16-weights copies included)."""
        if self.par.kind == "single":
            return super().forward_backward(micro, total_tokens)
        from . import loop

        acc = torch.zeros((), dtype=torch.float64, device=self.device)
        for j, b in enumerate(micro):
            with self.par.sync_context(last_micro_batch=j == len(micro) - 1):
                s = loop.loss_sum_of(self.par.forward_module, b, self.device, self.cfg.dtype)
                (s / total_tokens).backward()
            acc += s.detach().double()
        # the loss sum is reduced and the norm taken on the device; all three are read back together
        # (one host sync per step), after the update is queued: fused AdamW skips it on the device when
        # the reduced loss or norm is non-finite (the same verdict on every rank), so the device never
        # drains while the host reads, runs the guards and launches the (DTensor) optimizer step
        loss_sum = self.reduce.all_reduce_sum(acc)
        grad_norm = self.par.clip_grad_norm_tensor(self.params, self.cfg.clip if self.cfg.clip > 0 else float("inf"))
        read = loop.read_later(torch.stack([acc, loss_sum, grad_norm.to(acc.device, torch.float64)]))
        self.update_queued = self.queue_update(loss_sum, grad_norm)
        local, loss_sum, norm = read()
        self._local_loss = local
        return loss_sum / total_tokens, norm

    def guard_step(self, loss: float, grad_norm: float, step: int, sample_ids: list,
                   pre_step: tuple[dict, dict]) -> str:
        if self.ctx.active and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # every rank sees the same reduced NaN; say where it came from: the ranks whose own loss
            # was non-finite (all ranks when only the gradient norm was), with their samples
            reports = self.ctx.all_gather_object((self.ctx.rank, math.isfinite(self._local_loss), sample_ids))
            bad = [(r, ids) for r, ok, ids in reports if not ok] or [(r, ids) for r, _, ids in reports]
            sample_ids = {f"rank {r}": ids for r, ids in bad}
        return super().guard_step(loss, grad_norm, step, sample_ids, pre_step)

    # ---- resume ---------------------------------------------------------------------------------------
    def check_resume_config(self, saved: dict[str, Any]) -> None:
        """At another world size the global batch (world x batch x accumulation) and the sequence
        length must stay: the loader position is in samples, so the same steps then see the same
        samples. Per-rank batch and accumulation may change."""
        was, now = int(saved.get("world_size") or 1), self.ctx.world
        if was == now:
            return super().check_resume_config(saved)
        from .distributed import global_batch

        g_was = global_batch(saved.get("batch_size") or 0, saved.get("grad_accum") or 0, was)
        g_now = global_batch(self.cfg.batch_size, self.cfg.grad_accum, now)
        if (g_was != g_now or saved.get("seq_len") != self.cfg.seq_len) and not self.cfg.allow_config_change:
            raise InputError(
                f"--resume: the checkpoint was written by {was} process(es) with a global batch of {g_was} "
                f"(world {was} x batch {saved.get('batch_size')} x accumulation {saved.get('grad_accum')}, "
                f"seq_len {saved.get('seq_len')}); now {now} x {self.cfg.batch_size} x {self.cfg.grad_accum} = "
                f"{g_now} (seq_len {self.cfg.seq_len}). Keep world x --batch-size x --grad-accum and "
                f"--seq-len the same to continue the same run (e.g. --batch-size "
                f"{max(1, g_was // max(1, now * self.cfg.grad_accum))}), or pass --allow-config-change")
        self.log(f"resume: world size {was} -> {now}, global batch {g_was} -> {g_now}; resharding model and "
                 f"optimizer")
        return super().check_resume_config({**saved, "batch_size": self.cfg.batch_size,
                                            "grad_accum": self.cfg.grad_accum})

    def restore_state(self, ckpt: dict[str, Any]) -> None:
        if ckpt.get("sharded") is not None:
            load_sharded(ckpt["sharded"], self.par, self.optimizer)
        elif self.par.kind == "single":
            super().restore_state(ckpt)
        else:  # a single-process checkpoint continued on several ranks: each keeps its shard
            load_full(self.par, self.optimizer, ckpt["model"], ckpt["optimizer"])

    def load_trainer_state(self, st: dict[str, Any]) -> None:
        ranks = st.get("rng_ranks")
        if ranks and len(ranks) == self.ctx.world:  # the same world size: each rank its own RNG
            st = {**st, "rng": ranks[self.ctx.rank]}
        super().load_trainer_state(st)

    # ---- save / final --------------------------------------------------------------------------------
    def write_checkpoint(self, step: int, state: dict[str, Any]) -> Path:
        if not self.ctx.active:
            return super().write_checkpoint(step, state)
        return save_sharded_checkpoint(self.ckpt_root, step, self.par, self.optimizer, state,
                                       self.run_config, self.cfg.keep)

    def finish(self) -> None:
        """final/: one consolidated directory, written by rank 0 whatever the world size."""
        if not self.ctx.active or self.save_final is None:
            return super().finish()
        from . import guards

        problem = self.weights_problem()
        if problem is not None:
            raise guards.weights_error("final/", problem, self.kept_text(self.last_saved), self.cfg.steps)
        model = self.model
        if self.par.kind == "fsdp":
            full = full_model_state(self.par)  # a collective; the tensors land on rank 0
            model = consolidated_copy(self.model, full) if self.ctx.is_main else None
        self.ctx.run_on_main(lambda: self.save_final(model, self.run_dir / "final"))

    def fit(self) -> dict[str, Any]:
        if self.ctx.is_main:
            return super().fit()
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):  # one progress bar per job
            return super().fit()


def consolidated_copy(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain CausalLM (CPU) holding the consolidated weights of a sharded one, for the savers."""
    from ..model import CausalLM

    with torch.device("meta"):
        plain = CausalLM(model.cfg, kernels=getattr(model, "kernels", "torch"))
    plain.load_state_dict(state, assign=True, strict=True)
    for name in ("source", "peft_config"):  # declared fields the savers may read (provenance)
        if hasattr(model, name):
            setattr(plain, name, getattr(model, name))
    return plain.eval()


def build_trainer(model: torch.nn.Module, train_loader: Any, eval_loader: Any, cfg: Any, run_dir: Path,
                  parallel: str = "auto", adapters: bool = False, **kw: Any) -> ParallelTrainer:
    """The trainer of a command: parallelism applied to `model` (nothing in one process), the loaders
    split by global sample index, logging on rank 0 only."""
    from ..long_context import apply_memory_options
    from .distributed import current, shard_loader
    from .precision import to_training_dtype

    ctx = current()
    to_training_dtype(model, cfg.dtype)  # bf16-pure: before the optimizer exists (its state follows the weights)
    # before fully_shard: the blocks are recomputed inside (checkpointing, offload, MLP chunks: long_context.py)
    apply_memory_options(model, cfg)
    par = apply_parallel(model, ctx, parallel, cfg.dtype, adapters, cfg.grad_accum)
    if not ctx.is_main:
        kw["log"] = lambda text: None
    return ParallelTrainer(par, shard_loader(train_loader, ctx), shard_loader(eval_loader, ctx), cfg, run_dir, **kw)


__all__ = ["FSDP_UNIT_PARAMS", "PARALLEL_MODES", "DistReduce", "Parallel", "ParallelTrainer", "apply_ddp",
           "apply_fsdp", "apply_parallel", "build_trainer", "clip_grad_norm", "clip_grad_norm_tensor",
           "consolidated_copy", "fsdp_units", "full_model_state", "load_full", "load_sharded", "parallel_for",
           "resolve_parallel",
           "save_sharded", "save_sharded_checkpoint", "sharded_state"]
