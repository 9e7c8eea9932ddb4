"""PEFT-format adapter directories: save, read, load; the adapter note (what base, NF4 or not).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as
``peft.save_pretrained`` writes them (keys ``base_model.model.<HF path>.lora_A.weight``), plus our
``entrenar_adapter.json``: the base it was trained on (name and weights fingerprint, checked at load),
whether the base was NF4, and how to merge it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..fileio import atomic_write
from ..kernels import nf4
from ..model_spec import ADAPTER_CONFIG, PACKAGED, is_adapter_dir
from .identity import check_base_identity
from .lora import apply_lora, lora_modules

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NOTE = "entrenar_adapter.json"  # what base the adapter needs and whether it was NF4
PEFT_PREFIX = "base_model.model."


def base_to_record(base_spec: str | os.PathLike | None) -> str | None:
    """The base as an adapter records it: an existing path made absolute, anything else (a packaged
    name, a hub id of a peft adapter) as given."""
    if base_spec is None:
        return None
    spec = str(base_spec)
    if spec not in PACKAGED and Path(spec).exists():
        return os.path.abspath(spec)
    return spec


def base_relative_to(base_spec: str | None, adapter_dir: str | os.PathLike) -> str | None:
    """The recorded base's path relative to the adapter directory (None for a name or an unrelated drive)."""
    if base_spec is None or not os.path.isabs(base_spec):
        return None
    try:
        return Path(os.path.relpath(base_spec, os.path.abspath(adapter_dir))).as_posix()
    except ValueError:  # another drive (Windows)
        return None


def adapter_path(adapter_dir: str | Path) -> Path:
    """An adapter directory, or a LoRA run directory (its final/ adapter)."""
    d = Path(adapter_dir)
    if not is_adapter_dir(d) and is_adapter_dir(d / "final"):
        return d / "final"
    return d


def _peft_key(path: str, which: str) -> str:
    return f"{PEFT_PREFIX}{path}.{which}.weight"


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for path, m in lora_modules(model).items():
        out[_peft_key(path, "lora_A")] = m.lora_A.weight.detach().float().cpu().contiguous()
        out[_peft_key(path, "lora_B")] = m.lora_B.weight.detach().float().cpu().contiguous()
    return out


def _peft_adapter_config(cfg: dict[str, Any], base_spec: str | Path | None) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_spec is None else str(base_spec),
        "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"],
        "lora_dropout": cfg["lora_dropout"],
        "target_modules": list(cfg["target_modules"]),
        "use_rslora": cfg["use_rslora"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
    }


def _adapter_note(model_cfg: dict[str, Any] | None, cfg: dict[str, Any], base_spec: str | None,
                  out: Path) -> dict[str, Any]:
    return {
        "base_model": base_spec,
        # where the base sits relative to this directory: found again when both moved together
        "base_model_relative": base_relative_to(base_spec, out),
        # checked when the adapter is loaded or merged: a same-shape wrong base is refused (exit 2)
        "base_fingerprint": cfg.get("base_fingerprint"),
        "trained_against": "nf4" if cfg["quantize_nf4"] else "base weights",
        "base_quantization": {"type": "nf4", "block_size": nf4.BLOCK_SIZE,
                              "scale_block_size": nf4.SCALE_BLOCK_SIZE, "double_quant": "int8 + mean",
                              "modules": "all linears of the decoder layers"} if cfg["quantize_nf4"] else None,
        "base_config": model_cfg,
        "init_seed": cfg.get("init_seed"),
        "merge": "entrenar merge --base BASE --adapter DIR --out OUT"
                 + (" (default --onto trained: NF4-dequantized base)" if cfg["quantize_nf4"] else ""),
    }


def adapter_writer(model: nn.Module, base_spec: str | Path | None = None) -> Callable[[str | Path], Path]:
    """save_adapter in two halves: the adapter as it is now (its tensors copied, so training may go on) and a
    function that writes that copy as a PEFT LoRA directory later, e.g. from a checkpoint's background writer."""
    from safetensors.torch import save_file

    cfg = getattr(model, "peft_config", None)
    if cfg is None:
        raise InputError("the model has no LoRA adapters to save (apply_lora was not called)")
    tensors = {k: t.clone() for k, t in adapter_state_dict(model).items()}  # on the CPU .cpu() is the weight itself
    base_spec = base_to_record(base_spec)  # absolute: the adapter works from any folder (issue 28 item 3)
    model_cfg = getattr(model, "cfg", None)
    model_cfg = model_cfg.to_hf_dict() if model_cfg is not None else None
    peft_config = json.dumps(_peft_adapter_config(cfg, base_spec), indent=2) + "\n"
    cfg = dict(cfg)

    def write(out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)

        def write_weights(tmp: Path) -> None:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.chmod(tmp, 0o644)  # safetensors creates it owner-only

        atomic_write(out / ADAPTER_WEIGHTS, write_weights)
        atomic_write(out / ADAPTER_CONFIG, peft_config)
        atomic_write(out / ADAPTER_NOTE, json.dumps(_adapter_note(model_cfg, cfg, base_spec, out), indent=2,
                                                    default=str) + "\n")
        return out
    return write


def save_adapter(model: nn.Module, out_dir: str | Path, base_spec: str | Path | None = None) -> Path:
    """Write a PEFT LoRA directory: adapter_config.json + adapter_model.safetensors (+ our note).

    Each file is written atomically; the weights first, so a directory with a config has its weights."""
    return adapter_writer(model, base_spec)(out_dir)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e})") from e


def read_adapter_config(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter_config.json, our note or {}) with the checks that apply to any LoRA adapter."""
    d = adapter_path(adapter_dir)
    cfg_path = d / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise InputError(f"{d}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    cfg = _read_json(cfg_path)
    if cfg.get("peft_type", "LORA").upper() != "LORA":
        raise InputError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = [k for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                               "layers_to_transform") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']}")
    if cfg.get("fan_in_fan_out"):
        unsupported.append("fan_in_fan_out")
    if unsupported:
        raise InputError(f"{cfg_path}: unsupported LoRA options {', '.join(unsupported)}")
    note_path = d / ADAPTER_NOTE
    note = _read_json(note_path) if note_path.is_file() else {}
    return cfg, note


def _resolve_targets(model: nn.Module, target_modules: Any, cfg_path: Path) -> list[str]:
    if isinstance(target_modules, str):  # PEFT: a string is a regex matched against full module paths
        pattern = re.compile(target_modules)
        leaves = {p.rsplit(".", 1)[-1] for p, m in model.named_modules()
                  if isinstance(m, nn.Linear) and pattern.fullmatch(p)}
        if not leaves:
            raise InputError(f"{cfg_path}: target_modules regex {target_modules!r} matches no linear layer")
        return sorted(leaves)
    if not isinstance(target_modules, list) or not target_modules:
        raise InputError(f"{cfg_path}: target_modules must be a list of names, got {target_modules!r}")
    return list(target_modules)


def load_adapter(model: nn.Module, adapter_dir: str | Path, quantize_nf4: bool | None = None, *,
                 force_base: bool = False, base_name: str | None = None) -> nn.Module:
    """Attach an adapter written by us or by ``peft`` to ``model`` (in place, and return it).

    ``quantize_nf4=None`` follows the adapter: NF4 base if it was trained against one (our note).
    The base's weights must be the ones the adapter recorded (exit 2 otherwise, unless ``force_base``);
    the outcome is ``model.peft_config["base_check"]``, and a warning or note goes to stderr.
    """
    from ..model_spec import verified

    d = verified(adapter_path(adapter_dir))  # a run's final/ or checkpoint: the sha256 recorded when written
    cfg, note = read_adapter_config(d)
    weights = d / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise InputError(f"{d}: no {ADAPTER_WEIGHTS} (adapter_model.bin is not read; re-save with safetensors)")
    if quantize_nf4 is None:
        quantize_nf4 = note.get("trained_against") == "nf4"
    targets = _resolve_targets(model, cfg.get("target_modules"), d / ADAPTER_CONFIG)
    try:  # seed 0: the init is overwritten below; a fixed seed leaves torch's global RNG alone
        apply_lora(model, int(cfg["r"]), float(cfg.get("lora_alpha", 8)), float(cfg.get("lora_dropout", 0.0)),
                   bool(cfg.get("use_rslora", False)), targets, quantize_nf4=quantize_nf4, seed=0)
    except InputError as e:
        raise InputError(f"{d / ADAPTER_CONFIG}: {e}") from e
    load_adapter_weights(model, d)  # shape errors name the tensor before the identity check speaks
    if base_name is None:
        base_name = (getattr(model, "source", None) or {}).get("spec")
    fingerprint = model.peft_config["base_fingerprint"]  # taken by apply_lora before it wrapped anything
    check = check_base_identity(note, fingerprint, str(d), base_name, force_base)
    if check["status"] != "match":
        print(check["message"], file=sys.stderr, flush=True)
    model.peft_config["base_check"] = check
    return model


def load_adapter_weights(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Copy an adapter's tensors into the model's existing LoRA modules (same targets and rank)."""
    from safetensors import SafetensorError

    d = adapter_path(adapter_dir)
    weights = d / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise InputError(f"{d}: no {ADAPTER_WEIGHTS} (adapter_model.bin is not read; re-save with safetensors)")
    expected = {}
    for path, m in lora_modules(model).items():
        expected[_peft_key(path, "lora_A")] = m.lora_A.weight
        expected[_peft_key(path, "lora_B")] = m.lora_B.weight
    seen = set()
    try:
        _copy_adapter_tensors(weights, expected, seen)
    except (SafetensorError, OSError) as e:  # a header or data that safetensors cannot read: the file, not a bug
        raise InputError(f"{weights}: corrupt or truncated safetensors file ({e}); re-create the adapter or use "
                         f"another checkpoint") from None
    missing = sorted(set(expected) - seen)
    if missing:
        raise InputError(f"{weights}: {len(missing)} adapter tensors missing, e.g. {missing[0]}")
    return model


def _copy_adapter_tensors(weights: Path, expected: dict[str, torch.Tensor], seen: set[str]) -> None:
    from safetensors import safe_open

    from ..fileio import regular_file_problem

    problem = regular_file_problem(weights)  # a FIFO would block the open for ever
    if problem is not None:
        raise InputError(f"{weights}: {problem}; an adapter's weights must be a safetensors file")
    with safe_open(str(weights), framework="pt") as f:
        for key in list(f.keys()):
            ours = key.replace(".default.", ".")  # PEFT in-memory names carry the adapter name
            if ours not in expected:
                raise InputError(f"{weights}: tensor {key} has no matching LoRA module in this model "
                                 f"(adapter for a different base or different targets?)")
            t = f.get_tensor(key)
            param = expected[ours]
            if tuple(t.shape) != tuple(param.shape):
                raise InputError(f"{weights}: tensor {key} has shape {list(t.shape)}, this model needs "
                                 f"{list(param.shape)}: the adapter was trained for a different base model")
            with torch.no_grad():
                param.copy_(t.to(param.dtype))
            seen.add(ours)
