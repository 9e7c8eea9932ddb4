"""The training preflight: a seconds-long verify before step 1.

The training loop calls ``preflight(model, tokenizer, device, dtype, kernels)`` with the model as
it will train (device, weights, kernels; ``dtype`` is the compute dtype, autocast when it
differs from the weights). The probe (a < 32-token sequence and a ``seq_len`` one) runs through
it and through the same weights in float64 on the CPU with the torch reference ops. A broken
bound raises ``GuardError('GUARD-PARITY', ...)`` (exit 3) naming the first op/layer that
diverges; otherwise the numbers come back for ``RUN/preflight.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import GuardError
from .bisect import DTYPE_NAMES, DTYPES, CachedPath, OurPath, reference_model, verify_model
from .probe import build_probe

GUARD_ID = "GUARD-PARITY"


def _summary(rep: dict) -> dict:
    seqs = []
    for s in rep["sequences"]:
        worst = max((e for e in s["layers"] if e["rel_l2"] is not None), key=lambda e: e["rel_l2"], default=None)
        seqs.append({"name": s["name"], "tokens": s["tokens"], "logits_rel_l2": s["logits_rel_l2"],
                     "logits_max_abs": s["logits_max_abs"], "ce_test": s["ce_test"], "ce_ref": s["ce_ref"],
                     "ce_diff": s["ce_diff"], "worst_layer": worst, "first_divergent": s["first_divergent"],
                     "ok": s["ok"]})
    out = {"ok": rep["ok"], "test_path": rep["test_path"], "reference_path": rep["reference_path"],
           "bounds": rep["bounds"], "sequences": seqs, "first_divergent": rep["first_divergent"]}
    if rep.get("grads"):
        out["grads_worst"] = rep["grads"]["worst"]
        out["grads_ok"] = rep["grads"]["ok"]
    return out


def preflight(model: torch.nn.Module, tokenizer: Any, device: str | torch.device,
              dtype: torch.dtype | str, kernels: str, *, seq_len: int = 64, grads: bool = False,
              oracle: Any = None, convert: Callable[[torch.nn.Module], Any] | None = None,
              convert_bounds: str = "fp8") -> dict:
    """Check the run's forward (and optionally one backward) against float64; raise GUARD-PARITY.

    ``convert``: the run's in-place module swap (``--dtype fp8``: train/fp8.py's ``to_float8``), applied once
    the unconverted passes hold and checked by a last pass with the ``convert_bounds`` bounds against the
    same float64 reference. (A run without the preflight applies it itself.)

    Returns a JSON-able dict: ok, seconds, device, dtype, kernels, per-probe-sequence logits
    relL2 / max |diff| / CE of each side / CE difference / worst layer, bounds.
    """
    t0 = time.time()
    run_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    model_kernels = getattr(model, "kernels", kernels)
    probe = build_probe(tokenizer, max(32, seq_len))  # the probe must pass a 32-wide reduction
    if oracle is None:  # one float64 reference for both passes (a caller may share one across calls)
        oracle = CachedPath(OurPath(reference_model(model), label="cpu fp64 kernels=torch (reference)"))
    twin = None
    if run_dtype in (torch.bfloat16, torch.float16):
        # The same kernels in fp32 first: bf16 rounding (1.6e-2 relL2 per block at 7B width) hides a defect as
        # small as Qwen's eps read as 1e-5, which fp32's 1e-5 bounds show. Same float64 reference (cached).
        twin = verify_model(model, probe=probe, dtype=torch.float32, grads=False, oracle=oracle)
    rep = twin if twin is not None and not twin["ok"] else \
        verify_model(model, probe=probe, dtype=run_dtype, against="reference", grads=grads, oracle=oracle)
    unconverted = rep
    if convert is not None and rep["ok"]:
        convert(model)
        rep = verify_model(model, probe=probe, dtype=run_dtype, against="reference", grads=False, oracle=oracle,
                           bounds=convert_bounds)
    result = {"check": "parity", "device": str(device), "dtype": DTYPE_NAMES[run_dtype], "kernels": model_kernels,
              **_summary(rep), "seconds": round(time.time() - t0, 2)}
    if twin is not None:
        result["fp32_twin"] = _summary(twin)
    if rep is not unconverted:
        result["unconverted"] = _summary(unconverted)
        result["dtype"] = convert_bounds
    if model_kernels != kernels:
        result["note"] = f"model.kernels={model_kernels!r} differs from the run's kernels={kernels!r}"
    if not rep["ok"]:
        fd = rep["first_divergent"]
        if fd.get("rel_l2") is None and fd.get("note"):  # unchecked (never recorded), not a measured divergence
            what = f"cannot be checked at {fd['name']} on the {fd['sequence']} probe ({fd['note']})"
        else:
            what = (f"diverges from the float64 reference first at {fd['name']} on the {fd['sequence']} probe "
                    f"(relL2 {fd['rel_l2']:.3e} > bound {fd['bound']:g})")
        path = (f"{device}, {result['dtype']}, kernels={model_kernels}" if rep is not twin else
                f"{device}, kernels={model_kernels}, checked in fp32 before its {DTYPE_NAMES[run_dtype]} run")
        raise GuardError(
            GUARD_ID,
            f"the training path ({path}) {what}; "
            f"likely cause: {fd['hint']}.",
            remedy=f"fix the op named above; `entrenar verify --model MODEL --device {torch.device(device).type} "
                   f"--dtype {DTYPE_NAMES[run_dtype]} --kernels {model_kernels}` prints the full per-layer and "
                   f"per-op table. --no-preflight skips this check (logged), at your own risk.",
            details=result)
    return result
