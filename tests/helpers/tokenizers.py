"""Tiny tokenizers shared by the tests: GGUF-style byte-level metadata with a few merges and ChatML
(tiny_tokenizer), transformers' tokenizers of the packaged GGUFs (cached on disk), bytes as ids
(ByteTokenizer, for `data pack`), a word-level vocabulary (WordTokenizer)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from entrenar.tokenizer import BYTE_TO_UNICODE, tokenizer_from_gguf_metadata

SMOLLM = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


# ---- tiny byte-level vocabulary in GGUF metadata form ------------------------------------------
def tiny_meta(pre: str = "qwen2", add_bos: bool | None = False, chat_template: str | None = CHATML,
              bos: str = "<|endoftext|>") -> dict:
    """256 byte tokens, a few merges (incl. "1 2", which only a digit-joining split can use), three
    control tokens and one user-defined token, as tokenizer.ggml.* metadata."""
    tokens = [BYTE_TO_UNICODE[b] for b in range(256)]
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ġ"),
                 ("e", "r"), ("Ġ", "a"), ("1", "2"), ("Ġ", "1")]:
        merges.append(f"{a} {b}")
        if a + b not in tokens:
            tokens.append(a + b)
    types = [1] * len(tokens)
    specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)]
    for tok, kind in specials:
        tokens.append(tok)
        types.append(kind)
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": tokens.index(bos),
            "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
            "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>")}
    if add_bos is not None:
        meta["tokenizer.ggml.add_bos_token"] = add_bos
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


def tiny_tokenizer(**kw):
    return tokenizer_from_gguf_metadata(tiny_meta(**kw), "tiny.gguf")


# ---- transformers reference tokenizers (built from the GGUF once, then cached on disk) ------------
_HF_CACHE: dict[str, object] = {}


def hf_gguf_tokenizer(name: str):
    """transformers' tokenizer loaded from the packaged GGUF (AutoTokenizer(..., gguf_file=...)).

    Building it parses the GGUF in Python (tens of seconds for Qwen), so its save_pretrained copy is
    kept under the entrenar cache, keyed by file size/mtime and the transformers version."""
    if name in _HF_CACHE:
        return _HF_CACHE[name]
    import transformers
    from transformers import AutoTokenizer

    from entrenar.model_spec import cache_dir, packaged_path

    path = packaged_path(name)
    st = path.stat()
    d = cache_dir() / "test-fixtures" / f"hf-gguf-tokenizer-{name}-{st.st_size}-{st.st_mtime_ns}-" \
                                         f"tf{transformers.__version__}"
    if not (d / "tokenizer.json").is_file():
        built = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        built.save_pretrained(tmp)
        reloaded = AutoTokenizer.from_pretrained(str(tmp))
        probe = "def f(x):\n\t return x  + 12345 # ünï <|im_end|>\n\n"
        assert reloaded(probe)["input_ids"] == built(probe)["input_ids"], "save_pretrained changed the ids"
        if not d.exists():
            os.replace(tmp, d)
    _HF_CACHE[name] = AutoTokenizer.from_pretrained(str(d))
    return _HF_CACHE[name]


STDLIB = Path(json.__file__).parent  # json/*.py: ~40 kB of text


def _byte_tokenizers_model():
    """A real tokenizers.Tokenizer whose ids are the UTF-8 bytes (no merges), eos 256, bos 257:
    `data pack` stores it with the shards, and pretrain loads it from there."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in BYTE_TO_UNICODE.items()}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<bos>", special=True)])
    return tok


class ByteTokenizer:
    """Bytes as ids 0..255, eos 256, bos 257: enough for `data pack` (which saves `.tokenizer`)."""

    eos_id, bos_id, pad_id, add_bos = 256, 257, None, False

    def __init__(self) -> None:
        self.tokenizer = _byte_tokenizers_model()

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def __len__(self) -> int:
        return 258


WORDS = [f"w{i}" for i in range(40)]


class WordTokenizer:
    """The ChatTokenizer attributes pack() uses, over a real word-level tokenizers.Tokenizer."""

    def __init__(self, vocab_size: int = 64, add_bos: bool = False):
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        vocab.update({w: i + 3 for i, w in enumerate(WORDS)})
        for i in range(len(vocab), vocab_size):
            vocab[f"x{i}"] = i
        self.tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        self.tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        self.bos_id, self.eos_id, self.pad_id, self.add_bos = 1, 2, 2, add_bos

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if add_special and self.add_bos else []) + ids

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size()


# ---- transformers reference models of the packaged GGUFs (converted by transformers once, then cached) ------
_HF_MODELS: dict[str, object] = {}


def hf_gguf_model(path: Path, fresh: bool = False):
    """transformers' own model of a GGUF (AutoModelForCausalLM(..., gguf_file=...), fp32, eval mode): the oracle
    of the real-model parity tests. transformers dequantizes the GGUF in numpy (minutes for Qwen on a loaded
    2-core runner, and six test files need it), so its save_pretrained copy is kept under the entrenar cache,
    keyed by the file's size/mtime and the transformers version, built once under a file lock (the pytest
    workers) and checked tensor for tensor against the model it was saved from. One object per process: do not
    modify it; ``fresh=True`` loads a new one from the saved copy for a caller that changes it (verify's HFPath
    switches it to eager attention)."""
    key = str(path)
    if key in _HF_MODELS and not fresh:
        return _HF_MODELS[key]
    import fcntl

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from entrenar.model_spec import cache_dir

    st = path.stat()
    d = cache_dir() / "test-fixtures" / f"hf-gguf-model-{path.stem}-{st.st_size}-{st.st_mtime_ns}-" \
                                         f"tf{transformers.__version__}"
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / ".hf-gguf-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / "config.json").is_file():
            built = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
            tmp = d.with_name(d.name + f".tmp{os.getpid()}")
            tmp.mkdir()
            # transformers will not save_pretrained a model it loaded from a GGUF (its quantizer flag): the fp32
            # tensors it dequantized and its config, without that flag, are what it loads back
            from safetensors.torch import save_file

            config = copy.deepcopy(built.config)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(tmp)
            a = built.state_dict()
            save_file({k: v.detach().clone().contiguous() for k, v in a.items()}, str(tmp / "model.safetensors"),
                      metadata={"format": "pt"})
            reloaded = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
            b = reloaded.state_dict()
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the saved copy differs"
            os.replace(tmp, d)
            if not fresh:
                _HF_MODELS[key] = built
                return built
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    if not fresh:
        _HF_MODELS[key] = model
    return model
