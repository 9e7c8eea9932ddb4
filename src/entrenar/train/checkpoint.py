"""Atomic training checkpoints: RUN/checkpoints/step-NNNNNNN/ and a `latest` symlink.

Write order (so a kill at any point leaves the previous checkpoint usable):
  step-N.tmp/ <- every file, each fsynced; COMPLETE written last and fsynced; the directory
  fsynced; rename step-N.tmp -> step-N; `latest` replaced atomically (symlink + os.replace).
A directory without COMPLETE (or still named .tmp) is never resumed from.

Contents: model.safetensors (the trainable parameters: all of them for full training, only
the adapter for LoRA), optimizer.pt, trainer_state.pt (step, tokens, schedule, data-loader
state, guard state, RNG: python, numpy, torch CPU and CUDA), run_config.json (resolved config),
meta.json (sha256 of optimizer.pt and model.safetensors).
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..errors import InputError
from ..fileio import sha256_file

COMPLETE = "COMPLETE"
STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], run_config: dict[str, Any], keep: int) -> Path:
    """Write step-N atomically, point `latest` at it, prune to the newest `keep`. Returns its path."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / (step_dir_name(step) + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(trainable_state(model), str(tmp / "model.safetensors"))
    _fsync_file(tmp / "model.safetensors")
    buf = io.BytesIO()
    torch.save(optimizer.state_dict(), buf)
    _write_bytes(tmp / "optimizer.pt", buf.getvalue())
    buf = io.BytesIO()
    torch.save({"rng": rng_state(), **trainer_state}, buf)  # a given rng (pre-step) wins
    _write_bytes(tmp / "trainer_state.pt", buf.getvalue())
    _write_bytes(tmp / "run_config.json", (json.dumps(run_config, indent=2, default=str) + "\n").encode())
    meta = {"step": step, "tokens": trainer_state.get("tokens"),
            "sha256": {name: sha256_file(tmp / name) for name in
                       ("model.safetensors", "optimizer.pt", "trainer_state.pt")}}
    _write_bytes(tmp / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    _write_bytes(tmp / COMPLETE, b"ok\n")
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step after resuming from an earlier checkpoint
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(ckpt_root)
    link_tmp = ckpt_root / "latest.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    os.symlink(final.name, link_tmp)
    os.replace(link_tmp, ckpt_root / "latest")
    _fsync_dir(ckpt_root)
    prune(ckpt_root, keep)
    return final


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """COMPLETE checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for d in ckpt_root.iterdir():
        m = STEP_RE.match(d.name)
        if m and d.is_dir() and not d.is_symlink() and (d / COMPLETE).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def incomplete_checkpoints(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return sorted(d for d in ckpt_root.iterdir()
                  if d.is_dir() and not d.is_symlink() and d.name.startswith("step-")
                  and not (d / COMPLETE).is_file())


def prune(ckpt_root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for d in complete_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(d)


def find_resume(run_dir: Path, spec: str, log=print) -> Path | None:
    """`--resume auto`: newest COMPLETE checkpoint of run_dir (None if there is none).
    `--resume PATH`: that checkpoint, which must be COMPLETE (InputError otherwise)."""
    if spec == "auto":
        root = run_dir / "checkpoints"
        for d in incomplete_checkpoints(root):
            log(f"resume: ignoring incomplete checkpoint {d} (no {COMPLETE} marker: interrupted while "
                f"being written)")
        done = complete_checkpoints(root)
        if not done:
            log(f"resume: no complete checkpoint under {root}; starting from step 0")
            return None
        log(f"resume: continuing from {done[-1]}")
        return done[-1]
    path = Path(spec)
    if path.is_dir() and (path / "checkpoints").is_dir() and not (path / COMPLETE).exists():
        done = complete_checkpoints(path / "checkpoints")  # a run directory: its newest checkpoint
        if done:
            log(f"resume: continuing from {done[-1]}")
            return done[-1]
    if path.is_symlink() or path.is_dir():
        path = path.resolve()
    if not path.is_dir():
        raise InputError(f"--resume {spec}: no such checkpoint directory")
    if not (path / COMPLETE).is_file():
        raise InputError(f"--resume {spec}: {path} has no {COMPLETE} marker, so it was not fully "
                         f"written (the run was killed while saving). Resume from an earlier "
                         f"checkpoint or use --resume auto")
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify a COMPLETE checkpoint: {'model', 'optimizer', 'trainer_state', 'run_config', 'meta'}."""
    if not (path / COMPLETE).is_file():
        raise InputError(f"{path}: checkpoint has no {COMPLETE} marker")
    meta = json.loads((path / "meta.json").read_text())
    for name, digest in meta["sha256"].items():
        actual = sha256_file(path / name)
        if actual != digest:
            raise InputError(f"{path / name}: sha256 {actual[:12]}.. does not match the {digest[:12]}.. "
                             f"recorded when it was written: the checkpoint is corrupt; resume from an "
                             f"earlier one")
    return {
        "model": load_file(str(path / "model.safetensors")),
        "optimizer": torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False),
        "trainer_state": torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False),
        "run_config": json.loads((path / "run_config.json").read_text()),
        "meta": meta,
    }


def restore_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpointed trainable parameters into the model; every trainable one must be there."""
    params = dict(model.named_parameters())
    want = {n for n, p in params.items() if p.requires_grad}
    missing, unexpected = want - set(tensors), set(tensors) - set(params)
    if missing or unexpected:
        raise InputError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    with torch.no_grad():
        for n, t in tensors.items():
            if params[n].shape != t.shape:
                raise InputError(f"checkpoint tensor {n} has shape {tuple(t.shape)}, model has "
                                 f"{tuple(params[n].shape)}")
            params[n].copy_(t)


