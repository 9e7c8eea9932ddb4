"""Training precision: what `--dtype` means for one optimizer step.

  fp32          everything fp32.
  bf16          (the GPU default) fp32 master weights are the model's parameters; the step runs under
                bf16 autocast: matmuls, attention and the fused kernels in bf16, the residual stream,
                norms' inputs and the embedding in fp32. Holds the bf16 parity bounds (logits relL2 <= 2e-2).
                Frozen linears (a LoRA base, a preference objective's reference copy; QLoRA's are NF4) are
                stored in bf16: autocast rounded them to bf16 at every use anyway, so the step is the same.
  bf16-weights  fp32 master weights stay the model's parameters (the optimizer, checkpoints, guards and
                resume see only them, unchanged), but the step's forward and backward run on bf16 copies
                of every floating parameter, refreshed from the masters once per step (one multi-tensor
                copy), with no per-op weight casts and a bf16 residual stream: the numerics of a bf16
                model (the benchmark's "bf16 weights" rows), the update of an fp32 one. Each bf16
                gradient is moved into its master's fp32 `.grad` as soon as autograd has it (summed in
                fp32 over micro-batches), so the bf16 gradients never all exist at once.

  bf16-pure     (--mode full) the model itself is bf16: weights, gradients and AdamW state, 8 bytes per
                parameter instead of 16; numerics of bf16-weights' step, but the update is rounded to
                bf16 too (a change below ~2^-8 of a weight is lost). Cast after the step-0 preflight
                (`BF16Pure.prepare_model`, in build_trainer), which checks the fp32 weights as bf16.

Each --dtype is one `Precision` object (`precision_policy`), used identically by every parallel strategy:
  prepare_model(model)  before parallelization and before the optimizer exists (bf16-pure: the cast; a
                        later fp8 policy: the float8 swap of the decoder's linears)
  autocast(device)      the compute dtype of every forward, train and eval
  step_weights(model)   the weights one training step's forward AND backward run on (bf16-weights: the copies)
  fsdp_policy()         FSDP2's MixedPrecisionPolicy (bf16 all-gathers of the fp32 masters under bf16)
  master_dtype          what the optimizer's parameters and state are
bf16-weights' copies stand in the modules' place, where DDP's and FSDP2's hooks do not see them: it is
refused under torchrun (`one_process_only`; train/commands.py says so before anything is built).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..devices import BF16_COMPUTE
from ..devices import TRAIN_DTYPES as DTYPES

BF16_DTYPES = BF16_COMPUTE  # fp8: what is not float8 runs in bf16


def uses_bf16(dtype: str) -> bool:
    """True for the dtypes whose matmuls run in bf16 (autocast is on for eval and the bf16 path)."""
    return dtype in BF16_DTYPES


def verify_dtype(dtype: str) -> str:
    """The dtype the step-0 parity check (`verify.preflight`) runs: the kernels' bf16 path. bf16-weights
    is checked as bf16, whose bounds it is documented to exceed on random init (logits ~2.5e-2)."""
    return "bf16" if uses_bf16(dtype) else dtype


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), attr


class BF16Weights:
    """bf16 compute copies of `model`'s floating parameters (see the module docstring).

    `with precision.compute():` refreshes the trainable copies from the masters, puts the copies in the
    modules' place for the forward AND the backward (activation checkpointing recomputes blocks inside
    the backward, and must see the same weights), then puts the masters back, also on an exception."""

    def __init__(self, model: nn.Module):
        self.model = model
        # named_parameters() lists a tied tensor once: one copy serves both of its uses
        named = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
        self.slots = [(*_owner(model, n), p) for n, p in named]
        self.copies = [nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=p.requires_grad)
                       for _, p in named]
        self.trainable = [(m, c) for (_, _, m), c in zip(self.slots, self.copies, strict=True) if m.requires_grad]
        for master, copy in self.trainable:
            copy.register_post_accumulate_grad_hook(self._grad_hook(master))
        self.active = False

    @staticmethod
    def _grad_hook(master: nn.Parameter):
        def move(copy: torch.Tensor) -> None:
            grad, copy.grad = copy.grad, None
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)  # fp32 sum over the micro-batches of the step
        return move

    def refresh(self) -> None:
        """bf16 copies <- fp32 masters (trainable ones: frozen weights never change)."""
        if self.trainable:
            with torch.no_grad():
                torch._foreach_copy_([c for _, c in self.trainable], [m for m, _ in self.trainable])

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self.active:  # re-entered (e.g. an eval inside a step): already swapped
            yield
            return
        self.refresh()
        for (module, attr, _), copy in zip(self.slots, self.copies, strict=True):
            module._parameters[attr] = copy
        self.active = True
        try:
            yield
        finally:
            for module, attr, master in self.slots:
                module._parameters[attr] = master
            self.active = False


class Precision:
    """--dtype fp32: everything fp32 (and the base of the other policies)."""

    name = "fp32"
    compute_bf16 = False  # matmuls under bf16 autocast
    master_dtype = torch.float32  # the optimizer's parameters and state
    one_process_only = False  # True: its step cannot run under DDP/FSDP2

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model as this precision trains it, before any parallel wrapping and before the optimizer."""
        return model

    def prepare_frozen(self, model: nn.Module) -> nn.Module:
        """A model that never trains but runs under this precision's autocast (a preference reference copy)."""
        if self.compute_bf16:
            frozen_linears_in_bf16(model)
        return model

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.compute_bf16)

    def weight_copies(self, model: nn.Module) -> BF16Weights | None:
        """The compute copies a step swaps in, or None where the step computes on the parameters."""
        return None

    def step_weights(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """The weights one step's forward and backward compute with (the model's own here)."""
        return contextlib.nullcontext()

    def fsdp_policy(self, reduce_bf16: bool = False) -> Any:
        """FSDP2's MixedPrecisionPolicy: forward inputs are never cast (the RoPE tables stay fp32);
        gradients reduce-scattered in fp32, or in bf16 with ``reduce_bf16`` (--grad-reduce bf16)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        reduce_dtype = torch.bfloat16 if reduce_bf16 else None
        if self.compute_bf16:  # bf16 copies of the fp32 masters are all-gathered
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype or torch.float32,
                                        cast_forward_inputs=False)
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype, cast_forward_inputs=False)


def frozen_linears_in_bf16(model: nn.Module) -> int:
    """Store the frozen ``nn.Linear`` weights and biases inside the decoder layers in bf16; returns the
    parameters cast. Under bf16 autocast every use of such a tensor rounds it to bf16 first (round to nearest,
    as this cast), so a step computes the same values from either; an fp32 copy that never trains only costs
    memory, 4 bytes a weight instead of 2, and a cast at each use (a LoRA base, the linears --targets leaves
    out, a preference objective's frozen reference)."""
    cast = 0
    with torch.no_grad():
        for path, module in model.named_modules():
            if type(module) is not nn.Linear or ".layers." not in f".{path}":
                continue
            for p in module.parameters(recurse=False):
                if not p.requires_grad and p.dtype == torch.float32:
                    p.data = p.data.to(torch.bfloat16)
                    cast += p.numel()
    return cast


class BF16(Precision):
    """--dtype bf16: fp32 masters, bf16 autocast; frozen linears stored in bf16 (frozen_linears_in_bf16)."""

    name = "bf16"
    compute_bf16 = True

    def prepare_model(self, model: nn.Module) -> nn.Module:
        frozen_linears_in_bf16(model)
        return model


class BF16WeightsPrecision(BF16):
    """--dtype bf16-weights: the step on bf16 copies of the fp32 masters (BF16Weights), built at the first
    step (never for a run that only evaluates)."""

    name = "bf16-weights"
    one_process_only = True

    def __init__(self) -> None:
        self.copies: BF16Weights | None = None

    def weight_copies(self, model: nn.Module) -> BF16Weights:
        if self.copies is None:
            self.copies = BF16Weights(model)
        assert self.copies.model is model, "one bf16-weights policy per trained model"
        return self.copies

    def step_weights(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self.weight_copies(model).compute()


class BF16Pure(BF16):
    """--dtype bf16-pure: the model itself is bf16, so the optimizer built on it keeps bf16 state."""

    name = "bf16-pure"
    master_dtype = torch.bfloat16

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if any(p.is_floating_point() and p.dtype != torch.bfloat16 for p in model.parameters()):
            model.to(torch.bfloat16)  # only when needed: a second .to on FSDP2-wrapped (already bf16) params is avoided
        return model


class FP8(BF16Pure):
    """--dtype fp8 (train/fp8.py): bf16-pure, the blocks' linears swapped for torchao's Float8Linear (unless the
    preflight's last pass already did), then each block compiled: eager, float8's per-tensor scale and cast are
    separate kernels that cost more than the fp8 matmul saves (0.22-0.60x bf16-pure on an H200); compiled they
    fuse (bench/results/session7-h200-fp8-probe)."""

    name = "fp8"

    def prepare_model(self, model: nn.Module) -> nn.Module:
        from .fp8 import float8_linear_names, to_float8

        model = super().prepare_model(model)
        if not float8_linear_names(model):
            to_float8(model)
        for block in model.model.layers:
            block.compile()
        return model


POLICIES: dict[str, type[Precision]] = {p.name: p for p in (Precision, BF16, BF16WeightsPrecision, BF16Pure, FP8)}
assert tuple(POLICIES) == DTYPES, "one policy per --dtype"
assert BF16_COMPUTE == tuple(n for n, p in POLICIES.items() if p.compute_bf16), "devices.BF16_COMPUTE is stale"


def precision_policy(dtype: str) -> Precision:
    """A fresh policy object for --dtype `dtype` (each holds its own state, e.g. bf16-weights' copies)."""
    if dtype not in POLICIES:
        raise ValueError(f"dtype {dtype!r} not in {DTYPES}")
    return POLICIES[dtype]()


__all__ = ["BF16_DTYPES", "FP8", "POLICIES", "BF16Weights", "Precision", "frozen_linears_in_bf16", "precision_policy",
           "uses_bf16", "verify_dtype"]
