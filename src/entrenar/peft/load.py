"""Loading a model to run from a MODEL spec, with a LoRA/QLoRA adapter attached unmerged (generate, eval,
verify, qa, export): the one place where formats/ (the weights) and the adapter files meet."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..formats import load_model, resolve_model
from .base_location import locate_base, located_base_mismatch
from .io import adapter_path, is_adapter_dir, load_adapter
from .nf4_linear import enable_dequantize_once


def load_model_with_adapter(spec: str | os.PathLike, adapter: str | os.PathLike | None = None, *,
                            dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                            kernels: str = "torch", force_base: bool = False):
    """The one way commands load a model to run: MODEL, plus an adapter attached unmerged.

    ``spec`` may itself be an adapter directory (a LoRA run's final/): its recorded base is loaded and the
    adapter attached. The base must be the one the adapter recorded (exit 2 naming both otherwise) unless
    ``force_base``. Returns the model in eval mode on ``device``.
    """
    found_note = None
    if adapter is None:
        path = resolve_model(spec)
        if is_adapter_dir(path):  # its recorded base, from any folder (issue 28 item 3)
            run = str(spec)
            spec, found_note = locate_base(path, shown_as=run)
            adapter = path
            if found_note:
                print(found_note, file=sys.stderr, flush=True)
    model = load_model(spec, dtype=dtype, device=device, kernels=kernels)
    if adapter:
        try:
            model = load_adapter(model, adapter, force_base=force_base, base_name=str(spec)).to(device)
        except InputError as e:
            if found_note is None:
                raise
            raise located_base_mismatch(e, found_note, run) from e
        if torch.device(device).type == "cpu":  # there dequantizing per token is ~20x the matmuls
            enable_dequantize_once(model)
    return model.eval()


def tokenizer_spec(spec: str, adapter: str | os.PathLike | None) -> str:
    """Where the tokenizer of MODEL `spec` plus `adapter` comes from: the adapter's own tokenizer files when
    it has them (a fine-tune saves its tokenizer and any --chat-template into final/, so chats render as they
    were trained), else the model's."""
    if adapter:
        d = adapter_path(adapter)
        if (d / "tokenizer.json").is_file():
            return str(d)
    return str(spec)


def load_any_model(spec: str, device: str = "cpu", kernels: str = "torch",
                   adapter: str | None = None, force_base: bool = False) -> tuple[torch.nn.Module, Any, Path]:
    """A full model (plus `adapter`, unmerged) or a LoRA adapter directory (loaded onto its recorded
    base). Returns (model, tokenizer or None, resolved path)."""
    path = resolve_model(spec)
    model = load_model_with_adapter(spec, adapter, dtype=torch.float32, device=device, kernels=kernels,
                                    force_base=force_base)
    if is_adapter_dir(path):  # an adapter: its tokenizer, else the base's (wherever it is now)
        tok = tokenizer_or_none(str(path) if (path / "tokenizer.json").is_file() else locate_base(path, spec)[0])
    else:  # the model's, or the --adapter's own when it carries one
        tok = tokenizer_or_none(tokenizer_spec(str(path) if path.is_dir() else spec, adapter))
    return model, tok, path


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def tokenizer_or_none(spec: str | None, log: Callable[[str], None] = _note) -> Any:
    """The tokenizer of MODEL `spec`, or None (said through `log`) when it has none."""
    if not spec:
        return None
    from ..tokenizer import load_tokenizer

    try:
        return load_tokenizer(spec)
    except InputError as e:
        log(f"note: no tokenizer from {spec}: {e}")
        return None
