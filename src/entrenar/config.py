"""Model configuration, presets, and the mapping to transformers' ``config.json``.

One ``ModelConfig`` describes every LLaMA / Qwen2 / Qwen3 / SmolLM2 shape we support. Nothing in the
model hard-codes eps, theta, RoPE pairing, bias or qk-norm: each comes from here, and what a family
fixes or defaults (config.json's names, Q/K/V bias, qk-norm, eps) comes from its spec in ``families.py``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .families import FAMILIES, Family, family

ROPE_STYLES = ("neox", "gptj")
ARCHITECTURES = tuple(FAMILIES)


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_style: str = "neox"  # neox: pairs (i, i+d/2) as HF LLaMA/Qwen2; gptj: pairs (2i, 2i+1)
    rope_scaling: dict[str, Any] | None = None  # None | {"rope_type": "linear"|"llama3", "factor": ..}
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False  # Q/K/V projection biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    architecture: str = "llama"  # which transformers class config.json names
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)  # config.json keys we carry but do not use

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid model config: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                bad(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            bad(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            bad(f"head_dim {self.head_dim} must be even for RoPE")
        if self.rope_style not in ROPE_STYLES:
            bad(f"rope_style {self.rope_style!r} not in {ROPE_STYLES}")
        if self.architecture not in ARCHITECTURES:
            bad(f"architecture {self.architecture!r} not in {ARCHITECTURES}")
        if not (0 < self.rms_norm_eps < 1e-2):
            bad(f"rms_norm_eps {self.rms_norm_eps} out of range")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("linear", "llama3", "default"):
                bad(f"rope_scaling type {kind!r} not supported (linear | llama3)")

    # ---- sizes -------------------------------------------------------------------------
    def layer_linear_parameters(self) -> int:
        """Weights of one decoder layer's linears: q/o over num_heads, k/v over num_kv_heads, the MLP's three."""
        h, d = self.hidden_size, self.head_dim
        return h * d * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * h * self.intermediate_size

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        not_linear = 2 * h  # the two RMSNorm weights
        if self.attention_bias:
            not_linear += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            not_linear += 2 * d
        per_layer = self.layer_linear_parameters() + not_linear
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + emb + head + h

    def matmul_parameters(self) -> int:
        """Parameters that take part in a matmul per token (all linears incl. the LM head)."""
        return self.num_layers * self.layer_linear_parameters() + self.vocab_size * self.hidden_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params + attention (causal-agnostic, as PaLM)."""
        attn = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
        return 6 * self.matmul_parameters() + attn

    # ---- transformers config.json ------------------------------------------------------
    @property
    def family(self) -> Family:
        return family(self.architecture)

    def to_hf_dict(self) -> dict[str, Any]:
        fam = self.family
        d: dict[str, Any] = dict(self.extra)
        d.update(
            architectures=[fam.hf_architecture],
            model_type=fam.name,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            # transformers >= 5 reads rope_parameters; the legacy keys above serve older versions
            rope_parameters={**{k: v for k, v in (self.rope_scaling or {}).items() if k != "type"},
                             "rope_type": (self.rope_scaling or {}).get(
                                 "rope_type", (self.rope_scaling or {}).get("type", "default")),
                             "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=fam.hidden_act,
            initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        # A family fixes Q/K/V bias: transformers' LLaMA and Qwen3 put a bias on o_proj too when attention_bias
        # is set, Qwen2 biases exactly Q/K/V. So Q/K/V bias is expressed as qwen2 and its absence as llama/qwen3.
        if self.attention_bias != fam.qkv_bias:
            other = _family_for(self.attention_bias, self.qk_norm)
            raise ValueError(f"Q/K/V bias without an o_proj bias is the {other.name} architecture; set "
                             f"architecture='{other.name}'" if self.attention_bias else
                             f"a {fam.name} config.json cannot express attention_bias=false; use {other.name}")
        if fam.qk_norm and not self.qk_norm:
            raise ValueError(f"a {fam.name} config.json cannot express qk_norm=false; use "
                             f"{_family_for(self.attention_bias, False).name}")
        d.update(fam.hf_fixed_keys)
        if self.rope_style != fam.rope_style:
            d["entrenar_rope_style"] = self.rope_style  # transformers has no gptj pairing for these families
        if self.qk_norm and not fam.qk_norm:
            d["entrenar_qk_norm"] = True
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise ValueError(f"config.json model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(FAMILIES)})")
        fam = FAMILIES[model_type]
        known = {
            "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rope_theta", "rope_scaling", "rms_norm_eps", "tie_word_embeddings",
            "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias",
            "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
            "entrenar_rope_style", "entrenar_qk_norm", "rope_parameters",
        }
        if d.get("hidden_act", fam.hidden_act) != fam.hidden_act:
            raise ValueError(f"hidden_act {d['hidden_act']!r} not supported ({fam.hidden_act} only)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        for key, value in fam.hf_fixed_keys:
            if d.get(key, value) not in (value, None):
                raise ValueError(f"{model_type} {key}={d[key]!r} is not supported"
                                 + (" (bias on o_proj too)" if key == "attention_bias" else ""))
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported: every layer here attends to the whole "
                             "context, so layers past the window would compute something else than the model")
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta", 10000.0)
        if d.get("rope_parameters"):  # transformers >= 5 writes theta and scaling here
            rope_scaling = {k: v for k, v in d["rope_parameters"].items() if k != "rope_theta"}
            rope_theta = d["rope_parameters"].get("rope_theta", rope_theta)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(rope_theta),
            rope_style=d.get("entrenar_rope_style", fam.rope_style),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", fam.rms_norm_eps)),
            attention_bias=fam.qkv_bias,
            qk_norm=fam.qk_norm or bool(d.get("entrenar_qk_norm", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", fam.tie_word_embeddings)),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            architecture=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            initializer_range=d.get("initializer_range", 0.02),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()))

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _family_for(qkv_bias: bool, qk_norm: bool) -> Family:
    """The family a config.json of these features is written as: the one that fixes both, else the one with this
    bias and no qk-norm (qk-norm then travels as entrenar_qk_norm)."""
    exact = [f for f in FAMILIES.values() if (f.qkv_bias, f.qk_norm) == (qkv_bias, qk_norm)]
    return (exact or [f for f in FAMILIES.values() if f.qkv_bias == qkv_bias and not f.qk_norm])[0]


PRESETS: dict[str, ModelConfig] = {
    # tests and from-scratch smoke runs; vocab of the SmolLM2 tokenizer so packed shards fit
    "tiny": ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=176, num_layers=2,
                        num_heads=4, num_kv_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
                        tie_word_embeddings=True, max_position_embeddings=2048),
    "llama-370m": ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                              num_layers=24, num_heads=16, num_kv_heads=8, rope_theta=10000.0,
                              rms_norm_eps=1e-5, tie_word_embeddings=False,
                              max_position_embeddings=4096),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, rope_theta=100000.0,
                                rms_norm_eps=1e-5, tie_word_embeddings=True,
                                max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                num_layers=24, num_heads=14, num_kv_heads=2, rope_theta=1e6,
                                rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=True,
                                max_position_embeddings=32768, architecture="qwen2",
                                bos_token_id=151643, eos_token_id=151645),
    "qwen2.5-coder-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                    num_layers=28, num_heads=28, num_kv_heads=4, rope_theta=1e6,
                                    rms_norm_eps=1e-6, attention_bias=True,
                                    tie_word_embeddings=False, max_position_embeddings=32768,
                                    architecture="qwen2", bos_token_id=151643,
                                    eos_token_id=151645),
    # Qwen3: no Q/K/V bias, RMSNorm over head_dim on q and k before RoPE, head_dim not hidden / heads
    "tiny-qwen3": ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=176, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6,
                              qk_norm=True, tie_word_embeddings=True, max_position_embeddings=2048,
                              architecture="qwen3"),
    "qwen3-0.6b": ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                              qk_norm=True, tie_word_embeddings=True, max_position_embeddings=40960,
                              architecture="qwen3", bos_token_id=151643, eos_token_id=151645),
}


# Presets whose size is part of their name: (parameters low, high) at the reference vocabulary.
# Checked whenever the preset is built, so a wrong width or depth fails before any training.
PARAMETER_BANDS: dict[str, tuple[int, int, int]] = {
    "llama-370m": (366_000_000, 374_000_000, 32000),  # (low, high, reference vocab_size)
}
VOCAB_MULTIPLE = 64  # embedding / LM-head rows are padded to this for the matmuls


def check_parameter_band(name: str, cfg: ModelConfig) -> None:
    """ValueError naming the count when preset `name` with its reference vocabulary leaves its band."""
    if name not in PARAMETER_BANDS:
        return
    low, high, vocab = PARAMETER_BANDS[name]
    n = cfg.replace(vocab_size=vocab).num_parameters()
    if not low <= n <= high:
        raise ValueError(f"preset {name!r} has {n:,} parameters with a {vocab:,}-token vocabulary, outside "
                         f"its band {low:,}..{high:,}: a width, depth or intermediate size is wrong")


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    cfg = dataclasses.replace(PRESETS[name])
    check_parameter_band(name, cfg)
    return cfg


def round_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-int(n) // multiple) * multiple


def preset_for_tokenizer(name: str, vocab_size: int, bos_id: int | None = None, eos_id: int | None = None,
                         pad_id: int | None = None) -> tuple[ModelConfig, str | None]:
    """Preset `name` for a tokenizer of `vocab_size` tokens: a different vocabulary gives
    vocab_size rounded up to a multiple of 64 (the rows above `vocab_size` are padding, never a
    target: no token id reaches them). The special-token ids come from the tokenizer. Returns the
    config and a note saying what changed (None when nothing did)."""
    cfg = preset(name)
    note = None
    if vocab_size != cfg.vocab_size:
        padded = round_vocab(vocab_size)
        note = (f"preset {name}: vocab_size {cfg.vocab_size} -> {padded} (the shards' tokenizer has "
                f"{vocab_size} tokens" + (f", rounded up to a multiple of {VOCAB_MULTIPLE}; ids {vocab_size}.."
                                          f"{padded - 1} are padding rows, never targets)" if padded != vocab_size
                                          else ")") + f"; {cfg.replace(vocab_size=padded).num_parameters():,} "
                f"parameters")
        cfg = cfg.replace(vocab_size=padded)
    cfg = cfg.replace(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    return cfg, note
