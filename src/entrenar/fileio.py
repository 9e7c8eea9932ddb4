"""Small file helpers shared by data packing and checkpoints."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, read in chunks (shards and checkpoints can be GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
