"""`--dtype fp8`: the decoder's linears train in float8 (torchao's float8 training recipe), the rest as bf16-pure.

What runs in float8: every nn.Linear inside the blocks (q/k/v/o, gate/up/down) whose both dimensions are
multiples of 16 (torch._scaled_mm's rule) -- forward in e4m3, the gradients in e5m2, one dynamic scale per
tensor (torchao's "tensorwise" recipe, torchtitan's default), fp32 accumulation. What does not: the
embedding, the norms, RoPE, attention, the LM head and the loss (the fused linear cross-entropy reads the
head weight in bf16) -- the recipe's usual split, since the head's logits and the norms are where float8's
3 mantissa bits hurt the loss most. Weights, gradients and AdamW state are bf16 (as --dtype bf16-pure):
float8 here is a compute format, never a storage one.

Hardware: float8 matmuls need an NVIDIA GPU of compute capability >= 8.9 (Ada, Hopper: H100/H200);
elsewhere `--dtype fp8` is exit 2 naming the device. torchao is imported only here, only for fp8.

Numerics: e4m3 keeps 3 mantissa bits (unit roundoff u = 2^-4), so one linear moves its output by a few
percent; logits of a 24-block model land ~0.15-0.25 relL2 from float64 at random init (measured on an
H200: llama-370m 0.16, Qwen2.5-0.5B 0.23; 2 blocks on the CPU in torchao's emulation 0.058). The preflight
checks the converted model against the same float64 reference with verify.bisect's "fp8" bounds (depth-grown,
k = relL2 / (u sqrt(depth + 1)) measured 0.52-0.72, bound at k = 2): loose by nature, it catches a broken
float8 path (a wrong scale, a transposed weight, inf/NaN), while the fp32 and bf16 passes before it catch the
model defects (eps, bias, RoPE, causality) at their tight bounds.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError

FP8_MIN_CAPABILITY = (8, 9)
FP8_RECIPE = "tensorwise"


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """Why `--dtype fp8` cannot run on `device`, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"--dtype fp8 needs an NVIDIA GPU with float8 matmuls (compute capability >= 8.9: H100, H200, " \
               f"Ada); this run's device is {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        return f"--dtype fp8 needs compute capability >= 8.9 (H100, H200, Ada); {torch.cuda.get_device_name(device)} " \
               f"has {cap[0]}.{cap[1]}"
    return None


def require_fp8(device: torch.device | str, mode: str) -> None:
    """InputError (exit 2) where `--dtype fp8` cannot run: the device, the mode, a missing torchao."""
    if mode != "full":
        raise InputError(f"--dtype fp8 trains the full model's linears in float8 (--mode full); with --mode {mode} "
                         "use --dtype bf16 (the adapters train in bf16 over the frozen base)")
    reason = fp8_unsupported_reason(device)
    if reason:
        raise InputError(reason + "; use --dtype bf16-pure (the same run in bf16) or --dtype auto")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise InputError(f"--dtype fp8 uses torchao's float8 training ({e}); `pip install torchao` "
                         "or use --dtype bf16-pure") from e


def fp8_eligible(module: nn.Module, name: str) -> bool:
    """A linear inside a block whose dimensions torch._scaled_mm takes (both multiples of 16)."""
    return (isinstance(module, nn.Linear) and (".layers." in f".{name}" or name.startswith("layers."))
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def to_float8(model: nn.Module, *, emulate: bool = False) -> list[str]:
    """Swap the eligible linears of `model` (a CausalLM) for torchao's Float8Linear in place, keeping their
    parameters (same tensors: checkpoints, optimizer and guards see the same names). Returns the swapped
    names. `emulate` runs the float8 casts and matmuls in torch on any device (tests on the CPU)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(FP8_RECIPE)
    if emulate:
        config = Float8LinearConfig(emulate=True)
    swapped: list[str] = []

    def keep(module: nn.Module, name: str) -> bool:
        ok = fp8_eligible(module, name)
        if ok:
            swapped.append(name)
        return ok

    convert_to_float8_training(model.model, module_filter_fn=keep, config=config)
    return [f"model.{n}" for n in swapped]


def float8_linear_names(model: nn.Module) -> list[str]:
    """Names of the Float8Linear modules in `model` (empty when torchao was never imported)."""
    import sys

    mod = sys.modules.get("torchao.float8.float8_linear")
    if mod is None:
        return []
    return [n for n, m in model.named_modules() if isinstance(m, mod.Float8Linear)]
