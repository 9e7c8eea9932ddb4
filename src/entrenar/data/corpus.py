"""Pretraining corpus: text files -> flat token shards + index.json, and the window loader over them.

Layout of a packed directory:
  index.json                 format, dtype, tokenizer identity, source hash, per-split counts + shards
  train-00000.bin ...        little-endian uint16 (vocab < 65536) or uint32 token ids, memory-mapped
  train.docs.bin             uint64 start offset of every document in the split's token stream
  val-00000.bin, val.docs.bin (when --val-fraction > 0)

Each document is ``[bos] + encode(text) + [eos]`` (bos only for tokenizers that add one), so EOS
separates documents. A document goes to val when a hash of (seed, its text) falls below the val
fraction: the split is deterministic, independent of file order, and identical texts share a split.
Packing streams: memory is bounded by the encode batch and the write buffer, not the corpus.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import InputError
from ..fileio import sha256_file
from ..tensors import IGNORE_INDEX, positions_from_doc_ids

FORMAT = "entrenar-token-shards-v1"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB uint16 / 256 MiB uint32 per shard
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


class TextEncoder(Protocol):
    eos_id: int | None
    bos_id: int | None
    add_bos: bool

    def encode(self, text: str, add_special: bool = True) -> list[int]: ...

    def __len__(self) -> int: ...


# ---- inputs -------------------------------------------------------------------------------------
def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, directories (recursive, text suffixes) and globs -> sorted, de-duplicated file list."""
    files: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_file():
            found = [p]
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES
                           and not any(part.startswith(".") or part == "__pycache__"
                                       for part in f.relative_to(p).parts))
        else:
            found = sorted(Path(f) for f in glob.glob(spec, recursive=True) if Path(f).is_file())
        if not found:
            raise InputError(f"{spec}: no such file, no text files in that directory "
                             f"({', '.join(TEXT_SUFFIXES)}), and no glob match")
        files.extend(found)
    seen, out = set(), []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{where}: not UTF-8 text ({e}); convert it or leave it out of the inputs") from e


def iter_jsonl_texts(path: Path, source_hash: Any) -> Iterator[str]:
    """The ``text`` field of each row, streamed line by line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            source_hash.update(raw)
            line = _decode(raw, f"{path}:{lineno}")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise InputError(f"{path}:{lineno}: a pretraining JSONL row must be an object with a string "
                                 f"\"text\" field")
            yield row["text"]


def iter_text_blocks(path: Path, source_hash: Any, block_bytes: int) -> Iterator[str]:
    """A text file in blocks of about ``block_bytes`` cut at safe points (see _SAFE_CUT); a block
    with no safe point grows until one comes (or the file ends)."""
    carry = b""
    with open(path, "rb") as f:
        while block := f.read(block_bytes):
            source_hash.update(block)
            block = carry + block
            cut = _last_safe_cut(block, _SAFE_CUT_BYTES)
            if cut is None and len(block) > MAX_GROWTH * block_bytes:
                # No safe point in 16 blocks (minified text?): bound memory, cut after a newline or
                # space (tokens may differ from whole-file encoding right at this cut).
                cut = max(block.rfind(b"\n"), block.rfind(b" ")) + 1 or None
            if cut is None:
                carry = block
                continue
            carry = block[cut:]
            yield _decode(block[:cut], str(path))  # a cut after b"\n" is a UTF-8 character boundary
    if carry:
        yield _decode(carry, str(path))


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

    def start_document(self) -> None:
        self._docs.write(np.uint64(self.tokens).tobytes())
        self.documents += 1

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
    inner = getattr(tokenizer, "tokenizer", None)
    serialized = inner.to_str() if inner is not None and hasattr(inner, "to_str") else None
    return {"model": spec, "vocab_size": len(tokenizer),
            "sha256": hashlib.sha256(serialized.encode()).hexdigest() if serialized else None,
            "bos_id": getattr(tokenizer, "bos_id", None), "eos_id": tokenizer.eos_id,
            "add_bos": bool(getattr(tokenizer, "add_bos", False))}


def pack(inputs: list[str], tokenizer: TextEncoder, out_dir: str | Path, val_fraction: float = 0.0,
         seed: int = 0, shard_tokens: int = DEFAULT_SHARD_TOKENS, tokenizer_spec: str | None = None,
         progress: bool = False) -> dict[str, Any]:
    """Tokenize a corpus into shards under ``out_dir``; returns (and writes) the index.

    Written to a temporary sibling directory and renamed at the end, so a failure leaves nothing
    half-written. An existing ``out_dir`` must be empty or a previous pack (it has index.json).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise InputError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise InputError(f"shard size must be >= 1 token, got {shard_tokens}")
    if tokenizer.eos_id is None:
        raise InputError("the tokenizer has no EOS token, so documents cannot be separated")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "index.json").is_file())):
        raise InputError(f"{out}: exists and is not an empty directory or a previous `entrenar data pack` "
                         f"output; choose another --out")
    files = expand_inputs(inputs)
    vocab = len(tokenizer)
    dtype = np.dtype("<u2") if vocab < 65536 else np.dtype("<u4")
    bos = [int(tokenizer.bos_id)] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []
    eos = [int(tokenizer.eos_id)]
    encode_batch = _batch_encoder(tokenizer)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writers = {s: _SplitWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
        source_hash = hashlib.sha256()
        empty_docs = 0
        pending: list[tuple[str, list[str]]] = []  # (split, pieces) waiting for one batched encode
        pending_chars = 0

        def checked(ids: list[int]) -> np.ndarray:
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                raise InputError(f"tokenizer produced id {int(arr.max())} outside its vocab {vocab}")
            return arr

        def flush() -> None:
            nonlocal pending_chars
            encoded = iter(encode_batch([p for _, pieces in pending for p in pieces]))
            for split, pieces in pending:
                writers[split].start_document()
                writers[split].write(checked(bos + [t for _ in pieces for t in next(encoded)] + eos))
            pending.clear()
            pending_chars = 0

        def add_document(text: str) -> None:
            nonlocal pending_chars, empty_docs
            if not text.strip():
                empty_docs += 1
                return
            pending.append(("val" if _doc_in_val(text, seed, val_fraction) else "train",
                            split_safely(text, PIECE_CHARS)))
            pending_chars += len(text)
            if pending_chars >= ENCODE_BATCH_CHARS:
                flush()

        def add_big_file(path: Path) -> None:
            """One document read block by block; its split is decided by its first block."""
            flush()
            writer = None
            for block in iter_text_blocks(path, source_hash, BIG_DOC_BYTES):
                if writer is None:
                    writer = writers["val" if _doc_in_val(block, seed, val_fraction) else "train"]
                    writer.start_document()
                    writer.write(checked(bos))
                for ids in encode_batch(split_safely(block, PIECE_CHARS)):
                    writer.write(checked(ids))
            writer.write(checked(eos))

        from tqdm import tqdm

        total_bytes = sum(f.stat().st_size for f in files)
        with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="pack", disable=not progress) as bar:
            for path in files:
                size = path.stat().st_size
                source_hash.update(size.to_bytes(8, "little"))
                if path.suffix == ".jsonl":
                    for text in iter_jsonl_texts(path, source_hash):
                        add_document(text)
                elif size <= BIG_DOC_BYTES:
                    data = path.read_bytes()
                    source_hash.update(data)
                    add_document(_decode(data, str(path)))
                else:
                    add_big_file(path)
                bar.update(size)
            flush()
        splits = {s: w.close() for s, w in writers.items()}
        if splits["train"]["documents"] == 0:
            raise InputError(f"no training documents: {len(files)} input files gave "
                             f"{splits['val']['documents']} val and 0 train documents "
                             f"({empty_docs} empty); lower --val-fraction or add data")
        index = {
            "format": FORMAT, "dtype": dtype.name, "vocab_size": vocab,
            "tokenizer": tokenizer_identity(tokenizer, tokenizer_spec),
            "source_sha256": source_hash.hexdigest(), "inputs": [str(f) for f in files],
            "seed": seed, "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "documents": sum(s["documents"] for s in splits.values()),
            "tokens": sum(s["tokens"] for s in splits.values()), "empty_documents_skipped": empty_docs,
            "splits": splits,
        }
        (tmp / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def read_index(shards_dir: str | Path) -> dict[str, Any]:
    path = Path(shards_dir) / "index.json"
    if not path.is_file():
        raise InputError(f"{shards_dir}: no index.json; create token shards with `entrenar data pack`")
    index = json.loads(path.read_text())
    if index.get("format") != FORMAT:
        raise InputError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}; re-run `entrenar data pack`")
    return index


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
        self.num_tokens = at
        docs = self.dir / info["doc_offsets"]
        self.doc_starts = np.fromfile(docs, dtype="<u8").astype(np.int64) if docs.stat().st_size else \
            np.zeros(0, dtype=np.int64)
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)
        if self.num_windows == 0:
            raise InputError(f"{self.dir} split {split!r} has {self.num_tokens} tokens, too few for one "
                             f"window of seq_len {seq_len} + 1; lower --seq-len or add data")
        self._epoch, self._position = 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    @property
    def epoch(self) -> int:
        return self._epoch

    def __len__(self) -> int:
        return self.num_windows

    def _tokens(self, start: int, n: int) -> np.ndarray:
        pieces, end = [], start + n
        for s in self.shards:
            lo, hi = max(start, s.start), min(end, s.start + len(s.tokens))
            if lo < hi:
                pieces.append(np.asarray(s.tokens[lo - s.start:hi - s.start], dtype=np.int64))
        out = np.concatenate(pieces)
        assert len(out) == n, f"window [{start}, {end}) reads {len(out)} tokens"
        return out

    def window(self, w: int) -> dict[str, np.ndarray]:
        start = w * self.seq_len
        toks = self._tokens(start, self.seq_len + 1)
        item = {"input_ids": toks[:-1], "labels": toks[1:].copy()}
        if self.doc_mask:
            doc = np.searchsorted(self.doc_starts, np.arange(start, start + self.seq_len + 1), side="right") - 1
            item["labels"][doc[1:] != doc[:-1]] = IGNORE_INDEX  # never predict across a document boundary
            item["doc_ids"] = doc[:-1] - doc[0]
        return item

    def _collate(self, windows: list[int]) -> dict[str, Any]:
        items = [self.window(w) for w in windows]
        batch: dict[str, Any] = {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in items[0]}
        if self.doc_mask:

            batch["position_ids"] = positions_from_doc_ids(batch["doc_ids"])
        batch["sample_ids"] = list(windows)
        return batch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> dict[str, Any]:
        windows = []
        for _ in range(self.batch_size):
            windows.append(int(self._epoch_order(self._epoch)[self._position]))
            self._position += 1
            if self._position == self.num_windows:
                self._epoch, self._position = self._epoch + 1, 0
        return self._collate(windows)

    def iter_epoch(self) -> Iterator[dict[str, Any]]:
        """Every window once in stream order; the last batch may be smaller. State untouched."""
        for i in range(0, self.num_windows, self.batch_size):
            yield self._collate(list(range(i, min(i + self.batch_size, self.num_windows))))

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self._epoch, "position": self._position, "seed": self.seed,
                "rng": "numpy.random.default_rng([seed, epoch]).permutation", "split": self.split,
                "seq_len": self.seq_len, "batch_size": self.batch_size, "doc_mask": self.doc_mask,
                "num_windows": self.num_windows, "source_sha256": self.index["source_sha256"]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        mine = self.state_dict()
        for key in ("kind", "split", "seq_len", "num_windows", "source_sha256"):
            if sd.get(key) != mine[key]:
                raise InputError(f"cannot resume the pretraining loader: saved {key}={sd.get(key)!r}, now "
                                 f"{mine[key]!r} (resume with the same shards and --seq-len)")
        if not 0 <= sd["position"] < self.num_windows or sd["epoch"] < 0:
            raise InputError(f"cannot resume the pretraining loader: position {sd['position']} / epoch "
                             f"{sd['epoch']} out of range for {self.num_windows} windows")
        self.seed, self._epoch, self._position = int(sd["seed"]), int(sd["epoch"]), int(sd["position"])
        self._order_epoch = -1
