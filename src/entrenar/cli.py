"""`entrenar ...`: the command line. Each area registers its own subcommands (through the leaf
module `cli_registry`, so no library module imports this one).

Contract (docs/design.md): every command takes --json and then prints one JSON object as the last
stdout line -- also when the arguments do not parse, on Ctrl-C and on errors ({"ok": false, ...});
that line is strict JSON (non-finite floats become null, their keys listed under "nonfinite").
Exit 0 success, 1 a check failed (verify, qa) or an internal error (a traceback follows the JSON
line), 2 bad input, 3 a guard stopped training, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from typing import Any, NoReturn

# Modules with a `register(subparsers)` function, in help order.
COMMAND_MODULES = [
    "entrenar.formats.commands",  # inspect, convert
    "entrenar.formats.export",  # export gguf
    "entrenar.verify.commands",  # verify, qa
    "entrenar.data.commands",  # data pack, data sft-from-code, data check
    "entrenar.tokenizer_train",  # tokenizer train
    "entrenar.model_commands",  # merge, generate
    "entrenar.train.commands",  # pretrain, finetune, eval, plot
]

EXIT_USAGE = 2  # argparse's own exit code for bad arguments: the same as InputError
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class UsageError(Exception):
    """Arguments that do not parse (argparse's error), raised instead of argparse's sys.exit(2)
    so that `main` can still print the --json line."""

    def __init__(self, prog: str, usage: str, message: str):
        self.prog, self.usage, self.message = prog, usage, message
        super().__init__(f"{prog}: error: {message}")


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors raise UsageError; subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, self.format_usage(), message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="entrenar", description="Train decoder-only LLMs, checked.")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return parser


def strict_json(obj: Any, path: str = "", nonfinite: list[str] | None = None) -> Any:
    """`obj` with every NaN/Infinity float replaced by None; the dotted path of each is appended
    to `nonfinite`. Strict parsers (JavaScript, jq, Go) reject the bare NaN tokens that
    json.dumps writes by default."""
    if isinstance(obj, float) and not math.isfinite(obj):
        if nonfinite is not None:
            nonfinite.append(path or "$")
        return None
    if isinstance(obj, dict):
        return {k: strict_json(v, f"{path}.{k}" if path else str(k), nonfinite) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v, f"{path}[{i}]", nonfinite) for i, v in enumerate(obj)]
    return obj


def emit_json(obj: dict[str, Any]) -> None:
    """Print one strict JSON line. Non-finite numbers are null and named in "nonfinite"."""
    nonfinite: list[str] = []
    clean = strict_json(obj, nonfinite=nonfinite)
    if nonfinite:
        clean["nonfinite"] = sorted(set(clean.get("nonfinite") or []) | set(nonfinite))
    print(json.dumps(clean, default=str, allow_nan=False), flush=True)


def _wants_json(argv: list[str]) -> bool:
    # argparse has not produced a namespace when parsing fails: look at the raw arguments.
    return "--json" in argv


def _failure(command: str, message: str, code: int, want_json: bool, **extra: Any) -> int:
    print(f"entrenar {command}: {message}" if command else f"entrenar: {message}", file=sys.stderr, flush=True)
    if want_json:
        emit_json({"ok": False, "error": message, "exit_code": code, **extra})
    return code


def _resolve_common(args: argparse.Namespace) -> None:
    """One rule for every command's --device and --kernels (auto = Triton on CUDA)."""
    if getattr(args, "device", None) is not None:
        from .devices import resolve_device

        args.device = resolve_device(args.device)
    if getattr(args, "kernels", None) in ("auto", "triton"):  # triton: refused off CUDA (exit 2)
        from .kernels import resolve_kernels

        args.kernels = resolve_kernels(args.kernels, getattr(args, "device", "cpu"))


def main(argv: list[str] | None = None) -> int:
    from .errors import EntrenarError

    argv = list(sys.argv[1:] if argv is None else argv)
    want_json = _wants_json(argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        sys.stderr.write(f"{e.usage}{e}\n")  # what argparse itself prints
        if want_json:
            emit_json({"ok": False, "error": str(e), "guard": None, "exit_code": EXIT_USAGE, "usage": True})
        return EXIT_USAGE
    except KeyboardInterrupt:
        return _failure(command, "interrupted", EXIT_INTERRUPTED, want_json, guard=None)
    command, want_json = args.command, bool(getattr(args, "json", False))
    try:
        _resolve_common(args)
        result = args.func(args)
    except EntrenarError as e:
        if getattr(e, "guard_id", None):  # a guard decides on values reduced over ranks: every rank stops
            _settle_ranks()  # with it (each exits with its code), and rank 0 prints the job's one message
            if _other_rank():
                return e.exit_code
        return _failure(command, str(e), e.exit_code, want_json, guard=getattr(e, "guard_id", None),
                        **_error_details(e))
    except KeyboardInterrupt as e:
        return _failure(command, _interrupted_message(e), EXIT_INTERRUPTED, want_json, guard=None,
                        **_interrupt_details(e))
    except Exception as e:  # a bug, not the user's input: the JSON line still comes, then the traceback
        if want_json:
            emit_json({"ok": False, "error": f"internal error ({type(e).__name__}: {e}); please report it with "
                                             f"the traceback", "guard": None, "exit_code": 1, "internal": True})
        raise
    if want_json and not _other_rank():  # under torchrun: one JSON line per job, from rank 0
        emit_json({"ok": True, **(result or {})})
    return int((result or {}).get("exit_code", 0))


def _other_rank() -> bool:
    from .train.distributed import other_rank

    return other_rank()


def _settle_ranks() -> None:
    if "WORLD_SIZE" in os.environ:  # only under torchrun: do not import torch.distributed otherwise
        from .train.distributed import settle_ranks

        settle_ranks()


def _error_details(e: Exception) -> dict[str, Any]:
    details = getattr(e, "details", None)
    return {"details": details} if details else {}


def _interrupted_message(e: BaseException) -> str:
    """Ctrl-C: the trainer's interruption names the last complete checkpoint and how to resume."""
    text = str(e).strip()
    return f"interrupted: {text}" if text else "interrupted"


def _interrupt_details(e: BaseException) -> dict[str, Any]:
    return {k: getattr(e, k) for k in ("checkpoint", "resume_command") if getattr(e, k, None) is not None}


if __name__ == "__main__":
    sys.exit(main())
