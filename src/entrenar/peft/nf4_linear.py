"""The frozen NF4 base of QLoRA: a linear whose weight is stored NF4 and dequantized for each matmul.

For inference on the CPU (generate / eval of a QLoRA run) dequantizing every weight for every decoded token
costs ~20x the matmuls (Qwen2.5-0.5B: 2.1 s a token on one core); ``dequantize_once`` keeps the dequantized
weight, the same values, for as long as gradients are off. Training never takes that path: the point of
QLoRA there is to hold only the 4-bit weights.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import nf4


class _NF4LinearFn(torch.autograd.Function):
    """x @ W^T + b with W dequantized on the fly; backward re-dequantizes instead of keeping W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nf4.NF4Weight, bias: torch.Tensor | None):
        w = nf4.dequantize(weight, x.dtype)
        ctx.weight = weight
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        w = nf4.dequantize(ctx.weight, grad_out.dtype)
        return grad_out @ w, None, None


class NF4Linear(nn.Module):
    """A frozen linear whose weight is stored NF4 (kernels.nf4); the bias, if any, in full precision."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q = nf4.quantize(linear.weight)
        # Not in state_dict: the base is re-quantized from the 16-bit weights (deterministic), never saved.
        for name, t in q.tensors().items():
            self.register_buffer(f"nf4_{name}", t.to(linear.weight.device), persistent=False)
        self.weight_dtype = linear.weight.dtype
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)
        self.dequantize_once = False  # set by enable_dequantize_once (inference on the CPU)
        self._dequantized: tuple[tuple, torch.Tensor] | None = None

    @property
    def nf4_weight(self) -> nf4.NF4Weight:
        return nf4.NF4Weight(self.nf4_packed, self.nf4_qscale, self.nf4_factor, self.nf4_mean,
                             (self.out_features, self.in_features))

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return nf4.dequantize(self.nf4_weight, dtype or self.weight_dtype)

    def _kept_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in ``dtype``, computed once per (dtype, device, storage)."""
        key = (dtype, self.nf4_packed.device, self.nf4_packed.data_ptr())
        if self._dequantized is None or self._dequantized[0] != key:
            self._dequantized = (key, nf4.dequantize(self.nf4_weight, dtype))
        return self._dequantized[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if self.dequantize_once and not torch.is_grad_enabled():
            return F.linear(x, self._kept_weight(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return _NF4LinearFn.apply(x, self.nf4_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4, " \
               f"bias={self.bias is not None}"


def enable_dequantize_once(model: nn.Module, budget_bytes: int | None = None) -> int:
    """Let every NF4Linear of ``model`` keep its dequantized weight while gradients are off (inference).

    Returns the bytes that will be kept (fp32), or 0 where that exceeds ``budget_bytes`` (default: half of
    the memory available now), in which case nothing changes: slower, but no out-of-memory.
    """
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    need = sum(m.in_features * m.out_features * 4 for m in layers)
    if budget_bytes is None:
        budget_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    if not layers or need > budget_bytes:
        return 0
    for m in layers:
        m.dequantize_once = True
    return need


@contextlib.contextmanager
def dequantized_for_inference(model: nn.Module) -> Iterator[int]:
    """enable_dequantize_once for the block's inference only (e.g. GUARD-QA's generation inside a QLoRA run on the
    CPU, where dequantizing every NF4 weight at every decode step cost ~2 s a step on a 0.5B model), then the
    kept weights are dropped and training dequantizes per forward again. Yields the bytes kept (0: unchanged)."""
    layers = [m for m in model.modules() if isinstance(m, NF4Linear) and not m.dequantize_once]
    kept = enable_dequantize_once(model) if layers else 0
    try:
        yield kept
    finally:
        if kept:
            for m in layers:
                m.dequantize_once, m._dequantized = False, None
