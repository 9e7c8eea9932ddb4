"""Whether a command's output path can be created (CLI-OUT-CREATABLE, docs/design.md "Command line"),
and whether an existing one is the command's own output that --overwrite may replace (CLI-OVERWRITE-OWN).

An output that cannot be created (a parent is a file, or not writable) is refused (exit 2) before any
work, so a command never fails after minutes of loading with an OSError traceback (issue 18: an
--out under a file was a traceback in convert, merge and finetune).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .errors import InputError


def check_creatable(path: str | os.PathLike, flag: str = "--out") -> None:
    """InputError unless `path` could be created: its nearest existing ancestor is a writable
    directory. Nothing is left behind here."""
    path = Path(path)
    anc = path
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise InputError(f"{flag} {path}: cannot be created: {anc} is a file, not a directory; choose another "
                         f"{flag}")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot be created: {anc} is not writable; choose another {flag}")
    # os.access says yes to root everywhere, also where nothing can be created (/proc, a read-only mount):
    # a hidden probe directory, removed at once, asks the file system itself (issue 28 item 7)
    probe = anc / f".entrenar-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except FileExistsError:
        pass
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot be created: nothing can be written in {anc} "
                         f"({e.strerror or e}); choose another {flag}") from None
    else:
        probe.rmdir()


def check_replaceable(out: str | os.PathLike, command: str, owns: Callable[[str], bool],
                      required: str | None = None, flag: str = "--out") -> None:
    """InputError unless the existing directory ``out`` holds only files ``command`` writes (names for
    which ``owns`` is true), including ``required``: what --overwrite may delete (CLI-OVERWRITE-OWN).

    `--overwrite` once deleted any directory that held a tokenizer.json (a run's final/, a checkpoint,
    an HF model): a name the command writes, among files it never writes, is not its output.
    """
    out = Path(out)
    if not out.is_dir():
        raise InputError(f"{flag} {out}: exists and is not a directory, so --overwrite will not delete it; "
                         f"choose another {flag}")
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if not owns(n)]
    if foreign or (required is not None and required not in names):
        what = (f"it also holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}" if foreign
                else f"it has no {required}")
        raise InputError(f"{flag} {out}: exists and is not an empty directory or a previous `entrenar {command}` "
                         f"output ({what}), so --overwrite will not delete it; choose another {flag}")


def check_replaceable_file(out: str | os.PathLike, what: str, looks_own: Callable[[bytes], bool],
                           flag: str = "--out") -> None:
    """InputError unless the existing file ``out`` is empty or its first 64 KiB look like what the command
    writes (``looks_own``): a source file or a model given as --out by mistake is never replaced."""
    out = Path(out)
    if out.is_dir():
        raise InputError(f"{flag} {out}: is a directory; give the path of the file to write")
    with open(out, "rb") as f:
        head = f.read(1 << 16)
    if head and not looks_own(head):
        raise InputError(f"{flag} {out}: exists and is not {what}, so this command will not replace it; "
                         f"choose another {flag}")


def looks_like_jsonl(head: bytes) -> bool:
    """The first line of ``head`` is a JSON object (what a JSONL writer wrote)."""
    import json

    first = head.lstrip(b"\xef\xbb\xbf").split(b"\n", 1)[0].strip()
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:  # also UnicodeDecodeError
        return False


def check_jsonl_out(out: str | os.PathLike, overwrite: bool) -> Path:
    """A JSONL file a `data` command writes: not a directory, an existing one only with --overwrite and only when
    it is a JSONL file (CLI-OVERWRITE-OWN), else a path that can be created. Checked before any work."""
    out = Path(out)
    if out.is_dir():
        raise InputError(f"--out {out}: is a directory; give the path of the JSONL file to write")
    if out.exists() and not overwrite:
        raise InputError(f"--out {out}: already exists; choose another --out, or pass --overwrite to replace it")
    if out.exists():
        check_replaceable_file(out, "a JSONL file (a previous output)", looks_like_jsonl)
    else:
        check_creatable(out)
    return out
