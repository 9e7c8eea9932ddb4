"""Tokenizer: ids identical to transformers' tokenizer built from the same GGUF, special tokens
whole, BOS only when the metadata says, ids range-checked, save_hf round trip through AutoTokenizer.

The tiny GGUF-style metadata and the cached transformers reference tokenizers are tests/helpers/tokenizers.py's.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from entrenar import tokenizer as tokmod
from entrenar.errors import InputError
from entrenar.tokenizer import load_tokenizer, tokenizer_from_gguf_metadata
from tests.helpers.tokenizers import CHATML, QWEN, SMOLLM, hf_gguf_tokenizer, tiny_meta, tiny_tokenizer


def stdlib_texts(n_files: int = 240, head_chars: int = 4096) -> list[tuple[str, str]]:
    """(name, text): the first `head_chars` of `n_files` stdlib sources spread over the tree, plus
    three whole files (unicode tables, tabs, long whitespace runs, digits)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    step = max(1, len(files) // n_files)
    chosen = files[::step][:n_files]
    out = [(str(p.relative_to(root)), p.read_text(encoding="utf-8", errors="replace")[:head_chars])
           for p in chosen]
    for rel in ("textwrap.py", "encodings/cp1252.py", "this.py"):
        p = root / rel
        out.append((rel + " (whole)", p.read_text(encoding="utf-8")))
    return out


TRANSCRIPTS = [
    ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
     "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"),
    "<|im_start|>user\nWrite `def f(x): return x**2` in Rust.\n\n\tThanks   a lot<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<|im_end|><|im_start|>",
    "<|im_start|><|im_end|>  <|im_start|>\n\n\n<|im_end|>ünïcödé — 日本語 🙂 1234567",
    "no special tokens at all, just 3.14159 and   spaces\r\n",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|im_end|>",
    "<|im_start|>assistant\n<|im_start|> is not nested<|im_end|>\n<|endoftext|><|endoftext|>",
]


def smollm_reference_pre_tokenizer():
    """SmolLM2's own tokenizer.json pre-tokenizer (and llama.cpp's `smollm`): each digit isolated,
    then GPT-2's byte-level split. transformers' GGUF loader ignores tokenizer.ggml.pre = smollm
    and uses the GPT-2 split alone, which differs on whitespace before a digit."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def reference_ids(name: str, text: str) -> list[int]:
    ref = hf_gguf_tokenizer(name)
    return ref(text)["input_ids"]


@pytest.fixture(scope="module")
def smollm_tok():
    return load_tokenizer(SMOLLM)


@pytest.fixture(scope="module")
def qwen_tok():
    return load_tokenizer(QWEN)


@pytest.fixture(scope="module")
def corpus():
    return stdlib_texts()


# ---- real vocabularies vs transformers ----------------------------------------------------------
def _mismatches(ours, ref, texts) -> list[str]:
    bad = []
    for name, text in texts:
        if ours.encode(text) != ref(text)["input_ids"]:
            bad.append(name)
    return bad


def test_qwen_ids_match_transformers_on_stdlib_and_transcripts(qwen_tok, corpus):
    ref = hf_gguf_tokenizer(QWEN)
    assert len(corpus) >= 200
    texts = corpus + [(f"transcript {i}", t) for i, t in enumerate(TRANSCRIPTS)]
    assert _mismatches(qwen_tok, ref, texts) == []
    assert len(qwen_tok) == len(ref) == 151936


def test_smollm_ids_match_transformers_on_stdlib_and_transcripts(smollm_tok, corpus):
    """Vocabulary, merges and special tokens as transformers reads them from the GGUF; the split
    is SmolLM2's own (transformers' GGUF path drops it, see smollm_reference_pre_tokenizer)."""
    from transformers import AutoTokenizer

    hf_gguf_tokenizer(SMOLLM)  # builds the cached copy
    ref = AutoTokenizer.from_pretrained(str(_cached_dir(SMOLLM)))
    ref.backend_tokenizer.pre_tokenizer = smollm_reference_pre_tokenizer()
    texts = corpus + [(f"transcript {i}", t) for i, t in enumerate(TRANSCRIPTS)]
    assert _mismatches(smollm_tok, ref, texts) == []
    assert len(smollm_tok) == len(ref) == 49152


def _cached_dir(name: str) -> Path:
    ref = hf_gguf_tokenizer(name)
    return Path(ref.name_or_path)


def test_smollm_splits_digits_like_llama_cpp(smollm_tok):
    # llama.cpp SMOLLM: "\p{N}" then GPT-2's regex. "x  12" -> "x", "  ", "1", "2": the double space
    # stays one piece (GPT-2's regex alone would give " " and " 12").
    pieces = [p for p, _ in smollm_tok.tokenizer.pre_tokenizer.pre_tokenize_str("x  12")]
    assert pieces == ["x", "ĠĠ", "1", "2"]
    # and transformers' unmodified GGUF tokenizer agrees everywhere no digit follows whitespace
    ref = hf_gguf_tokenizer(SMOLLM)
    text = "def f(x):\n    return x + y  # no digits here\n\tdone"
    assert smollm_tok.encode(text) == ref(text)["input_ids"]


def test_wrong_pre_tokenizer_is_caught(qwen_tok, corpus, monkeypatch):
    """Mutation: build Qwen's vocabulary with GPT-2's split instead of qwen2's -> ids differ."""
    monkeypatch.setitem(tokmod.GGUF_PRE_TOKENIZERS, "qwen2", tokmod.GGUF_PRE_TOKENIZERS["gpt2"])
    mutated = load_tokenizer(QWEN)
    assert _mismatches(mutated, hf_gguf_tokenizer(QWEN), corpus[:60]), "GPT-2 split went unnoticed"


def test_decode_round_trips_stdlib(qwen_tok, smollm_tok, corpus):
    for tok in (qwen_tok, smollm_tok):
        for name, text in corpus[:80]:
            assert tok.decode(tok.encode(text)) == text, name


def test_packaged_special_tokens(qwen_tok, smollm_tok):
    assert (qwen_tok.eos_id, qwen_tok.eot_id, qwen_tok.pad_id, qwen_tok.add_bos) == (151645, 151645, 151643, False)
    assert (smollm_tok.eos_id, smollm_tok.eot_id, smollm_tok.add_bos) == (2, 2, False)
    for tok in (qwen_tok, smollm_tok):
        ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
        assert ids[0] == tok.tokenizer.token_to_id("<|im_start|>")
        assert ids[-1] == tok.eot_id
        assert tok.decode(ids, skip_special=True) == "user\nhi"


# ---- special tokens, BOS, ids -------------------------------------------------------------------
def test_special_tokens_are_single_and_unsplit():
    tok = tiny_tokenizer()
    im_start, im_end = tok.tokenizer.token_to_id("<|im_start|>"), tok.tokenizer.token_to_id("<|im_end|>")
    ids = tok.encode("a<|im_start|>user\nthe<|im_end|>b<tool_call>")
    assert ids.count(im_start) == 1 and ids.count(im_end) == 1
    assert tok.tokenizer.token_to_id("<tool_call>") in ids
    assert tok.decode(ids) == "a<|im_start|>user\nthe<|im_end|>b<tool_call>"
    # control tokens are special (skipped on request), the user-defined one is not
    assert tok.decode(ids, skip_special=True) == "auser\ntheb<tool_call>"


def test_special_token_split_mutation_is_caught(monkeypatch):
    """Mutation: treat control tokens as ordinary vocabulary -> '<|im_start|>' splits into bytes."""
    monkeypatch.setattr(tokmod, "TOKEN_CONTROL", -1)
    tok = tiny_tokenizer()
    ids = tok.encode("<|im_start|>user")
    assert tok.tokenizer.token_to_id("<|im_start|>") not in ids
    assert len(ids) > 2


def test_bos_only_when_metadata_says():
    off, absent, on = tiny_tokenizer(add_bos=False), tiny_tokenizer(add_bos=None), tiny_tokenizer(add_bos=True)
    assert off.encode("the") == absent.encode("the") == on.encode("the", add_special=False)
    assert on.encode("the") == [on.bos_id] + off.encode("the")
    assert on.encode("the").count(on.bos_id) == 1


def test_unsupported_pre_tokenizer_is_input_error():
    for pre in ("falcon", "", None):
        meta = tiny_meta()
        if pre is None:
            del meta["tokenizer.ggml.pre"]
        else:
            meta["tokenizer.ggml.pre"] = pre
        with pytest.raises(InputError, match="tokenizer.ggml.pre"):
            tokenizer_from_gguf_metadata(meta, "x.gguf")
    meta = tiny_meta()
    meta["tokenizer.ggml.model"] = "llama"
    with pytest.raises(InputError, match="tokenizer.ggml.model"):
        tokenizer_from_gguf_metadata(meta, "x.gguf")


@pytest.mark.parametrize("pre", ["qwen2", "smollm", "llama-bpe", "gpt2"])
def test_pre_tokenizers_split_as_named(pre):
    tok = tiny_tokenizer(pre=pre)
    pieces = [p for p, _ in tok.tokenizer.pre_tokenizer.pre_tokenize_str("x  1234 ab")]
    expected = {
        "qwen2": ["x", "Ġ", "Ġ", "1", "2", "3", "4", "Ġab"],
        "smollm": ["x", "ĠĠ", "1", "2", "3", "4", "Ġab"],
        "llama-bpe": ["x", "Ġ", "Ġ", "123", "4", "Ġab"],
        "gpt2": ["x", "Ġ", "Ġ1234", "Ġab"],
    }[pre]
    assert pieces == expected
    # the "1 2" merge is reachable only where digits are not isolated
    twelve = tok.tokenizer.token_to_id("12")
    assert (twelve in tok.encode("12")) == (pre in ("llama-bpe", "gpt2"))


def test_check_ids_rejects_out_of_range():
    tok = tiny_tokenizer()
    tok.check_ids([0, 5, 99], vocab_size=100)
    with pytest.raises(InputError, match="out of range"):
        tok.check_ids([0, 100], vocab_size=100)
    with pytest.raises(InputError, match="out of range"):
        tok.check_ids([-1], vocab_size=100)
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    with pytest.raises(InputError, match=f"token id {im_end}"):
        tok.check_ids(tok.encode("hi<|im_end|>"), vocab_size=im_end)


# ---- save_hf -> transformers AutoTokenizer -------------------------------------------------------
@pytest.mark.parametrize("add_bos", [False, True])
def test_save_hf_loads_in_transformers_with_same_ids(tmp_path, add_bos):
    from transformers import AutoTokenizer

    tok = tiny_tokenizer(add_bos=add_bos)
    tok.save_hf(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TRANSCRIPTS + ["the  12 in\n\nthe"]:
        assert hf(text)["input_ids"] == tok.encode(text), text
    assert hf.chat_template == CHATML
    msgs = [{"role": "user", "content": "the 12"}, {"role": "assistant", "content": "in"}]
    ref = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    ours = tok.encode_chat(msgs).ids
    # transformers tokenizes a rendered chat without special tokens; ours adds the model's one BOS
    assert ours == ([tok.bos_id] if add_bos else []) + list(ref)
    again = load_tokenizer(tmp_path)
    assert again.add_bos == add_bos and again.eot_id == tok.eot_id and again.chat_template == CHATML
    assert again.encode(TRANSCRIPTS[1]) == tok.encode(TRANSCRIPTS[1])


def test_packaged_save_hf_round_trip(tmp_path, qwen_tok, smollm_tok, corpus):
    from transformers import AutoTokenizer

    for tok in (qwen_tok, smollm_tok):
        out = tmp_path / str(len(tok))
        tok.save_hf(out)
        hf = AutoTokenizer.from_pretrained(str(out))
        for name, text in corpus[:40] + [("t", t) for t in TRANSCRIPTS]:
            assert hf(text)["input_ids"] == tok.encode(text), name
        assert len(hf) == len(tok)
