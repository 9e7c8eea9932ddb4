"""Model families: everything that differs between LLaMA, Qwen2 and Qwen3, in one spec each.

A family is what transformers calls a ``model_type`` and llama.cpp an architecture: one decoder graph with
fixed structural choices. The layers read these specs instead of testing names:

- ``config.py``: config.json's ``model_type`` / ``architectures``, keys a family writes with fixed values,
  defaults of keys a config.json may omit (RMSNorm eps, tied head, RoPE pairing), which features the family
  implies (Q/K/V bias, qk-norm) and which it cannot express;
- ``model.py``: builds from the ModelConfig fields these specs set (bias, qk-norm, eps, tied head, RoPE style);
- ``formats/gguf.py`` and ``formats/gguf_write.py``: GGUF ``general.architecture``, whether llama.cpp's RoPE
  for it pairs adjacent dims (so Q/K rows are permuted in the file), which features its graph has;
- ``formats/gguf_write.py``: the llama.cpp pre-tokenizer names the family's tokenizers use, tried first;
- ``verify/``: the transformers classes of the oracle, the per-block op names (q_norm / k_norm), eps hints.

Adding a family whose blocks need no new kernel is one ``Family(...)`` in ``FAMILIES`` plus its tests
(tests/test_family_*.py: HF parity, GGUF round trip through llama.cpp, verify ops, a tiny preset).
SmolLM2 is a LLaMA (model_type llama); Qwen2.5 and Qwen2.5-Coder are Qwen2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture, config.json's model_type
    hf_architecture: str  # config.json's architectures[0]: the transformers model class
    hf_config_class: str  # the transformers config class (verify builds its oracle with it)
    gguf_arch: str  # GGUF general.architecture: the llama.cpp graph
    qkv_bias: bool  # Q/K/V projections carry biases (never o_proj): Qwen2 always, the others never
    qk_norm: bool  # an RMSNorm over head_dim on q and on k, before RoPE (Qwen3)
    rms_norm_eps: float  # what a config.json without rms_norm_eps means
    # llama.cpp's RoPE for gguf_arch: True = NORM (adjacent pairs 2i, 2i+1), so HF's split-half Q/K rows are
    # permuted in the file (convert_hf_to_gguf.py's `permute`); False = NEOX, stored as HF has them
    gguf_rope_adjacent: bool
    # config.json keys this family writes with a fixed value, and refuses with another one: LLaMA's and Qwen3's
    # attention_bias=true puts a bias on o_proj too, which our model does not have
    hf_fixed_keys: tuple[tuple[str, Any], ...] = ()
    rope_style: str = "neox"  # HF's pairing for the family: (i, i + d/2)
    hidden_act: str = "silu"  # the gated MLP's activation (SwiGLU; the one MLP kernel we have)
    tie_word_embeddings: bool = False  # transformers' default when config.json omits tie_word_embeddings
    # llama.cpp pre-tokenizer names of the family's known tokenizers: the export tries them first (the probe
    # strings still decide; a family name only wins where two candidates split every probe alike)
    gguf_pre_tokenizers: tuple[str, ...] = ()
    members: tuple[str, ...] = ()  # model lines that are this family (docs, error messages)


LLAMA = Family(
    name="llama", hf_architecture="LlamaForCausalLM", hf_config_class="LlamaConfig", gguf_arch="llama",
    qkv_bias=False, qk_norm=False, rms_norm_eps=1e-5, gguf_rope_adjacent=True,
    hf_fixed_keys=(("attention_bias", False), ("mlp_bias", False)),
    gguf_pre_tokenizers=("llama-bpe", "smollm", "smaug-bpe", "gpt2"),
    members=("LLaMA 2/3", "SmolLM2", "TinyLlama"),
)
QWEN2 = Family(
    name="qwen2", hf_architecture="Qwen2ForCausalLM", hf_config_class="Qwen2Config", gguf_arch="qwen2",
    qkv_bias=True, qk_norm=False, rms_norm_eps=1e-6, gguf_rope_adjacent=False,
    gguf_pre_tokenizers=("qwen2",),
    members=("Qwen2", "Qwen2.5", "Qwen2.5-Coder"),
)
QWEN3 = Family(
    name="qwen3", hf_architecture="Qwen3ForCausalLM", hf_config_class="Qwen3Config", gguf_arch="qwen3",
    qkv_bias=False, qk_norm=True, rms_norm_eps=1e-6, gguf_rope_adjacent=False,
    hf_fixed_keys=(("attention_bias", False),),
    gguf_pre_tokenizers=("qwen2",),
    members=("Qwen3 (dense)",),
)

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3)}
GGUF_FAMILIES: dict[str, Family] = {f.gguf_arch: f for f in FAMILIES.values()}


def family(name: str) -> Family:
    """The family of a ModelConfig.architecture / config.json model_type; ValueError naming the supported ones."""
    if name not in FAMILIES:
        raise ValueError(f"architecture {name!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def gguf_family(arch: Any) -> Family | None:
    """The family of a GGUF general.architecture, None when we have none."""
    return GGUF_FAMILIES.get(arch) if isinstance(arch, str) else None


def family_with(qkv_bias: bool, qk_norm: bool) -> Family | None:
    """The family whose fixed features are these (the remedy when a config sits in the wrong family)."""
    return next((f for f in FAMILIES.values() if f.qkv_bias == qkv_bias and f.qk_norm == qk_norm), None)


def eps_defaults() -> str:
    """'llama 1e-05, qwen2 1e-06, ...': each family's RMSNorm eps default (verify's hint names them)."""
    return ", ".join(f"{f.name} {f.rms_norm_eps:g}" for f in FAMILIES.values())
