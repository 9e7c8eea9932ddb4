"""Helpers shared by the Triton kernels: output allocation (tests poison it), device checks."""

from __future__ import annotations

import os

import torch


def empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output is allocated here, uninitialised; tests replace it with a NaN-filled one."""
    return torch.empty(shape, dtype=dtype, device=device)


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# @triton.jit reads TRITON_INTERPRET when the kernel modules are imported (this module is imported first).
_INTERPRETER_AT_IMPORT = interpreter_on()


def check_device(*tensors: torch.Tensor) -> None:
    """Triton runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1; anything else is refused loudly."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"triton kernel inputs on several devices: {sorted(map(str, devices))}")
    (device,) = devices
    if device.type == "cuda":
        return
    if device.type == "cpu" and _INTERPRETER_AT_IMPORT:
        return
    raise RuntimeError(f"kernels='triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
                       f"before entrenar is imported; got {device}. Use kernels='torch' here.")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
