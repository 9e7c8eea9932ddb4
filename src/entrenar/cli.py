"""`entrenar ...`: the command line. Each area registers its own subcommands here.

Contract (DESIGN.md): every command takes --json and then prints one JSON object as the last
stdout line; exit 0 success, 2 bad input, 3 a guard stopped training.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

# Modules with a `register(subparsers)` function, in help order.
COMMAND_MODULES = [
    "entrenar.formats.commands",  # inspect, convert
    "entrenar.verify.commands",  # verify, qa
    "entrenar.data.commands",  # data pack, data sft-from-code, data check
    "entrenar.merge",  # merge
    "entrenar.train.commands",  # pretrain, finetune, eval, plot
    "entrenar.generate",  # generate
]


def add_command(sub: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], dict],
                help: str) -> argparse.ArgumentParser:
    """A subcommand whose `func(args)` returns the JSON-able result dict."""
    p = sub.add_parser(name, help=help, description=help)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="entrenar", description="Train decoder-only LLMs, checked.")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return parser


def emit_json(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, default=str), flush=True)


def main(argv: list[str] | None = None) -> int:
    from .errors import EntrenarError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "kernels", None) == "auto":  # one rule for every command: Triton on CUDA
            from .kernels import resolve_kernels

            args.kernels = resolve_kernels(args.kernels, getattr(args, "device", "cpu"))
        result = args.func(args)
    except EntrenarError as e:
        print(f"entrenar {args.command}: {e}", file=sys.stderr, flush=True)
        if getattr(args, "json", False):
            emit_json({"ok": False, "error": str(e), "guard": getattr(e, "guard_id", None),
                       "exit_code": e.exit_code})
        return e.exit_code
    except KeyboardInterrupt:
        print(f"entrenar {args.command}: interrupted", file=sys.stderr)
        return 130
    if getattr(args, "json", False):
        emit_json({"ok": True, **(result or {})})
    code = (result or {}).get("exit_code", 0)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
