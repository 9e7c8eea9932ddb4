"""Hugging Face model directories: config.json + model.safetensors (or a sharded index).

Loading is strict: every checkpoint tensor must be consumed and every parameter filled, with
the shapes the config implies; config/tensor disagreements (bias tensors without
attention_bias, an lm_head on a tied model) are GUARD-LOAD errors, never guesses. Stored
dtypes are preserved (a BF16 tensor stays BF16, bit for bit, through load and save).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import InputError, LoadError

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name of CausalLM(cfg) and its shape (built on the meta device: no memory)."""
    from ..model import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_state(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise LoadError (GUARD-LOAD) unless `state` fills exactly the parameters of CausalLM(cfg)."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {expected[k]}"
                       for k in set(expected) & set(state) if tuple(state[k].shape) != expected[k])
    problems = []
    bias = [k for k in unexpected if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
    if bias and not cfg.attention_bias:
        problems.append(f"checkpoint has Q/K/V bias tensors ({bias[0]}, ...) but the config says "
                        f"attention_bias=false")
    if "lm_head.weight" in unexpected and cfg.tie_word_embeddings:
        problems.append("checkpoint has lm_head.weight but the config says tie_word_embeddings=true")
    if "lm_head.weight" in missing:
        problems.append("config says tie_word_embeddings=false but the checkpoint has no lm_head.weight")
    if missing:
        problems.append(f"{len(missing)} missing: {_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_names(unexpected)}")
    if misshaped:
        problems.append(f"{len(misshaped)} mis-shaped: {_names(misshaped)}")
    non_float = sorted(k for k, v in state.items() if k in expected and not v.is_floating_point())
    if non_float:
        problems.append(f"non-float tensors: {_names(non_float)}")
    if problems:
        raise LoadError(f"{source}: checkpoint and model disagree: " + "; ".join(problems) + ".",
                        "check that config and weights come from the same model",
                        details={"missing": missing, "unexpected": unexpected, "misshaped": misshaped})


def _names(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise InputError(f"{path}: no config.json (not an HF model directory)")
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: unreadable config.json ({e})") from e
    try:
        return ModelConfig.from_hf_dict(d)
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: {type(e).__name__}: {e}") from e


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a directory, from the shard index when there is one."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise InputError(f"{index}: unreadable shard index ({e})") from e
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise InputError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = model_dir / WEIGHTS_NAME
    if single.is_file():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    if (model_dir / "pytorch_model.bin").is_file():
        raise InputError(f"{model_dir}: only pytorch_model.bin found; re-save it as safetensors")
    raise InputError(f"{model_dir}: no model.safetensors, {INDEX_NAME} or *.safetensors file")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    from ..fileio import regular_file_problem

    problem = regular_file_problem(path)  # a FIFO would block the open for ever
    if problem is not None:
        raise InputError(f"{path}: {problem}; a model's weights must be a safetensors file")
    out: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[k] = f.get_tensor(k)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise InputError(f"{path}: corrupt or truncated safetensors file ({e})") from e
    return out


def load_hf_dir(model_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, state dict with stored dtypes, info) from an HF directory; not yet checked."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        part = read_safetensors(f)
        dup = set(part) & set(state)
        if dup:
            raise LoadError(f"{f}: tensors stored twice across shards: {_names(sorted(dup))}")
        state.update(part)
    stored = {k: str(v.dtype).removeprefix("torch.") for k, v in state.items()}
    return cfg, state, {"format": "hf", "path": str(model_dir), "stored_dtypes": stored,
                        "quantized": False}


def save_hf(cfg: ModelConfig, state: dict[str, torch.Tensor], out_dir: str | Path,
            tokenizer: Any = None) -> Path:
    """Write config.json, model.safetensors (dtypes as given), generation_config.json and, when a
    tokenizer is given, its files. `state` must already be check_state-clean."""
    from ..fileio import write_safetensors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_state(cfg, state, str(out_dir))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    dtypes = {v.dtype for v in tensors.values()}
    d = cfg.to_hf_dict()
    d.pop("torch_dtype", None)
    d["dtype"] = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    (out_dir / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    tmp = out_dir / (WEIGHTS_NAME + f".tmp{os.getpid()}")
    write_safetensors(tensors, tmp, metadata={"format": "pt"})  # hashed as written: final/'s MANIFEST takes it
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_dir / WEIGHTS_NAME)
    gen = {k: getattr(cfg, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(cfg, k) is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_hf(out_dir)
    return out_dir
