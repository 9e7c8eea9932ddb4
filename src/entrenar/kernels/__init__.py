"""Kernels: the torch references (``reference.py``) and, per op, a Triton kernel with its autograd.Function.

``get_ops("torch")`` returns the references (any device, any dtype, float64 included; torch only).
``get_ops("triton")`` the fused kernels (CUDA, or the CPU interpreter with TRITON_INTERPRET=1). Triton is
imported there, on first request, not here: ``import entrenar.model`` works where Triton is absent, and
asking for Triton kernels there is an InputError that names the remedy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InputError
from . import reference


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable
    rope: Callable
    swiglu: Callable
    linear_cross_entropy: Callable
    # (x, delta, weight, eps) -> (rms_norm(x + delta), x + delta): a block's residual add fused into its norm
    add_rms_norm: Callable


KERNELS = ("torch", "triton")  # --kernels (with auto first): the one vocabulary, read by the CLI

TORCH_OPS = Ops(reference.rms_norm_reference, reference.rope_reference, reference.swiglu_reference,
                reference.linear_cross_entropy_reference, reference.add_rms_norm_reference)


@functools.cache
def _triton_ops() -> Ops:
    try:
        from . import cross_entropy, rmsnorm, rope, swiglu
    except ImportError as e:
        # Only a missing triton is the user's to fix; an ImportError of anything else is a bug: raise it.
        if e.name is None or not e.name.split(".")[0] == "triton":
            raise
        raise InputError(f"--kernels triton: the triton package cannot be imported ({e}). Install it "
                         f"(`pip install triton`, CUDA Linux; it comes with torch's CUDA wheels) or use "
                         f"--kernels torch.") from e
    return Ops(rmsnorm.rms_norm, rope.rope, swiglu.swiglu, cross_entropy.linear_cross_entropy,
               rmsnorm.add_rms_norm)


def triton_available() -> bool:
    """Whether the Triton kernels can be imported here (imports them on the first call)."""
    try:
        _triton_ops()
    except InputError:
        return False
    return True


def resolve_kernels(kind: str, device: str) -> str:
    """'auto' -> Triton on CUDA (the fast path) when it can be imported, the torch references elsewhere.
    'triton' off CUDA is an InputError (it was a RuntimeError at the first kernel: issue 28 item 7), except
    under the CPU interpreter (TRITON_INTERPRET=1 before import), which the kernel tests use."""
    from . import _common

    on_cuda = str(device).startswith("cuda")
    if kind == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if kind not in KERNELS:
        raise ValueError(f"kernels {kind!r} not in ('auto', 'torch', 'triton')")
    if kind == "triton":
        _triton_ops()  # no importable triton: that remedy first (pip install triton)
    if kind == "triton" and not on_cuda and not _common._INTERPRETER_AT_IMPORT:
        # the device may be --device auto's choice: name it as the run's device, not as a flag the user gave
        raise InputError(f"--kernels triton runs on CUDA GPUs, and this command runs on {device} (the --device "
                         f"given, or --device auto's choice where no GPU is visible). Use --kernels torch (or auto: "
                         f"triton on CUDA, torch elsewhere), or --device cuda on a machine with a GPU")
    return kind


def get_ops(kind: str) -> Ops:
    """The ops of ``kind``; 'triton' without an importable triton raises InputError (exit 2) naming the fix."""
    if kind == "torch":
        return TORCH_OPS
    if kind == "triton":
        return _triton_ops()
    raise ValueError(f"kernels {kind!r} not in ('torch', 'triton')")
