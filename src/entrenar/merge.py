"""Fold a LoRA/QLoRA adapter into its base (`entrenar merge`, in model_commands.py).

Merging folds ``scale * B @ A`` into the base weight. Which base weight matters for QLoRA: the adapter
was trained against the NF4-dequantized weights of *every* decoder linear, so the default
``--onto trained`` merges onto those (the merged model computes what was trained). ``--onto original``
merges onto the 16-bit weights instead, and we report how far that model's logits are from the
trained one's (a LoRA adapter trained on 16-bit weights gives the same model either way).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import peft as ep
from .errors import GuardError, InputError

ONTO = ("trained", "original")
MERGE_TOLERANCE = 1e-4  # relL2 of merged vs base+adapter logits (fp32); measured ~1e-7


def probe_ids(vocab_size: int, n: int = 48, seed: int = 1234) -> torch.Tensor:
    """Fixed token ids on which merged and unmerged logits are compared."""
    return torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def merge_in_place(model: nn.Module, onto: str = "trained",
                   original: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> int:
    """Replace every LoRALinear / NF4Linear by a plain nn.Linear; returns the number of adapters merged.

    onto="trained": base weight = what the forward used (NF4-dequantized where the base is NF4).
    onto="original": base weight = ``original[path + '.weight']`` (the 16-bit weights before NF4).
    """
    if onto not in ONTO:
        raise InputError(f"--onto must be one of {ONTO}, got {onto!r}")
    merged = 0
    for path, mod in list(model.named_modules()):
        if isinstance(mod, ep.LoRALinear):
            base = mod.base_layer
            w = base_weight(base, path, onto, original)
            w = w + mod.delta_weight()
            merged += 1
        elif isinstance(mod, ep.NF4Linear) and not path.endswith(".base_layer"):
            base = mod
            w = base_weight(base, path, onto, original)
        else:
            continue
        out_dtype = dtype or (base.weight_dtype if isinstance(base, ep.NF4Linear) else base.weight.dtype)
        lin = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                        device=w.device, dtype=out_dtype)
        lin.weight.copy_(w.to(out_dtype))
        if base.bias is not None:
            lin.bias.copy_(base.bias.to(out_dtype))
        lin.requires_grad_(False)
        ep._set_module(model, path, lin)
    model.peft_config = None
    return merged


def base_weight(base: nn.Module, path: str, onto: str, original: dict[str, torch.Tensor] | None) -> torch.Tensor:
    if onto == "original" and isinstance(base, ep.NF4Linear):
        if original is None or f"{path}.weight" not in original:
            raise InputError(f"--onto original needs the 16-bit weight of {path}")
        return original[f"{path}.weight"].float()
    if isinstance(base, ep.NF4Linear):
        return base.dequantized_weight(torch.float32)
    return base.weight.detach().float()


def merge(base: str | os.PathLike, adapter: str | os.PathLike, out: str | os.PathLike,
          onto: str = "trained") -> dict[str, Any]:
    """Merge and write an HF directory; returns what was done and the logit differences."""
    from .formats import load_model, resolve_model, save_hf_dir

    if onto not in ONTO:
        raise InputError(f"--onto must be one of {ONTO}, got {onto!r}")
    adapter_dir = Path(adapter)
    if not (adapter_dir / ep.ADAPTER_CONFIG).is_file() and (adapter_dir / "final" / ep.ADAPTER_CONFIG).is_file():
        adapter_dir = adapter_dir / "final"
    _, note = ep.read_adapter_config(adapter_dir)
    trained_nf4 = note.get("trained_against") == "nf4"
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InputError(f"{out_dir}: already exists and is not empty; choose a new --out")

    model = load_model(base)
    dtype = model.model.embed_tokens.weight.dtype
    original = {f"{p}.weight": m.weight.detach().clone() for p, m in model.named_modules()
                if isinstance(m, nn.Linear) and ".layers." in f".{p}"} if trained_nf4 else None
    ep.load_adapter(model, adapter_dir)  # the model as trained: NF4 base when it was trained so
    model.float().eval()
    ids = probe_ids(model.cfg.vocab_size)
    with torch.no_grad():
        trained_logits = model(ids)
    if original is not None:
        original = {k: v.float() for k, v in original.items()}
    n_merged = merge_in_place(model, onto, original)
    with torch.no_grad():
        merged_logits = model(ids)
    rel_vs_trained = _rel(merged_logits, trained_logits)
    if (onto == "trained" or not trained_nf4) and rel_vs_trained > MERGE_TOLERANCE:
        raise GuardError("GUARD-MERGE", f"merged logits differ from base+adapter by relL2 {rel_vs_trained:.3g} "
                         f"(> {MERGE_TOLERANCE:g}); nothing was written.",
                         "report this as a bug; use the unmerged adapter (--adapter) meanwhile")
    model.to(dtype)

    tokenizer = None
    base_path = resolve_model(base)
    if base_path.is_file() or (base_path / "tokenizer.json").is_file():
        from .tokenizer import load_tokenizer

        tokenizer = load_tokenizer(base)
    tmp = out_dir.with_name(out_dir.name + ".merging")
    if tmp.exists():
        shutil.rmtree(tmp)  # leftover of an interrupted merge to the same --out
    save_hf_dir(model, tmp, tokenizer=tokenizer)
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(tmp, out_dir)
    result = {
        "out_dir": str(out_dir), "onto": onto, "adapters_merged": n_merged,
        "trained_against": "nf4" if trained_nf4 else "base weights",
        "logit_rel_l2_vs_trained": rel_vs_trained,
        "logit_max_abs_diff_vs_trained": (merged_logits - trained_logits).abs().max().item(),
        "dtype": str(dtype).removeprefix("torch."), "tokenizer": tokenizer is not None,
    }
    if onto == "original" and trained_nf4:
        result["note"] = ("merged onto the 16-bit weights, not the NF4 weights the adapter was trained "
                          f"against: logits move by relL2 {rel_vs_trained:.3g} from the trained model")
    elif onto == "original":
        result["note"] = "adapter was trained on the 16-bit weights: --onto original equals --onto trained"
    return result
