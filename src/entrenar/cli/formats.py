"""`entrenar inspect MODEL` and `entrenar convert MODEL OUT_DIR`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import torch

from ..devices import DTYPES, WEIGHT_DTYPES
from ..errors import InputError
from ..fileio import atomic_dir
from ..outpaths import check_creatable
from .registry import add_command


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "inspect", cmd_inspect,
                    "config plus one row per tensor: name shape stored-dtype mean std min max; of a LoRA/QLoRA "
                    "adapter: base, rank, alpha, targets, parameters, update norms, chat template, manifest")
    p.add_argument("model", help="packaged name, .gguf file, HF directory, run directory or LoRA adapter directory")
    p = add_command(sub, "convert", cmd_convert, "any readable model -> HF directory")
    p.add_argument("model", help="packaged name, .gguf file, HF directory or run directory")
    p.add_argument("out_dir", help="HF directory to create (must not exist)")
    p.add_argument("--dtype", choices=("keep", *WEIGHT_DTYPES), default="keep",
                   help="keep = the stored float dtype (float32 for a quantized GGUF), or fp32 / bf16 (keep)")


def tensor_rows(state: dict[str, torch.Tensor], info: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per tensor; statistics in float64 over the (dequantized) values."""
    rows = []
    stored = info.get("stored_dtypes", {})
    for name, t in state.items():
        x = t.detach().to(torch.float64)
        rows.append({
            "name": name, "shape": list(t.shape), "dtype": stored.get(name, str(t.dtype)),
            "mean": x.mean().item(), "std": x.std(unbiased=False).item() if x.numel() > 1 else 0.0,
            "min": x.min().item(), "max": x.max().item(),
        })
    return rows


def cmd_inspect(args: argparse.Namespace) -> dict:
    from ..formats import load_state
    from ..model_spec import is_adapter_dir, resolve_model

    path = resolve_model(args.model)  # a recorded sha256 that does not match: exit 2 naming the file
    if is_adapter_dir(path):
        return _inspect_adapter(path, args)
    cfg, state, info = load_state(args.model)
    rows = tensor_rows(state, info)
    config = dataclasses.asdict(cfg)
    if not args.json:
        print(f"# {info['path']} ({info['format']})")
        for k, v in config.items():
            if k != "extra" or v:
                print(f"{k:>26}: {v}")
        print(f"{'parameters':>26}: {cfg.num_parameters():,}")
        w = max(len(r["name"]) for r in rows)
        print(f"{'name':<{w}}  {'shape':<14} {'dtype':<8} {'mean':>11} {'std':>11} {'min':>11} {'max':>11}")
        for r in rows:
            shape = "x".join(map(str, r["shape"]))
            print(f"{r['name']:<{w}}  {shape:<14} {r['dtype']:<8} {r['mean']:>11.4g} {r['std']:>11.4g} "
                  f"{r['min']:>11.4g} {r['max']:>11.4g}")
    return {"model": str(info["path"]), "format": info["format"], "config": config,
            "num_parameters": cfg.num_parameters(), "tensors": rows}


def _inspect_adapter(path: Path, args: argparse.Namespace) -> dict:
    """`inspect` of a LoRA/QLoRA adapter directory (peft/describe.py): what it adapts, how much, onto what."""
    from ..peft.describe import describe_adapter

    d = describe_adapter(path, shown_as=args.model)
    if not args.json:
        base = d["base_model"]
        where = ("found" if base["found"] == base["recorded"] else f"found at {base['found']}") if base["found"] \
            else f"NOT FOUND here: {base['note']}"
        kind = "QLoRA adapter (trained against the NF4 base)" if d["qlora"] else "LoRA adapter"
        share = (f" ({d['trainable_percent']:.3f}% of the base's {d['base_parameters']:,}"
                 + (f", from {d['base_parameters_from']}" if d["base_parameters_from"] != "base" else "") + ")"
                 if d["base_parameters"] else " (the base's size is unknown: base not found)")
        chat = d["chat_template"]
        if chat is None:
            chat_line = "none carried (no tokenizer files: commands use the base's)"
        elif not chat["present"]:
            chat_line = "its tokenizer files carry none"
        else:
            same = {True: ", the base's", False: ", not the base's", None: ""}[chat["same_as_base"]]
            chat_line = (f"{chat['file']}, {chat['chars']} characters, sha256 {chat['sha256'][:12]}..{same}"
                         + (", renders tools" if chat["supports_tools"] else ""))
        m = d["manifest"]
        manifest = (f"{m['file']}: {m['files']} files verified"
                    + (f"; not recorded: {', '.join(m['unrecorded'])}" if m["unrecorded"] else "")
                    if m["status"] == "verified" else m["note"])
        print(f"# {d['adapter']} ({kind}, PEFT format)")
        for label, value in (("base model", f"{base['recorded']} ({where})"), ("rank", d["rank"]),
                             ("alpha", f"{d['alpha']:g} (scaling {d['scaling_rule']} = {d['scaling']:g})"),
                             ("target modules", ", ".join(d["target_modules"]) if isinstance(d["target_modules"], list)
                              else f"{d['target_modules']!r} (a regex)"), ("dropout", f"{d['dropout']:g}"),
                             ("trainable parameters", f"{d['trainable_parameters']:,}{share}"),
                             ("chat template", chat_line), ("manifest", manifest)):
            print(f"{label:>22}: {value}")
        print(f"{'target':<12} {'modules':>7} {'mean ||B@A||*s':>15} {'max':>11} {'zero B':>7}")
        for target, t in d["update_norms"].items():
            print(f"{target:<12} {t['modules']:>7} {t['mean']:>15.4g} {t['max']:>11.4g} {t['zero_b']:>7}")
        if d["untrained"]:
            print("untrained: every lora_B is zero, so the adapter does not change its base (a run saved before "
                  "its first step, or an adapter that never trained)")
        elif d["zero_b_modules"]:
            print(f"note: {d['zero_b_modules']} of {d['modules']} adapted modules have an all-zero lora_B (no update)")
    return d


def _has_tokenizer(spec: str) -> bool:
    """Whether the source carries a tokenizer (GGUF vocabulary metadata or tokenizer.json).
    A weights-only source converts to a weights-only directory."""
    from ..model_spec import resolve_model

    path = resolve_model(spec)
    if path.is_dir():
        return (path / "tokenizer.json").is_file()
    from ..formats.gguf import open_reader

    return "tokenizer.ggml.tokens" in open_reader(path).fields


def _convert_to_gguf(args: argparse.Namespace, out: Path) -> dict:
    """`convert MODEL x.gguf` is `export gguf MODEL x.gguf` (fp32 -> f32, bf16 -> bf16, keep -> f16)."""
    from .export import cmd_export_gguf

    export_type = {"fp32": "f32", "bf16": "bf16"}.get(args.dtype, "f16")
    ns = argparse.Namespace(model=args.model, out=str(out), export_type=export_type, adapter=None,
                            tokenizer=None, force_base=False, json=args.json)
    if not args.json:
        print(f"{out.name} ends in .gguf: writing a GGUF file as `entrenar export gguf --type {export_type}` "
              f"does (see `entrenar export gguf --help` for --type and --adapter)")
    return {**cmd_export_gguf(ns), "dispatched_to": "export gguf"}


def cmd_convert(args: argparse.Namespace) -> dict:
    from ..formats import load_model, save_hf_dir

    out = Path(args.out_dir)
    if out.suffix.lower() == ".gguf":  # a GGUF file, not an HF directory named x.gguf (issue 18 item 5)
        return _convert_to_gguf(args, out)
    if out.exists():
        raise InputError(f"{out}: output directory already exists; choose a new path")
    check_creatable(out, "OUT_DIR")  # a parent that is a file or read-only: exit 2 before loading
    # a missing parent is made (atomic_dir), as `mkdir -p` would: the README's `convert ... runs/x` works verbatim
    model = load_model(args.model, dtype=DTYPES.get(args.dtype))
    tokenizer = None
    if importlib.util.find_spec("entrenar.tokenizer") is not None and _has_tokenizer(args.model):
        from ..tokenizer import load_tokenizer  # type: ignore[import-not-found]

        tokenizer = load_tokenizer(args.model)
    # nothing half-written under OUT_DIR; the temporary is fileio's hidden per-process name, never a
    # user's directory (OUT_DIR.tmp was deleted here: issue 28 item 1)
    with atomic_dir(out) as tmp:
        save_hf_dir(model, tmp, tokenizer=tokenizer)
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    files = sorted(p.name for p in out.iterdir())
    if not args.json:
        print(f"wrote {out} ({', '.join(files)}; dtype {', '.join(dtypes)})")
    return {"out_dir": str(out), "files": files, "dtype": dtypes, "tokenizer": tokenizer is not None,
            "num_parameters": model.cfg.num_parameters()}
