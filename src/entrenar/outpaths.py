"""The one rule for a command's output path (CLI-NO-OVERWRITE, docs/design.md "Command line").

An existing output is refused (exit 2) unless the command offers --overwrite and it was given; an
output that cannot be created (a parent is a file, or not writable) is refused before any work, so
a command never fails after minutes of work with an OSError traceback (issue 18: `data
sft-from-code` replaced a 533-row file without a word; an --out under a file was a traceback).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InputError


def check_creatable(path: str | os.PathLike, flag: str = "--out") -> None:
    """InputError unless `path` could be created: its nearest existing ancestor is a writable
    directory. Nothing is created here."""
    path = Path(path)
    anc = path.parent if path.exists() else path
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"{flag} {path}: cannot be created: {anc} is a file, not a directory; choose another "
                         f"{flag}")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot be created: {anc} is not writable; choose another {flag}")


def check_new_output(path: str | os.PathLike, flag: str = "--out", *, is_dir: bool,
                     overwrite: bool | None = None) -> None:
    """InputError when `path` exists (an empty directory counts as new for a directory output) and
    `overwrite` is not True, when it is the wrong kind (a directory where a file is written or the
    reverse), or when it cannot be created. `overwrite=None`: the command has no --overwrite."""
    path = Path(path)
    if path.exists():
        if is_dir and not path.is_dir():
            raise InputError(f"{flag} {path}: exists and is not a directory; choose a new {flag}")
        if not is_dir and path.is_dir():
            raise InputError(f"{flag} {path}: is a directory; give a file path, e.g. {path / 'out.jsonl'}")
        if not (is_dir and not any(path.iterdir())) and not overwrite:
            remedy = "choose a new " + flag + ("" if overwrite is None else ", or pass --overwrite to replace it")
            raise InputError(f"{flag} {path}: already exists; {remedy}")
    check_creatable(path, flag)
