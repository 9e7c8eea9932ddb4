"""AdamW with fp32 master state and the learning-rate schedule (warmup + cosine|linear|constant).

Weight decay applies only to tensors with >= 2 dims (matmul weights, embeddings); norms and
biases are not decayed. The schedule is a plain object with a step counter so its state is
one integer in the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULES = ("cosine", "linear", "constant")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into decayed (>= 2-D) and non-decayed (1-D) groups."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    master_dtype: torch.dtype = torch.float32) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, which must be `master_dtype`: fp32 master weights, except under
    --dtype bf16-pure (bf16 weights and AdamW state by choice)."""
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    for g in groups:
        for p in g["params"]:
            assert p.dtype == master_dtype, f"master parameters must be {master_dtype}, got {p.dtype}"
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    # fused on CUDA (one kernel for all tensors); foreach elsewhere. Both are deterministic on CPU.
    kwargs = {"fused": True} if on_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kwargs)


@dataclass
class Schedule:
    """lr(step) = peak * warmup ramp, then decay to min_ratio * peak by `total` steps."""

    peak_lr: float
    warmup: int
    total: int
    kind: str = "cosine"
    min_ratio: float = 0.1
    step: int = 0  # optimizer steps taken so far

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule {self.kind!r} not in {SCHEDULES}")

    def lr_at(self, step: int) -> float:
        """Learning rate for the update that makes optimizer step number `step + 1`."""
        if self.warmup > 0 and step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        if self.kind == "constant":
            return self.peak_lr
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        if self.kind == "linear":
            scale = 1.0 - progress
        else:
            scale = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_ratio + (1.0 - self.min_ratio) * scale)

    def apply(self, optimizer: torch.optim.Optimizer) -> float:
        lr = self.lr_at(self.step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

    def advance(self) -> None:
        self.step += 1

    def state_dict(self) -> dict:
        return {"peak_lr": self.peak_lr, "warmup": self.warmup, "total": self.total, "kind": self.kind,
                "min_ratio": self.min_ratio, "step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
