"""Where an adapter's base model is, from any folder (issue 28 item 3).

The base was recorded as the path typed (``--model runs/t1``, relative to the cwd of the training), so a
LoRA run worked only from the folder it was trained in. It is now recorded as an absolute path
(``base_model_name_or_path`` and the note's ``base_model``) plus its place relative to the adapter
directory (``base_model_relative``), next to the weights fingerprint (identity.py). ``locate_base``
takes the recorded path when it exists; else a base at the recorded place relative to the adapter (a
runs folder moved or copied as a whole), whose fingerprint the adapter load then checks; else it stops
with exit 2 naming the recorded base and the remedy, ``--model BASE --adapter RUN``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..model_spec import PACKAGED
from .io import adapter_path, read_adapter_config


def _candidates(recorded: str, note: dict[str, Any], adapter_dir: Path) -> list[Path]:
    """Where a base moved together with the adapter would be: its recorded place relative to the
    adapter directory; for a relative path recorded before absolute paths were, that path under each
    folder above the adapter (the runs folder it was typed from)."""
    out = []
    rel = note.get("base_model_relative")
    if isinstance(rel, str):
        out.append(Path(os.path.normpath(adapter_dir / rel)))
    if not os.path.isabs(recorded):
        out += [anc / recorded for anc in adapter_dir.resolve().parents]
    return out


def locate_base(adapter_dir: str | os.PathLike, shown_as: str | None = None) -> tuple[str, str | None]:
    """(MODEL spec of the adapter's recorded base that exists here, a note when it was found elsewhere
    than recorded). InputError naming the recorded base and the remedy when it is nowhere."""

    d = adapter_path(adapter_dir)
    cfg, note = read_adapter_config(d)
    recorded = cfg.get("base_model_name_or_path") or note.get("base_model")
    run = shown_as or str(adapter_dir)
    if not recorded:
        raise InputError(f"{d}: the adapter records no base model; give it: --model BASE --adapter {run}")
    recorded = str(recorded)
    if recorded in PACKAGED or Path(recorded).exists():
        return recorded, None
    if isinstance(note.get("base_fingerprint"), dict):  # a found base is only used when its weights are checked
        for candidate in _candidates(recorded, note, d):
            if candidate.exists():
                return str(candidate), (f"note: the recorded base {recorded} of {run} was not found; using "
                                        f"{candidate} (where it sits relative to the adapter), whose weights "
                                        f"are checked against the recorded fingerprint")
    where = "" if os.path.isabs(recorded) else f" (a path relative to the folder it was trained from; here: {os.getcwd()})"
    raise InputError(f"{run}: the base model it was trained on, recorded as {recorded}{where}, does not exist, "
                     f"and no base was found where it sat relative to the run. Give the base: "
                     f"--model BASE --adapter {run}")


def located_base_mismatch(error: InputError, recorded_note: str, run: str) -> InputError:
    """The fingerprint refusal of a base found relative to the run, with the remedy for a moved run."""
    return InputError(f"{recorded_note.removeprefix('note: ')}; but {error} Give the base it was trained on: "
                      f"--model BASE --adapter {run}")
