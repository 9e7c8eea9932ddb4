"""Shared fixtures. The packaged real models load once per session (fp32, read-only: tests that
train or mutate a model must ``copy.deepcopy`` it first). Commands that load them run under
``flock /tmp/entrenar-real.lock``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SMOLLM = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture()
def poisoned_outputs(monkeypatch):
    """Every Triton kernel output starts as NaN (-7 for integers): a kernel that leaves a row unwritten
    fails its comparison. Kernel test modules use it with pytestmark = pytest.mark.usefixtures(...)."""
    from entrenar.kernels import _common

    def nan_empty(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if dtype.is_floating_point else t.fill_(-7)

    monkeypatch.setattr(_common, "empty", nan_empty)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF (llama architecture, Q4_1 + Q8_0 + F32)."""
    from entrenar.formats.registry import packaged_path

    return packaged_path(SMOLLM)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    """The packaged Qwen2.5-Coder-0.5B-Instruct GGUF, assembled once into the cache directory."""
    from entrenar.formats.registry import packaged_path

    return packaged_path(QWEN)


@pytest.fixture(scope="session")
def smollm_model(smollm_path):
    """Our CausalLM of the packaged SmolLM2 (fp32, eval mode). Do not modify it in place."""
    from entrenar.formats import load_model

    return load_model(smollm_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def qwen_model(qwen_path):
    """Our CausalLM of the packaged Qwen2.5-Coder-0.5B (fp32, ~2 GB, eval mode). Do not modify it."""
    from entrenar.formats import load_model

    return load_model(qwen_path, dtype=torch.float32)


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
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.02 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model


@pytest.fixture()
def tiny_hf_dir(tmp_path):
    """Factory: (transformers model, directory it was saved to with save_pretrained)."""
    counter = iter(range(1000))

    def make(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
        model = make_hf_model(arch, seed, **overrides).to(dtype)
        out = tmp_path / f"hf-{arch}-{next(counter)}"
        model.save_pretrained(out)
        return model, out

    return make


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


LAUNCH_ABORT = "terminate called without an active exception"


def run_torchrun(cmd: list[str], *, check: bool = False, **kwargs):
    """subprocess.run of a torchrun command, launched once more (saying so) when a rank aborted in C++ with
    LAUNCH_ABORT: seen once in 2-worker CI (a gloo worker at start-up on an overloaded 2-core machine),
    never reproduced alone. Any other failure, and a second abort, is returned as it is."""
    import subprocess
    import sys

    proc = subprocess.run(cmd, check=check, **kwargs)
    if proc.returncode != 0 and LAUNCH_ABORT in (proc.stderr or ""):
        print(f"note: a rank aborted at launch ({LAUNCH_ABORT}); launching once more", file=sys.stderr)
        proc = subprocess.run(cmd, check=check, **kwargs)
    return proc
