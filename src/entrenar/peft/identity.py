"""Which base model an adapter belongs to: a weights fingerprint recorded at save time, checked at load.

An adapter of the right shape applied to the wrong base (a random init, another fine-tune of the same
architecture) loads without a shape error and silently computes nonsense. ``base_fingerprint`` samples
``N_SAMPLE`` weights at fixed pseudo-random positions of the base's parameters (sorted by name) and
records them with a digest of every parameter's name and shape: cheap for a 7B model (a few hundred
scalar reads), and independent of the dtype the base is loaded in, because samples are compared with a
tolerance (bf16 vs fp32 storage, or a Q8 GGUF of the same weights, stay well inside it; another
checkpoint of the same shape is ~100% off).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from typing import Any

import torch
from torch import nn

from ..errors import InputError

FINGERPRINT_METHOD = "entrenar-weight-sample-v1"
N_SAMPLE = 256
SAMPLE_SEED = 0x5EED
SAMPLE_REL_TOLERANCE = 0.02  # relL2 of the sampled weights; bf16 rounding is <= 0.4%, Q8_0 ~0.5%


def _sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


@torch.no_grad()
def base_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Identity of ``model``'s weights (call it before wrapping: names and NF4 change afterwards)."""
    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    sizes = [p.numel() for _, p in params]
    total = sum(sizes)
    shapes = _sha256("\n".join(f"{n}:{list(p.shape)}" for n, p in params))
    positions = torch.randint(0, max(total, 1), (N_SAMPLE,),
                              generator=torch.Generator().manual_seed(SAMPLE_SEED)).sort().values.tolist()
    ends = list(itertools.accumulate(sizes))
    picked: list[torch.Tensor] = []
    for i, (_, p) in enumerate(params):  # one gather per tensor, in name order
        start = ends[i] - sizes[i]
        lo, hi = bisect.bisect_left(positions, start), bisect.bisect_left(positions, ends[i])
        if hi > lo:
            idx = torch.tensor(positions[lo:hi], device=p.device) - start
            picked.append(p.detach().reshape(-1)[idx].float())
    sample = torch.cat(picked).cpu() if picked else torch.zeros(0)
    return {"method": FINGERPRINT_METHOD, "tensors": len(params), "parameters": total, "shapes_sha256": shapes,
            "sample_sha256": _sha256(sample.numpy().tobytes()),
            "sample": [float(f"{v:.7g}") for v in sample.tolist()]}


def _difference(recorded: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why the two fingerprints are different bases, or None when they are the same base."""
    if recorded.get("shapes_sha256") != current["shapes_sha256"] or recorded.get("parameters") != current["parameters"]:
        return (f"parameter names/shapes differ ({recorded.get('tensors')} tensors, {recorded.get('parameters')} "
                f"parameters recorded; {current['tensors']} tensors, {current['parameters']} parameters given)")
    if recorded.get("sample_sha256") == current["sample_sha256"]:
        return None
    a = torch.tensor(current["sample"], dtype=torch.float64)
    b = torch.tensor(recorded.get("sample") or [], dtype=torch.float64)
    if a.shape != b.shape:
        return "the recorded weight sample has a different length"
    num, den = (a - b).norm().item(), b.norm().item()
    rel = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    if not rel <= SAMPLE_REL_TOLERANCE:  # also catches NaN
        return f"sampled weights differ by relL2 {rel:.3g} (same base: <= {SAMPLE_REL_TOLERANCE:g})"
    return None


def short_id(fp: dict[str, Any] | None) -> str:
    return (fp or {}).get("sample_sha256", "unrecorded")[:12]


def check_base_identity(note: dict[str, Any], current: dict[str, Any], adapter: str, base_name: str | None,
                        force: bool = False) -> dict[str, Any]:
    """Compare the adapter note's recorded base with the loaded base's fingerprint.

    Returns {"status": "match" | "unrecorded" | "mismatch-forced", "message": ...}; a mismatch without
    ``force`` is an InputError (exit 2) naming both bases and the remedy.
    """
    recorded_name = note.get("base_model")
    recorded = note.get("base_fingerprint")
    if not isinstance(recorded, dict) or recorded.get("method") != FINGERPRINT_METHOD:
        return {"status": "unrecorded",
                "message": f"note: {adapter} records no base fingerprint (written by peft, or by entrenar before "
                           f"it recorded one); cannot check that {base_name or 'the base'} is the model it was "
                           f"trained on ({recorded_name or 'base unrecorded'})"}
    why = _difference(recorded, current)
    if why is None:
        return {"status": "match", "message": f"base matches the adapter's recorded base ({short_id(current)})"}
    what = (f"adapter {adapter} was trained on base {recorded_name!r} (weights {short_id(recorded)}), but the base "
            f"given, {base_name!r} (weights {short_id(current)}), is a different model: {why}")
    if not force:
        raise InputError(f"{what}. Give the base the adapter was trained on, or pass --force-base to apply it "
                         f"to this base anyway")
    return {"status": "mismatch-forced", "message": f"warning: --force-base: {what}; applying it anyway"}
