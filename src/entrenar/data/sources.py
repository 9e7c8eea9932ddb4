"""Corpus inputs shared by `data pack` and `tokenizer train`: which files, and their texts.

An INPUT is a file, a directory (searched recursively for the suffixes below, hidden
directories and ``__pycache__`` left out) or a glob. Kinds, by name:

  .txt .md .rst .py (and any other file named explicitly)  one document per file, UTF-8
  .jsonl  .jsonl.gz                                        one document per row's "text" field
  .parquet                                                 one document per row's "text" column

A file that cannot be read or decoded (permissions, not UTF-8, a truncated gzip, a malformed
JSONL row, a Parquet file without a string "text" column) raises ``SkippedFile``; callers skip
the whole file, count it and list the first ``MAX_LISTED`` (``--strict`` makes it exit 2).
A file is never half-used: callers keep a file's documents only after it was read to the end.
"""

from __future__ import annotations

import glob
import gzip
import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import InputError
from ..fileio import read_jsonl

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
ALL_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
MAX_LISTED = 20  # skipped files named in reports and index.json; all are counted
PARQUET_BATCH_ROWS = 1024


class SkippedFile(Exception):
    """A file that cannot be read or decoded; ``str()`` is the reason (with file:line when known)."""


@dataclass
class SkipReport:
    """Skipped input files: all counted, the first MAX_LISTED listed as 'path: reason'."""

    count: int = 0
    listed: list[str] = field(default_factory=list)

    def add(self, path: str | Path, reason: str) -> None:
        self.count += 1
        if len(self.listed) < MAX_LISTED:
            self.listed.append(reason if reason.startswith(str(path)) else f"{path}: {reason}")

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "listed": list(self.listed)}

    def strict_error(self, what: str) -> InputError:
        shown = "; ".join(self.listed[:5]) + (" ..." if self.count > 5 else "")
        return InputError(f"--strict: {self.count} input file(s) cannot be read or decoded ({shown}); "
                          f"fix or remove them, or run without --strict to skip them; {what}")


def kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".jsonl.gz"):
        return "jsonl.gz"
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def _wanted(path: Path) -> bool:
    return path.name.lower().endswith(ALL_SUFFIXES)


def walk_files(root: Path, skip_dir: Callable[[str], bool] = lambda name: False) -> Iterator[Path]:
    """Every file under ``root``, following symlinked directories but entering each real directory
    once: a symlink loop (loop/self -> ../loop) is walked once instead of until the OS refuses
    (issue 28 item 6: two such links made `**` enumerate 2^40 paths)."""
    import os

    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            dirnames[:] = []
            continue
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not skip_dir(d))
        for name in sorted(filenames):
            yield Path(dirpath) / name


_GLOB_MAGIC = re.compile(r"[*?[]")


def _component_regex(part: str) -> str:
    """One path component of a glob as a regex that never crosses '/' (and, as glob does, never
    matches a hidden name unless the pattern itself starts with '.')."""
    if part == "**":
        return "(?:[^/.][^/]*/)*"
    out, i = ["" if part.startswith(".") else r"(?!\.)"], 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (j := part.find("]", i + 2 if part[i + 1:i + 2] in ("!", "]") else i + 1)) > 0:
            body = part[i + 1:j].replace("\\", "\\\\")
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def glob_files(spec: str) -> list[Path]:
    """The files ``glob.glob(spec, recursive=True)`` matches, with ``**`` walked by ``walk_files``
    (each real directory once) instead of glob's recursion, which follows symlink loops."""
    if "**" not in spec:  # no recursion: bounded by the pattern's depth
        return sorted(Path(f) for f in glob.glob(spec) if Path(f).is_file())
    parts = Path(spec).parts
    first = next(k for k, part in enumerate(parts) if _GLOB_MAGIC.search(part))
    base = Path(*parts[:first]) if first else Path(".")
    rest = [_component_regex(p) for p in parts[first:]]
    if parts[-1] == "**":  # a trailing ** matches every file beneath
        rest[-1] = "(?:[^/.][^/]*/)*(?!\\.)[^/]+"
    pattern = re.compile("".join(r if r.endswith("/)*") else r + "/" for r in rest[:-1]) + rest[-1])
    hidden_ok = any(p.startswith(".") for p in parts[first:])
    return [f for f in walk_files(base, lambda d: d.startswith(".") and not hidden_ok)
            if pattern.fullmatch(f.relative_to(base).as_posix()) and f.is_file()]


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, directories (recursive) and globs -> one sorted, de-duplicated file list per INPUT,
    in the order given. An INPUT that matches nothing is an InputError (a typo, not a skip).
    Symlinked directories are followed, each real directory once."""
    files: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if p.is_file():
            found = [p]
        elif p.is_dir():
            found = sorted(f for f in walk_files(p, lambda d: d.startswith(".") or d == "__pycache__")
                           if _wanted(f) and f.is_file() and not f.name.startswith("."))
        else:
            found = sorted(glob_files(spec))
        if not found:
            raise InputError(f"{spec}: no such file, no corpus files in that directory "
                             f"({', '.join(ALL_SUFFIXES)}), and no glob match")
        files.extend(found)
    seen, out = set(), []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def _open_binary(path: Path) -> BinaryIO:
    # one place that opens inputs (tests replace it to simulate an unreadable file as root)
    return open(path, "rb")


def _decode(data: bytes, where: str, first: bool) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SkippedFile(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    # a UTF-8 byte-order mark is an encoding marker, not text (editors on Windows write it)
    return text[1:] if first and text.startswith("\ufeff") else text


def read_text_blocks(path: Path, block_bytes: int) -> Iterator[bytes]:
    """Raw blocks of a file; read errors become SkippedFile."""
    try:
        with _open_binary(path) as f:
            while block := f.read(block_bytes):
                yield block
    except OSError as e:
        raise SkippedFile(f"{path}: cannot be read ({e.strerror or e})") from None


def read_text(path: Path) -> str:
    """A whole text file, strictly UTF-8 (a leading BOM dropped)."""
    return _decode(b"".join(read_text_blocks(path, 1 << 24)), str(path), True)


def iter_jsonl_texts(path: Path) -> Iterator[str]:
    """The "text" field of each row of a .jsonl or .jsonl.gz file (fileio.read_jsonl, streamed)."""
    def malformed(lineno: int, e: json.JSONDecodeError) -> None:
        raise SkippedFile(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})")

    try:
        _open_binary(path).close()  # unreadable files fail here, with the same reason as text files
        for lineno, row in read_jsonl(path, on_error=malformed):
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise SkippedFile(f"{path}:{lineno}: a pretraining JSONL row must be an object with a "
                                  f"string \"text\" field")
            yield row["text"]
    except InputError as e:  # not UTF-8 (read_jsonl names file:line)
        raise SkippedFile(str(e)) from None
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        what = "truncated or corrupt gzip" if isinstance(e, (EOFError, zlib.error, gzip.BadGzipFile)) \
            else "cannot be read"
        raise SkippedFile(f"{path}: {what} ({e.strerror or e if isinstance(e, OSError) else e})") from None


def iter_parquet_texts(path: Path) -> Iterator[str]:
    """The "text" column of a Parquet file, row group by row group (nulls are empty documents)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise InputError(f"{path}: reading Parquet needs pyarrow; install it with: pip install pyarrow") from e
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(str(path))
        if "text" not in pf.schema_arrow.names:
            raise SkippedFile(f"{path}: no \"text\" column (columns: {', '.join(pf.schema_arrow.names)})")
        kind = pf.schema_arrow.field("text").type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise SkippedFile(f"{path}: the \"text\" column is {kind}, not a string column")
        for batch in pf.iter_batches(columns=["text"], batch_size=PARQUET_BATCH_ROWS):
            for value in batch.column(0).to_pylist():
                yield value or ""
    except (OSError, pa.ArrowException) as e:
        raise SkippedFile(f"{path}: unreadable Parquet ({e})") from None


def _last_match_end(data: bytes, pattern: re.Pattern) -> int | None:
    last = None
    for m in pattern.finditer(data):
        last = m.end()
    return last


def iter_text_blocks(path: Path, block_bytes: int, cut: re.Pattern, max_growth: int = 16) -> Iterator[str]:
    """A text file in blocks of about ``block_bytes``, each cut where ``cut`` matches last (a point
    no token spans, see corpus._SAFE_CUT); a block with no such point grows until one comes, or
    after ``max_growth`` blocks is cut after a newline or space. Raises SkippedFile."""
    carry, first, at = b"", True, 0
    for block in read_text_blocks(path, block_bytes):
        block = carry + block
        end = _last_match_end(block, cut)
        if end is None and len(block) > max_growth * block_bytes:
            # no safe point in max_growth blocks (minified text?): bound memory; the tokens may
            # differ from whole-file encoding right at this cut
            end = max(block.rfind(b"\n"), block.rfind(b" ")) + 1 or None
        if end is None:
            carry = block
            continue
        carry = block[end:]
        # a cut after b"\n" or b" " is a UTF-8 character boundary
        yield _decode(block[:end], f"{path} (bytes {at}-{at + end})", first)
        at += end
        first = False
    if carry:
        yield _decode(carry, f"{path} (bytes {at}-{at + len(carry)})", first)


def iter_file_texts(path: Path, block_bytes: int, cut: re.Pattern, max_growth: int = 16
                    ) -> Iterator[tuple[str, bool]]:
    """(text, continues) pairs of one input file: ``continues`` is True for a block that continues
    the previous document (a text file larger than ``block_bytes`` is read in blocks cut at
    ``cut``). Raises SkippedFile."""
    kind = kind_of(path)
    if kind in ("jsonl", "jsonl.gz"):
        for text in iter_jsonl_texts(path):
            yield text, False
    elif kind == "parquet":
        for text in iter_parquet_texts(path):
            yield text, False
    else:
        try:
            size = path.stat().st_size
        except OSError as e:
            raise SkippedFile(f"{path}: cannot be read ({e.strerror or e})") from None
        if size <= block_bytes:
            yield read_text(path), False
        else:
            for i, text in enumerate(iter_text_blocks(path, block_bytes, cut, max_growth)):
                yield text, i > 0
