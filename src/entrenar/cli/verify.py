"""`entrenar verify` and `entrenar qa`."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from ..devices import COMPUTE_DTYPES, DTYPES
from ..errors import InputError
from ..kernels import KERNELS
from ..verify.bisect import format_report, hf_from_source, hf_with_adapter, verify_model


def register(sub: argparse._SubParsersAction) -> None:
    from .registry import add_command, add_device_option, add_dtype_option

    p = add_command(sub, "verify", cmd_verify,
                    "the model's fast path (device/dtype/kernels) vs a float64 reference or transformers: "
                    "logits, CE, per-layer and per-op relL2, gradients; exit 1 naming the first op over its bound")
    p.add_argument("--model", required=True, help="packaged name, .gguf file, HF directory or run directory")
    add_device_option(p)
    add_dtype_option(p, COMPUTE_DTYPES, "compute dtype of the path under test; its bounds are docs/design.md's")
    p.add_argument("--kernels", default="auto", choices=("auto", *KERNELS),
                   help="auto = triton on cuda, torch elsewhere (auto)")
    p.add_argument("--adapter", default=None, help="a LoRA adapter directory to attach to the model (none)")
    p.add_argument("--force-base", action="store_true", help="apply --adapter even if MODEL is not the base it recorded (exit 2 otherwise)")
    p.add_argument("--against", default="reference", choices=("reference", "hf"),
                   help="reference: our eager model in float64 on the CPU, same weights; hf: transformers "
                        "loading the same file itself, which also catches loader bugs (reference)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens in the long probe sequence, >= 32 (512)")
    p.add_argument("--no-grads", action="store_true", help="skip the backward-pass comparison")

    p = add_command(sub, "qa", cmd_qa, "golden prompts generated greedily; gates on empty, repetitive, "
                                       "unterminated, unparseable or gibberish answers; exit 1 on failure")
    p.add_argument("--model", required=True, help="packaged name, .gguf file, HF directory or run directory")
    p.add_argument("--adapter", default=None, help="a LoRA adapter directory to attach to the model (none)")
    p.add_argument("--force-base", action="store_true", help="apply --adapter even if MODEL is not the base it recorded (exit 2 otherwise)")
    add_device_option(p)
    add_dtype_option(p, COMPUTE_DTYPES, "compute dtype the answers are generated in")
    p.add_argument("--kernels", default="auto", choices=("auto", *KERNELS),
                   help="auto = triton on cuda, torch elsewhere (auto)")


def _device(name: str) -> torch.device:
    from ..devices import resolve_device  # the one --device rule for every command

    return torch.device(resolve_device(name))


def _dtype(requested: str, device: torch.device) -> str:
    """--dtype auto -> bf16 on a CUDA device with native bf16, else fp32 (entrenar.devices.resolve_dtype)."""
    from ..devices import resolve_dtype

    dtype, why = resolve_dtype(requested, str(device))
    if requested == "auto":
        print(why, file=sys.stderr, flush=True)
    return dtype


def _load(spec: str, adapter: str | None, device: torch.device, dtype: torch.dtype, kernels: str,
          force_base: bool = False):
    from ..peft.load import load_model_with_adapter

    return load_model_with_adapter(spec, adapter, dtype=dtype, device=device, kernels=kernels,
                                   force_base=force_base)


def run_verify(spec: str, device: str = "cpu", dtype: str = "auto", kernels: str = "torch",
               against: str = "reference", seq_len: int = 512, adapter: str | None = None,
               grads: bool = True, force_base: bool = False) -> dict:
    """Load MODEL on the path under test, load the oracle, compare; the report dict (exit_code 0/1)."""
    from ..model_spec import resolve_model
    from ..peft.base_location import locate_base
    from ..peft.io import is_adapter_dir
    from ..tokenizer import load_tokenizer
    from ..verify.probe import build_probe

    if seq_len < 32:
        raise InputError(f"--seq-len {seq_len}: must be >= 32 so the long probe passes a 32-wide reduction")
    t0 = time.time()
    dev = _device(device)
    dtype = _dtype(dtype, dev)
    path = resolve_model(spec)
    hf_source, hf_adapter = path, adapter
    if adapter is None and is_adapter_dir(path):  # a LoRA run: transformers loads its base, peft the adapter
        hf_source, hf_adapter = resolve_model(locate_base(path, str(spec))[0]), path
    tokenizer = load_tokenizer(spec)
    probe = build_probe(tokenizer, seq_len)
    model = _load(spec, adapter, dev, DTYPES[dtype], kernels, force_base)
    for s in probe:
        tokenizer.check_ids(s.input_ids[0].tolist(), model.cfg.vocab_size)
    hf_model = None
    if against == "hf" and hf_adapter and grads:
        grads = False  # transformers holds the adapter merged: its parameters are not ours to compare by name
    if against == "hf":
        hf_model = hf_from_source(hf_source)
        if hf_adapter:
            hf_model = hf_with_adapter(hf_model, hf_adapter)
    rep = verify_model(model, probe=probe, dtype=DTYPES[dtype], against=against, hf_model=hf_model, grads=grads,
                       meta={"model": str(spec), "path": str(path), "adapter": adapter, "device": str(dev),
                             "kernels": kernels, "seq_len": seq_len})
    rep["total_seconds"] = round(time.time() - t0, 2)
    return rep


def cmd_verify(args: argparse.Namespace) -> dict:
    rep = run_verify(args.model, args.device, args.dtype, args.kernels, args.against, args.seq_len, args.adapter,
                     grads=not args.no_grads, force_base=args.force_base)
    if not args.json:
        print(format_report(rep), flush=True)
    return rep  # cli.emit_json writes a non-finite relL2 as null and lists it under "nonfinite"


def cmd_qa(args: argparse.Namespace) -> dict:
    from ..tokenizer import load_tokenizer
    from ..verify.qa import format_qa, run_qa

    dev = _device(args.device)
    tokenizer = load_tokenizer(args.model)
    model = _load(args.model, args.adapter, dev, DTYPES[_dtype(args.dtype, dev)], args.kernels, args.force_base)
    rep: dict[str, Any] = run_qa(model, tokenizer)
    rep.update(model=args.model, adapter=args.adapter)
    if not args.json:
        print(format_qa(rep), flush=True)
    return rep
