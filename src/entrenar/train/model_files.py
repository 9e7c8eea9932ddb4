"""The files that make a directory of trained weights a MODEL by itself (issue 13): written into every
checkpoint and final/ of a run (train/commands.py). Not in tokenizer.py: writing adapters and
config.json is above the tokenizer's layer (docs/design.md, "Layout")."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..peft import adapter_writer
from ..tokenizer import save_tokenizer_files


def checkpoint_files(model: Any, tokenizer: Any = None, base_spec: str | None = None) -> Callable[[Path], None]:
    """What write_checkpoint_files writes, taken from the model now (an adapter's tensors copied) and written by
    the returned function later: a checkpoint written in the background while training goes on holds the
    adapter of its own step (train/checkpoint.py)."""
    cfg = model.cfg
    adapter = adapter_writer(model, base_spec) if getattr(model, "peft_config", None) is not None else None
    config = None
    if adapter is None:
        d = cfg.to_hf_dict()
        dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad}
        d["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
        config = json.dumps(d, indent=2) + "\n"
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    if tokenizer is not None:  # a model config without special ids (a preset): the tokenizer's
        for key, tok_id in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id),
                            ("pad_token_id", tokenizer.pad_id)):
            ids[key] = tok_id if ids[key] is None else ids[key]
    gen = json.dumps({k: v for k, v in ids.items() if v is not None}, indent=2) + "\n"

    def write(out: Path) -> None:
        out = Path(out)
        if adapter is not None:
            adapter(out)
        else:
            (out / "config.json").write_text(config)
        if tokenizer is not None:
            save_tokenizer_files(tokenizer, out)
        (out / "generation_config.json").write_text(gen)
    return write


def write_checkpoint_files(model: Any, out_dir: str | os.PathLike, tokenizer: Any = None,
                           base_spec: str | None = None) -> None:
    """The files that make a directory of trained weights a MODEL by itself (issue 13): for full
    training config.json (the weights are the checkpoint's model.safetensors, all parameters under
    their HF names), for LoRA/QLoRA the PEFT adapter files (onto ``base_spec``); and for both
    generation_config.json (bos/eos/pad) and the tokenizer files."""
    checkpoint_files(model, tokenizer, base_spec)(Path(out_dir))
