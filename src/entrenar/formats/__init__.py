"""Model loading and saving: any MODEL spec (packaged name, .gguf, HF dir, run dir) -> CausalLM.

``load_state`` gives (config, HF-named tensors in their stored dtypes, info); ``load_model``
checks them strictly against the model (GUARD-LOAD) and builds the CausalLM; ``save_hf_dir``
writes an HF directory transformers loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..model_spec import resolve_model

__all__ = ["load_model", "load_state", "resolve_model", "save_hf_dir", "state_dtype"]


def load_state(spec: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, HF-named state dict, info) for a MODEL spec; tensors in their stored dtypes
    (dequantized GGUF tensors as float32). Not yet checked against the model."""
    path = resolve_model(spec)
    if path.is_file():
        from .gguf import load_gguf

        cfg, state, info = load_gguf(path)
    else:
        from ..model_spec import is_adapter_dir

        if is_adapter_dir(path):
            from ..errors import InputError

            raise InputError(f"{path}: is a LoRA adapter directory, not a full model; "
                             f"merge it with `entrenar merge` or load it on its base model")
        from .hf import load_hf_dir

        cfg, state, info = load_hf_dir(path)
    info["spec"] = str(spec)
    return cfg, state, info


def state_dtype(state: dict[str, torch.Tensor], info: dict[str, Any]) -> torch.dtype:
    """The dtype to load as: the stored float dtype when every tensor agrees, else float32."""
    if info.get("quantized"):
        return torch.float32
    dtypes = {v.dtype for v in state.values()}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def load_model(spec: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               kernels: str = "torch"):
    """CausalLM for a MODEL spec, strictly loaded (GUARD-LOAD on any missing / unexpected /
    mis-shaped tensor or config disagreement). dtype None keeps the stored float dtype."""
    from ..model import CausalLM
    from .hf import check_state

    cfg, state, info = load_state(spec)
    check_state(cfg, state, info["path"])
    if dtype is None:
        dtype = state_dtype(state, info)
    with torch.device("meta"):
        model = CausalLM(cfg, kernels=kernels)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.source = info  # where the weights came from (inspect / run.json)
    return model.eval()


def save_hf_dir(model, out_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Write `model` as an HF directory (config.json, model.safetensors in the model's dtypes, no
    lm_head when tied, generation_config.json; tokenizer files via tokenizer.save_hf)."""
    from .hf import save_hf

    return save_hf(model.cfg, model.state_dict(), out_dir, tokenizer)
