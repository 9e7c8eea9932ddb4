"""Fold a LoRA/QLoRA adapter into its base (`entrenar merge`, in cli/models.py).

Merging folds ``scale * B @ A`` into the base weight. Which base weight matters for QLoRA: the adapter
was trained against the NF4-dequantized weights of *every* decoder linear, so the default
``--onto trained`` merges onto those (the merged model computes what was trained). ``--onto original``
merges onto the 16-bit weights instead, and we report how far that model's logits are from the
trained one's (a LoRA adapter trained on 16-bit weights gives the same model either way).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import GuardError, InputError
from .fileio import atomic_dir
from .peft import adapter_path, load_adapter, read_adapter_config
from .peft.lora import ONTO, merge_in_place  # the merge math lives with LoRALinear
from .tensors import rel_l2

__all__ = ["MERGE_TOLERANCE", "ONTO", "GuardError", "merge", "merge_checked", "merge_in_place", "probe_ids"]

MERGE_TOLERANCE = 1e-4  # relL2 of merged vs base+adapter logits (fp32); measured ~1e-7


def probe_ids(vocab_size: int, n: int = 48, seed: int = 1234) -> torch.Tensor:
    """Fixed token ids on which merged and unmerged logits are compared."""
    return torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def merge_checked(model: nn.Module, onto: str = "trained", original: dict[str, torch.Tensor] | None = None,
                  check: bool = True) -> tuple[int, float, float]:
    """Fold every adapter of ``model`` into its base weights (``merge_in_place``); return (adapters merged,
    relL2 and max |diff| of the merged logits vs base + adapter on ``probe_ids``). GUARD-MERGE (exit 3)
    when ``check`` and they differ by more than MERGE_TOLERANCE: the one check of `merge` and `export`."""
    ids = probe_ids(model.cfg.vocab_size)
    with torch.no_grad():
        before = model(ids)
    n_merged = merge_in_place(model, onto, original)
    with torch.no_grad():
        after = model(ids)
    rel = rel_l2(after, before)
    if check and not rel <= MERGE_TOLERANCE:
        raise GuardError("GUARD-MERGE", f"merged logits differ from base+adapter by relL2 {rel:.3g} "
                         f"(> {MERGE_TOLERANCE:g}); nothing was written.",
                         "report this as a bug; use the unmerged adapter (--adapter) meanwhile")
    return n_merged, rel, (after - before).abs().max().item()


def _check_out(out_dir: Path) -> None:
    """Refuse an --out that exists (non-empty) or cannot be created, before anything is loaded."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InputError(f"{out_dir}: already exists and is not empty; choose a new --out")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out_dir}: its parent directory cannot be created ({e.strerror}); "
                         f"choose a writable --out") from e
    if not os.access(out_dir.parent, os.W_OK):
        raise InputError(f"--out {out_dir}: {out_dir.parent} is not writable; choose a writable --out")


def _save_merged(model: nn.Module, base: str | os.PathLike, adapter_dir: Path, out_dir: Path) -> str | None:
    """Write the merged HF directory atomically (a crash leaves no half --out); where its tokenizer came from
    (None: none went).
    The tokenizer is the adapter's own when it carries one: a fine-tune saves its tokenizer and --chat-template
    there (issue 38 item 9: the base's template made a tool-call fine-tune's merged model "not support tools")."""
    from .formats import resolve_model, save_hf_dir
    from .peft.load import tokenizer_spec
    from .tokenizer import load_tokenizer

    tokenizer = None
    source = tokenizer_spec(str(base), adapter_dir)
    if source != str(base):  # the adapter's tokenizer files, as `--model BASE --adapter DIR` reads them
        tokenizer = load_tokenizer(source)
    else:
        base_path = resolve_model(base)
        if base_path.is_file() or (base_path / "tokenizer.json").is_file():
            tokenizer = load_tokenizer(base)
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked): atomic_dir renames onto a path that does not exist
    with atomic_dir(out_dir) as tmp:
        save_hf_dir(model, tmp, tokenizer=tokenizer)
    return None if tokenizer is None else source


def merge(base: str | os.PathLike, adapter: str | os.PathLike, out: str | os.PathLike,
          onto: str = "trained", *, force_base: bool = False) -> dict[str, Any]:
    """Merge and write an HF directory; returns what was done and the logit differences.

    The base must be the one the adapter recorded (name + weights fingerprint): another base of the same
    shape is an InputError naming both, unless ``force_base`` (then a warning, in the result too)."""
    from .formats import load_model

    if onto not in ONTO:
        raise InputError(f"--onto must be one of {ONTO}, got {onto!r}")
    adapter_dir = adapter_path(adapter)
    _, note = read_adapter_config(adapter_dir)
    trained_nf4 = note.get("trained_against") == "nf4"
    out_dir = Path(out)
    _check_out(out_dir)

    model = load_model(base)
    dtype = model.model.embed_tokens.weight.dtype
    original = {f"{p}.weight": m.weight.detach().clone() for p, m in model.named_modules()
                if isinstance(m, nn.Linear) and ".layers." in f".{p}"} if trained_nf4 else None
    # the model as trained: NF4 base when it was trained so; the base identity is checked here
    load_adapter(model, adapter_dir, force_base=force_base, base_name=str(base))
    base_check = model.peft_config["base_check"]
    model.float().eval()
    if original is not None:
        original = {k: v.float() for k, v in original.items()}
    n_merged, rel_vs_trained, max_diff = merge_checked(model, onto, original,
                                                       check=onto == "trained" or not trained_nf4)
    model.to(dtype)
    tokenizer_from = _save_merged(model, base, adapter_dir, out_dir)
    result = {
        "out_dir": str(out_dir), "onto": onto, "adapters_merged": n_merged,
        "trained_against": "nf4" if trained_nf4 else "base weights",
        "logit_rel_l2_vs_trained": rel_vs_trained,
        "logit_max_abs_diff_vs_trained": max_diff,
        "dtype": str(dtype).removeprefix("torch."), "tokenizer": tokenizer_from is not None,
        "tokenizer_from": tokenizer_from,
        "base_check": base_check["status"],
    }
    if base_check["status"] != "match":
        result["base_check_message"] = base_check["message"]
    if onto == "original" and trained_nf4:
        result["note"] = ("merged onto the 16-bit weights, not the NF4 weights the adapter was trained "
                          f"against: logits move by relL2 {rel_vs_trained:.3g} from the trained model")
    elif onto == "original":
        result["note"] = "adapter was trained on the 16-bit weights: --onto original equals --onto trained"
    return result
