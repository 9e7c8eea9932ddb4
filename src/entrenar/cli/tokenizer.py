"""`entrenar tokenizer train`: the parser and handler (the library part is tokenizer_train.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..tokenizer_train import train_tokenizer
from .registry import add_command, add_json_flag


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    report = train_tokenizer(args.inputs, args.vocab_size, args.out, min_frequency=args.min_frequency,
                             strict=args.strict, overwrite=args.overwrite, progress=not args.json)
    stream = sys.stderr if args.json else sys.stdout
    print(f"trained a {report['vocab_size']}-token byte-level BPE tokenizer on {report['inputs']} files "
          f"({report['input_bytes'] / 1e6:.1f} MB) in {report['seconds']:.1f}s -> {report['out']}", file=stream)
    if report["vocab_size"] < args.vocab_size:
        print(f"note: the corpus supports only {report['vocab_size']} tokens at --min-frequency "
              f"{args.min_frequency} (asked for {args.vocab_size})", file=stream)
    if report["skipped"]["count"]:
        print(f"skipped {report['skipped']['count']} file(s) that cannot be read or decoded:", file=stream)
        for line in report["skipped"]["listed"]:
            print(f"  {line}", file=stream)
    return report


def register(sub: argparse._SubParsersAction) -> None:
    def dispatch(args: argparse.Namespace) -> dict:
        return args.tokenizer_func(args)

    p = add_command(sub, "tokenizer", dispatch, "train a tokenizer for from-scratch pretraining")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True, metavar="{train}")
    q = tsub.add_parser("train", help="byte-level BPE (LLaMA-3 split, ChatML specials) from a corpus",
                        description="byte-level BPE (LLaMA-3 split, ChatML specials) from a corpus; writes "
                                    "tokenizer.json + tokenizer_config.json that transformers loads")
    add_json_flag(q)
    q.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary, specials included")
    q.add_argument("--out", required=True, help="output directory (a valid --model/tokenizer spec)")
    q.add_argument("--min-frequency", type=int, default=2, help="a merge must occur this often (2)")
    q.add_argument("--strict", action="store_true",
                   help="exit 2 on a file that cannot be read or decoded instead of skipping it")
    q.add_argument("--overwrite", action="store_true", help="replace an existing --out tokenizer directory")
    q.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, directories or globs: text, .py, .jsonl(.gz) and .parquet with a text field")
    q.set_defaults(tokenizer_func=cmd_train)
