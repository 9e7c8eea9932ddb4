"""Tiny random models shared by the tests: transformers' LlamaForCausalLM / Qwen2ForCausalLM (the oracle) and
our CausalLM, every tensor drawn from a seed."""

from __future__ import annotations

import torch

# ---- tiny random transformers models (the oracle), shared by parity / loading / mutation tests ----


TINY_BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random transformers LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (fp32, eval).

    Every tensor is randomized -- norm weights around 1, biases nonzero -- so no parameter can be
    dropped or swapped without changing the logits. Embeddings stay small (std 0.02 as HF's init)
    so RMSNorm's eps matters to the output.
    """
    import transformers

    from entrenar.families import family

    fam = family(arch)
    kw = {**TINY_BASE, **overrides}
    cfg, cls = getattr(transformers, fam.hf_config_class)(**kw), getattr(transformers, fam.hf_architecture)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_(model, seed + 1, embed_std=0.02)
    return model


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, *, embed_std: float,
               embed_names: tuple[str, ...] = ("embed_tokens",)) -> None:
    """Every parameter drawn from Generator(seed) in parameter order: norm weights 1 + N(0, 0.2), biases N(0, 0.5),
    the tensors named by `embed_names` N(0, embed_std), the rest N(0, 1 / fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.5 * noise)
        elif any(e in name for e in embed_names):
            p.copy_(embed_std * noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


# ---- tiny random CausalLMs (our model), shared by verify / generate / peft / trainer tests ----


def tiny_config(arch: str = "llama", **overrides):
    """A small ModelConfig: 2 layers, hidden 64, 4 heads over 2 KV heads (GQA); ``arch="qwen2"`` adds
    Qwen2's Q/K/V bias, eps 1e-6 and tied head; ``arch="qwen3"`` qk-norm, eps 1e-6, tied head and head_dim 32
    (not hidden / heads = 16). Any field can be overridden."""
    from entrenar.config import ModelConfig

    base = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
            "num_kv_heads": 2, "architecture": arch}
    if arch == "qwen2":
        base.update(attention_bias=True, tie_word_embeddings=True, rms_norm_eps=1e-6)
    if arch == "qwen3":
        base.update(qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6, head_dim=32)
    return ModelConfig(**{**base, **overrides})


def tiny_causal_lm(cfg, seed: int = 0, *, bias_std: float = 0.0, norm_std: float = 0.0, head_scale: float = 1.0):
    """Our CausalLM with ``init_weights(seed)``, then, drawn in parameter order from Generator(seed + 1):
    biases ~ N(0, bias_std) (nonzero, so a dropped bias shows), norm weights 1 + N(0, norm_std); embedding
    and untied head scaled by ``head_scale`` (sharper logits: greedy choices are not near-ties)."""
    from entrenar.model import CausalLM

    model = CausalLM(cfg)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") and bias_std:
                p.copy_(bias_std * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight") and norm_std:
                p.copy_(1 + norm_std * torch.randn(p.shape, generator=gen))
            elif head_scale != 1.0 and ("embed_tokens" in name or "lm_head" in name):
                p.mul_(head_scale)
    return model
