"""Padding-free attention: one row of several samples, each attending causally to itself only.

A padding-free batch (`finetune --padding-free`, data/sft.py) is one row of N = sum(lengths) tokens with
``cu_seqlens`` (int32 [n+1], the samples' cumulative lengths) and ``doc_ids``. `VarlenSpans` is what the model's
blocks receive as their ``mask``: on CUDA in fp16/bf16 `Attention.forward` calls its `attend`, torch's varlen
flash attention over the spans (no [T, T] mask is ever built); everywhere else (CPU, fp32) each span is one causal
SDPA call, the same result; only verify's attention probabilities take `dense()`, the doc-id mask of packed rows.

torch's varlen function changed across versions (we run on 2.11-2.14): causal attention is
``window_size=(-1, 0)`` (2.11+) or ``is_causal=True`` (older); GQA is ``enable_gqa=True`` where the signature
has it (2.13+), else the keys/values are repeated per head. `varlen_style` reads the signature once.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.float16, torch.bfloat16)  # flash attention computes in these only


@functools.cache
def varlen_function() -> Callable | None:
    """torch's varlen attention, or None where this torch has none (looked up once: every block asks)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=8)
def varlen_style(fn: Callable) -> tuple[str | None, bool]:
    """(how `fn` is told "causal": "window_size", "is_causal" or None = cannot be, whether it takes enable_gqa)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: we cannot know how to ask for causal
        return None, False
    causal = "window_size" if "window_size" in params else "is_causal" if "is_causal" in params else None
    return causal, "enable_gqa" in params


def varlen_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a forward on `device` computing in `dtype` runs the varlen kernel (else the dense doc-id mask)."""
    fn = varlen_function()
    return device.type == "cuda" and dtype in HALF_DTYPES and fn is not None and varlen_style(fn)[0] is not None


def dense_doc_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """The SDPA mask [B, 1, T, T] of packed rows: causal, and only inside a run of one doc id."""
    T = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal)[:, None]


@dataclass
class VarlenSpans:
    """The spans of a padding-free row, passed to the blocks as their attention ``mask``. ``flash``: torch's varlen
    kernel runs (`varlen_usable`); else each span is its own causal SDPA call (`attend_per_span`): never an N x N
    mask, which for a batch of 16 samples of 4k tokens would be 4 G entries."""

    cu_seqlens: torch.Tensor  # int32 [n+1], on the device of the activations
    max_seqlen: int
    doc_ids: torch.Tensor  # [1, T]
    flash: bool = True
    _dense: torch.Tensor | None = field(default=None, repr=False)
    _bounds: list[int] | None = field(default=None, repr=False)

    def dense(self) -> torch.Tensor:
        """The doc-id causal mask [1, 1, T, T] (the fallback, and verify's attention_probs), built once."""
        if self._dense is None:
            self._dense = dense_doc_mask(self.doc_ids)
        return self._dense

    def attend_per_span(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`attend` by one causal SDPA call per span (CPU, fp32, no varlen kernel): the spans' own lengths, squared,
        instead of the row's. Reads cu_seqlens on the host once per forward, not per block (free on the CPU; one
        sync on CUDA's fp32 path)."""
        if self._bounds is None:
            self._bounds = self.cu_seqlens.tolist()
        bounds = self._bounds
        gqa = q.shape[2] != k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, T, D]
        ys = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                             enable_gqa=gqa) for a, b in itertools.pairwise(bounds)]
        return torch.cat(ys, dim=2).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention inside each span: q [1, T, H, D], k/v [1, T, K, D] -> [1, T, H, D]."""
        if not self.flash:
            return self.attend_per_span(q, k, v)
        fn = varlen_function()
        assert fn is not None, "VarlenSpans.attend without a varlen function (varlen_usable said no)"
        causal, has_gqa = varlen_style(fn)
        q, k, v = q[0], k[0], v[0]  # [T, heads, D]: total tokens first
        kwargs: dict = {"window_size": (-1, 0)} if causal == "window_size" else {"is_causal": True}
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and has_gqa:
            kwargs["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cu, n = self.cu_seqlens, self.max_seqlen
        y = fn(q, k, v, cu, cu, n, n, **kwargs)
        return y.unsqueeze(0)
