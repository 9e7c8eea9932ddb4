"""`entrenar export gguf`: the parser and handler (the library part is entrenar/export.py)."""

from __future__ import annotations

import argparse
from typing import Any

from ..export import export_gguf
from ..formats.gguf_write import EXPORT_TYPES
from .registry import add_command


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a model in a runtime's format (gguf: llama.cpp, Ollama, LM Studio)",
                       description="write a model in a runtime's format")
    formats = p.add_subparsers(dest="export_format", required=True, metavar="FORMAT")
    g = add_command(formats, "gguf", cmd_export_gguf,
                    "MODEL -> one GGUF file that llama.cpp loads (weights, architecture, tokenizer, chat template)")
    g.add_argument("model", metavar="MODEL", help="packaged name, .gguf file, HF directory, run or checkpoint directory")
    g.add_argument("out", metavar="OUT.gguf", help="GGUF file to create (must not exist)")
    g.add_argument("--adapter", default=None,
                   help="LoRA/QLoRA adapter directory (or LoRA run) merged onto MODEL before writing (none)")
    g.add_argument("--type", dest="export_type", choices=EXPORT_TYPES, default="f16",
                   help="stored type of the 2-D weights (norms and biases stay f32); q8_0/q4_0 quantize "
                        "with gguf.quants (f16)")
    g.add_argument("--tokenizer", default=None,
                   help="take the tokenizer from this MODEL/HF directory (MODEL's own)")
    g.add_argument("--force-base", action="store_true",
                   help="merge --adapter even if MODEL is not the base the adapter recorded")


def cmd_export_gguf(args: argparse.Namespace) -> dict[str, Any]:
    result = export_gguf(args.model, args.out, args.export_type, args.adapter, args.tokenizer, args.force_base)
    if not args.json:
        types = ", ".join(f"{k} x{v}" for k, v in sorted(result["tensor_types"].items()))
        merged = f", {result['adapters_merged']} adapters merged" if result["adapters_merged"] else ""
        print(f"wrote {result['out']}: {result['architecture']}, {result['tensors']} tensors ({types}), "
              f"{result['bytes'] / 1e6:.1f} MB written in {result['seconds']:.1f} s ({result['mb_per_s']} MB/s; "
              f"{result['total_seconds']:.1f} s with loading); "
              f"tokenizer: {result['vocab']} tokens, pre-tokenizer {result['pre_tokenizer']}, "
              f"add_bos {str(result['add_bos']).lower()}{merged}")
        for note in result["notes"]:
            print(f"note: {note}")
    return result
