"""`entrenar export gguf MODEL OUT.gguf [--adapter DIR] [--type f32|f16|bf16|q8_0|q4_0]`.

MODEL is anything `--model` accepts (packaged name, .gguf, HF directory, run or checkpoint
directory, or a LoRA run whose adapter names its base). `--adapter` merges a LoRA/QLoRA adapter
onto the base it was trained against first (as `entrenar merge --onto trained` does), checked by
comparing merged and unmerged logits (GUARD-MERGE, merge.merge_checked). The writer is formats/gguf_write.py,
the command cli/export.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from .errors import InputError
from .formats.gguf_write import EXPORT_TYPES, write_gguf
from .outpaths import check_creatable


def _tokenizer_for(spec: str, tokenizer_spec: str | None) -> Any:
    """MODEL's tokenizer; for an adapter directory without one, its recorded base's."""
    from .model_spec import resolve_model
    from .peft import is_adapter_dir
    from .tokenizer import load_tokenizer

    if tokenizer_spec is not None:
        return load_tokenizer(tokenizer_spec)
    path = resolve_model(spec)
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        if is_adapter_dir(path):
            from .peft.base_location import locate_base

            return _tokenizer_for(locate_base(path, shown_as=spec)[0], None)
        raise InputError(f"{path}: has no tokenizer.json, and a GGUF file must carry its tokenizer; "
                         f"pass --tokenizer with the model or directory whose tokenizer this model uses")
    return load_tokenizer(spec)


def _merged_model(spec: str, adapter: str | None, force_base: bool) -> tuple[Any, int]:
    """float32 model with every LoRA/QLoRA adapter folded in (GUARD-MERGE checked), and how many were merged."""
    from .merge import merge_checked
    from .peft import LoRALinear
    from .peft.load import load_model_with_adapter

    model = load_model_with_adapter(spec, adapter, dtype=torch.float32, force_base=force_base)
    if not any(isinstance(m, LoRALinear) for m in model.modules()):
        return model, 0
    n, _, _ = merge_checked(model, "trained")
    return model, n


def _requantized_from(model: torch.nn.Module, export_type: str) -> list[str]:
    """The source's quantized GGUF types when --type quantizes into another type (issue 28 item 9)."""
    from .formats.gguf import _FLOAT_TYPES

    stored = (getattr(model, "source", None) or {}).get("stored_dtypes") or {}
    quantized = sorted({t for t in stored.values() if t not in _FLOAT_TYPES})
    if export_type not in ("q8_0", "q4_0") or not quantized or quantized == [export_type.upper()]:
        return []
    return quantized


def export_gguf(spec: str, out: str | os.PathLike, export_type: str = "f16", adapter: str | None = None,
                tokenizer: str | None = None, force_base: bool = False) -> dict[str, Any]:
    """Load MODEL (+ adapter, merged), write OUT as GGUF; returns the summary of write_gguf."""
    out = Path(out)
    if out.exists():
        raise InputError(f"{out}: already exists; choose a new output path (export never overwrites)")
    # a missing parent directory is made when the file is written (fileio.atomic_write; CLI-OUT-PARENTS)
    check_creatable(out, "OUT")  # a read-only directory: exit 2 before loading (was a traceback at write)
    if export_type not in EXPORT_TYPES:
        raise InputError(f"--type must be one of {', '.join(EXPORT_TYPES)}, got {export_type!r}")
    start = time.perf_counter()
    if tokenizer is None and adapter is not None:  # the adapter's own tokenizer and chat template, as merge takes
        from .peft.load import tokenizer_spec

        own = tokenizer_spec(spec, adapter)
        tokenizer = own if own != str(spec) else None
    chat_tokenizer = _tokenizer_for(spec, tokenizer)  # before the weights: a refusal costs nothing
    model, n_merged = _merged_model(spec, adapter, force_base)
    load_seconds = time.perf_counter() - start
    name = Path(str(spec).rstrip("/")).name.removesuffix(".gguf")
    requantized = _requantized_from(model, export_type)
    result = write_gguf(model.cfg, model.state_dict(), chat_tokenizer, out, export_type, name=name)
    if requantized:
        result["notes"].append(f"{spec} stores its weights as {', '.join(requantized)}; --type {export_type} "
                               f"re-quantizes those already rounded values into another type, which is lossy "
                               f"against the source (greedy answers may change); --type f32 keeps the source's "
                               f"values exactly")
    result.update(model=str(spec), adapter=adapter, adapters_merged=n_merged, requantized_from=requantized or None,
                  load_seconds=round(load_seconds, 3), total_seconds=round(time.perf_counter() - start, 3))
    return result
