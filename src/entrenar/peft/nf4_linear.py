"""The frozen NF4 base of QLoRA: a linear whose weight is stored NF4 and dequantized for each matmul."""

from __future__ import annotations

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

    @property
    def nf4_weight(self) -> nf4.NF4Weight:
        return nf4.NF4Weight(self.nf4_packed, self.nf4_qscale, self.nf4_factor, self.nf4_mean,
                             (self.out_features, self.in_features))

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return nf4.dequantize(self.nf4_weight, dtype or self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return _NF4LinearFn.apply(x, self.nf4_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4, " \
               f"bias={self.bias is not None}"
