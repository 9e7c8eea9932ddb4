"""Strict loading (GUARD-LOAD), GGUF reading (tiny files written with gguf.GGUFWriter), dtype
preservation, saving, inspect / convert, and bad input (exit 2, one line naming the file)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from entrenar.errors import InputError, LoadError
from entrenar.formats import gguf as ggufmod
from entrenar.formats import load_model, load_state, save_hf_dir
from entrenar.formats.hf import check_state
from entrenar.tensors import rel_l2
from tests.helpers.cli import run_cli
from tests.helpers.models import make_hf_model

Q = gguf.GGMLQuantizationType
_TO_GGUF = {v: k for k, v in ggufmod._GLOBAL_NAMES.items()}
_BLOCK_TO_GGUF = {v: k for k, v in ggufmod._BLOCK_NAMES.items()}


def to_gguf_name(name: str) -> str:
    if name in _TO_GGUF:
        return _TO_GGUF[name]
    parts = name.split(".")  # model.layers.N.<rest>
    return f"blk.{parts[2]}.{_BLOCK_TO_GGUF['.'.join(parts[3:])]}"


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py permute (the forward direction)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2)
            .reshape(w.shape))


def write_gguf(path: Path, hf_model, arch: str | None = None, weight_type: Q = Q.F32,
               types: dict[str, Q] | None = None, permute: bool = True) -> Path:
    """A GGUF file of a transformers model the way llama.cpp writes one (llama Q/K permuted).

    weight_type applies to 2-D tensors; 1-D tensors are F32 as in llama.cpp; `types` overrides by
    HF name. arch defaults to the model's model_type.
    """
    c = hf_model.config
    arch = arch or c.model_type
    head_dim = c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.detach().float()
        if arch == "llama" and permute and ".q_proj." in name:
            t = permute_qk(t, c.num_attention_heads)
        elif arch == "llama" and permute and ".k_proj." in name:
            t = permute_qk(t, c.num_key_value_heads)
        qtype = (types or {}).get(name, weight_type if t.ndim == 2 else Q.F32)
        arr = np.ascontiguousarray(t.numpy())
        if qtype == Q.F32:
            w.add_tensor(to_gguf_name(name), arr)
        elif qtype == Q.F16:
            w.add_tensor(to_gguf_name(name), arr.astype(np.float16))
        else:
            raw = gguf.quants.quantize(arr, qtype)
            w.add_tensor(to_gguf_name(name), raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _ids(vocab: int, seq: int = 17, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(seed))


def _logits_rel(hf_model, ours, seq: int = 17) -> float:
    ids = _ids(ours.cfg.vocab_size, seq)
    with torch.no_grad():
        return rel_l2(ours(ids), hf_model(ids).logits)


# ---- GGUF -------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)])
def test_gguf_f32_matches_transformers(arch, tied, tmp_path):
    """A GGUF written as llama.cpp does (Q/K permuted for llama) loads to transformers' logits."""
    hf_model = make_hf_model(arch, tie_word_embeddings=tied, rms_norm_eps=1e-6, rope_theta=1e6)
    path = write_gguf(tmp_path / "m.gguf", hf_model)
    ours = load_model(path)
    assert ours.cfg.tie_word_embeddings == tied and (ours.lm_head is None) == tied
    assert ours.cfg.attention_bias == (arch == "qwen2")
    assert ours.cfg.rms_norm_eps == 1e-6 and ours.cfg.rope_theta == 1e6
    assert _logits_rel(hf_model, ours) <= 1e-5


def test_gguf_dtypes_and_dequantization(tmp_path):
    """F32/F16/BF16 keep their dtype (BF16 bit for bit); Q8_0 dequantizes to float32, values match
    gguf's own dequantizer; shapes come out in torch order."""
    hf_model = make_hf_model("qwen2", tie_word_embeddings=False)
    types = {"model.layers.0.self_attn.q_proj.weight": Q.F16,
             "model.layers.0.self_attn.k_proj.weight": Q.BF16,
             "model.layers.0.mlp.up_proj.weight": Q.Q8_0,
             "lm_head.weight": Q.Q8_0}
    path = write_gguf(tmp_path / "m.gguf", hf_model, types=types)
    _cfg, state, info = load_state(path)
    sd = hf_model.state_dict()
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float16
    bf = state["model.layers.0.self_attn.k_proj.weight"]
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf.view(torch.int16), sd["model.layers.0.self_attn.k_proj.weight"].bfloat16().view(torch.int16))
    up = state["model.layers.0.mlp.up_proj.weight"]
    assert up.dtype == torch.float32 and tuple(up.shape) == (176, 64)
    want = gguf.quants.dequantize(gguf.quants.quantize(sd["model.layers.0.mlp.up_proj.weight"].numpy(), Q.Q8_0),
                                  Q.Q8_0)
    assert np.array_equal(up.numpy(), want)
    assert 0 < rel_l2(up, sd["model.layers.0.mlp.up_proj.weight"]) < 1e-2  # quantized, but close
    assert info["stored_dtypes"]["lm_head.weight"] == "Q8_0"
    assert info["stored_dtypes"]["model.layers.0.self_attn.k_proj.weight"] == "BF16"
    assert load_model(path).model.embed_tokens.weight.dtype == torch.float32  # quantized file -> fp32


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0], ids=lambda q: q.name)
def test_legacy_quants_dequantize_like_gguf_bit_for_bit(qtype, tmp_path):
    """Q8_0/Q4_0/Q4_1/Q5_0 are dequantized by our torch code (formats/gguf.py, not gguf.quants' per-16-rows numpy
    loop): the weights of a file quantized to the type, and blocks of random bytes (any scale, any code, and
    more than one chunk), equal gguf.quants.dequantize bit for bit (NaN where it gives NaN)."""
    hf_model = make_hf_model("qwen2", tie_word_embeddings=False)
    quantized = {n for n, t in hf_model.state_dict().items() if t.ndim == 2 and t.shape[-1] % 32 == 0}
    path = write_gguf(tmp_path / "m.gguf", hf_model, types=dict.fromkeys(quantized, qtype))
    _cfg, state, info = load_state(path)
    checked = 0
    for name, t in hf_model.state_dict().items():
        if name in quantized:
            assert info["stored_dtypes"][name] == qtype.name
            want = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(t.float().numpy()), qtype), qtype)
            assert state[name].dtype == torch.float32 and np.array_equal(state[name].numpy().view(np.uint32),
                                                                         want.view(np.uint32)), name
            checked += 1
    assert checked >= 8
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = 3 * ggufmod._DEQUANT_CHUNK + 5
    raw = np.random.default_rng(0).integers(0, 256, size=(blocks, size), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.dequantize(raw.reshape(1, -1), qtype).reshape(blocks, 32)
    got = ggufmod._dequant_torch(raw, qtype.name, (blocks, 32)).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.where(np.isnan(got), 0, got).view(np.uint32), np.where(np.isnan(want), 0, want).view(np.uint32))


def bf16_gguf_roundtrip_ok(tmp_path: Path) -> bool:
    """BF16 stored in a GGUF reads back bit for bit as bfloat16."""
    hf_model = make_hf_model("llama")
    path = write_gguf(tmp_path / "bf16.gguf", hf_model, weight_type=Q.BF16)
    _, state, _ = load_state(path)
    ref = hf_model.state_dict()["model.layers.1.mlp.down_proj.weight"].bfloat16()
    got = state["model.layers.1.mlp.down_proj.weight"]
    return got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_gguf_bf16_read_bit_exact(tmp_path):
    assert bf16_gguf_roundtrip_ok(tmp_path)


# ---- HF directories -------------------------------------------------------------------------
def bf16_hf_roundtrip_ok(tmp_path: Path, tiny_hf_dir) -> bool:
    """bf16 HF dir -> load (stays bf16) -> save -> load: every tensor bit for bit, dtype bf16."""
    _, src = tiny_hf_dir("qwen2", dtype=torch.bfloat16, tie_word_embeddings=False)
    first = load_model(src)
    if next(first.parameters()).dtype != torch.bfloat16:
        return False
    out = tmp_path / "resaved"
    save_hf_dir(first, out)
    on_disk = load_file(str(out / "model.safetensors"))
    original = load_file(str(src / "model.safetensors"))
    if set(on_disk) != set(original):
        return False
    for k, v in original.items():
        if on_disk[k].dtype != torch.bfloat16 or not torch.equal(on_disk[k].view(torch.int16), v.view(torch.int16)):
            return False
    second = load_model(out)
    return all(b.dtype == torch.bfloat16 and torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(first.state_dict().values(), second.state_dict().values()))


def test_bf16_hf_roundtrip_bit_exact(tmp_path, tiny_hf_dir):
    assert bf16_hf_roundtrip_ok(tmp_path, tiny_hf_dir)


def test_sharded_hf_dir_loads(tmp_path):
    hf_model = make_hf_model("qwen2")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert _logits_rel(hf_model, load_model(tmp_path / "sharded")) <= 1e-5


def test_saved_dir_loads_in_transformers(tmp_path, tiny_hf_dir):
    """HF dir -> our load -> save -> transformers: same logits; tied head has no lm_head tensor."""
    from transformers import AutoModelForCausalLM

    for arch in ("llama", "qwen2"):
        _, src = tiny_hf_dir(arch, tie_word_embeddings=True)
        ours = load_model(src)
        out = save_hf_dir(ours, tmp_path / f"out-{arch}")
        assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
        assert json.loads((out / "generation_config.json").read_text()).get("eos_token_id") == ours.cfg.eos_token_id
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert _logits_rel(theirs, ours) <= 1e-5


def _edit_state(path: Path, fn) -> None:
    f = path / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f))


def _edit_config(path: Path, **changes) -> None:
    d = json.loads((path / "config.json").read_text())
    d.update(changes)
    (path / "config.json").write_text(json.dumps(d))


def test_strict_missing_unexpected_misshaped(tiny_hf_dir):
    _, path = tiny_hf_dir("llama", tie_word_embeddings=False)
    _edit_state(path, lambda sd: (sd.pop("model.layers.1.mlp.up_proj.weight"),
                                  sd.__setitem__("model.layers.0.extra.weight", torch.ones(3)),
                                  sd.__setitem__("model.norm.weight", torch.ones(65))))
    with pytest.raises(LoadError) as e:
        load_model(path)
    msg = str(e.value)
    assert e.value.guard_id == "GUARD-LOAD" and e.value.exit_code == 2
    assert "model.layers.1.mlp.up_proj.weight" in msg and "missing" in msg
    assert "model.layers.0.extra.weight" in msg and "unexpected" in msg
    assert "model.norm.weight" in msg and "mis-shaped" in msg
    assert str(path) in msg


def test_bias_tensors_with_attention_bias_false_is_an_error(tiny_hf_dir):
    _, path = tiny_hf_dir("qwen2")
    _edit_config(path, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(LoadError, match="attention_bias=false"):
        load_model(path)


def test_lm_head_present_but_tied_is_an_error(tiny_hf_dir):
    _, path = tiny_hf_dir("llama", tie_word_embeddings=False)
    _edit_config(path, tie_word_embeddings=True)
    with pytest.raises(LoadError, match="tie_word_embeddings=true"):
        load_model(path)


def test_untied_without_lm_head_is_an_error(tiny_hf_dir):
    _, path = tiny_hf_dir("llama", tie_word_embeddings=True)
    _edit_config(path, tie_word_embeddings=False)
    with pytest.raises(LoadError, match="no lm_head.weight"):
        load_model(path)


def test_dropped_bias_tensors_are_reported(tiny_hf_dir):
    _, path = tiny_hf_dir("qwen2")
    _edit_state(path, lambda sd: [sd.pop(k) for k in list(sd) if k.endswith("_proj.bias")])
    with pytest.raises(LoadError, match=r"missing: .*q_proj\.bias"):
        load_model(path)


def test_check_state_accepts_exact_state(tiny_hf_dir):
    _, path = tiny_hf_dir("qwen2", tie_word_embeddings=True)
    cfg, state, _ = load_state(path)
    check_state(cfg, state, "x")  # no error
    state["lm_head.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    with pytest.raises(LoadError):
        check_state(cfg, state, "x")


# ---- command line: bad input exits 2 with one line naming the file ----------------------------
def _run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what fixtures printed (progress bars)
    run = run_cli(list(argv), capsys)
    return run[0], run.out, run[2]


def _assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2
    line = err.strip()
    assert line and "\n" not in line, f"expected one line, got {err!r}"
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"


def test_cli_missing_file(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    rc, _, err = _run_cli(capsys, "inspect", str(missing))
    _assert_one_line_error(rc, err, str(missing), "no such file")


def test_cli_truncated_safetensors(tiny_hf_dir, capsys):
    _, path = tiny_hf_dir("llama")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    rc, _, err = _run_cli(capsys, "inspect", str(path))
    _assert_one_line_error(rc, err, str(f), "truncated")


def test_cli_gguf_unknown_architecture(tmp_path, capsys):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, _, err = _run_cli(capsys, "convert", str(path), str(tmp_path / "out"))
    _assert_one_line_error(rc, err, str(path), "'gpt2'", "not supported")
    assert not (tmp_path / "out").exists()


def test_cli_unknown_packaged_name(capsys):
    rc, _, err = _run_cli(capsys, "inspect", "no-such-model-0.1b")
    _assert_one_line_error(rc, err, "no-such-model-0.1b", "not a packaged model")


def test_cli_not_a_gguf_file(tmp_path, capsys):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    rc, _, err = _run_cli(capsys, "inspect", str(path))
    _assert_one_line_error(rc, err, str(path))


# ---- inspect / convert ---------------------------------------------------------------------------
def test_inspect_json_rows(tmp_path, capsys):
    hf_model = make_hf_model("qwen2", tie_word_embeddings=False)
    path = write_gguf(tmp_path / "m.gguf", hf_model, types={"lm_head.weight": Q.Q8_0,
                                                            "model.layers.0.mlp.up_proj.weight": Q.BF16})
    rc, out, _ = _run_cli(capsys, "inspect", str(path), "--json")
    assert rc == 0
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["config"]["architecture"] == "qwen2" and doc["config"]["attention_bias"] is True
    rows = {r["name"]: r for r in doc["tensors"]}
    assert len(rows) == len(hf_model.state_dict())
    assert rows["lm_head.weight"]["dtype"] == "Q8_0" and rows["lm_head.weight"]["shape"] == [256, 64]
    assert rows["model.layers.0.mlp.up_proj.weight"]["dtype"] == "BF16"
    assert rows["model.norm.weight"]["dtype"] == "F32"
    # describe() reads the same names, shapes and stored types without touching tensor data
    assert {r.name: (list(r.shape), r.stored) for r in ggufmod.describe(path)} == {
        n: (r["shape"], r["dtype"]) for n, r in rows.items()}
    deq = load_state(path)[1]["lm_head.weight"].double()  # stats are over dequantized values
    assert rows["lm_head.weight"]["mean"] == pytest.approx(deq.mean().item(), rel=1e-9)
    assert rows["lm_head.weight"]["std"] == pytest.approx(deq.std(unbiased=False).item(), rel=1e-9)
    assert rows["lm_head.weight"]["max"] == deq.max().item()
    rc, out, _ = _run_cli(capsys, "inspect", str(path))  # the table
    assert rc == 0 and "Q8_0" in out and "model.layers.1.self_attn.q_proj.bias" in out


def test_convert_gguf_to_hf_dir_and_dtypes(tmp_path, capsys):
    hf_model = make_hf_model("llama", tie_word_embeddings=False)
    path = write_gguf(tmp_path / "m.gguf", hf_model)
    out = tmp_path / "hf"
    rc, stdout, _ = _run_cli(capsys, "convert", str(path), str(out), "--json")
    assert rc == 0 and json.loads(stdout.strip().splitlines()[-1])["ok"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not (tmp_path / "hf.tmp").exists()
    assert _logits_rel(hf_model, load_model(out)) <= 1e-5
    rc, _, _ = _run_cli(capsys, "convert", str(out), str(tmp_path / "hf-bf16"), "--dtype", "bf16")
    assert rc == 0
    assert {v.dtype for v in load_file(str(tmp_path / "hf-bf16" / "model.safetensors")).values()} == {torch.bfloat16}
    assert next(load_model(tmp_path / "hf-bf16").parameters()).dtype == torch.bfloat16  # dtype None keeps it
    rc, _, err = _run_cli(capsys, "convert", str(path), str(out))  # existing output
    _assert_one_line_error(rc, err, str(out), "exists")


def test_convert_failure_leaves_nothing(tmp_path, capsys, monkeypatch):
    from entrenar import fileio

    hf_model = make_hf_model("llama")
    path = write_gguf(tmp_path / "m.gguf", hf_model)

    def failing_save(*a, **k):
        raise InputError("disk full (simulated)")

    monkeypatch.setattr(fileio, "write_safetensors", failing_save)
    rc, _, err = _run_cli(capsys, "convert", str(path), str(tmp_path / "out"))
    assert rc == 2 and "disk full" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_unknown_gguf_tensor_is_unexpected(tmp_path):
    hf_model = make_hf_model("llama")
    path = tmp_path / "extra.gguf"
    write_gguf(path, hf_model)
    # rewrite with one more tensor llama.cpp would not write for this architecture
    reader = gguf.GGUFReader(path)
    assert reader.tensors
    w = gguf.GGUFWriter(str(tmp_path / "extra2.gguf"), "llama")
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY
                        else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("blk.0.attn_mystery.weight", np.ones((4,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoadError, match="blk.0.attn_mystery.weight"):
        load_model(tmp_path / "extra2.gguf")


# ---- our GGUF parser vs gguf.GGUFReader ------------------------------------------------------
def test_gguf_parser_matches_gguf_reader(tmp_path):
    """Every metadata value type and tensor type we read comes out as gguf.GGUFReader reads it."""
    hf_model = make_hf_model("qwen2", tie_word_embeddings=False)
    path = tmp_path / "m.gguf"
    types = {"model.layers.0.self_attn.q_proj.weight": Q.F16, "model.layers.0.self_attn.k_proj.weight": Q.BF16,
             "model.layers.0.mlp.up_proj.weight": Q.Q8_0, "model.layers.1.mlp.up_proj.weight": Q.Q4_1,
             "model.layers.1.mlp.gate_proj.weight": Q.Q5_0, "lm_head.weight": Q.Q8_0}
    write_gguf(path, hf_model, types=types)
    # a second file with one key of every value type (metadata only)
    meta = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(meta), "qwen2")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-6)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**60))
    w.add_float64("t.f64", 1e-300)
    w.add_string("t.str", "héllo <|im_end|>")
    w.add_array("t.strs", ["a", "", "ĠĠ", "日本"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for f in (path, meta):
        ours, ref = ggufmod.open_reader(f), gguf.GGUFReader(f)
        ref_fields = {k: v.contents() for k, v in ref.fields.items() if not k.startswith("GGUF.")}
        assert set(ours.fields) == set(ref_fields)
        for k, v in ref_fields.items():
            if isinstance(v, float):
                assert ours.fields[k] == pytest.approx(v, rel=1e-7), k
            else:
                assert ours.fields[k] == v, k
        assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
        for a, b in zip(ours.tensors, ref.tensors):
            assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
            assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
            assert np.array_equal(a.data, b.data), a.name


def test_gguf_truncated_is_input_error(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", make_hf_model("llama"))
    path.write_bytes(path.read_bytes()[:-1000])
    rc, _, err = _run_cli(capsys, "inspect", str(path))
    _assert_one_line_error(rc, err, str(path), "truncated")
