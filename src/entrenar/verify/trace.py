"""Recording intermediates for the bisection, by forward hooks, on our model and on transformers alike.

Both models use Hugging Face's module names (``model.layers.i.self_attn.q_proj`` ...), so one set of
hooks records the same names on each side. What no hook can see is taken from inside the forward:
q/k after RoPE and the attention probabilities -- ours through ``CausalLM.record_internals``, the
transformers side through eager attention's returned weights and a wrapper around its
``apply_rotary_pos_emb``.

Names: ``embed``, ``layers.{i}`` (block output), ``norm``, and per block ``layers.{i}.{op}`` for op in
``block_ops(cfg)``: ``OP_ORDER``, plus ``q_norm``/``k_norm`` for a family with qk-norm (Qwen3). q/k/v projections
and q/k norms are recorded as [B, T, heads, D]; attention probabilities [B, H, T, Tk].
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Ops inside one block, in execution order.
OP_ORDER = ("input_norm", "q_proj", "k_proj", "v_proj", "q_rope", "k_rope", "attn_probs", "attn_out",
            "o_proj", "attn_residual", "post_attention_norm", "gate_proj", "up_proj", "act", "down_proj",
            "mlp_residual")
# A qk-norm family's (Qwen3) per-head RMSNorms on q and k: between the projections and RoPE.
QK_NORM_OPS = ("q_norm", "k_norm")
# Every op any family has, in execution order (orders divergences across families' op lists).
ALL_OPS = OP_ORDER[:OP_ORDER.index("q_rope")] + QK_NORM_OPS + OP_ORDER[OP_ORDER.index("q_rope"):]
# The ops a forward hook cannot see: they come from inside the attention forward.
INTERNAL_OPS = ("q_rope", "k_rope", "attn_probs")


def block_ops(cfg: Any) -> tuple[str, ...]:
    """The ops of one block of a model of `cfg` (a ModelConfig), in execution order: q_norm / k_norm only where
    its family has qk-norm, so a LLaMA's list has no op it cannot record and a Qwen3's none it skips."""
    return ALL_OPS if cfg.qk_norm else OP_ORDER


class FilteredTrace(dict):
    """A trace dict that keeps only wanted names, moved to CPU float64 at once (saves device memory)."""

    def __init__(self, keep: Callable[[str], bool]):
        super().__init__()
        self.keep = keep

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        if self.keep(name):
            super().__setitem__(name, value.detach().to("cpu", torch.float64))


def keep_layers(name: str) -> bool:
    """Pass 1 of the bisection: the layer-level hidden states only."""
    return name in ("embed", "norm") or re.fullmatch(r"layers\.\d+", name) is not None


def keep_block(layer: int) -> Callable[[str], bool]:
    """Pass 2: every op of one block."""
    prefix = f"layers.{layer}."

    def keep(name: str) -> bool:
        return name.startswith(prefix)

    keep.cache_key = prefix  # the same filter whenever asked again (verify.bisect.CachedPath)
    return keep


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@contextlib.contextmanager
def op_hooks(backbone: torch.nn.Module, trace: dict, head_dim: int) -> Iterator[None]:
    """Forward hooks on an HF-named backbone (``embed_tokens``, ``layers``, ``norm``) recording every
    op a hook can see into ``trace`` (a FilteredTrace drops the unwanted ones)."""
    handles = []

    def out_hook(name: str, heads: bool = False):
        def hook(_mod, _inp, out):
            x = _first(out)
            trace[name] = x.unflatten(-1, (-1, head_dim)) if heads else x
        return hook

    def in_hook(name: str):
        def hook(_mod, inp):
            trace[name] = inp[0]
        return hook

    def residual_hook(name: str):
        # HF's post-attention norm is called on the sum x + attn; ours adds inside (the fused add + norm,
        # model.Block) and returns (normed, x + attn)
        def hook(_mod, inp, out):
            trace[name] = out[1] if isinstance(out, tuple) else inp[0]
        return hook

    handles.append(backbone.embed_tokens.register_forward_hook(out_hook("embed")))
    for i, layer in enumerate(backbone.layers):
        p = f"layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        handles += [
            layer.input_layernorm.register_forward_hook(out_hook(p + "input_norm")),
            attn.q_proj.register_forward_hook(out_hook(p + "q_proj", heads=True)),
            attn.k_proj.register_forward_hook(out_hook(p + "k_proj", heads=True)),
            attn.v_proj.register_forward_hook(out_hook(p + "v_proj", heads=True)),
            *(getattr(attn, op).register_forward_hook(out_hook(p + op)) for op in QK_NORM_OPS if hasattr(attn, op)),
            attn.o_proj.register_forward_pre_hook(in_hook(p + "attn_out")),
            attn.o_proj.register_forward_hook(out_hook(p + "o_proj")),
            layer.post_attention_layernorm.register_forward_hook(residual_hook(p + "attn_residual")),
            layer.post_attention_layernorm.register_forward_hook(out_hook(p + "post_attention_norm")),
            mlp.gate_proj.register_forward_hook(out_hook(p + "gate_proj")),
            mlp.up_proj.register_forward_hook(out_hook(p + "up_proj")),
            mlp.down_proj.register_forward_pre_hook(in_hook(p + "act")),
            mlp.down_proj.register_forward_hook(out_hook(p + "down_proj")),
            layer.register_forward_hook(out_hook(p + "mlp_residual")),
            layer.register_forward_hook(out_hook(f"layers.{i}")),
        ]
    handles.append(backbone.norm.register_forward_hook(out_hook("norm")))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def record_ours(model: Any, trace: dict, keep: Callable[[str], bool] = lambda name: True) -> Iterator[dict]:
    """Record our CausalLM's intermediates into ``trace`` during the forwards inside the block.

    The attention probabilities cost a [B, H, T, T] matmul: they are built only for the layers whose
    internal ops ``keep`` asks for."""
    wanted = [i for i in range(model.cfg.num_layers) if any(keep(f"layers.{i}.{op}") for op in INTERNAL_OPS)]
    with op_hooks(model.model, trace, model.cfg.head_dim), model.record_internals(trace, layers=wanted):
        yield trace


@contextlib.contextmanager
def record_hf(hf_model: Any, trace: dict, head_dim: int) -> Iterator[dict]:
    """The same names from a transformers LLaMA/Qwen2/Qwen3 model in eager attention."""
    base = hf_model.model
    handles = []
    for i, layer in enumerate(base.layers):
        def probs_hook(_mod, _inp, out, name=f"layers.{i}.attn_probs"):
            if isinstance(out, tuple) and len(out) > 1 and out[1] is not None:
                trace[name] = out[1]
        handles.append(layer.self_attn.register_forward_hook(probs_hook))
    # q, k after RoPE live inside the attention forward: wrap the modeling module's function.
    modeling = sys.modules[type(base.layers[0].self_attn).__module__]
    original = modeling.apply_rotary_pos_emb
    calls = [0]

    def recording_rope(q, k, *args, **kwargs):
        q2, k2 = original(q, k, *args, **kwargs)
        i = calls[0]
        calls[0] += 1
        trace[f"layers.{i}.q_rope"] = q2.transpose(1, 2)
        trace[f"layers.{i}.k_rope"] = k2.transpose(1, 2)
        return q2, k2

    modeling.apply_rotary_pos_emb = recording_rope
    try:
        with op_hooks(base, trace, head_dim):
            yield trace
    finally:
        modeling.apply_rotary_pos_emb = original
        for h in handles:
            h.remove()
