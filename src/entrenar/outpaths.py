"""Whether a command's output path can be created (CLI-OUT-CREATABLE, docs/design.md "Command line").

An output that cannot be created (a parent is a file, or not writable) is refused (exit 2) before any
work, so a command never fails after minutes of loading with an OSError traceback (issue 18: an
--out under a file was a traceback in convert, merge and finetune).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InputError


def check_creatable(path: str | os.PathLike, flag: str = "--out") -> None:
    """InputError unless `path` could be created: its nearest existing ancestor is a writable
    directory. Nothing is created here."""
    path = Path(path)
    anc = path
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"{flag} {path}: cannot be created: {anc} is a file, not a directory; choose another "
                         f"{flag}")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot be created: {anc} is not writable; choose another {flag}")
