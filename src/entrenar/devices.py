"""The one parser/validator of `--device` (issue 11: four copies had four rules and defaults)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch

from .errors import InputError

_DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:\d+|auto)$")
DEVICE_CHOICES_HELP = ("cpu | cuda | cuda:N | auto (= this process's GPU when CUDA is available: cuda:LOCAL_RANK "
                       "under torchrun, else cuda:0; the CPU otherwise; the choice and why are logged)")
# issue 36 item 1: with "cpu" as the default a user on a GPU host trained on the CPU (53 min of CPU time, still in
# step 1) unless they also knew --device cuda; every command that computes now uses the GPU it has.
DEFAULT_DEVICE = "auto"

# The --dtype vocabulary of every command, written once (the CLI reads it): a name -> the torch dtype.
# Weights are loaded and saved in WEIGHT_DTYPES (generate, convert); verify and qa also compute in fp16;
# training adds its precision recipes to WEIGHT_DTYPES (train/config.py DTYPES, train/precision.py).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHT_DTYPES = ("fp32", "bf16")
# a training run's --dtype choices (what each means: train/precision.py)
TRAIN_DTYPES = (*WEIGHT_DTYPES, "bf16-weights", "bf16-pure", "fp8")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")
# the training recipes whose matmuls run under bf16 autocast (train/precision.py asserts it is its policies'
# compute_bf16; read here by code below train, e.g. the task eval's generation)
BF16_COMPUTE = ("bf16", "bf16-weights", "bf16-pure", "fp8")
DTYPE_AUTO_HELP = ("auto = bf16 on a CUDA device with native bf16 (compute capability >= 8.0), fp32 on the CPU "
                   "and older GPUs; the choice and its reason are logged")


def resolve_device(name: str) -> str:
    """`resolve_device_reason`'s device."""
    return resolve_device_reason(name)[0]


def _local_rank() -> int | None:
    """LOCAL_RANK as torchrun sets it (one GPU per process on a node), None outside torchrun."""
    raw = os.environ.get("LOCAL_RANK", "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"environment variable LOCAL_RANK={raw!r} is not an integer (torchrun sets it)") from None


def _auto_device() -> tuple[str, str]:
    if not torch.cuda.is_available():
        return "cpu", "--device auto: no CUDA device"
    rank = _local_rank()
    index = rank or 0
    count = torch.cuda.device_count()
    if not 0 <= index < count:  # torchrun started more processes on this node than it has GPUs
        raise InputError(f"--device auto: LOCAL_RANK={index} but this node has {count} CUDA device(s); use "
                         f"torchrun --nproc-per-node <= the number of GPUs, or --device cpu")
    where = f", LOCAL_RANK={rank} under torchrun" if rank is not None else ""
    return f"cuda:{index}", f"--device auto: {torch.cuda.get_device_name(index)}, CUDA available{where}"


def resolve_device_reason(name: str) -> tuple[str, str]:
    """(device, why). 'auto' -> this process's GPU when CUDA is available (cuda:LOCAL_RANK under torchrun, else
    cuda:0), the CPU otherwise; 'cpu', 'cuda', 'cuda:N' are checked against this machine and kept. Anything else
    is an InputError (exit 2) naming the accepted values."""
    name = str(name).strip().lower()
    if not _DEVICE_RE.match(name):
        raise InputError(f"--device {name!r}: not a device; use cpu, cuda, cuda:N or auto")
    if name == "auto":
        return _auto_device()
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError(f"--device {name}: no CUDA device is available (torch.cuda.is_available() is "
                             f"False); use --device cpu")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise InputError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return name, f"--device {name} as given"


# --dtype auto (issue 23): a user's first GPU run was fp32, 10x slower than the bf16 recipe and peers
# (torchtune, litgpt, torchtitan all default to bf16 where the GPU has it). bf16 = fp32 master weights,
# AdamW state and residual stream with bf16 matmuls: the fastest recipe that keeps the 2e-2 logits bound.
AUTO_DTYPE_GPU = "bf16"


def bf16_supported(device: str) -> bool:
    """True on a CUDA device of compute capability >= 8.0 (Ampere and later: native bf16 matmuls)."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    index = int(str(device).partition(":")[2] or torch.cuda.current_device())
    return torch.cuda.get_device_capability(index) >= (8, 0)


def resolve_dtype(requested: str, device: str) -> tuple[str, str]:
    """(dtype, why) for `--dtype REQUESTED` on a resolved `device`. 'auto' is bf16 on a CUDA device with
    native bf16, fp32 elsewhere (the CPU, older GPUs); an explicit dtype is kept as given."""
    if requested != "auto":
        return requested, f"--dtype {requested} as given"
    if bf16_supported(device):
        name = torch.cuda.get_device_name(torch.device(device))
        return AUTO_DTYPE_GPU, (f"--dtype auto: bf16 on {device} ({name} has native bf16): fp32 master weights, "
                                f"bf16 matmuls, inside the 2e-2 logits bound; --dtype fp32 for full precision")
    where = "the CPU" if not str(device).startswith("cuda") else f"{device} (no native bf16)"
    return "fp32", f"--dtype auto: fp32 on {where}"


def on_side_stream(fn: Callable[[], Any], device: torch.device) -> Any:
    """fn() on a fresh CUDA side stream, the current stream then waiting for it: torch's recipe for the eager run
    before a CUDA graph capture (lazy initialisations -- cuBLAS workspaces, Triton kernel loads -- happen
    there, not in the capture). Used by the decode step's and the training step's graphs."""
    here, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(here)
    with torch.cuda.stream(side):
        out = fn()
    here.wait_stream(side)
    return out

