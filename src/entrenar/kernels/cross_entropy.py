"""LM head + cross-entropy. The reference (``reference.py``, re-exported here) builds the logits; the
fused path never builds all of them.

``linear_cross_entropy`` walks the tokens in chunks: for each chunk it computes that chunk's logits
[chunk, vocab] with one matmul, and a Triton kernel makes one pass for the log-sum-exp and the target
logit (online softmax over vocab blocks) and a second pass that overwrites the logits, in place, with
d loss / d logits = softmax - one_hot (zero on ignored rows). Two more matmuls turn that into this
chunk's grad_hidden rows and its share of grad_weight. The gradients are therefore finished during the
forward; backward only scales them by grad_output (and 1/n for reduction="mean").
Peak extra memory is one [chunk, vocab] buffer (``_CHUNK_BYTES``), never [tokens, vocab].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tensors import IGNORE_INDEX
from . import _common
from .reference import linear_cross_entropy_reference  # noqa: F401 -- re-exported: each kernel next to its reference

# Size of one chunk's logits buffer; tests shrink it to run several chunks (and a remainder).
_CHUNK_BYTES = 1 << 30


@triton.jit
def _ce_rows_kernel(logits_ptr, row_stride, labels_ptr, loss_ptr, n_vocab, ignore_index,
                    BLOCK: tl.constexpr, WRITE_GRAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    label = tl.load(labels_ptr + row)
    running_max = float("-inf")
    running_sum = 0.0
    target = 0.0
    # pass 1: online log-sum-exp and the target logit. The target is picked by comparison inside the
    # block, so a label outside [0, vocab) is never used as an address.
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
        target += tl.sum(tl.where(cols == label, x, 0.0), axis=0)
    lse = running_max + tl.log(running_sum)
    valid = label != ignore_index
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    if WRITE_GRAD:
        keep = tl.where(valid, 1.0, 0.0)
        # pass 2: softmax - one_hot, written over the logits (zero for ignored rows)
        for start in range(0, n_vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_vocab = cols < n_vocab
            x = tl.load(base + cols, mask=in_vocab, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)) * keep
            tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=in_vocab)


def _ce_rows(logits: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor, ignore_index: int,
             write_grad: bool) -> None:
    """Per-row CE of a logits chunk into loss_rows; with write_grad, logits become d loss / d logits."""
    n_rows, n_vocab = logits.shape
    if n_rows == 0:
        return
    block = min(_common.next_pow2(n_vocab), 16384 if logits.is_cuda else 32768)
    _ce_rows_kernel[(n_rows,)](logits, logits.stride(0), labels, loss_rows, n_vocab, ignore_index,
                               BLOCK=block, WRITE_GRAD=write_grad, num_warps=16 if block >= 8192 else 4)


def _chunk_rows(n_vocab: int, itemsize: int) -> int:
    return max(1, _CHUNK_BYTES // (n_vocab * itemsize))


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, reduction, compute_dtype, need_grad):
        n_tokens = hidden.shape[0]
        n_vocab = weight.shape[0]
        device = hidden.device
        need_gh = need_grad and ctx.needs_input_grad[0]
        need_gw = need_grad and ctx.needs_input_grad[1]
        with torch.autocast(device.type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            loss_rows = _common.empty((n_tokens,), torch.float32, device)
            grad_hidden = _common.empty((n_tokens, hidden.shape[1]), hidden.dtype, device) if need_gh else None
            # grad_weight accumulates over chunks in the parameter's dtype (fp32 for fp32 master weights)
            grad_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=device) if need_gw else None
            step = _chunk_rows(n_vocab, torch.finfo(compute_dtype).bits // 8)
            for start in range(0, n_tokens, step):
                end = min(start + step, n_tokens)
                h_chunk = h[start:end]
                logits = h_chunk @ w.t()  # [chunk, vocab], the only vocab-sized buffer
                _ce_rows(logits, labels[start:end], loss_rows[start:end], ignore_index, need_gh or need_gw)
                if need_gh:
                    if grad_hidden.dtype == compute_dtype:
                        torch.mm(logits, w, out=grad_hidden[start:end])
                    else:
                        grad_hidden[start:end] = logits @ w
                if need_gw:
                    if grad_weight.dtype == compute_dtype:
                        grad_weight.addmm_(logits.t(), h_chunk)
                    else:
                        grad_weight += (logits.t() @ h_chunk).to(grad_weight.dtype)
                del logits
            loss = loss_rows.sum()
            n_valid = (labels != ignore_index).sum()
            if reduction == "mean":
                divisor = n_valid.clamp(min=1).to(torch.float32)  # all ignored -> 0 loss, zero grads
                loss = loss / divisor
            else:
                divisor = None
        ctx.divisor = divisor
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output if ctx.divisor is None else grad_output / ctx.divisor
        # scaled in place: the buffers belong to this graph node and backward runs once
        if grad_hidden is not None:
            grad_hidden.mul_(scale.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.mul_(scale.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, reduction: str = "sum") -> torch.Tensor:
    """Fused LM head + CE (Triton): hidden [N, H], weight [V, H], labels [N] -> fp32 scalar loss.

    reduction "sum" (the caller knows the non-ignored count) or "mean"; every label ignored gives
    0 and zero gradients. Under autocast the matmuls run in the autocast dtype, as the reference's do.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction {reduction!r} not in ('sum', 'mean')")
    _common.check_device(hidden, weight, labels)
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1], \
        f"hidden {tuple(hidden.shape)} vs weight {tuple(weight.shape)}"
    assert labels.shape == (hidden.shape[0],), f"labels {tuple(labels.shape)} vs hidden {tuple(hidden.shape)}"
    if not labels.is_cuda and labels.numel():  # a device sync on CUDA; the CPU check is free
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"label {int(labels[bad][0])} outside vocab [0, {weight.shape[0]}) "
                             f"and not ignore_index {ignore_index}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropyFunction.apply(hidden, weight, labels.contiguous(), ignore_index, reduction,
                                             compute_dtype, need_grad)
