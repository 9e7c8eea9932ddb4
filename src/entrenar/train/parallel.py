"""Data parallelism applied from outside the model, in one place: FSDP2 or DDP.

`apply_parallel` takes the built `CausalLM` (fp32 master weights, LoRA already applied) and
returns a `Parallel` handle: `.module` is the model (its config, parameter names, saving),
`.forward_module` is what the trainer calls. Single process: both are the model, no wrapping.

- FSDP2 (`fully_shard`): one group per decoder block, then the root, which keeps the final norm
  and the head. The embedding gets its own group only when the head is untied; a tied head reads
  `embed_tokens.weight` inside the root's forward, so the embedding must be a root parameter.
  Under --dtype bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the sharded fp32
  parameters stay the master weights and AdamW state, compute runs in bf16, gradients are reduced
  in fp32. Forward inputs are not cast (the RoPE tables stay fp32, as in one process).
- DDP: for the adapter modes. The trainable LoRA tensors are a few MB; sharding them buys no
  memory, and FSDP would shard (all-gather every step) the frozen base, which DDP leaves
  alone: DDP all-reduces only parameters with requires_grad, so the frozen (NF4) base is
  never communicated. `init_sync=False`: every rank loads the same base and seeds LoRA alike.

Both reduce gradients with a plain SUM (FSDP: divide factor 1 with sum reduction; DDP: a SUM
comm hook), because every rank already backpropagates loss_sum / global_loss_tokens: an
averaging reduction would divide the update by the world size a second time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InputError
from .distributed import DistContext

PARALLEL_MODES = ("auto", "fsdp", "ddp")


def resolve_parallel(mode: str, adapters: bool) -> str:
    """auto: FSDP2 for full training (sharded master weights and AdamW state are what lets a 7B
    model train at all), DDP for LoRA/QLoRA (see the module docstring)."""
    if mode not in PARALLEL_MODES:
        raise InputError(f"--parallel {mode!r} not in {'|'.join(PARALLEL_MODES)}")
    if mode == "auto":
        return "ddp" if adapters else "fsdp"
    if mode == "fsdp" and adapters:
        raise InputError("--parallel fsdp with --mode lora/qlora: the frozen (NF4) base cannot be sharded "
                         "by fully_shard here; use --parallel ddp (or auto)")
    return mode


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


def _mp_policy(dtype: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    return MixedPrecisionPolicy(cast_forward_inputs=False)


def apply_fsdp(model: torch.nn.Module, ctx: DistContext, dtype: str) -> torch.nn.Module:
    """fully_shard each decoder block, the untied embedding, then the root (in place)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mp = _mp_policy(dtype)
    for block in model.model.layers:
        fully_shard(block, mesh=ctx.mesh, mp_policy=mp)
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


def apply_ddp(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    kwargs: dict[str, Any] = {"broadcast_buffers": False}
    if ctx.device.type == "cuda":
        kwargs["device_ids"] = [ctx.device.index]
    try:
        ddp = DDP(model, init_sync=False, **kwargs)
    except TypeError:  # torch without init_sync: the initial broadcast is redundant but harmless
        ddp = DDP(model, **kwargs)
    ddp.register_comm_hook(None, _sum_hook)
    return ddp


def apply_parallel(model: torch.nn.Module, ctx: DistContext, mode: str = "auto", dtype: str = "fp32",
                   adapters: bool = False) -> Parallel:
    """Wrap `model` for data parallelism over ctx's ranks (a no-op handle in one process)."""
    if not ctx.active:
        return Parallel(model, model, "single", ctx)
    kind = resolve_parallel(mode, adapters)
    if kind == "fsdp":
        return Parallel(apply_fsdp(model, ctx, dtype), model, "fsdp", ctx)
    return Parallel(model, apply_ddp(model, ctx), "ddp", ctx)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip by the global L2 norm and return it. Under FSDP the gradients are DTensor shards and
    torch's clip reduces the norm over the mesh (the result is a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


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


@contextlib.contextmanager
def rank_zero_first(ctx: DistContext) -> Iterator[None]:
    """Rank 0 runs the block, then the others (e.g. creating a directory they all write into)."""
    if ctx.is_main:
        yield
        ctx.barrier()
    else:
        ctx.barrier()
        yield


__all__ = ["PARALLEL_MODES", "Parallel", "apply_ddp", "apply_fsdp", "apply_parallel", "clip_grad_norm",
           "full_model_state", "load_full", "load_sharded", "rank_zero_first", "resolve_parallel",
           "save_sharded", "sharded_state"]
