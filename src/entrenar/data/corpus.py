"""Pretraining corpus: text files -> flat token shards + index.json, and the window loader over them.

Layout of a packed directory:
  index.json                 format, dtype, tokenizer identity, source hash, per-split counts + shards
  train-00000.bin ...        little-endian uint16 (vocab < 65536) or uint32 token ids, memory-mapped
  train.docs.bin             uint64 start offset of every document in the split's token stream
  val-00000.bin, val.docs.bin (when --val-fraction > 0)

  tokenizer.json, tokenizer_config.json, special_tokens_map.json: the tokenizer itself (sha256 of
                             each in index.json), so training needs nothing of the packing machine

Each document is ``[bos] + encode(text) + [eos]`` (bos only for tokenizers that add one), so EOS
separates documents. A document goes to val when a hash of (seed, its text) falls below the val
fraction: the split is deterministic, independent of file order, and identical texts share a split.

Inputs are read by ``sources`` (text, .py, JSONL, JSONL.gz, Parquet); a file that cannot be read
or decoded is skipped whole, counted and listed (``strict``: exit 2, nothing written). Files are
grouped into tasks of about TASK_BYTES; ``workers`` > 1 encodes tasks in spawned processes and the
main process writes their results in task order, so the shards are byte-identical to workers=1.
Memory per task is bounded by the tokens of its files (a file's tokens are kept until the file
was read to its end, so a file that fails late leaves nothing behind). The pack is built in a
temporary sibling directory renamed into place at the end (fileio.atomic_dir).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import GuardError, InputError
from ..fileio import atomic_dir, atomic_write, describe_path, sha256_file
from ..outpaths import check_creatable, check_replaceable
from ..tensors import IGNORE_INDEX, positions_from_doc_ids
from .epochs import EpochCursor
from .sources import ALL_SUFFIXES, SkippedFile, SkipReport, expand_inputs, iter_file_texts

__all__ = ["FORMAT", "PretrainLoader", "expand_inputs", "pack", "read_index", "split_safely"]

FORMAT = "entrenar-token-shards-v1"
TEXT_SUFFIXES = ALL_SUFFIXES  # every input kind a directory is searched for
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB uint16 / 256 MiB uint32 per shard
# the smallest --shard-tokens the command accepts: `--shard-tokens 7` (a typo) wrote 13,638 files for a
# 95k-token corpus (issue 28 item 8). The library takes any size >= 1 (tests shard tiny corpora).
MIN_SHARD_TOKENS = 1 << 16
# Memory is bounded by these (tokenizers needs ~40x the text size while encoding): ~100 MB peak.
ENCODE_BATCH_CHARS = 1 << 20  # encode ~1 MB of text per call (parallel over its pieces)
PIECE_CHARS = 1 << 16  # a longer document is encoded in pieces of about this size ...
BIG_DOC_BYTES = 1 << 20  # ... and a text file larger than this is read in blocks of this size
# ... cut only after a single newline between a non-space character and an ASCII letter: the
# byte-level BPE pre-tokenizers (GPT-2/SmolLM split whitespace runs, Qwen2 glues newlines to the
# punctuation before them) never join a token across such a point, so the pieces encode to exactly
# the tokens of the whole text (tested with both packaged tokenizers).
MAX_GROWTH = 16  # how far past its size a block may grow looking for a safe cut
_SAFE_CUT = re.compile(r"(?<=\S)\n(?=[A-Za-z])")
_SAFE_CUT_BYTES = re.compile(rb"(?<=\S)\n(?=[A-Za-z])")
TASK_BYTES = 1 << 20  # input files are grouped into encode tasks of about this size


class TextEncoder(Protocol):
    eos_id: int | None
    bos_id: int | None
    add_bos: bool

    def encode(self, text: str, add_special: bool = True) -> list[int]: ...

    def __len__(self) -> int: ...


# ---- encoding --------------------------------------------------------------------------------------
def _last_safe_cut(data: Any, pattern: re.Pattern, start: int = 0, end: int | None = None) -> int | None:
    last = None
    for m in pattern.finditer(data, start, len(data) if end is None else end):
        last = m.end()
    return last


def split_safely(text: str, piece_chars: int) -> list[str]:
    """Pieces of about piece_chars, cut only at safe points; a text without one stays whole."""
    pieces, start = [], 0
    while len(text) - start > piece_chars:
        window_end = start + piece_chars
        cut = _last_safe_cut(text, _SAFE_CUT, start + 1, window_end)
        if cut is None:  # no safe point in this window: take the next one (blocks bound the size)
            m = _SAFE_CUT.search(text, window_end)
            if m is None:
                break
            cut = m.end()
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _doc_in_val(text: str, seed: int, val_fraction: float) -> bool:
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < val_fraction


def _batch_encoder(tokenizer: TextEncoder) -> Callable[[list[str]], list[list[int]]]:
    """Plain encoding (no special tokens) of many texts; tokenizers' parallel batch path when there."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "encode_batch"):
        batch = getattr(inner, "encode_batch_fast", inner.encode_batch)  # fast: no offsets, less memory
        return lambda texts: [e.ids for e in batch(texts, add_special_tokens=False)]
    return lambda texts: [tokenizer.encode(t, add_special=False) for t in texts]


@dataclass
class _Context:
    """What an encode task needs; pickled once into each worker process."""

    tokenizer: Any
    bos: list[int]
    eos: list[int]
    vocab: int
    dtype: str
    seed: int
    val_fraction: float


@dataclass
class _Doc:
    split: str
    chunks: list[np.ndarray] = field(default_factory=list)


@dataclass
class _FileResult:
    """One input file's documents, per split: all tokens concatenated and each document's length."""

    path: str
    size: int = 0
    sha256: str = ""
    skipped: str | None = None
    empty: int = 0
    docs: list[_Doc] = field(default_factory=list)
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


class _Encoder:
    """Batches pieces of many documents into one encode call (tokenizers parallelises inside it)."""

    def __init__(self, ctx: _Context):
        self.ctx, self.encode_batch = ctx, _batch_encoder(ctx.tokenizer)
        self.pending: list[tuple[_FileResult, _Doc, str]] = []
        self.chars = 0

    def add(self, result: _FileResult, doc: _Doc, pieces: list[str]) -> None:
        self.pending.extend((result, doc, p) for p in pieces)
        self.chars += sum(len(p) for p in pieces)
        if self.chars >= ENCODE_BATCH_CHARS:
            self.flush()

    def drop(self, result: _FileResult) -> None:
        self.pending = [item for item in self.pending if item[0] is not result]

    def flush(self) -> None:
        if not self.pending:
            return
        encoded = self.encode_batch([p for _, _, p in self.pending])
        for (_, doc, _), ids in zip(self.pending, encoded):
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= self.ctx.vocab):
                raise InputError(f"tokenizer produced id {int(arr.max())} outside its vocab {self.ctx.vocab}")
            doc.chunks.append(arr.astype(self.ctx.dtype))
        self.pending.clear()
        self.chars = 0


def _read_file(path: Path, result: _FileResult, encoder: _Encoder, ctx: _Context) -> None:
    """Queue every document of one file; raises SkippedFile (the caller drops what was queued)."""
    try:
        result.size = path.stat().st_size
        result.sha256 = sha256_file(path)
    except OSError as e:
        raise SkippedFile(f"{path}: cannot be read ({e.strerror or e})") from None
    current: _Doc | None = None
    for text, continues in iter_file_texts(path, BIG_DOC_BYTES, _SAFE_CUT_BYTES, MAX_GROWTH):
        if continues and current is not None:  # a big text file's next block: the first block chose the split
            encoder.add(result, current, split_safely(text, PIECE_CHARS))
            continue
        if not text.strip():
            result.empty += 0 if continues else 1
            current = None
            continue
        if continues:  # a big file whose first blocks were blank: not empty after all
            result.empty -= 1
        current = _Doc("val" if _doc_in_val(text, ctx.seed, ctx.val_fraction) else "train")
        result.docs.append(current)
        encoder.add(result, current, split_safely(text, PIECE_CHARS))


def _encode_task(paths: list[str], ctx: _Context) -> list[_FileResult]:
    """Read and encode a group of files; a file that fails is returned with its skip reason only."""
    encoder = _Encoder(ctx)
    results = []
    for p in paths:
        result = _FileResult(p)
        results.append(result)
        try:
            _read_file(Path(p), result, encoder, ctx)
        except SkippedFile as e:
            encoder.drop(result)
            result.skipped, result.docs, result.empty = str(e), [], 0
    encoder.flush()
    bos, eos = np.asarray(ctx.bos, dtype=ctx.dtype), np.asarray(ctx.eos, dtype=ctx.dtype)
    for result in results:
        for split in SPLITS:
            docs = [np.concatenate([bos, *d.chunks, eos]) for d in result.docs if d.split == split]
            if docs:
                result.splits[split] = (np.concatenate(docs), np.asarray([len(d) for d in docs], dtype=np.int64))
        result.docs = []  # only the concatenated arrays travel back from a worker
    return results


_WORKER_CONTEXT: _Context | None = None


def _init_worker(ctx: _Context) -> None:
    global _WORKER_CONTEXT
    # one thread per process: --workers N means N busy cores, not N x tokenizers' thread pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_CONTEXT = ctx


def _worker_task(paths: list[str]) -> list[_FileResult]:
    assert _WORKER_CONTEXT is not None
    return _encode_task(paths, _WORKER_CONTEXT)


def _tasks(files: list[Path]) -> list[list[str]]:
    """Consecutive files grouped to about TASK_BYTES (a larger file is a task of its own)."""
    tasks: list[list[str]] = []
    size = 0
    for f in files:
        try:
            n = f.stat().st_size
        except OSError:
            n = 0  # the task reports it as unreadable
        if not tasks or (size + n > TASK_BYTES and tasks[-1]):
            tasks.append([])
            size = 0
        tasks[-1].append(str(f))
        size += n
    return tasks


def _run_tasks(tasks: list[list[str]], ctx: _Context, workers: int) -> Iterator[list[_FileResult]]:
    """Results in task order, from this process (workers=1) or a pool of spawned processes."""
    if workers <= 1 or len(tasks) <= 1:
        for t in tasks:
            yield _encode_task(t, ctx)
        return
    import multiprocessing

    # spawn, not fork: a forked child inherits tokenizers' thread pool in an undefined state
    with multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(ctx,)) as pool:
        yield from pool.imap(_worker_task, tasks)


# ---- writing shards -------------------------------------------------------------------------------
class _SplitWriter:
    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.tokens = self.documents = 0
        self._file = None
        self._in_shard = 0
        self._docs = open(out / f"{split}.docs.bin", "wb")  # noqa: SIM115 (open across calls)

    def _open_shard(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.out / name, "wb")  # noqa: SIM115 (open across calls)
        self.shards.append({"file": name, "tokens": 0})
        self._in_shard = 0

    def write_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        starts = self.tokens + np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.uint64)
        self._docs.write(starts.astype("<u8").tobytes())
        self.documents += len(lengths)
        self.write(tokens)

    def write(self, ids: np.ndarray) -> None:
        at = 0
        while at < len(ids):
            if self._file is None or self._in_shard == self.shard_tokens:
                if self._file is not None:
                    self._file.close()
                self._open_shard()
            n = min(len(ids) - at, self.shard_tokens - self._in_shard)
            self._file.write(ids[at:at + n].astype(self.dtype).tobytes())
            self._in_shard += n
            self.shards[-1]["tokens"] += n
            self.tokens += n
            at += n

    def close(self) -> dict[str, Any]:
        if self._file is not None:
            self._file.close()
        self._docs.close()
        for s in self.shards:
            s["sha256"] = sha256_file(self.out / s["file"])
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards,
                "doc_offsets": f"{self.split}.docs.bin"}


def tokenizer_identity(tokenizer: Any, spec: str | None = None) -> dict[str, Any]:
    from ..tokenizer import encoding_sha256

    inner = getattr(tokenizer, "tokenizer", None)
    serialized = inner.to_str() if inner is not None and hasattr(inner, "to_str") else None
    return {"model": spec, "vocab_size": len(tokenizer),
            "sha256": hashlib.sha256(serialized.encode()).hexdigest() if serialized else None,
            # what decides the ids (vocabulary, merges, pre-tokenizer, added tokens), for comparisons
            "encoding_sha256": encoding_sha256(tokenizer),
            "bos_id": getattr(tokenizer, "bos_id", None), "eos_id": tokenizer.eos_id,
            "add_bos": bool(getattr(tokenizer, "add_bos", False))}


_PACK_FILE = re.compile(r"(index\.json|(train|val)-\d{5}\.bin|(train|val)\.docs\.bin)\Z")


def _is_pack_file(name: str) -> bool:
    from ..tokenizer import TOKENIZER_FILES

    return bool(_PACK_FILE.match(name)) or name in TOKENIZER_FILES


def _check_out(out: Path, overwrite: bool) -> None:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return  # an empty directory is as good as none
    if not overwrite:
        previous = (out / "index.json").is_file()
        raise InputError(f"{out}: already exists; choose another --out, or pass --overwrite to replace "
                         f"{'that previous pack' if previous else 'it'}")
    # only a previous pack: its shards, index and tokenizer files, and an index of this format
    check_replaceable(out, "data pack", _is_pack_file, required="index.json")
    try:
        previous_format = json.loads((out / "index.json").read_text()).get("format")
    except (ValueError, AttributeError):
        previous_format = None
    if previous_format != FORMAT:
        raise InputError(f"--out {out}: its index.json is not a `entrenar data pack` index (format "
                         f"{previous_format!r}), so --overwrite will not delete it; choose another --out")


def pack(inputs: list[str], tokenizer: TextEncoder, out_dir: str | Path, val_fraction: float = 0.0,
         seed: int = 0, shard_tokens: int = DEFAULT_SHARD_TOKENS, tokenizer_spec: str | None = None,
         progress: bool = False, workers: int = 1, strict: bool = False,
         overwrite: bool = False) -> dict[str, Any]:
    """Tokenize a corpus into shards under ``out_dir``; returns (and writes) the index.

    Built in a temporary sibling directory renamed at the end, so a failure or an interrupt leaves
    nothing that looks complete. An existing ``out_dir`` is refused unless ``overwrite`` (and then
    only an empty directory or a previous pack is replaced).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise InputError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise InputError(f"--shard-tokens must be >= 1 (tokens per shard file), got {shard_tokens}")
    if workers < 1:
        raise InputError(f"--workers must be >= 1, got {workers}")
    if tokenizer.eos_id is None:
        raise InputError("the tokenizer has no EOS token, so documents cannot be separated")
    out = Path(out_dir)
    _check_out(out, overwrite)
    check_creatable(out, "--out")  # under /proc or read-only: exit 2 before encoding (issue 38 item 8)
    files = expand_inputs(inputs)
    vocab = len(tokenizer)
    dtype = np.dtype("<u2") if vocab < 65536 else np.dtype("<u4")
    bos = [int(tokenizer.bos_id)] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []
    ctx = _Context(tokenizer, bos, [int(tokenizer.eos_id)], vocab, dtype.str, seed, val_fraction)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        writers = {s: _SplitWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
        source_hash, skipped, used, empty = hashlib.sha256(), SkipReport(), [], 0
        from tqdm import tqdm

        total_bytes = sum(f.stat().st_size for f in files if f.exists())
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="pack", disable=not progress) as bar:
            for results in _run_tasks(_tasks(files), ctx, workers):
                for r in results:
                    bar.update(r.size)
                    if r.skipped is not None:
                        skipped.add(r.path, r.skipped)
                        if strict:
                            raise skipped.strict_error("nothing was written")
                        continue
                    used.append(r.path)
                    source_hash.update(r.size.to_bytes(8, "little") + bytes.fromhex(r.sha256))
                    empty += r.empty
                    for split, (tokens, lengths) in r.splits.items():
                        writers[split].write_documents(tokens, lengths)
        splits = {s: w.close() for s, w in writers.items()}
        if splits["train"]["documents"] == 0:
            why = f"; skipped: {'; '.join(skipped.listed[:5])}" if skipped.count else ""
            raise InputError(f"no training documents: {len(files)} input files ({skipped.count} skipped) gave "
                             f"{splits['val']['documents']} val and 0 train documents ({empty} empty){why}; "
                             f"lower --val-fraction or add data")
        identity = tokenizer_identity(tokenizer, tokenizer_spec)
        from ..tokenizer import save_tokenizer_files

        identity["files"] = save_tokenizer_files(tokenizer, tmp)
        index = {
            "format": FORMAT, "dtype": dtype.name, "vocab_size": vocab, "tokenizer": identity,
            "source_sha256": source_hash.hexdigest(), "inputs": used, "skipped": skipped.to_dict(),
            "seed": seed, "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "documents": sum(s["documents"] for s in splits.values()),
            "tokens": sum(s["tokens"] for s in splits.values()), "empty_documents_skipped": empty,
            "splits": splits,
        }
        atomic_write(tmp / "index.json", json.dumps(index, indent=2) + "\n")
        if out.exists():  # --overwrite, checked above: replaced only now that the new pack is complete
            shutil.rmtree(out)
    return index

def read_index(shards_dir: str | Path) -> dict[str, Any]:
    path = Path(shards_dir) / "index.json"
    if not path.is_file():  # what it is instead, and what is expected (issue 38 item 10)
        raise InputError(f"{shards_dir}: {describe_path(shards_dir)}, not a directory of token shards (no "
                         f"index.json); create them with `entrenar data pack --model MODEL --out SHARDS "
                         f"{shards_dir}`")
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise InputError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}; re-run `entrenar data pack`")
    return index


def shard_tokenizer(shards_dir: str | Path, index: dict[str, Any] | None = None) -> Any:
    """The tokenizer packed into the shard directory (its files checked against the sha256 in
    index.json); None for a pack written before shards carried their tokenizer."""
    from ..tokenizer import load_hf_tokenizer

    shards_dir = Path(shards_dir)
    index = index or read_index(shards_dir)
    files = (index.get("tokenizer") or {}).get("files")
    if not files:
        return None
    for name, digest in files.items():
        path = shards_dir / name
        if not path.is_file():
            raise InputError(f"{path}: missing; index.json lists it as the shards' tokenizer. Copy the whole "
                             f"shard directory, or re-run `entrenar data pack`")
        if sha256_file(path) != digest:
            raise InputError(f"{path}: sha256 differs from the one index.json recorded when the shards were "
                             f"packed; the tokenizer was changed after packing. Restore it or re-pack")
    tok = load_hf_tokenizer(shards_dir)
    if len(tok) != index["vocab_size"]:
        raise InputError(f"{shards_dir}: the packed tokenizer has {len(tok)} tokens, index.json says "
                         f"{index['vocab_size']}; re-run `entrenar data pack`")
    return tok


def check_same_tokenizer(shards_dir: str | Path, shards_tok: Any, other: Any, other_spec: str, flag: str,
                         alternative: str | None = None) -> None:
    """InputError naming both when ``other`` (the tokenizer of --model/--init) would encode text
    differently from the tokenizer the shards were packed with. ``alternative``: the remedy besides
    re-packing (pretrain: train from a preset)."""
    from ..tokenizer import encoding_sha256

    if shards_tok is None or other is None:
        return
    mine, theirs = encoding_sha256(shards_tok), encoding_sha256(other)
    if mine != theirs or len(shards_tok) != len(other):
        alternative = alternative or f"train from a preset (`--model PRESET`, no {flag})"
        raise InputError(f"{flag} {other_spec} has a different tokenizer ({len(other)} tokens, encoding sha256 "
                         f"{str(theirs)[:12]}..) from the one the shards {shards_dir} were packed with "
                         f"({len(shards_tok)} tokens, {str(mine)[:12]}..); its token ids would mean other text. "
                         f"Re-pack the corpus with `entrenar data pack --model {other_spec}`, or {alternative}")


def check_shards_fit(shards_dir: str | Path, index: dict[str, Any], vocab_size: int, flag: str = "--model") -> None:
    """InputError when the shards' tokenizer has more tokens than the model's embedding has rows: an id
    past the last row would index out of range (eval crashed with exit 1 on one: issue 28 item 7)."""
    if index["vocab_size"] > vocab_size:
        raise InputError(f"{shards_dir}: shards were packed with a tokenizer of {index['vocab_size']} tokens, "
                         f"more than the model's vocab_size {vocab_size}; pack with the model's tokenizer or "
                         f"choose a matching {flag}")


# ---- loading --------------------------------------------------------------------------------------
@dataclass
class _Shard:
    start: int
    tokens: np.ndarray


class PretrainLoader:
    """Fixed windows of ``seq_len + 1`` tokens over one split, as (input_ids, shifted labels).

    Window w covers stream tokens [w*seq_len, w*seq_len + seq_len]; input_ids are its first seq_len
    tokens and labels its last seq_len. With ``doc_mask`` batches carry ``doc_ids`` (attention stays
    inside a document, positions restart per document) and the label that would predict the next
    document's first token from the previous document is -100.

    ``next_batch`` is endless: each epoch visits every window once in an order drawn from
    ``(seed, epoch)``; a batch may span two epochs. ``iter_epoch`` is one pass in stream order.
    """

    kind = "pretrain"

    def __init__(self, shards_dir: str | Path, split: str = "train", seq_len: int = 1024, batch_size: int = 8,
                 seed: int = 0, doc_mask: bool = False):
        self.dir = Path(shards_dir)
        self.index = read_index(self.dir)
        if split not in self.index["splits"]:
            raise InputError(f"{self.dir}: no split {split!r}; splits: {', '.join(self.index['splits'])}")
        if seq_len < 1 or batch_size < 1:
            raise InputError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
        info = self.index["splits"][split]
        self.split, self.seq_len, self.batch_size = split, seq_len, batch_size
        self.seed, self.doc_mask = seed, doc_mask
        dtype = np.dtype(self.index["dtype"])
        self.shards: list[_Shard] = []
        at = 0
        for s in info["shards"]:
            f = self.dir / s["file"]
            if not f.is_file() or f.stat().st_size != s["tokens"] * dtype.itemsize:
                raise InputError(f"{f}: missing or not {s['tokens']} tokens long as index.json says; "
                                 f"re-run `entrenar data pack`")
            self.shards.append(_Shard(at, np.memmap(f, dtype=dtype, mode="r")))
            at += s["tokens"]
        self.shard_starts = [s.start for s in self.shards]
        self.num_tokens = at
        # ids >= the tokenizer's size are padding rows of a preset's rounded-up vocabulary: never
        # inputs, never targets (a corrupt shard or a mixed-up tokenizer would train them)
        self.vocab_size = int(self.index["vocab_size"])
        docs = self.dir / info["doc_offsets"]
        self.doc_starts = np.fromfile(docs, dtype="<u8").astype(np.int64) if docs.stat().st_size else \
            np.zeros(0, dtype=np.int64)
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)
        if self.num_windows == 0:
            raise InputError(f"{self.dir} split {split!r} has {self.num_tokens} tokens, too few for one "
                             f"window of seq_len {seq_len} + 1; lower --max-seq-len or add data")
        self.cursor = EpochCursor(self.num_windows, seed)  # the loaders' one epoch/state mechanism

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def __len__(self) -> int:
        return self.num_windows

    def _read(self, start: int, out: np.ndarray) -> None:
        """Stream tokens [start, start + len(out)) into `out` (int64), across shard borders."""
        end, at = start + len(out), 0
        i = max(bisect.bisect_right(self.shard_starts, start) - 1, 0)
        for s in self.shards[i:]:
            if s.start >= end:
                break
            lo, hi = max(start, s.start), min(end, s.start + len(s.tokens))
            if lo < hi:
                out[lo - start:hi - start] = s.tokens[lo - s.start:hi - s.start]
                at += hi - lo
        assert at == len(out), f"window [{start}, {end}) reads {at} tokens"

    def _check_ids(self, windows: list[int], toks: np.ndarray) -> None:
        """GUARD-DATA on the first window (row of `toks`) holding an id the shards' tokenizer does not have."""
        if not toks.size or int(toks.max()) < self.vocab_size:
            return
        row = int(np.argmax(toks.max(axis=1) >= self.vocab_size))
        raise GuardError("GUARD-DATA", f"{self.dir} window {windows[row]} holds token id {int(toks[row].max())}, "
                         f"but the shards' tokenizer has only {self.vocab_size} tokens: the shards are corrupt or "
                         f"were changed after packing, and ids >= {self.vocab_size} would train padding "
                         f"rows of the vocabulary.", "re-run `entrenar data pack`", exit_code=2)

    def window(self, w: int) -> dict[str, np.ndarray]:
        """Window w alone, as the rows of a batch (input_ids, labels, doc_ids with doc_mask)."""
        batch = self._collate([w])
        return {k: v[0].numpy() for k, v in batch.items() if k in ("input_ids", "labels", "doc_ids")}

    def _collate(self, windows: list[int]) -> dict[str, Any]:
        """The batch of `windows`, each read once from the shards into one (rows, seq_len + 1) array: per-window
        arrays stacked afterwards cost ~10x the time at the 32 windows each rank of a 4-GPU job reads a step."""
        T = self.seq_len
        toks = np.empty((len(windows), T + 1), dtype=np.int64)
        for row, w in enumerate(windows):
            self._read(w * T, toks[row])
        self._check_ids(windows, toks)
        labels = toks[:, 1:].copy()  # copies: for one row numpy calls the views contiguous, and -100 goes in
        doc = None
        if self.doc_mask:  # each token's document, by stream position
            at = np.asarray(windows, dtype=np.int64)[:, None] * T + np.arange(T + 1)
            doc = np.searchsorted(self.doc_starts, at, side="right") - 1
            labels[doc[:, 1:] != doc[:, :-1]] = IGNORE_INDEX  # never predict across a document boundary
        batch: dict[str, Any] = {"input_ids": torch.from_numpy(toks[:, :-1].copy()), "labels": torch.from_numpy(labels)}
        if doc is not None:
            batch["doc_ids"] = torch.from_numpy(doc[:, :-1] - doc[:, :1])
            batch["position_ids"] = positions_from_doc_ids(batch["doc_ids"])
        batch["sample_ids"] = list(windows)
        return batch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return self.cursor.order(epoch)

    def next_batch(self) -> dict[str, Any]:
        return self._collate([self.cursor.take() for _ in range(self.batch_size)])

    def iter_epoch(self) -> Iterator[dict[str, Any]]:
        """Every window once in stream order; the last batch may be smaller. State untouched."""
        for i in range(0, self.num_windows, self.batch_size):
            yield self._collate(list(range(i, min(i + self.batch_size, self.num_windows))))

    def _tokenizer_id(self) -> dict[str, Any]:
        tok = self.index.get("tokenizer") or {}
        return {"vocab_size": self.index.get("vocab_size"), "encoding_sha256": tok.get("encoding_sha256")}

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.cursor.state_dict(), "split": self.split,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "doc_mask": self.doc_mask,
                "num_windows": self.num_windows, "source_sha256": self.index["source_sha256"],
                "tokenizer": self._tokenizer_id()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        mine = self.state_dict()
        saved_tok = sd.get("tokenizer")  # absent in checkpoints written before it was recorded
        if saved_tok is not None and saved_tok != mine["tokenizer"]:
            # first: another tokenizer also changes num_windows, which named the effect, not the cause
            def describe(t: dict[str, Any]) -> str:
                return f"{t.get('vocab_size')} tokens, encoding sha256 {str(t.get('encoding_sha256'))[:12]}.."

            raise InputError(f"cannot resume: the run was trained on shards of another tokenizer "
                             f"({describe(saved_tok)}) than --data {self.dir} ({describe(mine['tokenizer'])}), "
                             f"so the same ids would mean other text; resume with the run's shards, or re-pack "
                             f"the corpus with the run's tokenizer (`entrenar data pack --model RUN_CHECKPOINT`)")
        for key in ("kind", "split", "seq_len", "num_windows", "source_sha256"):
            if sd.get(key) != mine[key]:
                raise InputError(f"cannot resume the pretraining loader: saved {key}={sd.get(key)!r}, now "
                                 f"{mine[key]!r} (resume with the same shards and --max-seq-len)")
        self.cursor.load_state_dict(sd, "pretraining")
        self.seed = self.cursor.seed
