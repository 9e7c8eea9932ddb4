"""Write GGUF files that llama.cpp runs: architecture metadata, llama.cpp tensor names, the tokenizer.

What llama.cpp needs, and why each step is here:

- Tensor names are llama.cpp's (``blk.0.attn_q.weight`` ...): the inverse of the reader's table in
  ``gguf.py``, so reading and writing can never disagree on a name.
- The architecture is the family's (``families.py``: ``gguf_arch``), and so is its RoPE: llama.cpp runs
  ``llama`` with NORM RoPE (adjacent pairs 2i, 2i+1) and ``qwen2``/``qwen3`` with NEOX RoPE (pairs i, i + d/2).
  Our weights pair as ``cfg.rope_style`` says (HF's neox by default),
  so Q/K rows (and biases) are permuted where the two disagree: neox -> llama is llama.cpp's own
  ``permute`` of convert_hf_to_gguf.py; gptj -> qwen2 is its inverse. The reader undoes the same.
  Qwen3's q_norm/k_norm act on whole heads before RoPE, so they are never permuted.
- Qwen2's Q/K/V biases are written (llama.cpp requires them); a tied head is written once
  (``token_embd.weight``, no ``output.weight``), which is how llama.cpp and our reader detect tying.
- 1-D tensors (norms, biases) stay F32 whatever ``--type`` says, as llama.cpp's converter does;
  2-D weights take the requested type; a row length that is not a multiple of the quantization
  block (32) falls back to F16, as llama.cpp's converter does.
- The tokenizer: byte-level BPE (``tokenizer.ggml.model = gpt2``) with the pre-tokenizer *name*
  that llama.cpp maps to the same text split. The name is found by running the tokenizer's own
  pre-tokenizer on probe strings and comparing with each split llama.cpp implements: never a guess.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import InputError
from ..families import family_with
from .gguf import _BLOCK_NAMES, _GLOBAL_NAMES, unpermute_qk

EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")

# llama.cpp's names for the pre-tokenizers entrenar implements (tokenizer.GGUF_PRE_TOKENIZERS),
# in the order they are tried; aliases of the same split (llama3, llama-v3) are left out. llama-bpe
# and smaug-bpe split alike; llama.cpp takes a word that is itself a token whole (ignore_merges)
# only for llama-bpe, so the BPE model's own ignore_merges flag picks between them.
LLAMA_CPP_PRE_NAMES = ("gpt2", "smollm", "qwen2", "llama-bpe", "smaug-bpe")

# Probe strings on which the pre-tokenizers above split differently: digit runs, contractions in
# both cases, punctuation glued to letters, newlines and space runs, non-Latin letters.
PRE_TOKENIZER_PROBES = (
    "Hello world 12345 and 7 or 1234567890.",
    "don't DON'T we'll I'M they've",
    "$hello (x+y)==z; foo.bar_baz()",
    "line one\n\n  indented\n\tx\r\ny   \n",
    "   leading spaces and trailing   ",
    "naïve café 東京タワー Привет мир 안녕하세요 ١٢٣",
    "def f(a, b):\n    return a**2 + b  # 3.14159\n",
    "emoji 🙂👍 and symbols ©®™ ... !!! ???",
    "x1y22z333 v2.0.1 0x1F 3e-5",
)


# ---- tensors ---------------------------------------------------------------------------------
_HF_TO_GGUF_GLOBAL = {hf: g for g, hf in _GLOBAL_NAMES.items()}
_HF_TO_GGUF_BLOCK = {hf: g for g, hf in _BLOCK_NAMES.items()}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for an HF parameter name (the inverse of gguf.hf_name)."""
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".", 3)  # model.layers.N.rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_TO_GGUF_BLOCK:
        return f"blk.{parts[2]}.{_HF_TO_GGUF_BLOCK[parts[3]]}"
    raise InputError(f"tensor {hf_name} has no llama.cpp name; this model cannot be exported to GGUF")


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py) of Q/K rows: split-half RoPE pairs (i, i+d/2)
    of each head become adjacent pairs (2i, 2i+1). The inverse of ``gguf.unpermute_qk``."""
    rows = w.shape[0]
    assert rows % (2 * n_head) == 0, (rows, n_head)
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape).contiguous())


def rope_layout(w: torch.Tensor, cfg: ModelConfig, n_head: int) -> torch.Tensor:
    """Q or K rows (weight or bias) in the pairing llama.cpp's RoPE for this architecture uses."""
    target_adjacent = cfg.family.gguf_rope_adjacent  # llama.cpp: llama = NORM, qwen2/qwen3 = NEOX
    source_adjacent = cfg.rope_style == "gptj"
    if target_adjacent and not source_adjacent:
        return permute_qk(w, n_head)
    if source_adjacent and not target_adjacent:
        return unpermute_qk(w, n_head)
    return w


def check_exportable(cfg: ModelConfig) -> None:
    """InputError for model features the family's llama.cpp graph (or our reader) cannot express: in GGUF the
    architecture alone says whether there are Q/K/V biases and qk-norm."""
    fam = cfg.family
    if cfg.qk_norm != fam.qk_norm:
        other = family_with(cfg.attention_bias, cfg.qk_norm)
        raise InputError(f"the model {'uses' if cfg.qk_norm else 'lacks'} qk-norm, which llama.cpp's {fam.gguf_arch} "
                         f"architecture {'does not have' if cfg.qk_norm else 'requires'}; "
                         + (f"set architecture='{other.name}' in its config.json before exporting" if other else
                            "it cannot be exported to GGUF"))
    if cfg.attention_bias and not fam.qkv_bias:
        other = family_with(True, cfg.qk_norm)
        raise InputError(f"a {fam.name} model with Q/K/V biases is the {other.name} architecture in GGUF; set "
                         f"architecture='{other.name}' in its config.json before exporting" if other else
                         f"a {fam.name} model with Q/K/V biases cannot be exported (no llama.cpp architecture "
                         f"has them with qk-norm)")
    if fam.qkv_bias and not cfg.attention_bias:
        raise InputError(f"a {fam.name} model without Q/K/V biases cannot be exported (llama.cpp requires them); "
                         f"export it as architecture '{family_with(False, cfg.qk_norm).name}'")
    kind = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type"))
    if kind not in (None, "default", "linear"):
        raise InputError(f"RoPE scaling {kind!r} is not supported by the GGUF export (none or linear)")


def ggml_type(export_type: str, tensor: torch.Tensor):
    """The GGML type a tensor is stored as under --type (1-D stays F32; unquantizable rows -> F16)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    if export_type not in EXPORT_TYPES:
        raise InputError(f"--type must be one of {', '.join(EXPORT_TYPES)}, got {export_type!r}")
    if tensor.dim() == 1 or export_type == "f32":
        return T.F32
    qtype = {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[export_type]
    block = GGML_QUANT_SIZES[qtype][0]
    return qtype if tensor.shape[-1] % block == 0 else T.F16


def tensor_nbytes(shape: tuple[int, ...], qtype) -> int:
    from gguf import GGML_QUANT_SIZES

    block, type_size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape, dtype=np.int64)) // block * type_size


def _check_finite(x: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise InputError(f"weights contain NaN/Inf in {name}; refusing to export a broken model "
                         f"(check the checkpoint with `entrenar inspect`)")


def encode_tensor(t: torch.Tensor, qtype, name: str) -> np.ndarray:
    """The bytes of `t` as GGML type `qtype` (a numpy array whose tofile() is the tensor data)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    x = t.detach().to("cpu", torch.float32).contiguous()
    if qtype in (T.F16, T.BF16):
        # one finiteness pass, over the converted tensor: NaN/Inf in x or an f16 overflow both show there
        y = x.to(torch.float16 if qtype == T.F16 else torch.bfloat16)
        if not bool(torch.isfinite(y).all()):
            _check_finite(x, name)
            raise InputError(f"{name} has values beyond {qtype.name}'s range (max |x| = "
                             f"{x.abs().max().item():.4g}); export with --type bf16 or f32")
        return y.numpy() if qtype == T.F16 else y.view(torch.int16).numpy().view(np.uint16)  # RNE rounding
    _check_finite(x, name)
    if qtype == T.F32:
        return x.numpy()
    return quants.quantize(x.numpy(), qtype)


@dataclass
class PlannedTensor:
    name: str  # GGUF name
    hf_name: str
    tensor: torch.Tensor  # already in llama.cpp's row layout
    qtype: Any  # gguf.GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(tuple(self.tensor.shape), self.qtype)


def plan_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor], export_type: str) -> list[PlannedTensor]:
    """Every tensor to write, GGUF-named, in llama.cpp's row layout, with its stored type."""
    check_exportable(cfg)
    plan = []
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: token_embd.weight is the head; written once
        if ".self_attn.q_proj." in name:
            tensor = rope_layout(tensor, cfg, cfg.num_heads)
        elif ".self_attn.k_proj." in name:
            tensor = rope_layout(tensor, cfg, cfg.num_kv_heads)
        plan.append(PlannedTensor(gguf_name(name), name, tensor, ggml_type(export_type, tensor)))
    return plan


# ---- tokenizer metadata ------------------------------------------------------------------------
@dataclass
class TokenizerMeta:
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    eot_id: int | None
    add_bos: bool
    chat_template: str | None
    padded: int = 0  # [PAD{i}] entries added to reach the model's vocab_size
    notes: list[str] = field(default_factory=list)


def _pre_split(pre_tokenizer: Any, text: str) -> list[str]:
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def detect_pre_tokenizer(tokenizer: Any, source: str = "tokenizer", ignore_merges: bool | None = None,
                         prefer: tuple[str, ...] = ()) -> str:
    """llama.cpp's pre-tokenizer name whose split equals this tokenizer's own on every probe.

    `tokenizer` is a ``tokenizers.Tokenizer`` (byte-level BPE). InputError when none matches:
    a wrong name makes llama.cpp split text differently and produce other token ids. `prefer`: the
    model family's own names (families.Family.gguf_pre_tokenizers), tried first.
    """
    from ..tokenizer import GGUF_PRE_TOKENIZERS

    own = tokenizer.pre_tokenizer
    if own is None:
        raise InputError(f"{source}: the tokenizer has no pre-tokenizer; GGUF's byte-level BPE needs one "
                         f"of llama.cpp's splits ({', '.join(LLAMA_CPP_PRE_NAMES)})")
    if ignore_merges is None:
        ignore_merges = bool(json.loads(tokenizer.to_str())["model"].get("ignore_merges", False))
    own_splits = [_pre_split(own, p) for p in PRE_TOKENIZER_PROBES]
    for name in dict.fromkeys([*(n for n in prefer if n in LLAMA_CPP_PRE_NAMES), *LLAMA_CPP_PRE_NAMES]):
        make, candidate_ignores_merges = GGUF_PRE_TOKENIZERS[name]
        if candidate_ignores_merges != ignore_merges:
            continue
        candidate = make()
        if all(_pre_split(candidate, p) == s for p, s in zip(PRE_TOKENIZER_PROBES, own_splits)):
            return name
    raise InputError(f"{source}: its pre-tokenizer splits text like none of llama.cpp's splits that "
                     f"entrenar knows ({', '.join(LLAMA_CPP_PRE_NAMES)}); a GGUF with a wrong "
                     f"tokenizer.ggml.pre would tokenize differently in llama.cpp, so nothing was written")


def _check_byte_level_bpe(j: dict[str, Any], source: str) -> list[str]:
    model = j.get("model") or {}
    if model.get("type") != "BPE":
        raise InputError(f"{source}: tokenizer model is {model.get('type')!r}; the GGUF export writes "
                         f"byte-level BPE (tokenizer.ggml.model gpt2) only")
    if (j.get("decoder") or {}).get("type") != "ByteLevel":
        raise InputError(f"{source}: the tokenizer's decoder is not ByteLevel; only byte-level BPE "
                         f"tokenizers can be exported to GGUF")
    if model.get("byte_fallback"):
        raise InputError(f"{source}: BPE with byte_fallback is SentencePiece-style, not byte-level BPE; "
                         f"it cannot be exported as tokenizer.ggml.model gpt2")
    notes = []
    norm = j.get("normalizer")
    if norm is not None:
        if norm.get("type") != "NFC":
            raise InputError(f"{source}: the tokenizer normalizes text ({norm.get('type')}), which "
                             f"llama.cpp's byte-level BPE does not do; ids would differ")
        notes.append("the tokenizer's NFC normalizer is not applied by llama.cpp (ids differ only on "
                     "non-NFC input)")
    return notes


def tokenizer_meta(chat_tokenizer: Any, vocab_size: int, prefer_pre: tuple[str, ...] = ()) -> TokenizerMeta:
    """GGUF tokenizer metadata from a ChatTokenizer: tokens by id, token types, merges, special ids.
    `prefer_pre`: the family's pre-tokenizer names, tried first (detect_pre_tokenizer)."""
    tok = chat_tokenizer.tokenizer
    source = chat_tokenizer.source or "tokenizer"
    j = json.loads(tok.to_str())
    notes = _check_byte_level_bpe(j, source)
    pre = detect_pre_tokenizer(tok, source, bool(j["model"].get("ignore_merges", False)), prefer_pre)
    merges = [m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]]
    merged = {m.replace(" ", "", 1) for m in merges}
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise InputError(f"{source}: the tokenizer has {n} tokens but the model's embedding only "
                         f"{vocab_size} rows; use the tokenizer that belongs to this model")
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    tokens: list[str | None] = [None] * n
    for text, idx in tok.get_vocab(with_added_tokens=True).items():
        tokens[idx] = text
    holes = [i for i, t in enumerate(tokens) if t is None]
    if holes:
        raise InputError(f"{source}: token ids are not contiguous (no token has id {holes[0]})")
    types = []
    for text in tokens:
        if text in added:
            types.append(3 if added[text] else 4)  # CONTROL / USER_DEFINED
        elif len(text) == 1 or text in merged:
            types.append(1)  # NORMAL: a byte or the result of a merge
        else:
            types.append(5)  # UNUSED: BPE can never produce it (e.g. Qwen's [PAD151665])
    padded = vocab_size - n
    tokens += [f"[PAD{i}]" for i in range(n, vocab_size)]  # as llama.cpp's converter pads
    types += [5] * padded
    eot = chat_tokenizer.eot_id
    return TokenizerMeta(
        pre=pre, tokens=tokens, token_types=types, merges=merges, bos_id=chat_tokenizer.bos_id,
        eos_id=chat_tokenizer.eos_id, pad_id=chat_tokenizer.pad_id, unk_id=chat_tokenizer.unk_id,
        eot_id=eot if eot != chat_tokenizer.eos_id else None, add_bos=chat_tokenizer.add_bos,
        chat_template=chat_tokenizer.chat_template, padded=padded, notes=notes)


# ---- the file ----------------------------------------------------------------------------------
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "bf16": 32}  # gguf.LlamaFileType


def _add_architecture(w: Any, cfg: ModelConfig, export_type: str, name: str) -> None:
    from gguf import GGML_QUANT_VERSION, RopeScalingType

    w.add_type("model")
    if name:
        w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    if cfg.head_dim != cfg.hidden_size // cfg.num_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    if (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type")) == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(_FILE_TYPES[export_type])
    if export_type in ("q8_0", "q4_0"):
        w.add_quantization_version(GGML_QUANT_VERSION)


def _add_tokenizer(w: Any, meta: TokenizerMeta) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta.pre)
    w.add_token_list(meta.tokens)
    w.add_token_types(meta.token_types)
    w.add_token_merges(meta.merges)
    for add, value in ((w.add_bos_token_id, meta.bos_id), (w.add_eos_token_id, meta.eos_id),
                       (w.add_pad_token_id, meta.pad_id), (w.add_unk_token_id, meta.unk_id),
                       (w.add_eot_token_id, meta.eot_id)):
        if value is not None:
            add(int(value))
    w.add_add_bos_token(meta.add_bos)
    w.add_add_eos_token(False)
    if meta.chat_template:
        w.add_chat_template(meta.chat_template)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    # on stderr (stdout carries the result / --json line); silent when stderr is not a terminal
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, disable=None,
                leave=False)


def write_gguf(cfg: ModelConfig, state: dict[str, torch.Tensor], tokenizer: Any, out: str | Path,
               export_type: str = "f16", name: str = "",
               on_tensor: Callable[[PlannedTensor], None] | None = None) -> dict[str, Any]:
    """Write `state` (HF names, our RoPE pairing) and `tokenizer` (a ChatTokenizer) as one GGUF file.

    The file appears under `out` only when complete (fileio.atomic_write). Returns the summary:
    tensors, tensor types, bytes, seconds, MB/s, pre-tokenizer.
    """
    from gguf import GGUFWriter

    from ..fileio import atomic_write

    out = Path(out)
    start = time.perf_counter()
    plan = plan_tensors(cfg, state, export_type)
    meta = tokenizer_meta(tokenizer, cfg.vocab_size, cfg.family.gguf_pre_tokenizers)

    def write(tmp: Path) -> None:
        w = GGUFWriter(tmp, cfg.family.gguf_arch)
        _add_architecture(w, cfg, export_type, name)
        _add_tokenizer(w, meta)
        for p in plan:
            # the shape in torch order; a non-uint8 dtype makes the writer take it as element counts
            w.add_tensor_info(p.name, tuple(p.tensor.shape), np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            with _progress(sum(p.nbytes for p in plan), f"export {out.name}") as bar:
                for p in plan:
                    data = encode_tensor(p.tensor, p.qtype, p.hf_name)
                    assert data.nbytes == p.nbytes, (p.name, data.nbytes, p.nbytes)
                    w.write_tensor_data(data)
                    bar.update(p.nbytes)
                    if on_tensor is not None:
                        on_tensor(p)
        finally:
            w.close()

    atomic_write(out, write)
    seconds = time.perf_counter() - start
    size = out.stat().st_size
    types: dict[str, int] = {}
    for p in plan:
        types[p.qtype.name] = types.get(p.qtype.name, 0) + 1
    return {"out": str(out), "type": export_type, "architecture": cfg.family.gguf_arch,
            "tensors": len(plan), "tensor_types": types, "bytes": size, "seconds": round(seconds, 3),
            "mb_per_s": round(size / 1e6 / seconds, 1) if seconds > 0 else None,
            "pre_tokenizer": meta.pre, "vocab": len(meta.tokens), "vocab_padded": meta.padded,
            "add_bos": meta.add_bos, "chat_template": meta.chat_template is not None, "notes": meta.notes}
