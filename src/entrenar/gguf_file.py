"""The GGUF file parser (llama.cpp's format, v2/v3 little-endian): metadata and raw tensors, nothing about models.

Below both of its readers: formats/gguf.py (GGUF -> ModelConfig and HF-named tensors) and tokenizer.py (a GGUF's
tokenizer metadata), which sit in separate layers (docs/design.md, "Layout"). It lives outside formats/ because
importing any module of a package runs the package's __init__, and formats/__init__ imports torch and the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError

# ---- a small GGUF parser ---------------------------------------------------------------------
# gguf.GGUFReader builds numpy views for every element of every metadata array: ~20 s for Qwen's
# 151k-token vocabulary and merges. This reads the same header with struct (well under a second)
# and exposes the tensors with the same `.name / .tensor_type / .shape (ne order) / .data` layout,
# so gguf.quants.dequantize applies unchanged. tests/test_loading.py checks it against GGUFReader.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
               6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order: ne0 (fastest) first
    data: np.ndarray  # as GGUFReader: typed for F32/F16, else uint8 [.., bytes per row]


class GGUFFile:
    """Metadata (``fields``: key -> python value) and tensors of a GGUF v2/v3 little-endian file."""

    def __init__(self, path: str | Path):
        import struct

        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        from .errors import InputError
        from .fileio import regular_file_problem

        self.path = Path(path)
        problem = regular_file_problem(self.path)  # a FIFO would block the open for ever
        if problem is not None:
            raise InputError(f"{self.path}: {problem}; a GGUF model must be a file")
        buf = np.memmap(self.path, mode="r")
        mv = memoryview(buf)
        pos = 0

        def take(fmt: str):
            nonlocal pos
            (v,) = struct.unpack_from(fmt, mv, pos)
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            s = bytes(mv[pos:pos + n]).decode("utf-8", errors="replace")
            pos += n
            return s

        def value(vtype: int):
            nonlocal pos
            if vtype == _STRING:
                return string()
            if vtype == _ARRAY:
                etype, count = take("<I"), take("<Q")
                if etype in _NP_SCALARS:
                    arr = np.frombuffer(buf, dtype=_NP_SCALARS[etype], count=count, offset=pos)
                    pos += arr.nbytes
                    return arr.tolist()
                return [value(etype) for _ in range(count)]
            if vtype not in _SCALARS:
                raise ValueError(f"unknown metadata value type {vtype}")
            return take(_SCALARS[vtype])

        if bytes(mv[:4]) != b"GGUF":
            raise ValueError("bad magic (not a GGUF file)")
        pos = 4
        self.version = take("<I")
        if self.version not in (2, 3):
            raise ValueError(f"GGUF version {self.version} not supported (2, 3; little-endian)")
        n_tensors, n_kv = take("<Q"), take("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            self.fields[key] = value(take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [take("<Q") for _ in range(take("<I"))]
            infos.append((name, dims, take("<I"), take("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        data_start = pos + (-pos) % align
        self.tensors: list[GGUFTensor] = []
        for name, dims, type_id, offset in infos:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
            rows = list(reversed(dims))  # numpy order
            if dims[0] % block:
                raise ValueError(f"tensor {name}: row of {dims[0]} not a multiple of block {block}")
            n_bytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
            start = data_start + offset
            if start + n_bytes > len(buf):
                raise ValueError(f"tensor {name} extends past the end of the file (truncated?)")
            raw = buf[start:start + n_bytes]
            if qtype.name in ("F32", "F16"):
                data = raw.view(np.float32 if qtype.name == "F32" else np.float16).reshape(rows)
            else:
                data = raw.reshape(rows[:-1] + [dims[0] // block * type_size])
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.int64), data))


def open_reader(path: str | Path) -> GGUFFile:
    """The parsed GGUF file, with unreadable files turned into InputError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such GGUF file")
    try:
        return GGUFFile(path)
    except Exception as e:  # struct.error, ValueError, UnicodeError... on bad or truncated bytes
        raise InputError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
