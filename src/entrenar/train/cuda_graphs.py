"""CUDA graphs of the training step (--cuda-graphs auto|on|off; docs/design.md "CUDA graphs of the step").

A micro-batch's forward AND backward are captured once per batch shape in a torch.cuda.CUDAGraph and then
replayed: one launch instead of ~40 kernels per block in each pass, which is what the GPU idled on between
kernels (bench/RESULTS.md, "Where the steps go": 20-36 ms of a 118-144 ms step). What a replay needs:

- the batch's tensors are copied into static device buffers of the captured shape (pinned host -> device);
- the loss sum is scaled by a device scalar (1 / the step's loss-token total, `loss_scale`), not a Python
  number a capture would freeze; the eager path multiplies by the same kind of scalar, so both compute the
  same bits;
- the gradients exist before the capture and are accumulated in place (AccumulateGrad's `grad += g`), so
  from the first capture on they are zeroed in place between steps, never set to None (`static_grads`);
- nothing in the step reads the device from the host, draws random numbers, or changes shape with the data:
  refused up front (`graph_decision`) for dropout, preference objectives, sharded steps (FSDP2/HSDP: under
  torchrun only replicas are captured, their gradients all-reduced by the replayed backward), bf16-weights'
  swapped copies, fp8's compiled blocks and activation offload; a capture that fails anyway is logged and
  that shape runs eagerly.

The first WARMUP_STEPS steps run eagerly (lazy initialisations, autotuning, the step-1 checks); the capture
step's micro-batch itself runs eagerly on a side stream (torch's recipe), then the graph is recorded (a capture
executes nothing) and every later micro-batch of that shape replays it. Graphs of different shapes (SFT length
buckets) share one memory pool: each replay's output is read before the next replay is queued.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..devices import on_side_stream
from ..errors import InputError
from .precision import Precision

WARMUP_STEPS = 2  # eager steps before the first capture
MAX_SHAPES = 8  # batch shapes captured at most; others run eagerly (a log line says so once)
GRAPHABLE_DTYPES = ("fp32", "bf16", "bf16-pure")


def graph_decision(requested: str, device: torch.device, world_size: int, dtype: str, objective: str,
                   model: nn.Module, offload: bool, varying_shapes: str | None = None,
                   parallel: str = "single") -> tuple[bool, str]:
    """(on, why) for --cuda-graphs `requested`: on where the step can be captured (CUDA, one process or
    replicas under torchrun: `parallel` is the resolved data parallelism, "ddp" then trains with
    ReplicaStrategy, whose bucket all-reduces the replayed backward issues; sharded FSDP2/HSDP steps are not
    captured; a causal-LM objective, a precision that computes on the parameters, no random op, no
    host-staged activations) and batches come in a few shapes (`varying_shapes`: why they do not, e.g.
    finetune batches padded to their longest row; auto is then off). `on` where it cannot is an InputError
    naming the reason (exit 2); `on` with varying shapes captures the first MAX_SHAPES shapes and runs the
    others eagerly."""
    if requested == "off":
        return False, "--cuda-graphs off as given"
    why_not = None
    dropout = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if device.type != "cuda":
        why_not = f"device {device} is not CUDA"
    elif world_size > 1 and parallel != "ddp":
        why_not = f"{world_size} processes under {parallel.upper()} (sharded steps are not captured yet)"
    elif objective != "causal-lm":
        why_not = f"objective {objective} (its reference forward and pair metrics are not captured yet)"
    elif dtype not in GRAPHABLE_DTYPES:
        why_not = f"--dtype {dtype} (captured: {', '.join(GRAPHABLE_DTYPES)})"
    elif dropout:
        why_not = f"dropout in {dropout[0]} draws random numbers each step (--dropout 0 to capture)"
    elif offload:
        why_not = "--offload-activations copies through host memory"
    if why_not is None and varying_shapes and requested == "auto":
        return False, f"--cuda-graphs auto: {varying_shapes}"
    if why_not is None:
        where = "one CUDA process" if world_size <= 1 else \
            f"{world_size} replicas, gradients all-reduced in buckets by the replayed backward"
        return True, f"--cuda-graphs {requested}: {where}, forward+backward replayed per batch shape"
    if requested == "on":
        raise InputError(f"--cuda-graphs on: cannot capture the training step: {why_not}; use --cuda-graphs auto "
                         f"or off")
    return False, f"--cuda-graphs auto: {why_not}"


def resolve_cuda_graphs(cfg: Any, device: torch.device, world_size: int, objective: str, model: nn.Module,
                        varying: str | None = None, parallel: str = "single") -> bool:
    """cfg.cuda_graphs (auto|on|off) resolved to on/off with cfg.cuda_graphs_reason by graph_decision, once: True
    when it resolved now, False when a reason was already there (the command resolved it before run.json)."""
    if cfg.cuda_graphs_reason:
        return False
    on, cfg.cuda_graphs_reason = graph_decision(cfg.cuda_graphs, device, world_size, cfg.dtype, objective, model,
                                                cfg.offload_activations, varying, parallel)
    cfg.cuda_graphs = "on" if on else "off"
    return True


def varying_shapes(command: str, pad_buckets: int, padding_free: bool = False, world_size: int = 1,
                   dtype: str = "bf16") -> str | None:
    """Why a command's batches come in ever new shapes (graph_decision's `varying_shapes`), or None. Padding-free rows
    are padded to a few lengths when the step is captured (SFTLoader.pad_rows_for_graphs), in one process whose
    attention is the varlen kernel's (fp32 attends span by span, the spans' bounds read on the host)."""
    if command == "finetune" and padding_free and world_size > 1:
        return "--padding-free under torchrun: each rank's row is its own samples' length, a new shape every step"
    if command == "finetune" and padding_free and dtype == "fp32":
        return "--padding-free in fp32 attends span by span, the spans' bounds read on the host every step"
    if command == "finetune" and padding_free:
        return None
    if command == "finetune" and not pad_buckets:
        return ("finetune batches are padded to their longest row, a new shape almost every step (--pad-buckets N "
                "pads to N lengths, each captured once)")
    return None


def loss_scale(inv_total: float, like: torch.Tensor) -> torch.Tensor:
    """`inv_total` (1 / the step's loss tokens) as a 0-d tensor of `like`'s dtype and device: what every
    micro-batch's loss sum is multiplied by before its backward (a fill kernel on CUDA, no host copy)."""
    return torch.full((), inv_total, dtype=like.dtype, device=like.device)


# the batch's Python numbers a captured forward reads (frozen at capture: part of the graph's key, handed to it)
GRAPH_NUMBERS = ("max_seqlen",)  # a padding-free row's longest span: the varlen kernel's grid


def signature(batch: dict) -> tuple:
    """What a graph is captured for: the batch's tensor entries with their shapes and dtypes, and its GRAPH_NUMBERS."""
    return tuple(sorted([(k, tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, torch.Tensor)]
                        + [(k, (int(batch[k]),), None) for k in GRAPH_NUMBERS if batch.get(k) is not None]))


def _shapes(sig: tuple) -> str:
    return ", ".join(f"{k} {list(shape)}" if dtype is not None else f"{k} {shape[0]}" for k, shape, dtype in sig)


# the capture step's eager micro-batch on a side stream (a seam: the CPU tests replace it)
warmup = on_side_stream


class CapturedGraph:
    """fn() captured in a torch.cuda.CUDAGraph (in `pool`, shared by the run's graphs); replay() re-runs it."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool: Any = None):
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (NCCL's watchdog polling its events, a checkpoint writer)
        # during the capture must not invalidate it, as the default global mode would
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.out = fn()

    def pool(self) -> Any:
        return self.graph.pool()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out

    def reset(self) -> None:
        self.graph.reset()


class StepGraphs:
    """The training step's graphs, one per micro-batch shape (see the module docstring).

    `micro_batch(batch, inv_total, eager)` returns the micro-batch's loss sum after its forward and backward ran
    (a replay, or the eager run of a capture step), or None: the caller runs it eagerly. `loss_sum(batch on the
    device)` is what a graph captures: the objective's summed loss, with no host read.
    """

    def __init__(self, loss_sum: Callable[[dict], torch.Tensor], precision: Precision, device: torch.device,
                 log: Callable[[str], None]):
        self.loss_sum, self.precision, self.device, self.log = loss_sum, precision, device, log
        self.graphs: dict[tuple, tuple[Any, dict[str, Any], torch.Tensor]] = {}
        self.refused: set[tuple] = set()  # shapes whose capture failed or came after MAX_SHAPES
        self.pool: Any = None
        self.steps = 0
        self.replays = 0
        self.captured = 0  # shapes captured over the run (the graphs themselves are freed by release())
        self.released = False
        self.static_grads = False  # True from the first capture: gradients zeroed in place, never None

    def begin_step(self) -> None:
        self.steps += 1

    def _autocast(self) -> Any:
        # autocast's cache of cast weights is freed when autocast exits, under a live graph: off in the capture
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision.compute_bf16,
                              cache_enabled=False)

    def _forward_backward(self, static: dict[str, Any], scale: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            s = self.loss_sum(static)
        (s * scale).backward()
        return s.detach()

    def micro_batch(self, batch: dict, inv_total: float, eager: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """The micro-batch's loss sum, its gradients accumulated (each multiplied by `inv_total`, 1 / the
        step's loss tokens); None: the caller runs it eagerly. `eager()` is that eager run (returns the sum)."""
        sig = signature(batch)
        if sig in self.graphs:
            graph, static, static_scale = self.graphs[sig]
            for k, buf in static.items():
                if not isinstance(buf, torch.Tensor):  # a GRAPH_NUMBERS entry: the same value (the key)
                    continue
                src = batch[k]
                buf.copy_(src.pin_memory() if src.device.type == "cpu" and self.device.type == "cuda" else src,
                          non_blocking=True)
            self.set_scale(static_scale, inv_total)
            self.replays += 1
            return graph.replay()
        if self.released or self.steps <= WARMUP_STEPS or sig in self.refused:
            return None
        if len(self.graphs) >= MAX_SHAPES:
            self.refused.add(sig)
            self.log(f"cuda graphs: a batch of a new shape after {MAX_SHAPES} captured ones runs eagerly "
                     f"({_shapes(sig)}); pad to fewer lengths (--pad-buckets) to replay it")
            return None
        # the capture step: this micro-batch runs eagerly on a side stream (lazy inits there), which also
        # makes every gradient exist, so the captured backward accumulates into them in place
        s = warmup(eager, self.device)
        # the buffers hold this batch (valid token ids) while the capture records (it reads nothing on CUDA)
        static: dict[str, Any] = {k: v.to(self.device, copy=True) for k, v in batch.items()
                                  if isinstance(v, torch.Tensor)}
        static.update({k: int(batch[k]) for k in GRAPH_NUMBERS if batch.get(k) is not None})
        static_scale = torch.zeros((), dtype=s.dtype, device=self.device)
        self.set_scale(static_scale, inv_total)
        try:
            graph = capture(lambda: self._forward_backward(static, static_scale), self.pool)
        except Exception as e:  # noqa: BLE001 - any capture failure: logged, this shape stays eager
            self.refused.add(sig)
            self.log(f"cuda graphs: capture of shape {_shapes(sig)} failed, it runs eagerly: "
                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return s
        self.pool = self.pool if self.pool is not None else graph.pool()
        self.graphs[sig] = (graph, static, static_scale)
        self.captured += 1
        self.static_grads = True
        self.log(f"cuda graphs: captured the forward+backward of a {_shapes(sig)} micro-batch "
                 f"at step {self.steps} ({len(self.graphs)} shape(s))")
        return s

    @staticmethod
    def set_scale(static_scale: torch.Tensor, inv_total: float) -> None:
        """This step's 1 / loss tokens into the scalar the graph reads (as loss_scale fills the eager path's)."""
        static_scale.fill_(inv_total)

    def release(self) -> None:
        """Free the graphs at the end of training (later micro-batches would run eagerly): a live graph that
        recorded NCCL kernels (ReplicaStrategy's all-reduces) makes destroy_process_group hang at exit
        (pytorch#115388; measured on 4 H200s: every rank hung after final/ was written)."""
        if self.graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay still running
        for graph, _, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None
        self.released = True  # nothing is captured again

    def state(self) -> dict[str, Any]:
        return {"shapes": self.captured, "replays": self.replays, "refused_shapes": len(self.refused)}


def capture(fn: Callable[[], torch.Tensor], pool: Any) -> CapturedGraph:
    """The capture (a seam: the CPU tests put their stand-in here)."""
    return CapturedGraph(fn, pool)


__all__ = ["MAX_SHAPES", "WARMUP_STEPS", "StepGraphs", "graph_decision", "loss_scale", "resolve_cuda_graphs",
           "varying_shapes"]
