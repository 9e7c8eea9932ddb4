"""What a LoRA/QLoRA adapter directory holds, for `entrenar inspect ADAPTER|RUN` (issue 38 item 11): its recorded
base (and whether it is found here), rank, alpha and scaling, targets, dropout, trainable parameters (and their
share of the base's), the size of each target's update ||B @ A||_F * scaling, whether it is untrained (every B
zero: the model is its base), the chat template it carries and its sha256 manifest. Nothing is loaded onto a
base: the adapter's tensors are read by themselves.

||B @ A||_F is computed from the r x r Gram matrices, ||B A||_F^2 = sum((B^T B) * (A A^T)), in float64: the
[out, in] product of a 7B model's MLP (18,944 x 3,584) is never formed.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..fileio import MANIFEST, NOT_READ_AS_MODEL, recorded_hashes
from .io import ADAPTER_CONFIG, ADAPTER_NOTE, ADAPTER_WEIGHTS, PEFT_PREFIX, read_adapter_config


def update_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    """||B @ A||_F (A [r, in], B [out, r]) from the r x r Gram matrices, in float64."""
    a, b = a.double(), b.double()
    return math.sqrt(max(0.0, float(((b.T @ b) * (a @ a.T)).sum())))


def _module_of(key: str, which: str) -> str | None:
    """`base_model.model.<path>.lora_A.weight` -> <path> (PEFT's in-memory `.default` adapter name dropped)."""
    suffix = f".{which}.weight"
    key = key.replace(".default.", ".")
    if not key.endswith(suffix):
        return None
    return key[:-len(suffix)].removeprefix(PEFT_PREFIX)


def module_updates(weights: Path, scaling: float) -> list[dict[str, Any]]:
    """One row per adapted module: its path, target (the module's own name), rank, parameters, the update's
    Frobenius norm ||B @ A||_F * scaling, and whether its B is all zeros."""
    from safetensors import SafetensorError, safe_open

    rows = []
    try:
        with safe_open(str(weights), framework="pt") as f:
            keys = list(f.keys())
            b_keys = {_module_of(k, "lora_B"): k for k in keys if _module_of(k, "lora_B")}
            for key in keys:
                path = _module_of(key, "lora_A")
                if path is None:
                    continue
                if path not in b_keys:
                    raise InputError(f"{weights}: {key} has no lora_B tensor beside it: the adapter is incomplete")
                a, b = f.get_tensor(key), f.get_tensor(b_keys[path])
                if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
                    raise InputError(f"{weights}: {key} {list(a.shape)} and its lora_B {list(b.shape)} do not "
                                     f"multiply (A [r, in], B [out, r])")
                rows.append({"module": path, "target": path.rsplit(".", 1)[-1], "rank": int(a.shape[0]),
                             "parameters": a.numel() + b.numel(), "norm": scaling * update_norm(a, b),
                             "zero_b": not bool(b.abs().max() > 0)})
    except (SafetensorError, OSError) as e:
        raise InputError(f"{weights}: corrupt or truncated safetensors file ({e})") from None
    if not rows:
        raise InputError(f"{weights}: no lora_A/lora_B tensors (not a LoRA adapter's weights)")
    return rows


def _per_target(rows: list[dict[str, Any]], order: Any) -> dict[str, dict[str, Any]]:
    """Per target module name, in the config's order of target_modules (then any other): modules, mean and max of
    the update norms, the module of the max, and how many have an all-zero B."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r["target"]].append(r)
    listed = [t for t in order if t in groups] if isinstance(order, list) else []
    out = {}
    for target in [*listed, *sorted(set(groups) - set(listed))]:
        rs = groups[target]
        norms = [r["norm"] for r in rs]
        worst = max(rs, key=lambda r: r["norm"])
        out[target] = {"modules": len(rs), "mean": sum(norms) / len(norms), "max": worst["norm"],
                       "max_at": worst["module"], "zero_b": sum(r["zero_b"] for r in rs)}
    return out


def _base_config(spec: str) -> Any:
    """The ModelConfig of MODEL `spec` from its config alone (config.json, or a GGUF's metadata): no weights read."""
    from ..model_spec import PACKAGED, packaged_path

    path = packaged_path(spec) if spec in PACKAGED else Path(spec)
    if path.is_dir() and not (path / "config.json").is_file() and (path / "final" / "config.json").is_file():
        path = path / "final"  # a full fine-tune's run directory
    if path.is_dir():
        from ..formats.hf import read_config

        return read_config(path)
    from ..formats.gguf import read_config as gguf_config
    from ..gguf_file import open_reader

    return gguf_config(open_reader(path), path)


def _base(cfg: dict[str, Any], note: dict[str, Any], d: Path, shown_as: str) -> tuple[dict[str, Any], int | None, Any]:
    """(the base's record: recorded, found, note; its parameter count or None; where the count came from)."""
    from ..config import ModelConfig
    from .base_location import locate_base

    recorded = cfg.get("base_model_name_or_path") or note.get("base_model")
    base: dict[str, Any] = {"recorded": recorded, "found": None, "note": None,
                            "fingerprint_recorded": isinstance(note.get("base_fingerprint"), dict)}
    try:
        base["found"], base["note"] = locate_base(d, shown_as)
    except InputError as e:
        base["note"] = str(e)
    if base["found"] is not None:
        try:
            return base, _base_config(base["found"]).num_parameters(), "base"
        except (InputError, OSError, ValueError) as e:
            base["note"] = f"{base['found']}: its config is not readable ({e})"
    if isinstance(note.get("base_config"), dict):  # our note records the base's config: its size is known
        try:
            return base, ModelConfig.from_hf_dict(note["base_config"]).num_parameters(), f"{ADAPTER_NOTE} base_config"
        except (ValueError, KeyError, TypeError):
            pass
    return base, None, None


def _chat_template(d: Path, base_found: str | None) -> dict[str, Any] | None:
    """The chat template of the adapter's own tokenizer files (a fine-tune saves the one it trained under), or
    None when it carries no tokenizer (commands then use the base's)."""
    if not (d / "tokenizer.json").is_file():
        return None
    from ..tokenizer import load_tokenizer

    tok = load_tokenizer(str(d))
    text = tok.chat_template
    if text is None:
        return {"present": False, "file": None, "chars": 0, "sha256": None, "supports_tools": False, "text": None,
                "same_as_base": None}
    file = "chat_template.jinja" if (d / "chat_template.jinja").is_file() else "tokenizer_config.json"
    same = None
    if base_found is not None:
        try:
            same = load_tokenizer(base_found).chat_template == text
        except (InputError, OSError):
            same = None
    return {"present": True, "file": file, "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "supports_tools": tok.supports_tools(), "same_as_base": same, "text": text}


def _manifest(d: Path) -> dict[str, Any]:
    """The sha256 record of the directory (final/'s MANIFEST, a checkpoint's meta.json) and its status; a record
    that does not match was already refused (exit 2) when the directory was resolved (model_spec.verified)."""
    found = recorded_hashes(d)
    if found is None:
        return {"status": "none", "file": None, "files": 0, "not_hashed": [], "unrecorded": [],
                "note": "no sha256 record (not written by entrenar, e.g. PEFT's save_pretrained): nothing to verify"}
    record, digests = found
    on_disk = sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file())
    return {"status": "verified", "file": record.name,
            "files": sum(name not in NOT_READ_AS_MODEL for name in digests),  # what verify_recorded hashed
            "not_hashed": sorted(name for name in digests if name in NOT_READ_AS_MODEL),  # resume's to verify
            "unrecorded": [f for f in on_disk if f not in digests and f not in (record.name, MANIFEST, "COMPLETE")]}


def describe_adapter(adapter_dir: str | Path, shown_as: str | None = None) -> dict[str, Any]:
    """Everything `inspect` reports of an adapter directory (the module docstring); the caller has verified it."""
    d = Path(adapter_dir)
    cfg, note = read_adapter_config(d)
    weights = d / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise InputError(f"{d}: no {ADAPTER_WEIGHTS} (adapter_model.bin is not read; re-save with safetensors)")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
    rows = module_updates(weights, scaling)
    base, base_params, base_params_from = _base(cfg, note, d, shown_as or str(d))
    trainable = sum(r["parameters"] for r in rows)
    zero = sum(r["zero_b"] for r in rows)
    norms = [r["norm"] for r in rows]
    return {
        "adapter": str(d), "format": "peft-lora", "base_model": base,
        "rank": rank, "alpha": alpha, "use_rslora": rslora, "scaling": scaling,
        "scaling_rule": "alpha / sqrt(r)" if rslora else "alpha / r",
        "target_modules": cfg.get("target_modules"), "dropout": float(cfg.get("lora_dropout", 0.0)),
        "qlora": note.get("trained_against") == "nf4", "trained_against": note.get("trained_against"),
        "trainable_parameters": trainable, "base_parameters": base_params, "base_parameters_from": base_params_from,
        "trainable_percent": 100.0 * trainable / base_params if base_params else None,
        "modules": len(rows), "zero_b_modules": zero, "untrained": zero == len(rows),
        "update_norm": {"mean": sum(norms) / len(norms), "max": max(norms)},
        "update_norms": _per_target(rows, cfg.get("target_modules")), "module_updates": rows,
        "chat_template": _chat_template(d, base["found"]), "manifest": _manifest(d),
        "files": sorted(p.name for p in d.iterdir() if p.is_file()),
        "config_file": ADAPTER_CONFIG,
    }


__all__ = ["describe_adapter", "module_updates", "update_norm"]
