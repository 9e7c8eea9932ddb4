"""The learning rate ``--lr auto`` picks, by mode and adapter shape."""

from __future__ import annotations

import math

from ..errors import InputError

LR_FULL = 2e-5
LR_LORA_REF = 2e-4  # well-tried recipe: r=16, alpha=32 (scale 2), Adam, lr 2e-4
REF_RANK, REF_SCALE = 16, 2.0


def auto_lr(mode: str, rank: int | None = None, rslora: bool = False,
            alpha: float | None = None) -> tuple[float, str]:
    """Learning rate for ``--lr auto`` and the reason, by mode and adapter shape.

    full: 2e-5 (the usual fine-tuning rate of all weights with AdamW).

    lora / qlora: Adam moves every entry of A and B by about ``lr`` per step whatever the gradient's
    size. From B = 0, one step changes the weight by dW = scale * dB @ A, where dB is [out, r] with
    entries ~lr and A's rows are independent Kaiming draws; each entry of dW sums r such terms, so
    |dW| grows like ``scale * lr * sqrt(r)`` (like ``r`` once A and B align). We hold that step size at
    the reference recipe's (r=16, alpha=32, scale 2, lr 2e-4) and never exceed 2e-4:

        lr = 2e-4 * min(1, (2 * sqrt(16)) / (scale * sqrt(r)))

    With alpha = 2r (the default) and standard scaling (scale 2) this is 2e-4 * sqrt(16 / r):
    r=8 -> 2e-4, r=64 -> 1e-4, r=256 -> 5e-5 (a fixed 2e-4 at r=256 takes 4x the reference step, and
    such a rank-256 run diverged in its first steps). With rslora (scale = alpha / sqrt(r)) and
    alpha = 2r, scale grows as 2 sqrt(r) and the rate falls as 1/r; with a fixed alpha it is
    constant in r (rsLoRA's point).
    """
    if mode == "full":
        return LR_FULL, "full fine-tuning: AdamW 2e-5 on all weights"
    if mode not in ("lora", "qlora"):
        raise InputError(f"--mode must be full, lora or qlora, got {mode!r}")
    if not rank or rank <= 0:
        raise InputError(f"--lr auto for {mode} needs a positive --rank, got {rank!r}")
    # alpha = 0 divided by zero below (a traceback, not a message); negative or non-finite alphas give
    # a negative or NaN rate that the optimizer would take silently
    if alpha is not None and not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise InputError(f"--alpha must be a positive number for --lr auto (the LoRA scale is alpha/r), "
                         f"got {alpha!r}; omit --alpha for the default 2 x --rank")
    alpha = float(2 * rank if alpha is None else alpha)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    ratio = (REF_SCALE * math.sqrt(REF_RANK)) / (scale * math.sqrt(rank))
    lr = LR_LORA_REF * min(1.0, ratio)
    how = f"alpha/sqrt(r)={scale:.3g} (rslora)" if rslora else f"alpha/r={scale:.3g}"
    reason = (f"{mode} r={rank} alpha={alpha:g} scale {how}: 2e-4 x min(1, 2*sqrt(16)/(scale*sqrt(r))) "
              f"= {lr:.3g}, which keeps one Adam step's weight change at the r=16/alpha=32/2e-4 "
              f"recipe's size")
    return lr, reason
