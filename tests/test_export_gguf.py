"""`entrenar export gguf`: files our loader, `inspect`, transformers and llama.cpp (llama-cpp-python)
read back with the same weights, the same token ids and the same logits.

Quick suite: tiny random llama / qwen2 models with a byte-level BPE tokenizer trained here.
The packaged models (SmolLM2, Qwen2.5-Coder) are in tests/test_export_real.py (real_model).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from entrenar.config import ModelConfig
from entrenar.errors import InputError
from entrenar.export import export_gguf
from entrenar.formats import gguf_write as gw
from entrenar.formats import load_model, save_hf_dir
from entrenar.formats.gguf import load_gguf, open_reader
from entrenar.model import CausalLM
from entrenar.tensors import rel_l2
from entrenar.tokenizer import QWEN2_SPLIT, ChatTokenizer, load_tokenizer
from tests.helpers.cli import run_cli
from tests.helpers.models import randomize_

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
          "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# 50 strings: code, unicode, whitespace runs, digits, special tokens, chat-templated prompts.
TOKENIZE_STRINGS = [
    "Hello world", " Hello world", "hello  world", "HELLO WORLD!!!", "don't stop", "DON'T STOP",
    "we'll they've I'm you're it's", "12345", "3.14159 2.71828", "0x1F 0b1010 1e-5", "x1y22z333",
    "v2.0.1-rc3", "def f(a, b):\n    return a + b\n", "for i in range(10):\n\tprint(i)\n",
    "if (x == y) { return; }", "class Foo(Bar):\n    pass\n\n\n", "    indented\n        more\n",
    "trailing spaces   ", "   leading", "\n\n\n", "\r\n\r\n", " \t \n", "a\n\nb", "tab\tseparated\tvalues",
    "naïve café résumé", "東京タワーは高い", "Привет, мир!", "안녕하세요", "مرحبا بالعالم", "١٢٣٤ ٥٦",
    "emoji 🙂👍🏽 ok", "©®™ … — –", "ÅÄÖ åäö ß", "ﬁ ligature", "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>", "text<|endoftext|>more text", "<|im_start|><|im_end|>", "<|im_start|> spaced <|im_end|>",
    "$hello (x+y)==z; foo.bar_baz()", "a+b=c", "path/to/file.py:42", "https://example.com/a?b=c&d=e",
    "'quoted' \"double\"", "#include <stdio.h>", "SELECT * FROM t WHERE id = 7;", "λx.x → ∀y∈Y",
    "", " ", "a",
]
assert len(TOKENIZE_STRINGS) == 50

CORPUS = [
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "The quick brown fox jumps over the lazy dog. Don't panic! It's 12:45 and we'll leave at 13:00.",
    "for i in range(100):\n\tif i % 3 == 0:\n\t\tprint('fizz', i)\n",
    "naïve café Привет мир 東京 안녕하세요 مرحبا 🙂 ©",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)  # 12 values\n",
] * 20


def train_tokenizer(out: Path, vocab_size: int = 420, add_bos: bool = False,
                    split: str = "qwen2") -> Path:
    """A byte-level BPE trained here, saved as an HF tokenizer directory (what `entrenar tokenizer
    train` writes): GPT-2 byte alphabet, Qwen2's split regex (or GPT-2's built-in one)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if split == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    chat = ChatTokenizer(tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         add_bos=add_bos, chat_template=CHATML, source=str(out))
    chat.save_hf(out)
    return out


def tiny_cfg(arch: str, vocab_size: int, **kw) -> ModelConfig:
    base = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": arch == "qwen2", "max_position_embeddings": 512, "architecture": arch,
            "attention_bias": arch == "qwen2"}
    base.update(kw)
    return ModelConfig(**base)


def random_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """Every tensor random (norms around 1, biases nonzero) and logits peaked enough that top-1 is
    meaningful: no tensor can be dropped, mis-permuted or mis-typed without changing the logits."""
    torch.manual_seed(seed)
    m = CausalLM(cfg)
    randomize_(m, seed + 1, embed_std=1.0, embed_names=("embed_tokens", "lm_head"))
    with torch.no_grad():
        if not cfg.tie_word_embeddings:
            # an untied head near the embedding: peaked next-token distributions as in trained models
            # (a fully random head has near-ties at many positions, where top-1 is a coin flip)
            m.lm_head.weight.mul_(0.5).add_(m.model.embed_tokens.weight)
    return m.eval()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A tokenizer trained by `entrenar tokenizer train` (LLaMA-3 split, no ignore_merges, ChatML)."""
    from entrenar.tokenizer_train import train_tokenizer as entrenar_train

    root = tmp_path_factory.mktemp("tok")
    for i, text in enumerate(CORPUS[:5]):
        (root / f"doc{i}.txt").write_text(text * 3, encoding="utf-8")
    entrenar_train([str(root / f"doc{i}.txt") for i in range(5)], 420, root / "tokenizer", min_frequency=1)
    return root / "tokenizer"


@pytest.fixture(scope="module")
def bos_tok_dir(tmp_path_factory) -> Path:
    """A second trained tokenizer: Qwen2's split and add_bos=True (BOS = <|endoftext|>)."""
    return train_tokenizer(tmp_path_factory.mktemp("tok-bos") / "tokenizer", add_bos=True)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, tok_dir) -> dict[str, Path]:
    """HF directories of a tiny llama and a tiny qwen2 with the trained tokenizer (vocab padded by 12)."""
    tok = load_tokenizer(tok_dir)
    out = {}
    for i, arch in enumerate(("llama", "qwen2")):
        cfg = tiny_cfg(arch, len(tok) + 12, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                       pad_token_id=tok.pad_id)
        model = random_model(cfg, seed=i)
        out[arch] = save_hf_dir(model, tmp_path_factory.mktemp(arch) / "model", tokenizer=tok)
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_dirs) -> dict[tuple[str, str], Path]:
    """(arch, type) -> exported GGUF, written once per module."""
    root = tmp_path_factory.mktemp("gguf")

    class Lazy(dict):
        def __missing__(self, key):
            arch, typ = key
            path = root / f"{arch}-{typ}.gguf"
            export_gguf(str(tiny_dirs[arch]), path, typ)
            self[key] = path
            return path

    return Lazy()


PROBE = torch.randint(0, 400, (1, 40), generator=torch.Generator().manual_seed(5))


def our_logits(spec, ids=PROBE) -> torch.Tensor:
    model = load_model(spec, dtype=torch.float32)
    with torch.no_grad():
        return model(ids)[0]


# ---- round trips through our loader -------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_round_trip_bit_exact(arch, tiny_dirs, exports):
    src = load_model(tiny_dirs[arch], dtype=torch.float32)
    cfg, state, info = load_gguf(exports[arch, "f32"])
    assert cfg == src.cfg.replace(extra={}, initializer_range=cfg.initializer_range, rope_style="neox")
    ref = src.state_dict()
    assert set(state) == set(ref)
    for k, v in ref.items():
        assert state[k].dtype == torch.float32 and torch.equal(state[k], v), k
    assert info["stored_dtypes"]["model.norm.weight"] == "F32"
    names = [t.name for t in open_reader(exports[arch, "f32"]).tensors]
    assert ("output.weight" in names) == (arch == "llama")  # qwen2 tied: the head written once
    assert names.count("token_embd.weight") == 1
    if arch == "qwen2":
        assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= set(names)


@pytest.mark.parametrize("typ,dtype", [("f16", torch.float16), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f16_bf16_round_trip_to_rounding(arch, typ, dtype, tiny_dirs, exports):
    ref = load_model(tiny_dirs[arch], dtype=torch.float32).state_dict()
    _, state, info = load_gguf(exports[arch, typ])
    for k, v in ref.items():
        if v.dim() == 1:  # norms and biases stay F32
            assert info["stored_dtypes"][k] == "F32" and torch.equal(state[k], v), k
        else:
            assert state[k].dtype == dtype and torch.equal(state[k], v.to(dtype)), k


@pytest.mark.parametrize("typ", ["q8_0", "q4_0"])
def test_quantized_round_trip_equals_gguf_quants(typ, tiny_dirs, exports):
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[typ.upper()]
    ref = load_model(tiny_dirs["llama"], dtype=torch.float32).state_dict()
    _, state, info = load_gguf(exports["llama", typ])
    for k, v in ref.items():
        if v.dim() == 2:
            assert info["stored_dtypes"][k] == typ.upper(), k
            want = quants.dequantize(quants.quantize(v.numpy(), qtype), qtype)
            assert np.array_equal(state[k].numpy(), want), k
            assert rel_l2(state[k], v) < (0.01 if typ == "q8_0" else 0.15), k


def test_inspect_reads_every_export(tiny_dirs, exports):
    for arch in ("llama", "qwen2"):
        for typ in gw.EXPORT_TYPES:
            path = exports[arch, typ]
            result = _run_json(["inspect", str(path), "--json"])
            assert result["ok"] and result["format"] == "gguf"
            assert result["config"]["architecture"] == arch
            assert len(result["tensors"]) == len(open_reader(path).tensors)


def test_gptj_pairing_exports_to_the_same_function(tmp_path, tok_dir):
    """A model whose RoPE pairs adjacent dims (gptj) needs no permutation for llama and the inverse
    one for qwen2; read back (as neox), it computes the same logits."""
    tok = load_tokenizer(tok_dir)
    for arch in ("llama", "qwen2"):
        model = random_model(tiny_cfg(arch, len(tok), rope_style="gptj"), seed=3)
        out = tmp_path / f"{arch}.gguf"
        gw.write_gguf(model.cfg, model.state_dict(), tok, out, "f32")
        with torch.no_grad():
            want = model(PROBE)[0]
        assert rel_l2(our_logits(out), want) < 1e-5, arch


def test_tokenizer_survives_our_reader(tok_dir, exports):
    """The GGUF tokenizer metadata rebuilds (our reader) to the same ids, specials, BOS rule and template."""
    src = load_tokenizer(tok_dir)
    back = load_tokenizer(exports["qwen2", "f16"])
    for s in TOKENIZE_STRINGS:
        assert back.encode(s) == src.encode(s), s
    assert (back.bos_id, back.eos_id, back.pad_id, back.eot_id, back.add_bos) == (
        src.bos_id, src.eos_id, src.pad_id, src.eot_id, src.add_bos)
    assert back.chat_template == src.chat_template and "<|im_start|>" in src.chat_template
    fields = open_reader(exports["qwen2", "f16"]).fields
    # entrenar's trainer: LLaMA-3's split, merges always applied -> llama.cpp's smaug-bpe
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "smaug-bpe"
    types = fields["tokenizer.ggml.token_type"]
    assert [types[src.tokenizer.token_to_id(t)] for t in SPECIALS] == [3, 3, 3]
    assert types[len(src):] == [5] * 12 and fields["tokenizer.ggml.tokens"][-1] == f"[PAD{len(src) + 11}]"
    assert set(types[:len(src)]) == {1, 3}


def bos_model_gguf(tmp_path: Path, bos_tok_dir: Path, typ: str = "f32") -> Path:
    """A tiny llama with the add-BOS tokenizer (Qwen2 split), exported."""
    tok = load_tokenizer(bos_tok_dir)
    model = random_model(tiny_cfg("llama", len(tok), bos_token_id=tok.bos_id, eos_token_id=tok.eos_id), seed=7)
    out = tmp_path / "bos.gguf"
    gw.write_gguf(model.cfg, model.state_dict(), tok, out, typ)
    return out


def test_bos_tokenizer_metadata(tmp_path, bos_tok_dir):
    out = bos_model_gguf(tmp_path, bos_tok_dir)
    fields = open_reader(out).fields
    src = load_tokenizer(bos_tok_dir)
    assert fields["tokenizer.ggml.pre"] == "qwen2" and fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["tokenizer.ggml.bos_token_id"] == src.bos_id
    back = load_tokenizer(out)
    assert back.add_bos and back.encode("hi there")[0] == src.bos_id == back.bos_id
    assert [back.encode(s) for s in TOKENIZE_STRINGS] == [src.encode(s) for s in TOKENIZE_STRINGS]


# ---- pre-tokenizer choice -------------------------------------------------------------------------
@pytest.mark.parametrize("name", gw.LLAMA_CPP_PRE_NAMES)
def test_pre_tokenizer_detected_from_the_split(name):
    from tokenizers import Tokenizer, models

    from entrenar.tokenizer import GGUF_PRE_TOKENIZERS

    make, ignore_merges = GGUF_PRE_TOKENIZERS[name]
    tok = Tokenizer(models.BPE(vocab={"a": 0}, merges=[], ignore_merges=ignore_merges))
    tok.pre_tokenizer = make()
    assert gw.detect_pre_tokenizer(tok) == name


def test_unknown_pre_tokenizer_refused(tmp_path, tok_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # llama.cpp has no such split
    with pytest.raises(InputError, match="splits text like none"):
        gw.detect_pre_tokenizer(tok)


# ---- the command ------------------------------------------------------------------------------
def _run_json(argv: list[str]) -> dict:
    code, result, _ = run_cli(argv, capture=True)
    assert result is not None, f"no JSON line from {argv}"
    result["exit_code_seen"] = code
    return result


def test_cli_export_summary_and_refusals(tmp_path, tiny_dirs):
    out = tmp_path / "m.gguf"
    r = _run_json(["export", "gguf", str(tiny_dirs["llama"]), str(out), "--type", "q8_0", "--json"])
    assert r["ok"] and r["exit_code_seen"] == 0 and out.is_file()
    assert r["tensors"] == len(open_reader(out).tensors) and r["bytes"] == out.stat().st_size
    assert r["tensor_types"] == {"F32": 5, "Q8_0": 16} and r["pre_tokenizer"] == "smaug-bpe"
    assert r["seconds"] > 0 and r["mb_per_s"] > 0
    again = _run_json(["export", "gguf", str(tiny_dirs["llama"]), str(out), "--json"])
    assert again["exit_code_seen"] == 2 and "already exists" in again["error"]
    # a missing directory of OUT is made (CLI-OUT-PARENTS; it was exit 2 "does not exist; create it first")
    missing = _run_json(["export", "gguf", str(tiny_dirs["llama"]), str(tmp_path / "no" / "x.gguf"), "--json"])
    assert missing["exit_code_seen"] == 0 and (tmp_path / "no" / "x.gguf").is_file(), missing


def test_convert_to_gguf_path_writes_a_gguf_file(tmp_path, tiny_dirs):
    """Issue 18 item 5: `convert MODEL x.gguf` made a directory named x.gguf; it now exports."""
    out = tmp_path / "merged.gguf"
    r = _run_json(["convert", str(tiny_dirs["qwen2"]), str(out), "--dtype", "bf16", "--json"])
    assert r["ok"] and r["dispatched_to"] == "export gguf" and r["type"] == "bf16"
    assert out.is_file() and not out.is_dir()
    assert load_gguf(out)[2]["stored_dtypes"]["model.layers.0.mlp.up_proj.weight"] == "BF16"


def test_model_without_tokenizer_needs_tokenizer_flag(tmp_path, tok_dir):
    model = random_model(tiny_cfg("llama", len(load_tokenizer(tok_dir))))
    bare = save_hf_dir(model, tmp_path / "bare")
    r = _run_json(["export", "gguf", str(bare), str(tmp_path / "a.gguf"), "--json"])
    assert r["exit_code_seen"] == 2 and "--tokenizer" in r["error"] and not (tmp_path / "a.gguf").exists()
    r = _run_json(["export", "gguf", str(bare), str(tmp_path / "a.gguf"), "--tokenizer", str(tok_dir), "--json"])
    assert r["ok"] and (tmp_path / "a.gguf").is_file()


def test_tokenizer_larger_than_embedding_refused(tmp_path, tok_dir):
    tok = load_tokenizer(tok_dir)
    model = random_model(tiny_cfg("llama", len(tok) - 1))
    with pytest.raises(InputError, match="tokenizer has .* tokens but the model's embedding"):
        gw.write_gguf(model.cfg, model.state_dict(), tok, tmp_path / "x.gguf", "f16")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_export_leaves_no_file(tmp_path, tiny_dirs):
    """Killed half-way (an exception after the first tensor): neither OUT nor a temporary file remains."""
    model = load_model(tiny_dirs["llama"], dtype=torch.float32)
    tok = load_tokenizer(tiny_dirs["llama"])
    seen = []

    def boom(p):
        seen.append(p.name)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gw.write_gguf(model.cfg, model.state_dict(), tok, tmp_path / "x.gguf", "f16", on_tensor=boom)
    assert seen == ["token_embd.weight"] and list(tmp_path.iterdir()) == []


def test_nonfinite_weights_refused(tmp_path, tiny_dirs):
    model = load_model(tiny_dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    tok = load_tokenizer(tiny_dirs["llama"])
    with pytest.raises(InputError, match="NaN/Inf in model.layers.1.mlp.up_proj.weight"):
        gw.write_gguf(model.cfg, model.state_dict(), tok, tmp_path / "x.gguf", "f32")
    assert list(tmp_path.iterdir()) == []


def test_f16_overflow_refused_with_remedy(tmp_path, tiny_dirs):
    model = load_model(tiny_dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1e6
    tok = load_tokenizer(tiny_dirs["llama"])
    with pytest.raises(InputError, match="beyond F16's range.*--type bf16"):
        gw.write_gguf(model.cfg, model.state_dict(), tok, tmp_path / "x.gguf", "f16")
    gw.write_gguf(model.cfg, model.state_dict(), tok, tmp_path / "x.gguf", "bf16")


def test_tensor_types_follow_llama_cpp_rules():
    """1-D tensors stay F32; a row that is not a multiple of the 32-wide block falls back to F16."""
    from gguf import GGMLQuantizationType as T

    assert gw.ggml_type("q4_0", torch.zeros(64)) == T.F32
    assert gw.ggml_type("q8_0", torch.zeros(64, 176)) == T.F16
    assert gw.ggml_type("q8_0", torch.zeros(176, 64)) == T.Q8_0
    assert gw.ggml_type("bf16", torch.zeros(3, 5)) == T.BF16
    assert gw.ggml_type("f32", torch.zeros(3, 5)) == T.F32


def test_unexportable_configs_refused():
    with pytest.raises(InputError, match="qk-norm"):
        gw.check_exportable(tiny_cfg("llama", 300, qk_norm=True))
    with pytest.raises(InputError, match="qwen2 architecture in GGUF"):
        gw.check_exportable(tiny_cfg("llama", 300, attention_bias=True))
    with pytest.raises(InputError, match="llama3"):
        gw.check_exportable(tiny_cfg("llama", 300, rope_scaling={"rope_type": "llama3", "factor": 8.0}))


# ---- transformers reads our f16 export ----------------------------------------------------------
def test_transformers_loads_f16_export(tiny_dirs, exports):
    from transformers import AutoModelForCausalLM

    for arch in ("llama", "qwen2"):
        path = exports[arch, "f16"]
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        assert hf.config.model_type == arch
        with torch.no_grad():
            theirs = hf(PROBE).logits[0]
        assert rel_l2(theirs, our_logits(tiny_dirs[arch])) <= 1e-2, arch  # f16 rounding only


# ---- llama.cpp (llama-cpp-python) as the client ---------------------------------------------------
def llama_cpp(path: Path, n_ctx: int = 256, vocab_only: bool = False, f32_cache: bool = False):
    """llama.cpp on the file, CPU, 1 thread, every position's logits kept. Its KV cache is f16 by
    default (relL2 ~2e-4 on its own); f32_cache keeps K/V in f32 for the f32 comparison.

    One thread as each pytest worker has one core (Makefile WORKERS): with 2 threads on a busy 2-core machine
    llama.cpp's threads wait on each other (24 greedy tokens of SmolLM2 f32: 53-70 s with 2, 4-5 s with 1)."""
    from llama_cpp import GGML_TYPE_F32, Llama

    cache = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_cache else {}
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=1,
                 n_threads_batch=1, logits_all=True, vocab_only=vocab_only, flash_attn=False,
                 verbose=False, **cache)


def llama_cpp_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))


def llama_cpp_greedy(llm, prompt_ids: list[int], n: int, stop_ids: set[int]) -> list[int]:
    """Greedy continuation by argmax over llama.cpp's logits (no sampler in between)."""
    llm.reset()
    llm.eval(prompt_ids)
    out: list[int] = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        if nxt in stop_ids:
            break
        llm.eval([nxt])
    return out


def llama_cpp_tokenize(llm, text: str) -> list[int]:
    """llama.cpp's ids; add_bos=True means "as the model's add-BOS flag says"; special tokens parsed."""
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()


# relL2 of llama.cpp's logits vs our forward on the source weights (the bounds) ...
SOURCE_BOUNDS = {"f32": 1e-4, "f16": 1e-2, "bf16": 1e-2}
# ... and vs our forward on the weights as stored in the file (dequantized): what is left is llama.cpp's
# own arithmetic (f16 KV cache; activations quantized to 8 bits in q8_0/q4_0 matmuls, ~1e-2 measured)
STORED_BOUNDS = {"f32": 1e-4, "f16": 1e-2, "bf16": 1e-2, "q8_0": 3e-2, "q4_0": 3e-2}
LONG_PROBE = torch.randint(0, 400, (1, 200), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("typ", gw.EXPORT_TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpp_logits_match_ours(arch, typ, tiny_dirs, exports):
    """Full forward of a 200-token prompt: llama.cpp on our file vs our model."""
    ids = LONG_PROBE[0].tolist()
    source = our_logits(tiny_dirs[arch], LONG_PROBE)
    stored = our_logits(exports[arch, typ], LONG_PROBE)
    theirs = llama_cpp_logits(llama_cpp(exports[arch, typ], f32_cache=typ == "f32"), ids)
    assert theirs.shape == source.shape
    if typ in SOURCE_BOUNDS:
        assert rel_l2(theirs, source) <= SOURCE_BOUNDS[typ], (arch, typ, rel_l2(theirs, source))
    assert rel_l2(theirs, stored) <= STORED_BOUNDS[typ], (arch, typ, rel_l2(theirs, stored))
    if typ in ("f32", "f16", "q8_0"):
        assert agreement(source, theirs) >= 0.99, (arch, typ, agreement(source, theirs))


def test_llama_cpp_tokenizes_like_us_trained_tokenizer(tok_dir, exports):
    ours = load_tokenizer(tok_dir)
    llm = llama_cpp(exports["llama", "f16"], vocab_only=True)
    for s in TOKENIZE_STRINGS:
        assert llama_cpp_tokenize(llm, s) == ours.encode(s), s
    chat = ours.encode_chat([{"role": "user", "content": "def f(x):\n    return 2 * x"}],
                            add_generation_prompt=True)
    text = ours.render_chat([{"role": "user", "content": "def f(x):\n    return 2 * x"}], True).text
    assert llama_cpp_tokenize(llm, text) == chat.ids


def test_llama_cpp_tokenizes_like_us_bos_tokenizer(tmp_path, bos_tok_dir):
    """Qwen2 split and add_bos=True: llama.cpp prepends BOS exactly when we do."""
    ours = load_tokenizer(bos_tok_dir)
    llm = llama_cpp(bos_model_gguf(tmp_path, bos_tok_dir), vocab_only=True)
    for s in TOKENIZE_STRINGS:
        assert llama_cpp_tokenize(llm, s) == ours.encode(s), s
    assert llama_cpp_tokenize(llm, "x")[0] == ours.bos_id


def lora_finetune(base: Path, out: Path, qlora: bool, steps: int = 10) -> Path:
    """A real (tiny) LoRA / QLoRA fine-tune: AdamW on one chat until its answer is learned, saved as
    a PEFT adapter recording `base`."""
    from entrenar import peft

    tok = load_tokenizer(base)
    model = load_model(base, dtype=torch.float32)
    peft.apply_lora(model, rank=4, alpha=8, quantize_nf4=qlora, seed=0)
    chat = tok.encode_chat([{"role": "user", "content": "say a poem"},
                            {"role": "assistant", "content": "roses are red, violets are blue"}])
    ids = torch.tensor([chat.ids])
    labels = torch.tensor([chat.ids[1:] + [-100]])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    model.train()
    for _ in range(steps):
        loss_sum, n = model(ids, labels=labels)
        (loss_sum / n).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    return peft.save_adapter(model, out, str(base))


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_adapter_export_generates_like_generate_adapter(qlora, tmp_path, tiny_dirs):
    base = tiny_dirs["llama"]
    adapter = lora_finetune(base, tmp_path / "adapter", qlora)
    prompt = "say a poem"
    ours = _run_json(["generate", "--model", str(base), "--adapter", str(adapter), "--prompt", prompt,
                      "--chat", "--max-new-tokens", "24", "--device", "cpu", "--json"])
    assert ours["ok"]
    without = _run_json(["generate", "--model", str(base), "--prompt", prompt, "--chat",
                         "--max-new-tokens", "24", "--device", "cpu", "--json"])
    assert without["token_ids"] != ours["token_ids"]  # the fine-tune changed the answer
    out = tmp_path / "merged.gguf"
    r = _run_json(["export", "gguf", str(base), str(out), "--adapter", str(adapter), "--type", "f32", "--json"])
    assert r["ok"] and r["adapters_merged"] == 14
    tok = load_tokenizer(base)
    text = tok.render_chat([{"role": "user", "content": prompt}], add_generation_prompt=True).text
    llm = llama_cpp(out)
    prompt_ids = llama_cpp_tokenize(llm, text)
    assert prompt_ids == tok.encode_rendered(text)
    assert llama_cpp_greedy(llm, prompt_ids, 24, tok.stop_ids) == ours["token_ids"]
    # the adapter directory as MODEL (a LoRA run's final/): merged onto the base it recorded, same file
    same = _run_json(["export", "gguf", str(adapter), str(tmp_path / "a.gguf"), "--type", "f32", "--json"])
    assert same["ok"] and same["adapters_merged"] == 14
    a, b = load_gguf(out)[1], load_gguf(tmp_path / "a.gguf")[1]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def llama_cpp_quantize(src: Path, out: Path, typ: str) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, `pure`: every 2-D tensor to the one type)."""
    import ctypes

    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = {"q8_0": lc.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": lc.LLAMA_FTYPE_MOSTLY_Q4_0}[typ]
    params.pure = True
    params.nthread = 2
    assert lc.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


def assert_same_tensor_bytes(ours: Path, theirs: Path) -> None:
    a = {t.name: t for t in open_reader(ours).tensors}
    b = {t.name: t for t in open_reader(theirs).tensors}
    assert set(a) == set(b)
    for name, t in a.items():
        assert t.tensor_type == b[name].tensor_type, (name, t.tensor_type, b[name].tensor_type)
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(b[name].data).view(np.uint8)), name


@pytest.mark.parametrize("typ", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_export_is_llama_cpp_quantize_byte_for_byte(arch, typ, exports, tmp_path):
    """Our q8_0/q4_0 tensors are exactly what llama.cpp's quantizer makes from our f32 export: any
    logit difference left is llama.cpp's own quantized arithmetic, not the export."""
    theirs = llama_cpp_quantize(exports[arch, "f32"], tmp_path / "theirs.gguf", typ)
    assert_same_tensor_bytes(exports[arch, typ], theirs)
