"""Operator mutants of src/entrenar/formats/gguf_write.py and gguf.py (targets gguf-export and gguf-read in
tools/mutation_targets.yaml) that the round-trip tests did not see. Oracles outside our code: the `gguf`
package (llama.cpp's Python writer, reader and enums), transformers' forward on the same weights, and the
GGUF spec (versions 2 and 3, alignment, tensor data offsets)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from entrenar.errors import InputError
from entrenar.formats import gguf_write as gw
from entrenar.formats import load_model
from entrenar.formats.gguf import load_gguf, open_reader
from entrenar.tensors import rel_l2
from entrenar.tokenizer import ChatTokenizer, load_tokenizer
from tests.helpers.models import make_hf_model
from tests.test_export_gguf import random_model, tiny_cfg, train_tokenizer
from tests.test_loading import permute_qk, to_gguf_name

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> ChatTokenizer:
    return load_tokenizer(train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer"))


def _fields(path: Path) -> dict:
    """Metadata as gguf.GGUFReader (llama.cpp's Python reader) sees it."""
    return {k: v.contents() for k, v in gguf.GGUFReader(path).fields.items()}


# ---- export: the metadata llama.cpp reads ---------------------------------------------------------
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}


@pytest.mark.parametrize("typ", list(FILE_TYPES))
def test_export_metadata_is_what_llama_cpp_reads(typ, tok, tmp_path):
    cfg = tiny_cfg("llama", len(tok) + 3, rope_theta=1e6, max_position_embeddings=777)
    out = tmp_path / "m.gguf"
    gw.write_gguf(cfg, random_model(cfg).state_dict(), tok, out, typ, name="tiny-test")
    f = _fields(out)
    assert f["general.type"] == "model" and f["general.name"] == "tiny-test"
    assert f["general.file_type"] == FILE_TYPES[typ]
    if typ in ("q8_0", "q4_0"):
        assert f["general.quantization_version"] == gguf.GGML_QUANT_VERSION
    else:
        assert "general.quantization_version" not in f
    assert f["llama.vocab_size"] == cfg.vocab_size and f["llama.context_length"] == 777
    assert f["llama.rope.freq_base"] == 1e6 and f["llama.rope.dimension_count"] == cfg.head_dim == 16
    assert (f["llama.block_count"], f["llama.attention.head_count"], f["llama.attention.head_count_kv"]) == (2, 4, 2)
    assert "llama.rope.scaling.type" not in f


def test_export_head_dim_other_than_hidden_over_heads(tok, tmp_path):
    """head_dim 32 with hidden 64 / 4 heads: llama.cpp would assume 16 unless key_length and value_length say 32."""
    cfg = tiny_cfg("llama", len(tok), head_dim=32)
    model = random_model(cfg, seed=2)
    out = tmp_path / "m.gguf"
    gw.write_gguf(cfg, model.state_dict(), tok, out, "f32")
    f = _fields(out)
    assert f["llama.attention.key_length"] == f["llama.attention.value_length"] == 32
    assert f["llama.rope.dimension_count"] == 32
    back = load_model(out, dtype=torch.float32)
    assert back.cfg.head_dim == 32
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_export_linear_rope_scaling_is_written_as_llama_cpp_keys(tok, tmp_path):
    cfg = tiny_cfg("llama", len(tok), rope_scaling={"rope_type": "linear", "factor": 4.0})
    out = tmp_path / "m.gguf"
    gw.write_gguf(cfg, random_model(cfg).state_dict(), tok, out, "f16")
    f = _fields(out)
    assert f["llama.rope.scaling.type"] == gguf.RopeScalingType.LINEAR.value and f["llama.rope.scaling.factor"] == 4.0
    assert load_gguf(out)[0].rope_scaling == {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize("typ", ["f16", "bf16"])
def test_nan_in_a_half_precision_export_is_named_as_nan_not_overflow(typ, tok, tmp_path):
    cfg = tiny_cfg("llama", len(tok))
    state = random_model(cfg).state_dict()
    state["model.layers.0.mlp.gate_proj.weight"][1, 2] = float("nan")
    with pytest.raises(InputError, match="NaN/Inf in model.layers.0.mlp.gate_proj.weight"):
        gw.write_gguf(cfg, state, tok, tmp_path / "x.gguf", typ)
    assert list(tmp_path.iterdir()) == []


def test_planning_the_tensors_refuses_an_unexportable_model(tok):
    cfg = tiny_cfg("llama", len(tok), qk_norm=True)
    with pytest.raises(InputError, match="qk-norm"):
        gw.plan_tensors(cfg, random_model(cfg).state_dict(), "f16")


# ---- export: token types (gguf.TokenType, as llama.cpp's converter assigns them) ----------------------
def _handmade_tokenizer(source: str) -> ChatTokenizer:
    """Byte-level BPE: the 256 byte symbols, one merge ("a b" -> "ab"), one entry no merge makes ("xyz"),
    two special (control) tokens -- end of sequence <|end|> and end of turn <|im_end|> -- and one added
    non-special (user-defined) token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["ab"], vocab["xyz"] = len(vocab), len(vocab) + 1
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("<|end|>", special=True), AddedToken("<|im_end|>", special=True)])
    t.add_tokens([AddedToken("<tool>", special=False)])
    return ChatTokenizer(t, bos_token=None, eos_token="<|end|>", eot_token="<|im_end|>", pad_token=None,
                         add_bos=False, chat_template=None, source=source)


def test_token_types_are_llama_cpps(tmp_path):
    T = gguf.TokenType
    chat = _handmade_tokenizer(str(tmp_path))
    n = chat.tokenizer.get_vocab_size(with_added_tokens=True)
    meta = gw.tokenizer_meta(chat, n + 2)
    kind = dict(zip(meta.tokens, meta.token_types))
    assert kind["a"] == kind["Ġ"] == kind["ab"] == T.NORMAL
    assert kind["xyz"] == T.UNUSED  # in the vocabulary, but no merge produces it
    assert kind["<|end|>"] == kind["<|im_end|>"] == T.CONTROL and kind["<tool>"] == T.USER_DEFINED
    assert meta.tokens[n:] == [f"[PAD{n}]", f"[PAD{n + 1}]"] and meta.token_types[n:] == [T.UNUSED] * 2
    assert meta.padded == 2 and len(meta.tokens) == len(meta.token_types) == n + 2


def test_vocabulary_mismatch_names_the_tokenizer_source(tmp_path):
    chat = _handmade_tokenizer(str(tmp_path / "my-tokenizer"))
    n = chat.tokenizer.get_vocab_size(with_added_tokens=True)
    with pytest.raises(InputError, match=f"^{tmp_path / 'my-tokenizer'}: the tokenizer has {n} tokens"):
        gw.tokenizer_meta(chat, n - 1)
    with pytest.raises(InputError, match=f"^tokenizer: the tokenizer has {n} tokens"):
        gw.tokenizer_meta(_handmade_tokenizer(""), n - 1)


def test_end_of_turn_other_than_end_of_sequence_is_written(tmp_path):
    """llama.cpp stops a chat turn at tokenizer.ggml.eot_token_id: an end-of-turn token that is not EOS
    (ChatML's <|im_end|> next to <|end|>) must be in the file."""
    chat = _handmade_tokenizer(str(tmp_path))
    cfg = tiny_cfg("llama", chat.tokenizer.get_vocab_size(with_added_tokens=True))
    out = tmp_path / "m.gguf"
    gw.write_gguf(cfg, random_model(cfg).state_dict(), chat, out, "f16")
    f = _fields(out)
    end, im_end = chat.tokenizer.token_to_id("<|end|>"), chat.tokenizer.token_to_id("<|im_end|>")
    assert f["tokenizer.ggml.eos_token_id"] == end and f["tokenizer.ggml.eot_token_id"] == im_end != end


# ---- reading: files written by gguf.GGUFWriter the way llama.cpp's converter does ---------------------
def llama_cpp_style_gguf(path: Path, hf_model, extra: Callable[[gguf.GGUFWriter], None] = lambda w: None,
                         skip: tuple[str, ...] = (), alignment: int | None = None) -> Path:
    """A llama GGUF (Q/K permuted, F32) of a transformers model; `skip` leaves metadata keys out, `extra`
    adds more."""
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    keys = {"block_count": lambda: w.add_block_count(c.num_hidden_layers),
            "context_length": lambda: w.add_context_length(c.max_position_embeddings),
            "embedding_length": lambda: w.add_embedding_length(c.hidden_size),
            "feed_forward_length": lambda: w.add_feed_forward_length(c.intermediate_size),
            "head_count": lambda: w.add_head_count(c.num_attention_heads),
            "head_count_kv": lambda: w.add_head_count_kv(c.num_key_value_heads),
            "freq_base": lambda: w.add_rope_freq_base(c.rope_parameters["rope_theta"]),
            "rms_eps": lambda: w.add_layer_norm_rms_eps(c.rms_norm_eps)}
    for name, add in keys.items():
        if name not in skip:
            add()
    extra(w)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if ".q_proj." in name:
            t = permute_qk(t, c.num_attention_heads)
        elif ".k_proj." in name:
            t = permute_qk(t, c.num_key_value_heads)
        w.add_tensor(to_gguf_name(name), np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits_rel(hf_model, path: Path) -> float:
    ours = load_model(path, dtype=torch.float32)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return rel_l2(ours(ids), hf_model(ids).logits)


def test_gguf_versions_2_and_3_are_read_others_refused(tmp_path):
    """GGUF v2 and v3 differ only in v3's big-endian support: a little-endian v3 file with its version
    field set to 2 is a valid v2 file (gguf.GGUFReader reads both)."""
    hf = make_hf_model("llama")
    v3 = llama_cpp_style_gguf(tmp_path / "v3.gguf", hf)
    data = bytearray(v3.read_bytes())
    assert data[4:8] == (3).to_bytes(4, "little")
    for version in (1, 2, 4):
        data[4:8] = version.to_bytes(4, "little")
        path = tmp_path / f"v{version}.gguf"
        path.write_bytes(bytes(data))
        if version == 2:
            gguf.GGUFReader(path)
            assert open_reader(path).version == 2 and _logits_rel(hf, path) < 1e-5
        else:
            with pytest.raises(InputError, match=f"GGUF version {version} not supported"):
                open_reader(path)


@pytest.mark.parametrize("alignment", [8, 64])
def test_custom_alignment_places_the_tensor_data(alignment, tmp_path):
    hf = make_hf_model("llama")
    path = llama_cpp_style_gguf(tmp_path / "m.gguf", hf, alignment=alignment)
    assert _fields(path)["general.alignment"] == alignment
    ref = gguf.GGUFReader(path)
    ours = open_reader(path)
    for a, b in zip(ours.tensors, ref.tensors):
        assert np.array_equal(a.data, b.data), a.name
    assert _logits_rel(hf, path) < 1e-5


def test_last_tensor_ending_exactly_at_the_end_of_the_file_is_read(tmp_path):
    """A file whose last tensor's data ends on its last byte is complete; one byte less is truncated."""
    hf = make_hf_model("llama")
    path = llama_cpp_style_gguf(tmp_path / "m.gguf", hf)
    ref = gguf.GGUFReader(path)
    last = max(ref.tensors, key=lambda t: t.data_offset)
    end = last.data_offset + last.n_bytes
    assert end <= path.stat().st_size
    path.write_bytes(path.read_bytes()[:end])  # any padding after it cut off
    assert _logits_rel(hf, path) < 1e-5
    path.write_bytes(path.read_bytes()[:end - 1])
    with pytest.raises(InputError, match="extends past the end of the file"):
        open_reader(path)


def test_linear_rope_scaling_is_read_to_transformers_logits(tmp_path):
    hf = make_hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})

    def scaling(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    path = llama_cpp_style_gguf(tmp_path / "m.gguf", hf, extra=scaling)
    cfg, _, _ = load_gguf(path)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert _logits_rel(hf, path) < 1e-5


def test_missing_freq_base_is_llama_cpps_default_10000(tmp_path):
    hf = make_hf_model("llama", rope_theta=10000.0)
    path = llama_cpp_style_gguf(tmp_path / "m.gguf", hf, skip=("freq_base",))
    assert "llama.rope.freq_base" not in _fields(path)
    assert load_gguf(path)[0].rope_theta == 10000.0
    assert _logits_rel(hf, path) < 1e-5


@pytest.mark.parametrize("key,value", [("value_length", 32), ("dimension_count", 8)])
def test_unequal_head_dims_are_refused(key, value, tmp_path):
    hf = make_hf_model("llama")

    def add(w):
        (w.add_value_length if key == "value_length" else w.add_rope_dimension_count)(value)

    path = llama_cpp_style_gguf(tmp_path / "m.gguf", hf, extra=add)
    with pytest.raises(InputError, match="partial RoPE / unequal head dims are not supported"):
        load_gguf(path)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
def test_loaded_tensors_own_their_memory(qtype, tmp_path):
    """The state dict must not be a view of the file's memory map: a file rewritten in place afterwards
    (convert writing over its input, a download resuming) would change the loaded weights."""
    hf = make_hf_model("llama")
    from tests.test_loading import write_gguf

    path = write_gguf(tmp_path / "m.gguf", hf, weight_type=qtype)
    _, state, info = load_gguf(path)
    name = "model.layers.0.mlp.up_proj.weight"
    assert info["stored_dtypes"][name] == qtype.name
    before = {k: v.clone() for k, v in state.items()}
    size = path.stat().st_size
    with open(path, "r+b") as fh:  # the same inode, overwritten: a shared mapping would see it
        fh.seek(size // 2)
        fh.write(b"\x7f" * (size - size // 2))
    assert all(torch.equal(state[k], v) for k, v in before.items())
    state[name].add_(1.0)  # writable, and the file is not touched
