"""`--profile START[:COUNT]`: where the real CLI's step goes, from the run itself.

torch.profiler records steps START .. START+COUNT-1 of the run (after the warm-up the user chose), and
RUN/profile.json gets per step: wall milliseconds, device (CUDA) or operator (CPU) milliseconds by class
(matmul, attention, our Triton kernels, optimizer, ...), the top kernels, and host idle = wall - kernels
(time the GPU waited for Python). It is the evidence a speed claim needs next to its tokens/s: what a step
is made of, so a gap to a peer can be named. Profiling slows the profiled steps: their tokens/s in
metrics.jsonl say so (`profiled: true`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from ..fileio import atomic_write

DEFAULT_COUNT = 2
TOP_KERNELS = 30

# (class, substrings of a lower-cased kernel/op name), first match wins: cuBLAS/cuDNN kernel names, our
# Triton kernels' names (kernels/*.py), PyTorch's fused optimizer and elementwise kernels
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention (sdpa/flash)", ("flash", "fmha", "attention", "sdpa")),
    ("float8 cast/scale", ("float8", "fp8", "scaled_mm", "amax")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet", "matmul", "wgmma", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear")),
    ("nf4 dequantize", ("dequant", "nf4")),
    ("triton rmsnorm", ("_rms_norm", "rms_norm")),
    ("triton rope", ("_rope", "rope")),
    ("triton swiglu", ("_swiglu", "swiglu")),
    ("triton cross-entropy", ("_ce_rows", "cross_entropy")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("embedding", ("embedding", "index", "scatter", "gather")),
    ("copies/casts", ("copy", "cast", "to_copy", "convert")),
    ("reductions", ("reduce", "sum", "norm")),
)


def classify(name: str) -> str:
    """The class of a kernel or operator name (CLASSES), else 'elementwise/other'."""
    k = name.lower()
    for cls, keys in CLASSES:
        if any(s in k for s in keys):
            return cls
    return "elementwise/other"


def parse_profile(text: str) -> tuple[int, int]:
    """--profile START[:COUNT]: START >= 1, COUNT >= 1 (default 2)."""
    start, _, count = text.partition(":")
    try:
        a, n = int(start), int(count) if count else DEFAULT_COUNT
    except ValueError:
        raise ValueError(f"must be START or START:COUNT (integers), got {text!r}") from None
    if a < 1 or n < 1:
        raise ValueError(f"START and COUNT must be >= 1, got {text!r}")
    return a, n


def summarize(events: Any, steps: int, wall_s: float, on_cuda: bool) -> dict[str, Any]:
    """profile.json's numbers from the profiler's key_averages(): per step, by class and top kernels."""
    by_class: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    for evt in events:
        if on_cuda:  # kernels (and memcpy/memset) only: a CPU operator's device total repeats its kernels'
            if getattr(evt, "device_type", None) != DeviceType.CUDA:
                continue
            us = getattr(evt, "device_time_total", 0.0)
        else:  # CPU: operators' own time (self), so nested ops are not counted twice
            us = getattr(evt, "self_cpu_time_total", 0.0)
        if us <= 0 or evt.key.startswith(("ProfilerStep", "cudaDeviceSynchronize", "[memory]")):
            continue
        ms = us / 1e3 / steps
        by_kernel[evt.key] = by_kernel.get(evt.key, 0.0) + ms
        c = classify(evt.key)
        by_class[c] = by_class.get(c, 0.0) + ms
    busy = sum(by_class.values())
    wall_ms = 1e3 * wall_s / steps
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return {"wall_ms_per_step": round(wall_ms, 3), "kernel_ms_per_step": round(busy, 3),
            "idle_ms_per_step": round(wall_ms - busy, 3) if on_cuda else None,
            "by_class_ms": {k: round(v, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[k[:160], round(v, 3)] for k, v in top]}


class StepProfiler:
    """Profiles steps [start, start+count) of a training loop and writes RUN/profile.json (main process)."""

    def __init__(self, spec: tuple[int, int], run_dir: Path, device: torch.device | str, write: bool = True):
        self.start, self.count = spec
        self.stop = self.start + self.count - 1
        self.run_dir, self.write = Path(run_dir), write
        self.on_cuda = torch.device(device).type == "cuda"
        self._prof: Any = None
        self._t0 = 0.0
        self.result: dict[str, Any] | None = None

    def active(self, step: int) -> bool:
        return self.start <= step <= self.stop

    def before(self, step: int) -> None:
        if step != self.start:
            return
        from torch.profiler import ProfilerActivity, profile

        # on a GPU only the kernels: the host's share is wall - kernels (idle), and CPU-side tracing would
        # slow the launch-bound steps it is meant to explain
        acts = [ProfilerActivity.CUDA] if self.on_cuda else [ProfilerActivity.CPU]
        if self.on_cuda:
            torch.cuda.synchronize()
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def after(self, step: int) -> None:
        if step != self.stop or self._prof is None:
            return
        if self.on_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        self.result = {"steps": [self.start, self.stop], "device": "cuda" if self.on_cuda else "cpu",
                       "measured": "device time per kernel" if self.on_cuda else "CPU self time per operator",
                       **summarize(self._prof.key_averages(), self.count, wall, self.on_cuda)}
        self._prof = None
        if self.write:
            atomic_write(self.run_dir / "profile.json", json.dumps(self.result, indent=2) + "\n")

    def close(self) -> None:
        """A run that ended inside the window (stopped, interrupted): no half profile is written."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
