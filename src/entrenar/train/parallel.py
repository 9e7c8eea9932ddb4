"""The parallel strategy part of the Trainer: data parallelism applied from outside the model, in one
place (`apply_parallel`, the parallelize function): one process, DDP, FSDP2 or HSDP.

`apply_parallel` takes the built `CausalLM` (its precision already prepared, LoRA already applied) and
returns a `Strategy`: `.module` is the model (its config, parameter names, saving), `.forward_module` is
what the trainer calls, `.reduce` the job's reductions; `sync_context`, `clip_grad_norm`,
`weights_max_abs`, `after_backward`, `close` and `final_model` are what differ between them (`Strategy` for one process,
`DDPStrategy`, `ReplicaStrategy`, `FSDPStrategy`, `HSDPStrategy`). The mesh is torchrun's named 1-D ("dp") DeviceMesh
(train/distributed.py), or for HSDP the 2-D (dp_replicate x dp_shard = nodes x processes per node) one; a
further dimension (tensor or context parallel) would be applied here too, after the data-parallel one is chosen.

- HSDP (several nodes, `torchrun --nnodes`): `fully_shard` over the 2-D mesh, the same units and
  MixedPrecisionPolicy as FSDP2: parameters, gradients and AdamW state are sharded over the GPUs of a
  node (NVLink) and replicated across nodes, so only one gradient all-reduce (of a node's shard) per
  step crosses the slower network, where FSDP2 over every rank would all-gather the weights across
  it twice per step. The gradient norm sums the squared shards over the shard dimension only (a
  replica holds the same numbers: summing over nodes would count them once per node).

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

- Replicas reduced by the captured backward (`ReplicaStrategy`): what `--parallel ddp` becomes when the step is
  captured in a CUDA graph (--cuda-graphs): DDP's reducer is host work inside the backward, which a replay does
  not run; gradients live in flat buffers cut into buckets whose all-reduces the backward itself issues on a
  side stream (recorded by the capture), or after the step's last backward with gradient accumulation.

All reduce gradients with a plain SUM (FSDP: divide factor 1 with sum reduction; DDP: a SUM
comm hook), because every rank already backpropagates loss_sum / global_loss_tokens: an
averaging reduction would divide the update by the world size a second time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InputError
from . import guards
from .config import DDP_BUCKET_MB, GRAD_REDUCE_DTYPES, PARALLEL_MODES
from .distributed import DistContext, DistReduce
from .precision import Precision

# --parallel auto trains a model with DDP (no sharding) when one card holds its whole training state
# (fp32 weights, gradients, AdamW moments and DDP's gradient buckets: DDP_BYTES_PER_PARAM per trainable
# parameter) in at most DDP_STATE_FRACTION of its memory, the rest left to activations: e.g. every model
# up to ~1 B parameters on an 80 GB card. DDP has no per-group host work and overlaps one bucketed
# all-reduce with the backward; FSDP2 all-gathers the weights twice per step and runs AdamW through
# DTensor dispatch, which on these small, host-bound steps cost throughput (bench/RESULTS.md, "Several GPUs").
DDP_STATE_FRACTION = 0.25
DDP_BYTES_PER_PARAM = 20


def resolve_parallel(mode: str, adapters: bool, trainable_params: int | None = None,
                     device_memory: int | None = None, nodes: int = 1) -> str:
    """auto: DDP for LoRA/QLoRA (see the module docstring) and for full training of a model whose
    unsharded training state fits DDP_STATE_FRACTION of one card (`device_memory` bytes; None, e.g.
    on the CPU: not known, so sharded); otherwise sharded: sharded master weights and AdamW state are
    what lets a 7B model train at all, FSDP2 on one node, HSDP over `nodes` > 1 (shards inside a node,
    one gradient all-reduce across nodes). hsdp on one node is FSDP2 (one replica)."""
    if mode not in PARALLEL_MODES:
        raise InputError(f"--parallel {mode!r} not in {'|'.join(PARALLEL_MODES)}")
    sharded = "hsdp" if nodes > 1 else "fsdp"
    if mode == "auto":
        if adapters:
            return "ddp"
        fits = (trainable_params is not None and device_memory is not None
                and trainable_params * DDP_BYTES_PER_PARAM <= DDP_STATE_FRACTION * device_memory)
        return "ddp" if fits else sharded
    if mode in ("fsdp", "hsdp") and adapters:
        raise InputError(f"--parallel {mode} with --mode lora/qlora: the frozen (NF4) base cannot be sharded "
                         f"by fully_shard here; use --parallel ddp (or auto)")
    return "fsdp" if mode == "hsdp" and nodes <= 1 else mode


def parallel_for(model: torch.nn.Module, device: torch.device, mode: str, adapters: bool, nodes: int = 1) -> str:
    """resolve_parallel with this model's trainable parameters, the card's memory and the job's nodes."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return resolve_parallel(mode, adapters, trainable, memory, nodes)


def job_parallel(model: torch.nn.Module, ctx: DistContext, mode: str, adapters: bool) -> str:
    """The data parallelism this job trains `model` with: "single" in one process, else parallel_for's kind
    (what run.json records, what --cuda-graphs decides on, what apply_parallel applies)."""
    return parallel_for(model, ctx.device, mode, adapters, ctx.nodes) if ctx.active else "single"


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


def apply_fsdp(model: torch.nn.Module, ctx: DistContext, precision: Precision,
               unit_params: int | None = None, grad_reduce: str = "fp32", mesh: Any = None) -> torch.nn.Module:
    """fully_shard the decoder blocks in units (`fsdp_units`), the untied embedding, then the root
    (in place), with the precision's MixedPrecisionPolicy (gradients reduced in `grad_reduce`), over
    `mesh`: ctx's 1-D mesh (FSDP2) by default, a 2-D (replicate, shard) one for HSDP."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = ctx.mesh if mesh is None else mesh

    mp = precision.fsdp_policy(reduce_bf16=grad_reduce == "bf16")
    units = fsdp_units(model.model.layers, unit_params)
    for i, unit in enumerate(units):
        # the last unit's weights are needed again first thing in the backward: keep them gathered
        fully_shard(unit[0] if len(unit) == 1 else unit, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=i < len(units) - 1)
    if getattr(model, "lm_head", None) is not None:
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp)
    # the root's parameters are needed again right at the start of the backward: keep them gathered
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
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


def _bf16_sum_hook(process_group, bucket):  # no annotations: DDP rejects any but GradBucket
    """DDP comm hook for --grad-reduce bf16: an fp32 bucket is all-reduced (SUM) as a bf16 copy, half the
    bytes on the wire, then written back into the bucket; a bucket already in bf16 goes as it is."""
    buffer = bucket.buffer()
    if buffer.dtype == torch.bfloat16:
        return _sum_hook(process_group, bucket)
    wire = buffer.to(torch.bfloat16)
    fut = dist.all_reduce(wire, group=process_group, async_op=True).get_future()
    return fut.then(lambda f: buffer.copy_(f.value()[0]))


# DDP's options (measured on 4x H200, llama-370m, bench/RESULTS.md "Several GPUs"): 100 MB buckets (15
# all-reduces per step instead of 38 at 25 MB: fewer NCCL launches, each past the LL protocol's size) and
# gradients as views into the buckets (no copy of each gradient into its bucket). Without accumulation
# the graph is also declared static (every step uses the same parameters in the same order: DDP skips
# its per-step search for unused parameters); torch's reducer fails an internal assert when no_sync
# (accumulation) runs before the first synchronised backward of a static graph. The math is the same
# (CPU tests compare losses with one process).
# The bucket size is --ddp-bucket-mb (DDP_BUCKET_MB by default).
DDP_OPTIONS: dict[str, Any] = {"gradient_as_bucket_view": True}


def apply_ddp(model: torch.nn.Module, ctx: DistContext, static_graph: bool = False,
              grad_reduce: str = "fp32", bucket_mb: int = DDP_BUCKET_MB) -> torch.nn.Module:
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    # no buffer sync in forward; torch 2.13 renamed the flag and warns (once per rank) on the old name.
    # Same behaviour: init_sync=False below skips the init sync the new flag would otherwise keep.
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
        else "broadcast_buffers"
    kwargs: dict[str, Any] = {no_sync: False, "static_graph": static_graph, "bucket_cap_mb": bucket_mb,
                              **DDP_OPTIONS}
    if ctx.device.type == "cuda":
        kwargs["device_ids"] = [ctx.device.index]
    try:
        ddp = DDP(model, init_sync=False, **kwargs)
    except TypeError:  # torch without init_sync: the initial broadcast is redundant but harmless
        ddp = DDP(model, **kwargs)
    ddp.register_comm_hook(None, _bf16_sum_hook if grad_reduce == "bf16" else _sum_hook)
    return ddp


# ---- the strategies -------------------------------------------------------------------------------------
class Strategy:
    """One process (and the base of the others): the model itself, torch's clip, no collectives (its
    `reduce` is the identity)."""

    kind = "single"

    def __init__(self, model: torch.nn.Module, ctx: DistContext, forward_module: torch.nn.Module | None = None):
        self.module, self.ctx = model, ctx
        self.forward_module = model if forward_module is None else forward_module
        self.reduce = DistReduce(ctx)

    def sync_context(self, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """What a micro-batch's backward runs under (DDP: no all-reduce but for the last one)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip by the global L2 norm; the norm as a device scalar (no host sync)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)

    def weights_max_abs(self, params: list[torch.nn.Parameter]) -> float:
        """Largest |w| of the trainable weights over the whole job."""
        return guards.weights_max_abs(params)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The consolidated (unsharded, CPU) state dict, on rank 0 (empty elsewhere). A collective:
        every rank must call it."""
        sd = {n: p.detach().cpu() for n, p in self.module.state_dict().items()}
        return sd if self.ctx.is_main else {}

    def final_model(self) -> torch.nn.Module | None:
        """The model final/ is written from, on rank 0 (a collective: every rank calls it)."""
        return self.module

    # the gradients must stay the tensors the strategy gave them (ReplicaStrategy's views): zeroed in place
    grads_in_place = False

    def after_backward(self) -> None:
        """After the step's last micro-batch's backward: what reduces the gradients when the backward itself
        does not (ReplicaStrategy); nothing here or under DDP/FSDP2 (their hooks reduce inside it)."""

    def close(self) -> None:
        """At the end of training (Trainer.fit): take off what the strategy put on the model's parameters
        (ReplicaStrategy's hooks), so the model can train again under another strategy."""


class DDPStrategy(Strategy):
    """Full replicas; gradients SUM-reduced in buckets by DDP (apply_ddp) during the last micro-batch's
    backward: the summed local gradients of the step are reduced once."""

    kind = "ddp"

    def sync_context(self, last_micro_batch: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last_micro_batch else self.forward_module.no_sync()


class GradBucket:
    """A contiguous slice of a ReplicaStrategy flat gradient buffer, SUM-reduced in one all-reduce; `wire` is its
    bf16 copy when an fp32 buffer is reduced in bf16 (--grad-reduce bf16), preallocated: an allocation inside a
    captured backward on the reduction's stream would be one more thing the capture must get right."""

    def __init__(self, grads: torch.Tensor, params: int, wire: torch.Tensor | None):
        self.grads, self.params, self.wire = grads, params, wire


class ReplicaStrategy(Strategy):
    """Full replicas without DDP's hooks, for a backward captured in a CUDA graph under torchrun (--cuda-graphs,
    train/cuda_graphs.py): every trainable gradient is a view into one flat buffer per dtype (as DDP's
    gradient_as_bucket_view), set before the first backward and zeroed in place between steps, so a replayed
    backward accumulates into them. The buffers are cut into buckets of about `bucket_mb` (--ddp-bucket-mb), the
    parameters in reverse order, i.e. roughly in the order the backward produces their gradients.

    `overlap` (no gradient accumulation): each bucket is SUM-reduced as soon as the backward has accumulated its
    last gradient (a post-accumulate-grad hook per parameter), on a side stream, so the all-reduces run under the
    rest of the backward; the backward's end (an autograd final callback) reduces any bucket whose parameters got
    no gradient and joins that stream. All of it is device work issued from inside the backward, so a captured
    backward records it and every replay reduces the gradients with no host work (measured without overlap in
    at 1b5fad7: the all-reduce after the backward cost 3.3 / 8.3 ms of a 92% step, bench/RESULTS.md).
    Without `overlap` (accumulation: only the last micro-batch's backward may reduce, and a graph is captured
    for whichever micro-batch comes first) `after_backward` reduces every bucket after the step's last backward.
    `grad_reduce` bf16: an fp32 bucket goes as a bf16 copy, as _bf16_sum_hook's DDP buckets."""

    kind = "ddp"
    grads_in_place = True

    def __init__(self, model: torch.nn.Module, ctx: DistContext, grad_reduce: str = "fp32",
                 bucket_mb: float = DDP_BUCKET_MB, overlap: bool = False):
        super().__init__(model, ctx)
        self.grad_reduce, self.overlap = grad_reduce, overlap
        self.buffers: list[tuple[torch.Tensor, list[tuple[torch.nn.Parameter, torch.Tensor]]]] = []
        self.buckets: list[GradBucket] = []
        self._bucket_of: dict[torch.nn.Parameter, int] = {}
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in reversed(list(model.parameters())):  # the backward's order, roughly: the head's first
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        cap = bucket_mb * 2**20
        for dtype, params in by_dtype.items():
            flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
            wire = (torch.zeros(flat.numel(), dtype=torch.bfloat16, device=flat.device)
                    if grad_reduce == "bf16" and dtype == torch.float32 else None)
            views, start, first, members = [], 0, 0, 0
            for k, p in enumerate(params):
                view = flat[start:start + p.numel()].view_as(p)
                p.grad = view
                views.append((p, view))
                self._bucket_of[p] = len(self.buckets)
                start += p.numel()
                members += 1
                if (start - first) * flat.element_size() >= cap or k == len(params) - 1:
                    self.buckets.append(GradBucket(flat[first:start], members,
                                                   None if wire is None else wire[first:start]))
                    first, members = start, 0
            self.buffers.append((flat, views))
        self._views = {p: view for _, views in self.buffers for p, view in views}
        device = next(iter(self._views)).device if self._views else torch.device("cpu")
        self._stream = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None
        self._waiting = [b.params for b in self.buckets]  # this backward's gradients still to come, per bucket
        self._launched = [False] * len(self.buckets)
        self._armed = False  # the backward's final callback is queued
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._views] if overlap else []

    def reduce_bucket(self, bucket: GradBucket) -> None:
        """SUM over the replicas, in place (a bf16 wire copy for --grad-reduce bf16)."""
        if bucket.wire is None:
            dist.all_reduce(bucket.grads)
        else:
            bucket.wire.copy_(bucket.grads)
            dist.all_reduce(bucket.wire)
            bucket.grads.copy_(bucket.wire)

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        view = self._views[p]
        if p.grad is not view:  # AccumulateGrad made a new tensor: the gradient was None (a stop's cleanup)
            view.copy_(p.grad)
            p.grad = view
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        i = self._bucket_of[p]
        self._waiting[i] -= 1
        if self._waiting[i] == 0:
            self._launch(i)

    def _launch(self, i: int) -> None:
        self._launched[i] = True
        if self._stream is None:
            self.reduce_bucket(self.buckets[i])
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))  # its gradients are written
        with torch.cuda.stream(self._stream):
            self.reduce_bucket(self.buckets[i])

    def _backward_done(self) -> None:
        for i, launched in enumerate(self._launched):
            if not launched:  # parameters this backward gave no gradient (their zeros are reduced all the same)
                self._launch(i)
        if self._stream is not None:  # what runs after the backward reads the reduced gradients
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        self._waiting = [b.params for b in self.buckets]
        self._launched = [False] * len(self.buckets)
        self._armed = False

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def after_backward(self) -> None:
        for p, view in self._views.items():
            grad = p.grad
            if grad is view:  # the same tensor object while nothing replaced it: no per-step device work
                continue
            if self.overlap:  # a replayed backward wrote into the view it was captured with
                p.grad = view
                continue
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            p.grad = view
        if not self.overlap:
            for bucket in self.buckets:
                self.reduce_bucket(bucket)


class FSDPStrategy(Strategy):
    """Sharded parameters, gradients and optimizer state (apply_fsdp); FSDP reduce-scatters per
    micro-batch (less memory)."""

    kind = "fsdp"

    def clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return clip_grad_norm_tensor(params, max_norm)

    def weights_max_abs(self, params: list[torch.nn.Parameter]) -> float:
        local = guards.weights_max_abs([p.to_local() for p in params])  # this rank's shards
        if self.ctx.any_true(math.isnan(local)):  # MAX over ranks is not NaN-propagating everywhere
            return float("nan")
        return self.ctx.all_reduce([local], "max")[0]

    def full_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.ctx.is_main else {}

    def final_model(self) -> torch.nn.Module | None:
        full = self.full_state()  # a collective; the tensors land on rank 0
        return consolidated_copy(self.module, full) if self.ctx.is_main else None


class HSDPStrategy(FSDPStrategy):
    """FSDP2 over the 2-D mesh (apply_fsdp with ctx.hsdp_mesh()): sharded inside a node, replicated across
    nodes; FSDP reduce-scatters inside the node and all-reduces the shard across nodes (both SUM)."""

    kind = "hsdp"


def apply_parallel(model: torch.nn.Module, ctx: DistContext, mode: str = "auto", precision: Precision | None = None,
                   adapters: bool = False, grad_accum: int = 1, grad_reduce: str = "fp32",
                   ddp_bucket_mb: int = DDP_BUCKET_MB, graphs: bool = False) -> Strategy:
    """The one place parallelism is applied: wrap `model` for data parallelism over ctx's mesh (nothing in
    one process). `precision` (its prepare_model already applied) gives FSDP2 its MixedPrecisionPolicy;
    `grad_accum` micro-batches per step: DDP declares its graph static only without accumulation (see
    DDP_OPTIONS); `grad_reduce` (fp32 | bf16) is the precision of the gradient reduction; `ddp_bucket_mb` DDP's
    bucket size; `graphs` (the step is captured, --cuda-graphs on): replicas reduced after the backward
    (ReplicaStrategy) instead of DDP, whose hooks would run at capture only."""
    assert grad_reduce in GRAD_REDUCE_DTYPES, grad_reduce
    kind = job_parallel(model, ctx, mode, adapters)
    if kind == "single":
        return Strategy(model, ctx)
    if kind == "hsdp":
        return HSDPStrategy(apply_fsdp(model, ctx, precision or Precision(), grad_reduce=grad_reduce,
                                       mesh=ctx.hsdp_mesh()), ctx)
    if kind == "fsdp":
        return FSDPStrategy(apply_fsdp(model, ctx, precision or Precision(), grad_reduce=grad_reduce), ctx)
    if graphs:
        return ReplicaStrategy(model, ctx, grad_reduce, bucket_mb=ddp_bucket_mb, overlap=grad_accum == 1)
    return DDPStrategy(model, ctx, apply_ddp(model, ctx, static_graph=grad_accum == 1, grad_reduce=grad_reduce,
                                                     bucket_mb=ddp_bucket_mb))


def clip_grad_norm_tensor(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global L2 norm; the norm as a device scalar (no host sync). Under FSDP the
    gradients are DTensor shards: the squared norms of the local shards are summed with ONE
    all-reduce over the mesh dimension they are sharded on (HSDP: the shard dimension only; the
    replicas across nodes hold the same numbers) and the local shards are scaled in place. torch's clip_grad_norm_ on
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
            dims = [i for i, pl in enumerate(g.placements) if isinstance(pl, Shard)]
            assert len(dims) == 1, g.placements  # FSDP/HSDP shard a parameter over one mesh dimension
            group = g.device_mesh.get_group(dims[0])
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


__all__ = ["DDP_OPTIONS", "FSDP_UNIT_PARAMS", "PARALLEL_MODES", "DDPStrategy", "FSDPStrategy", "HSDPStrategy",
           "ReplicaStrategy",
           "Strategy", "apply_ddp", "apply_fsdp", "apply_parallel", "clip_grad_norm_tensor", "consolidated_copy",
           "fsdp_units", "job_parallel", "parallel_for", "resolve_parallel"]
