"""Read GGUF files (llama.cpp's format): metadata -> ModelConfig, tensors -> HF-named torch tensors.

Float tensors keep their stored dtype (F32 -> float32, F16 -> float16, BF16 -> bfloat16, read
bit for bit); quantized tensors (Q8_0, Q4_1, Q5_0, Q4_K, Q6_K, ...) are dequantized to float32
with ``gguf.quants.dequantize``'s values (the legacy 32-value block types by our torch port of it, the
others by it). GGUF lists dimensions fastest-first (ne0, ne1), the reverse of
torch's order. llama.cpp permutes the rows of Q and K for the ``llama`` architecture (to turn
HF's split-half RoPE pairs into adjacent pairs); we undo it so the weights are HF's again.
``qwen2`` and ``qwen3`` are stored unpermuted (llama.cpp uses NeoX RoPE for them). Which
architecture does what is its family's spec (``families.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import InputError
from ..families import GGUF_FAMILIES, gguf_family
from ..gguf_file import GGUFFile, open_reader

SUPPORTED_ARCHITECTURES = tuple(GGUF_FAMILIES)

_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor name, or None when we have no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


# The GGUF parser itself is gguf_file.py (below the tokenizer, which reads it too).


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def _f32_value(v: float) -> float:
    """GGUF stores floats as float32: 1e-6 reads back as 9.99999997e-07. Take the shortest decimal
    that rounds to the same float32, which is what the HF config said (1e-06)."""
    return float(str(np.float32(v)))


def read_config(reader, path: str | Path) -> ModelConfig:
    """ModelConfig from GGUF metadata (an architecture of families.GGUF_FAMILIES)."""
    arch = _field(reader, "general.architecture")
    fam = gguf_family(arch)
    if fam is None:
        raise InputError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def need(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise InputError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise InputError(f"{path}: GGUF file has no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:
        raise InputError(f"{path}: rope_freqs.weight (llama3-style RoPE scaling stored as a tensor) is "
                         f"not supported; convert the HF checkpoint instead")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise InputError(f"{path}: per-layer head_count_kv is not supported")
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise InputError(f"{path}: key_length {head_dim}, value_length {value_dim}, rope dimension "
                         f"{rope_dim} differ; partial RoPE / unequal head dims are not supported")
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32_value(need("rope.scaling.factor"))}
    elif scaling_type not in ("none", None):
        raise InputError(f"{path}: RoPE scaling type {scaling_type!r} is not supported (linear only)")
    vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF dims are (hidden, vocab)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    try:
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rope_theta=_f32_value(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_style=fam.rope_style,  # the llama permutation is undone on load; qwen2/qwen3 are NeoX as stored
            rope_scaling=rope_scaling,
            rms_norm_eps=_f32_value(need("attention.layer_norm_rms_epsilon")),
            attention_bias=fam.qkv_bias,
            qk_norm=fam.qk_norm,
            tie_word_embeddings="output.weight" not in tensors,
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
            architecture=fam.name,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            pad_token_id=None if pad is None else int(pad),
        )
    except ValueError as e:
        raise InputError(f"{path}: {e}") from e


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` (convert_hf_to_gguf.py) of Q/K rows (weights or biases).

    llama.cpp: ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`` turns split-half pairs into
    adjacent pairs; the inverse views rows as (n_head, d/2, 2) and swaps back.
    """
    rows = w.shape[0]
    assert rows % (2 * n_head) == 0, (rows, n_head)
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape).contiguous())


@dataclass
class TensorRecord:
    name: str  # HF name (the GGUF name when there is no counterpart)
    gguf_name: str
    shape: tuple[int, ...]  # torch order
    stored: str  # GGUF type name: F32, BF16, Q4_K, ...


def _low_high_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[blocks, 16] bytes -> [blocks, 32]: the low nibbles are elements 0-15, the high ones 16-31 (ggml)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _f16_column(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _dequant_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float().mul_(_f16_column(b, 0))


def _dequant_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _low_high_nibbles(b[:, 2:]).float().sub_(8).mul_(_f16_column(b, 0))


def _dequant_q4_1(b: torch.Tensor) -> torch.Tensor:
    return _low_high_nibbles(b[:, 4:]).float().mul_(_f16_column(b, 0)).add_(_f16_column(b, 2))


def _dequant_q5_0(b: torch.Tensor) -> torch.Tensor:
    fifth = ((b[:, 2:6, None] >> _SHIFTS) & 1).reshape(-1, 32)  # a little-endian uint32: bit i is element i's
    return (_low_high_nibbles(b[:, 6:]) | fifth << 4).float().sub_(16).mul_(_f16_column(b, 0))


# ggml's legacy block formats in torch: (bytes per block of 32, dequantizer). The same float32 values as
# gguf.quants' numpy (codes are small integers, exact in float32; then one multiply by the block's scale and, for
# Q4_1, one add of its minimum: equal bit for bit, tests/test_loading.py), in place and in chunks instead of its
# per-16-rows loop. Other types go to gguf.quants.
_TORCH_DEQUANT = {"Q8_0": (34, _dequant_q8_0), "Q4_0": (18, _dequant_q4_0), "Q4_1": (20, _dequant_q4_1),
                  "Q5_0": (22, _dequant_q5_0)}
_DEQUANT_CHUNK = 1 << 14  # blocks per step: 0.5M values, the temporaries stay in cache


def _dequant_torch(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    size, fn = _TORCH_DEQUANT[type_name]
    blocks = torch.from_numpy(np.array(data, copy=True).view(np.uint8).reshape(-1, size))
    out = torch.empty(blocks.shape[0], 32, dtype=torch.float32)
    for i in range(0, blocks.shape[0], _DEQUANT_CHUNK):
        out[i:i + _DEQUANT_CHUNK] = fn(blocks[i:i + _DEQUANT_CHUNK])
    return out.reshape(shape)


def _tensor_to_torch(t, path: Path) -> torch.Tensor:
    from gguf import quants

    type_name = t.tensor_type.name
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    data = t.data
    if type_name in ("F32", "F16"):
        arr = np.array(data, copy=True).reshape(shape)
        return torch.from_numpy(arr)
    if type_name == "BF16":
        # the reader hands BF16 over as raw bytes: reinterpret the bits, never go through F16
        raw = np.array(data, copy=True).view(np.int16).reshape(shape)
        return torch.from_numpy(raw).view(torch.bfloat16)
    if type_name in _TORCH_DEQUANT:
        return _dequant_torch(data, type_name, shape)
    try:
        arr = quants.dequantize(data, t.tensor_type)
    except NotImplementedError as e:
        raise InputError(f"{path}: tensor {t.name} has GGUF type {type_name}, which cannot be "
                         f"dequantized ({e})") from e
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32).reshape(shape))


def iter_tensors(reader, cfg: ModelConfig, path: Path) -> Iterator[tuple[TensorRecord, torch.Tensor]]:
    """(record, tensor) per GGUF tensor, HF-named, llama's Q/K permutation undone."""
    permuted = cfg.family.gguf_rope_adjacent  # the file pairs Q/K rows for llama.cpp's NORM RoPE
    for t in reader.tensors:
        name = hf_name(t.name) or t.name
        tensor = _tensor_to_torch(t, path)
        if permuted:
            if ".self_attn.q_proj." in name:
                tensor = unpermute_qk(tensor, cfg.num_heads)
            elif ".self_attn.k_proj." in name:
                tensor = unpermute_qk(tensor, cfg.num_kv_heads)
        rec = TensorRecord(name, t.name, tuple(tensor.shape), t.tensor_type.name)
        yield rec, tensor


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, HF-named state dict, info) from a GGUF file. Unknown tensor names keep their GGUF
    name so the strict loader reports them as unexpected."""
    path = Path(path)
    reader = open_reader(path)
    cfg = read_config(reader, path)
    state: dict[str, torch.Tensor] = {}
    stored: dict[str, str] = {}
    for rec, tensor in iter_tensors(reader, cfg, path):
        state[rec.name] = tensor
        stored[rec.name] = rec.stored
    info = {"format": "gguf", "path": str(path), "stored_dtypes": stored,
            "quantized": any(s not in _FLOAT_TYPES for s in stored.values())}
    return cfg, state, info


def describe(path: str | Path) -> list[TensorRecord]:
    """Stored tensor types without reading any tensor data (for `inspect`)."""
    path = Path(path)
    reader = open_reader(path)
    out = []
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        out.append(TensorRecord(hf_name(t.name) or t.name, t.name, shape, t.tensor_type.name))
    return out
