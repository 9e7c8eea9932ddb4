"""Small file helpers shared by every module that writes files: hashing, atomic writes, JSONL."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, read in chunks (shards and checkpoints can be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _tmp_path(path: Path) -> Path:
    # one naming rule for every tmp-then-rename site: hidden, next to the target, unique per process
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write(path: str | Path, data: bytes | str | Callable[[Path], None]) -> Path:
    """Write `path` so that a crash leaves either the old file or the new one, never a partial one.

    `data` is bytes, text (UTF-8), or a callable that writes the given temporary path.
    """
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        if callable(data):
            data(tmp)
        elif isinstance(data, str):
            tmp.write_text(data, encoding="utf-8")
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; rename it to `path` only when the block succeeds.

    `path` must not exist (callers refuse or remove an existing target first).
    """
    path = Path(path)
    tmp = _tmp_path(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a bad line is an InputError naming file:line."""
    from .errors import InputError

    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
