"""Small tensor helpers shared by the model, the data loaders and verification.

A leaf module (imports only torch and numpy) so that `data` does not depend on `model`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Label value that contributes no loss (the convention of torch's cross_entropy and HF).
IGNORE_INDEX = -100


# Key of a distributed micro-batch holding batch_counts of the job's whole (global) micro-batch.
JOB_COUNTS = "job_counts"


def batch_counts(batch: dict) -> tuple[int, int, int]:
    """(loss tokens, samples without any loss token, tokens) of one batch, counted on the loader's
    (CPU) tensors: no device sync. One row is one sample here (padded or windowed rows), except in a padding-free
    batch (one row of its samples end to end, with "cu_seqlens"): there each sample is counted on its own span, and
    its tokens are all real (what the model processed)."""
    # numpy: a third of torch's time on one thread (this is host time in front of every step)
    labelled = batch["labels"].cpu().numpy() != IGNORE_INDEX
    tokens = int(batch["input_ids"].numel())
    if batch.get("cu_seqlens") is not None:  # per sample: its span's labelled positions
        cu = batch["cu_seqlens"].cpu().numpy().astype(np.int64)
        # a row padded for CUDA graphs ends in a span of padding: neither a sample nor tokens the samples have
        n = batch.get("samples", len(cu) - 1)
        per_row = np.add.reduceat(labelled.reshape(-1).astype(np.int64), cu[:-1])[:n]
        tokens = int(cu[n])
    else:
        per_row = np.count_nonzero(labelled, axis=-1)
    return int(per_row.sum()), int(np.count_nonzero(per_row == 0)), tokens


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at every change of doc id along the sequence."""
    B, T = doc_ids.shape
    idx = torch.arange(T, device=doc_ids.device).expand(B, T)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def rel_l2(test: torch.Tensor, ref: torch.Tensor) -> float:
    """||test - ref|| / ||ref|| in float64 on the CPU; inf when test holds NaN/Inf or ref is zero and
    test is not (a poisoned or unwritten output never passes a bound)."""
    a = test.detach().to("cpu", torch.float64).reshape(-1)
    b = ref.detach().to("cpu", torch.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(test.shape)} vs {tuple(ref.shape)}")
    if not bool(torch.isfinite(a).all()):
        return math.inf
    num, den = torch.linalg.vector_norm(a - b).item(), torch.linalg.vector_norm(b).item()
    if not math.isfinite(num):
        return math.inf
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
                 torch.float64: 2.0 ** -53}


def rounding_bound(n_terms: int, dtype: torch.dtype = torch.float32, c: float = 4.0, floor: float = 1e-5) -> float:
    """relL2 bound for a result computed in `dtype` whose longest reduction adds `n_terms` terms, against
    float64: c * u * sqrt(n), at least `floor`.

    Each addition rounds with a relative error of at most u (the unit roundoff); summed in any order the
    errors behave as independent, zero-mean variables (Higham, Accuracy and Stability of Numerical
    Algorithms, 2.8), so the error of an n-term sum grows like u * sqrt(n), whatever blocking or vector
    width (AVX2, AVX-512, AMX) a CPU's kernels use. c = 4 is four standard deviations. The floor keeps
    the suite's historic 1e-5 where the reduction is short. A defect (a dropped chunk, a wrong index)
    moves a result by O(1e-3) or more, far above the bound."""
    assert n_terms >= 1
    return max(floor, c * UNIT_ROUNDOFF[dtype] * math.sqrt(n_terms))
