"""Typed configuration of a training run: the one source of its defaults."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..devices import resolve_device
from ..errors import InputError
from . import guards

# Resuming with any of these changed would not continue the same run (refused unless allowed).
RESUME_SENSITIVE = ("batch_size", "grad_accum", "seq_len")


@dataclass
class TrainConfig:
    steps: int = 100
    batch_size: int = 8  # micro-batch size; the loaders are built with it
    grad_accum: int = 1
    seq_len: int = 512
    lr: float = 3e-4
    warmup: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0  # 0 = no clipping (the norm is still computed and logged)
    device: str = "cpu"
    dtype: str = "fp32"  # fp32 | bf16 (autocast; master weights and AdamW state stay fp32)
    eval_every: int = 0  # 0: eval at step 0 and at the end only
    eval_batches: int = 0  # 0: the whole eval set
    save_every: int = 0  # 0: save at the end only
    keep: int = 3
    seed: int = 0
    on_nonfinite: str = "stop"
    on_spike: str = "warn"
    spike_window: int = 128
    spike_sigma: float = 6.0
    check_init_loss: bool = False  # pretrained start (--init, finetune): GUARD-INIT-LOSS
    allow_config_change: bool = False
    log_every: int | None = None  # plain-line progress period (None: steps/20)
    extra: dict[str, Any] = field(default_factory=dict)  # mode, model spec, data paths ... (recorded)

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "seq_len"):
            if int(getattr(self, name)) <= 0:
                raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got "
                                 f"{getattr(self, name)}")
        for name in ("eval_every", "eval_batches", "save_every", "keep", "warmup"):
            if int(getattr(self, name)) < 0:
                raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise InputError(f"--lr must be > 0, got {self.lr}")
        if self.clip < 0 or self.weight_decay < 0:
            raise InputError("--clip and --weight-decay must be >= 0")
        if self.dtype not in ("fp32", "bf16"):
            raise InputError(f"--dtype {self.dtype!r} not in fp32|bf16")
        if self.on_nonfinite not in guards.NONFINITE_POLICIES:
            raise InputError(f"--on-nonfinite {self.on_nonfinite!r} not in {guards.NONFINITE_POLICIES}")
        if self.on_spike not in guards.SPIKE_POLICIES:
            raise InputError(f"--on-spike {self.on_spike!r} not in {guards.SPIKE_POLICIES}")
        self.device = resolve_device(self.device)  # the one --device rule (entrenar.devices)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
