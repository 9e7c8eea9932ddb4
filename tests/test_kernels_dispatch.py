"""Which ops a model runs (Triton by default on CUDA) and that the float64 oracle stays float64."""

from __future__ import annotations

import math

import pytest
import torch

from entrenar.kernels import get_ops, resolve_kernels
from entrenar.kernels import rope as rope_mod


def test_auto_kernels_are_triton_on_cuda_and_torch_elsewhere():
    assert resolve_kernels("auto", "cuda") == "triton"
    assert resolve_kernels("auto", "cuda:1") == "triton"
    assert resolve_kernels("auto", "cpu") == "torch"
    assert resolve_kernels("torch", "cuda") == "torch"  # an explicit choice is kept
    with pytest.raises(ValueError):
        resolve_kernels("cuda-graphs", "cuda")
    assert get_ops(resolve_kernels("auto", "cpu")) is get_ops("torch")


def test_cli_resolves_auto_before_the_command_runs(monkeypatch):
    import importlib

    cli_main = importlib.import_module("entrenar.cli.main")  # the module (entrenar.cli.main is also the function)
    seen = {}
    parser = cli_main.build_parser()
    args = parser.parse_args(["eval", "--model", "m", "--data", "d", "--device", "cuda"])
    assert args.kernels == "auto"
    monkeypatch.setattr(args, "func", lambda a: seen.setdefault("kernels", a.kernels) and {})
    monkeypatch.setattr(cli_main, "parse_command", lambda argv: args)  # the parse as the CLI would make it
    from entrenar import devices

    monkeypatch.setattr(devices, "resolve_device", lambda name: name)  # this host may have no CUDA
    monkeypatch.setattr(devices, "resolve_device_reason", lambda name: (name, f"--device {name} as given"))
    cli_main.main([])
    assert seen["kernels"] == "triton"


def _rope_fp64_by_hand(x: torch.Tensor, theta: float, style: str) -> torch.Tensor:
    T, D = x.shape[1], x.shape[-1]
    out = torch.empty_like(x)
    for t in range(T):
        for i in range(D // 2):
            a = t / theta ** (2 * i / D)
            c, s = math.cos(a), math.sin(a)
            j, k = (i, i + D // 2) if style == "neox" else (2 * i, 2 * i + 1)
            out[:, t, :, j] = x[:, t, :, j] * c - x[:, t, :, k] * s
            out[:, t, :, k] = x[:, t, :, k] * c + x[:, t, :, j] * s
    return out


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_reference_keeps_float64(style):
    """Regression: the reference rounded float64 inputs to fp32, so the 'float64 oracle' was fp32 there.
    Mutation (x.float() in rope._rotate) leaves ~1e-8 error, far over this 1e-13 bound."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 5, 2, 8, generator=gen, dtype=torch.float64)
    pos = torch.arange(5, dtype=torch.float64)[None]
    inv = 1.0 / (1e4 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    cos, sin = (pos[..., None] * inv).cos(), (pos[..., None] * inv).sin()
    rq, _ = rope_mod.rope_reference(q, q.clone(), cos, sin, style)
    assert rq.dtype == torch.float64
    ref = _rope_fp64_by_hand(q, 1e4, style)
    assert ((rq - ref).norm() / ref.norm()).item() < 1e-13
