"""The one parser/validator of `--device` (issue 11: four copies had four rules and defaults)."""

from __future__ import annotations

import re

import torch

from .errors import InputError

_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+|auto)$")


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when CUDA is available, else 'cpu'; 'cpu', 'cuda', 'cuda:N' are checked
    against this machine. Anything else is an InputError (exit 2) naming the accepted values."""
    name = str(name).strip().lower()
    if not _DEVICE_RE.match(name):
        raise InputError(f"--device {name!r}: not a device; use cpu, cuda, cuda:N or auto")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError(f"--device {name}: no CUDA device is available (torch.cuda.is_available() is "
                             f"False); use --device cpu")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise InputError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return name
