"""Activation memory for long sequences: block inputs offloaded to host memory, the MLP in token chunks.

With activation checkpointing, what a training step keeps on the GPU between forward and backward is
each block's input: tokens x hidden x 2 bytes per layer (bf16). For Qwen2.5-0.5B at 131,072 tokens that
is 235 MB x 24 layers = 5.3 GiB, more than the weights, gradients and AdamW state together (3.7 GiB).
And one block's forward, or its recompute in the backward, holds the MLP's intermediates for every
token at once: gate, up and their SwiGLU product, tokens x intermediate_size x 2 bytes each
(1.27 GB each there), plus their gradients in the backward. Two opt-in remedies (docs/design.md):

* ``ActivationOffload`` (``--offload-activations``): the checkpointed block inputs wait in pinned host
  memory. The device-to-host copy runs on a side stream as soon as the block's input exists; in the
  backward, fetching block i's input starts the host-to-device copy of block i-1's, so the copy back
  overlaps block i's recompute and backward. Costs host RAM of the same size and PCIe time.
* ``chunked_rows`` (``--mlp-chunk N``): the MLP (position-wise, so rows are independent) runs on pieces
  of at most N tokens, each under its own non-reentrant checkpoint, so its intermediates exist for one
  piece at a time, in the forward and in the backward alike. Costs one more MLP forward per step (the
  block recompute runs the pieces' forward, then each piece recomputes once more for its backward).

Both are transparent to autograd: same loss, same gradients up to the summation order of the weight
gradients over the pieces (tests/test_long_context.py states the bounds).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint


# ---- block inputs in host memory -------------------------------------------------------------------
class _Stored:
    """One offloaded tensor: its host copy, the event that marks the copy done (CUDA), and, once
    prefetched, its device copy and the event that marks that copy done."""

    __slots__ = ("copied", "device", "host", "index", "on_device", "ready", "taken")

    def __init__(self, host: torch.Tensor, device: torch.device, copied: Any, index: int):
        self.host, self.device, self.copied, self.index = host, device, copied, index
        self.on_device: torch.Tensor | None = None
        self.ready: Any = None
        self.taken = False


class ActivationOffload:
    """The block inputs of one forward, offloaded in forward order; the backward visits them in reverse.

    Used as ``with offload.saving(x): checkpoint(block, x, ...)``: the checkpoint saves its inputs
    under the caller's saved-tensor hooks (its own hooks cover only what runs inside the block), so
    ``x`` is packed here. Tensors shared by every block (RoPE tables, masks) stay on the device by
    reference: they cost nothing per block. One object per forward (``CausalLM.hidden_states``)."""

    def __init__(self) -> None:
        self.stored: list[_Stored] = []
        self.stream: Any = None  # the side stream of the copies (CUDA), made on first use

    @contextlib.contextmanager
    def saving(self, *tensors: torch.Tensor) -> Iterator[None]:
        """While open, a saved tensor that is one of ``tensors`` goes to host memory."""
        keys = {_key(t) for t in tensors}

        def pack(t: torch.Tensor) -> Any:
            return self._to_host(t) if _key(t) in keys else t

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _side_stream(self, device: torch.device) -> Any:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def _to_host(self, t: torch.Tensor) -> _Stored:
        t = t.detach()
        if t.is_cuda:
            stream = self._side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # copy what the forward wrote
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
                copied = stream.record_event()
            t.record_stream(stream)  # the allocator must not hand t's memory out before the copy is done
        else:
            # A CPU tensor is already in host memory; the copy keeps the one code path (and its tests).
            host, copied = t.clone(), None
        item = _Stored(host, t.device, copied, len(self.stored))
        self.stored.append(item)
        return item

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        tensor = self._fetch(packed)
        if packed.index > 0:  # the backward needs the block before this one next: start its copy now
            self._prefetch(self.stored[packed.index - 1])
        return tensor

    def _fetch(self, item: _Stored) -> torch.Tensor:
        item.taken = True
        if item.device.type != "cuda":
            return item.host
        current = torch.cuda.current_stream(item.device)
        if item.on_device is not None:  # prefetched on the side stream
            tensor, item.on_device = item.on_device, None
            current.wait_event(item.ready)
            tensor.record_stream(current)  # used here, allocated on the side stream
            return tensor
        current.wait_event(item.copied)
        return item.host.to(item.device, non_blocking=True)

    def _prefetch(self, item: _Stored) -> None:
        if item.device.type != "cuda" or item.taken or item.on_device is not None:
            return
        stream = self._side_stream(item.device)
        stream.wait_event(item.copied)
        with torch.cuda.stream(stream):
            item.on_device = item.host.to(item.device, non_blocking=True)
            item.ready = stream.record_event()


def _key(t: torch.Tensor) -> tuple:
    """The identity of a saved tensor's data (the hook may see another Python object for it)."""
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device


# the fused attention kernels SDPA dispatches to (those this torch has): what --save-attention keeps
_ATTENTION_OPS = frozenset(getattr(torch.ops.aten, n).default for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, n))


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective-checkpoint policy: the attention kernel's outputs (output and softmax statistics) are
    kept from the forward, everything else is recomputed. At long context the attention is most of a
    block's work and its output only tokens x hidden x 2 bytes."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_options() -> dict[str, Any]:
    """Non-reentrant checkpoints; inside a CUDA graph capture (train/cuda_graphs.py) without saving the RNG
    state, which reads the generator from the host: a captured step has no random op (graph_decision)."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return {"use_reentrant": False, "preserve_rng_state": not capturing}


def checkpoint_block(block: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any,
                     offload: ActivationOffload | None = None, save_attention: bool = False) -> torch.Tensor:
    """``block(x, *args)`` recomputed in the backward (non-reentrant checkpoint); with ``offload``, the
    saved input ``x`` waits in host memory until then; with ``save_attention`` the recompute reuses the
    forward's attention output instead of running the attention kernel again (it stays on the device)."""
    kwargs = checkpoint_options()
    if save_attention:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_attention)
    if offload is None:
        return torch.utils.checkpoint.checkpoint(block, x, *args, **kwargs)
    with offload.saving(x):
        return torch.utils.checkpoint.checkpoint(block, x, *args, **kwargs)


# ---- position-wise work in token chunks ------------------------------------------------------------
def chunked_rows(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any, chunk: int) -> torch.Tensor:
    """``fn(x, *args)`` for a row-wise ``fn`` (each token's output depends on that token's row only),
    computed on pieces of at most ``chunk`` tokens and concatenated in order. Under autograd each piece
    is its own non-reentrant checkpoint: only the piece's input (a view of ``x``) is saved, and its
    intermediates are rebuilt one piece at a time in the backward."""
    rows = x.reshape(-1, x.shape[-1]).split(chunk)  # split, not slicing: one gradient buffer for x
    if torch.is_grad_enabled():
        outs = [torch.utils.checkpoint.checkpoint(fn, r, *args, **checkpoint_options()) for r in rows]
    else:
        outs = [fn(r, *args) for r in rows]
    return torch.cat(outs).view(*x.shape[:-1], -1)


# ---- the switches ------------------------------------------------------------------------------------
def set_mlp_chunk(model: torch.nn.Module, tokens: int) -> int:
    """Every MLP of ``model`` computes inputs of more than ``tokens`` tokens in chunks of ``tokens``
    (0: never). Returns how many MLPs were set."""
    # the model's MLPs are the modules with a chunk size (model.MLP.chunk_tokens): this module is below
    # model.py (docs/design.md, "Layout"), so it does not import the class
    mlps = [m for m in model.modules() if hasattr(m, "chunk_tokens")]
    for m in mlps:
        m.chunk_tokens = int(tokens)
    return len(mlps)


def apply_memory_options(model: torch.nn.Module, cfg: Any) -> None:
    """TrainConfig's activation-memory flags onto the model, before any FSDP/DDP wrapping (blocks are
    checkpointed inside the wrappers). --offload-activations implies --activation-checkpointing: what it
    offloads are the checkpointed block inputs."""
    if getattr(cfg, "activation_checkpointing", False) or getattr(cfg, "offload_activations", False):
        model.activation_checkpointing = True
    if getattr(cfg, "offload_activations", False):
        model.activation_offload = True
    if getattr(cfg, "mlp_chunk", 0):
        set_mlp_chunk(model, cfg.mlp_chunk)
    if getattr(cfg, "save_attention", False):
        model.save_attention = True
