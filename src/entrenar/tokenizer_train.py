"""A byte-level BPE tokenizer for from-scratch pretraining (`entrenar tokenizer train`: cli/tokenizer.py).

Pre-tokenization is LLaMA-3's split (tiktoken's cl100k pattern; Qwen2 uses the same one but with
single digits) followed by GPT-2's byte-to-character map:

  (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\\r\\n\\p{L}\\p{N}]?\\p{L}+ | \\p{N}{1,3}
  | ?[^\\s\\p{L}\\p{N}]+[\\r\\n]* | \\s*[\\r\\n]+ | \\s+(?!\\S) | \\s+

Why this one for a code-heavy corpus: ``\\s+(?!\\S)`` leaves indentation runs as their own pieces
(so 4/8/12 spaces become single tokens, and the word after them keeps its one leading space);
``[^\\r\\n\\p{L}\\p{N}]?\\p{L}+`` lets a word take one leading symbol (``_name``, ``.append``),
which GPT-2's ``' ?\\p{L}+'`` does not; punctuation runs keep their trailing newlines (``):\\n``);
numbers are split into groups of at most three digits, so at most 1,110 number tokens exist
and arithmetic-like text is not memorised as long digit strings (Qwen2's one-digit split costs
~1.5x more tokens on numeric text at our vocabulary sizes). Case-insensitive contractions avoid
GPT-2's ``'S`` vs ``'s`` asymmetry. The split never joins characters across a newline that is
followed by a letter, so corpus.split_safely's cut points stay token boundaries.

All 256 byte symbols are in the initial alphabet, so every string encodes (no unknown token)
and ``decode(encode(text)) == text`` for any text (no normalizer, no prefix space). Special
tokens: ``<|endoftext|>`` (id 0: EOS between documents, padding), ``<|im_start|>`` and
``<|im_end|>`` (ChatML turns; ``<|im_end|>`` ends an assistant turn). No BOS is added: EOS
already separates packed documents. The chat template is ChatML.

Training streams the inputs (``sources``: the same kinds as `data pack`), so memory is bounded
by the trainer's word counts, not the corpus; the result depends only on the texts in input
order, so the same input gives a byte-identical tokenizer.json.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import InputError

SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
EOS_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
# the largest --vocab-size: 4x the largest real vocabularies (Gemma's 262k). The trainer allocates for the
# requested size up front, so --vocab-size 1000000000 aborted in Rust after a 70 GB allocation (rc 134).
MAX_VOCAB = 1 << 20
BLOCK_BYTES = 1 << 20  # a larger text file is fed to the trainer in blocks of about this size


def build_empty_tokenizer():
    """The untrained tokenizers.Tokenizer: BPE model, LLaMA-3 split + byte-level, byte-level decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def iter_corpus(files: list[Path], skipped: Any, strict: bool, bar: Any = None) -> Iterator[str]:
    """Every document (or block of a big text file) of the inputs, in order. A file that cannot
    be read or decoded is skipped and counted (strict: InputError). A file's texts are yielded as
    they are read, so a file that fails late has already contributed its first texts to the counts:
    the tokenizer is still deterministic for the same input."""
    from .data.corpus import _SAFE_CUT_BYTES
    from .data.sources import SkippedFile, iter_file_texts

    for path in files:
        try:
            for text, _ in iter_file_texts(path, BLOCK_BYTES, _SAFE_CUT_BYTES):
                if bar is not None:
                    bar.update(len(text.encode("utf-8", "surrogatepass")))
                yield text
        except SkippedFile as e:
            skipped.add(path, str(e))
            if strict:
                raise skipped.strict_error("no tokenizer was written") from None


def train_tokenizer(inputs: list[str], vocab_size: int, out_dir: str | Path, *, min_frequency: int = 2,
                    strict: bool = False, overwrite: bool = False, progress: bool = False) -> dict[str, Any]:
    """Train on the inputs and write tokenizer.json, tokenizer_config.json and special_tokens_map.json
    into ``out_dir`` (atomically). Returns a report (vocab size, files, skipped inputs, seconds)."""
    from tokenizers import pre_tokenizers, trainers

    from .data.sources import SkipReport, expand_inputs
    from .fileio import atomic_dir
    from .tokenizer import ChatTokenizer, save_tokenizer_files

    if vocab_size < MIN_VOCAB:
        raise InputError(f"--vocab-size {vocab_size} is too small: the 256 byte tokens and "
                         f"{len(SPECIAL_TOKENS)} special tokens alone need {MIN_VOCAB}")
    if vocab_size > MAX_VOCAB:
        raise InputError(f"--vocab-size {vocab_size} is more than {MAX_VOCAB:,}: real tokenizers have 32k-262k "
                         f"tokens (LLaMA 32,000; Qwen2 151,936); choose one of that size (a typo?)")
    if min_frequency < 1:
        raise InputError(f"--min-frequency must be >= 1, got {min_frequency}")
    out = Path(out_dir)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        if not overwrite:
            raise InputError(f"{out}: already exists; choose another --out, or pass --overwrite to replace it")
        from .outpaths import check_replaceable
        from .tokenizer import TOKENIZER_FILES

        # only a previous tokenizer directory: a model or run directory also holds a tokenizer.json
        check_replaceable(out, "tokenizer train", TOKENIZER_FILES.__contains__, required="tokenizer.json")
    from .outpaths import check_creatable

    check_creatable(out, "--out")  # under /proc or read-only: exit 2 before training (issue 38 item 8)
    files = expand_inputs(inputs)
    total = sum(f.stat().st_size for f in files if f.exists())
    tok = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    skipped = SkipReport()
    t0 = time.perf_counter()
    from tqdm import tqdm

    texts = {"usable": 0}

    def counted(blocks: Iterator[str]) -> Iterator[str]:
        for text in blocks:
            if not texts["usable"] and not text.isspace() and text:
                texts["usable"] = 1
            yield text

    with tqdm(total=total, unit="B", unit_scale=True, desc="read", disable=not progress, file=sys.stderr) as bar:
        tok.train_from_iterator(counted(iter_corpus(files, skipped, strict, bar)), trainer=trainer)
    seconds = time.perf_counter() - t0
    if skipped.count == len(files):
        raise InputError(f"no readable input: all {len(files)} files were skipped ({'; '.join(skipped.listed[:5])})")
    if not texts["usable"]:  # was a "successful" tokenizer of the byte alphabet alone (issue 28 item 9)
        raise InputError(f"no text to learn from: the {len(files)} input file(s) hold only empty or whitespace "
                         f"documents ({skipped.count} skipped); no tokenizer was written. Add text files, JSONL "
                         f"rows with a \"text\" field or Parquet with a text column")
    chat = ChatTokenizer(tok, bos_token=None, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, eot_token=IM_END,
                         add_bos=False, chat_template=CHATML_TEMPLATE, source=str(out))
    import shutil

    with atomic_dir(out) as tmp:
        files_written = save_tokenizer_files(chat, tmp)
        if out.exists():  # --overwrite (checked above), replaced only now that the new one is complete
            shutil.rmtree(out)
    return {"out": str(out), "vocab_size": len(chat), "requested_vocab_size": vocab_size,
            "merges": len(tok.get_vocab()) - MIN_VOCAB, "files": files_written, "inputs": len(files),
            "input_bytes": total, "skipped": skipped.to_dict(), "seconds": seconds,
            "special_tokens": {t: chat.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS},
            "pre_tokenizer": "llama3 split + byte-level"}
