"""`entrenar ...`: the command line. Each command module of this package registers its subcommands
(through `registry`); no library module imports the CLI (tests/test_layers.py).

Contract (docs/design.md): every command takes --json and then prints one JSON object as the last
stdout line -- also when the arguments do not parse, on Ctrl-C and on errors ({"ok": false, ...});
that line is strict JSON (non-finite floats become null, their keys listed under "nonfinite").
Exit 0 success, 1 a check failed (verify, qa) or an internal error (a traceback follows the JSON
line), 2 bad input, 3 a guard stopped training, 4 a rank of a distributed run died, 130 interrupted
(Ctrl-C), 143 stopped by SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import sys
from typing import Any, NoReturn

from ..errors import InputError
from .config_file import add_config_option, apply, check_values, config_path, file_values, leaf_parser

# Modules with a `register(subparsers)` function, in help order.
COMMAND_MODULES = [
    "entrenar.cli.formats",  # inspect, convert
    "entrenar.cli.export",  # export gguf
    "entrenar.cli.verify",  # verify, qa
    "entrenar.cli.data",  # data pack, data sft-from-code, data check
    "entrenar.cli.tokenizer",  # tokenizer train
    "entrenar.cli.models",  # merge, generate
    "entrenar.cli.train",  # pretrain, finetune, eval, plot
    "entrenar.cli.help",  # help TOPIC|COMMAND
]

EXIT_USAGE = 2  # argparse's own exit code for bad arguments: the same as InputError

# Read by torch's CPU allocator when torch loads (so set before any command imports it): buffers of 2 MB and
# more ask for transparent huge pages. Device-to-host copies into fresh memory -- a checkpoint's snapshot,
# final/'s gathered weights -- went 1.33 -> 3.21 GB/s on an H200 host and a 7B run's end 130 -> 80 s
# (bench/RESULTS.md, "The end of a run"). A value the user set wins.
HOST_ALLOCATOR_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


class UsageError(InputError):
    """Arguments that do not parse (argparse's error), raised instead of argparse's sys.exit(2)
    so that `main` can still print the --json line (and the Python API raises it as the InputError it is)."""

    def __init__(self, prog: str, usage: str, message: str):
        self.prog, self.usage, self.message = prog, usage, message
        super().__init__(f"{prog}: error: {message}")


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors raise UsageError; subparsers inherit the class. No abbreviations (issue 38
    item 10: `pretrain --mode lora` was read as `--model lora`, a prefix of a flag pretrain has)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, self.format_usage(), message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="entrenar", description="Train decoder-only LLMs, checked.")
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in COMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    for leaf in _leaves(parser):  # every command takes --config FILE (cli/config_file.py)
        add_config_option(leaf)
    return parser


def _leaves(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [parser]
    return [leaf for p in dict.fromkeys(subs[0].choices.values()) for leaf in _leaves(p)]


def parse_command(argv: list[str], values: dict[str, Any] | None = None, where: str = "") -> argparse.Namespace:
    """The one parse of the CLI and the Python API: `argv` over the values of its --config file, over `values`
    ({key: value}, the API's keyword arguments, named in messages as `where`). UsageError / InputError (exit 2)."""
    parser = build_parser()
    leaf, words = leaf_parser(parser, argv)
    command = " ".join(words)
    given: dict[str, Any] = {}
    path = config_path(leaf, argv[len(words):])
    if path is not None:
        given.update(file_values(leaf, path, command))
    if values:
        given.update(check_values(leaf, values, where, command))
    if given:
        apply(leaf, given)
    return parser.parse_args(argv)


def run_parsed(args: argparse.Namespace) -> dict[str, Any]:
    """Run a parsed command: its result dict, or the exception that is its exit code (main maps it)."""
    _resolve_common(args)
    return args.func(args) or {}


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


def json_text(obj: dict[str, Any]) -> str:
    """One strict JSON line. Non-finite numbers are null and named in "nonfinite"."""
    nonfinite: list[str] = []
    clean = strict_json(obj, nonfinite=nonfinite)
    if nonfinite:
        clean["nonfinite"] = sorted(set(clean.get("nonfinite") or []) | set(nonfinite))
    return json.dumps(clean, default=str, allow_nan=False)


def json_record(obj: dict[str, Any]) -> dict[str, Any]:
    """The dict a --json line carries, as a JSON parser reads it back (what the Python API returns)."""
    return json.loads(json_text(obj))


def emit_json(obj: dict[str, Any]) -> None:
    """Print one strict JSON line (json_text)."""
    print(json_text(obj), flush=True)


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
        from ..devices import resolve_device_reason

        requested = args.device
        args.device, args.device_reason = resolve_device_reason(requested)
        if str(requested).strip().lower() == "auto" and not _other_rank():  # the default: say what it chose
            print(f"device: {args.device} ({args.device_reason})", file=sys.stderr, flush=True)
    if getattr(args, "kernels", None) in ("auto", "triton"):  # triton: refused off CUDA (exit 2)
        from ..kernels import resolve_kernels

        args.kernels = resolve_kernels(args.kernels, getattr(args, "device", "cpu"))


def main(argv: list[str] | None = None) -> int:
    for name, value in HOST_ALLOCATOR_ENV.items():
        os.environ.setdefault(name, value)  # each torchrun rank runs main too; subprocesses inherit it
    from ..stops import handled

    code = 1
    with handled():  # SIGTERM stops a command as Ctrl-C does (stops.py)
        try:
            code = _main(argv)
        finally:
            _announce_end(code)
    _leave_past_writers(code)
    return code


def _main(argv: list[str] | None) -> int:
    from .. import stops
    from ..errors import EntrenarError

    argv = list(sys.argv[1:] if argv is None else argv)
    want_json = _wants_json(argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        args = parse_command(argv)
    except UsageError as e:
        sys.stderr.write(f"{e.usage}{e}\n")  # what argparse itself prints
        if want_json:
            emit_json({"ok": False, "error": str(e), "guard": None, "exit_code": EXIT_USAGE, "usage": True})
        return EXIT_USAGE
    except InputError as e:  # a --config file that does not read, an unknown key or a wrong value in it
        return _failure(command, str(e), e.exit_code, want_json, guard=None)
    except KeyboardInterrupt:
        return _failure(command, "interrupted", stops.exit_code(), want_json, guard=None)
    command, want_json = args.command, bool(getattr(args, "json", False))
    try:
        result = run_parsed(args)
    except EntrenarError as e:
        stops.reporting()
        if not getattr(e, "speaks", True):  # another rank of the job prints its message (train/jobwatch.py)
            return e.exit_code
        if getattr(e, "guard_id", None) or getattr(e, "job_wide", False):  # a verdict every rank holds (a guard
            _settle_ranks()  # on values reduced over ranks, rank 0's run_on_main): each exits with its code,
            if _other_rank():  # and rank 0 prints the job's one message
                return e.exit_code
        return _failure(command, str(e), e.exit_code, want_json, guard=getattr(e, "guard_id", None),
                        **_error_details(e))
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (stops.py); under torchrun only rank 0 raises it
        stops.reporting()
        if _other_rank():
            return stops.exit_code()
        return _failure(command, _interrupted_message(e), stops.exit_code(), want_json, guard=None,
                        **_interrupt_details(e))
    except Exception as e:  # a bug, not the user's input: the JSON line still comes, then the traceback
        stops.reporting()
        if _out_of_memory(e):  # the device's limit, not a bug: what to lower instead of a traceback
            from ..errors import EXIT_OUT_OF_MEMORY, out_of_memory_message

            return _failure(command, out_of_memory_message(command, e), EXIT_OUT_OF_MEMORY, want_json, guard=None,
                            out_of_memory=True)
        if stops.received() is not None and _other_rank():  # rank 0 stopped the job on the signal and said so
            return stops.exit_code()
        if want_json:
            emit_json({"ok": False, "error": f"internal error ({type(e).__name__}: {e}); please report it with "
                                             f"the traceback", "guard": None, "exit_code": 1, "internal": True})
        raise
    if want_json and not _other_rank():  # under torchrun: one JSON line per job, from rank 0
        emit_json({"ok": True, **(result or {})})
    return int((result or {}).get("exit_code", 0))


def _out_of_memory(e: BaseException) -> bool:
    """torch's out-of-memory error (CUDA, or another accelerator's), imported only when torch already is."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(e, oom)


def _other_rank() -> bool:
    from ..train.distributed import other_rank

    return other_rank()


def _settle_ranks() -> None:
    if "WORLD_SIZE" in os.environ:  # only under torchrun: do not import torch.distributed otherwise
        from ..train.distributed import settle_ranks

        settle_ranks()


def _error_details(e: Exception) -> dict[str, Any]:
    details = getattr(e, "details", None)
    return {**({"details": details} if details else {}), **_interrupt_details(e)}


def _leave_past_writers(code: int) -> None:
    """A checkpoint write that an error exit abandoned and that did not stop must not turn this process's exit
    (a torchrun rank's above all) into a crash (train/checkpoint.py leave_past_writers)."""
    checkpoint = sys.modules.get("entrenar.train.checkpoint")  # loaded only by commands that train
    if checkpoint is not None:
        checkpoint.leave_past_writers(code)


def _announce_end(code: int) -> None:
    """Under torchrun, rank 0 tells the other ranks it ended in order (train/jobwatch.py)."""
    if "WORLD_SIZE" in os.environ and not _other_rank():
        from ..train.distributed import current

        if current().active:
            from ..train.jobwatch import announce_end

            announce_end(code)


def _interrupted_message(e: BaseException) -> str:
    """Ctrl-C / SIGTERM: the trainer's interruption names the last complete checkpoint and how to resume."""
    from .. import stops

    what = "interrupted" if stops.received() in (None, signal.SIGINT) else f"stopped by {stops.name()}"
    text = str(e).strip()
    return f"{what}: {text}" if text else what


def _interrupt_details(e: BaseException) -> dict[str, Any]:
    return {k: getattr(e, k) for k in ("checkpoint", "resume_command", "lost_ranks")
            if getattr(e, k, None) is not None}


if __name__ == "__main__":
    sys.exit(main())
