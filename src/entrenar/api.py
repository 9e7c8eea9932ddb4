"""The Python API: `entrenar.pretrain(...)`, `finetune`, `evaluate` (= `eval`), `generate`, `export_gguf`.

Each is its CLI command, through the same path: the keyword arguments are named values for the command's flags
(the names of `--config` keys: a flag without its dashes, `seq_len`; cli/config_file.py), parsed by the command's
own parser (so its names, defaults, types and choices, and any flag a command gains, with no second list), then
the same command function runs. The result is the dict the `--json` line carries ({"ok": true, ...}, strict
JSON as parsed back). Failures raise instead of exiting: `entrenar.InputError` (exit 2: bad input, a usage
error), `entrenar.GuardError` (exit 3: a guard stopped the run), KeyboardInterrupt (130/143). Like `--json`, the
API prints no result text on stdout; progress goes to stderr as on the command line. `config="run.yaml"` reads a
config file (keyword arguments override it).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from .cli.config_file import key_name, leaf_parser
from .cli.main import HOST_ALLOCATOR_ENV, build_parser, json_record, parse_command, run_parsed

# the API's functions: name -> the command's words
COMMANDS = {"pretrain": ("pretrain",), "finetune": ("finetune",), "eval": ("eval",), "evaluate": ("eval",),
            "generate": ("generate",), "export_gguf": ("export", "gguf")}


def run_command(words: tuple[str, ...], kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """`entrenar WORDS` with `kwargs` as its flags: the --json result, or the command's exception."""
    for name, value in HOST_ALLOCATOR_ENV.items():  # as cli.main: read by torch's allocator when torch loads
        os.environ.setdefault(name, value)
    values = dict(kwargs)
    config = values.pop("config", None)
    values.setdefault("json", True)  # the result is returned, not printed
    argv = [*words] + (["--config", os.fspath(config)] if config is not None else [])
    args = parse_command(argv, values, where)
    return json_record({"ok": True, **run_parsed(args)})


class Command:
    """One command of the API: call it with the command's flags as keyword arguments."""

    def __init__(self, name: str, words: tuple[str, ...]):
        self.__name__ = self.__qualname__ = name
        self.words = words

    def __call__(self, **kwargs: Any) -> dict[str, Any]:
        return run_command(self.words, kwargs, f"entrenar.{self.__name__}()")

    @property
    def __signature__(self) -> inspect.Signature:
        """The command's flags as keyword-only parameters with the CLI's defaults (required ones: none)."""
        leaf, _ = leaf_parser(build_parser(), list(self.words))
        params = []
        for action in leaf._actions:
            if action.dest in ("help", "config", "json") or not action.dest:  # json: the API's result is returned
                continue
            name = key_name(action)
            default = inspect.Parameter.empty if action.required or not action.option_strings else action.default
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))
        params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None))
        return inspect.Signature(params, return_annotation=dict)

    @property
    def __doc__(self) -> str:  # type: ignore[override]
        leaf, _ = leaf_parser(build_parser(), list(self.words))
        return (f"`entrenar {' '.join(self.words)}` as a function: keyword arguments are its flags without dashes "
                f"(max_seq_len for --max-seq-len); returns the --json result; raises entrenar.InputError / GuardError.\n\n"
                + leaf.format_help())

    def __repr__(self) -> str:
        return f"<entrenar.{self.__name__}: `entrenar {' '.join(self.words)}`>"


pretrain = Command("pretrain", COMMANDS["pretrain"])
finetune = Command("finetune", COMMANDS["finetune"])
evaluate = Command("evaluate", COMMANDS["evaluate"])
eval = Command("eval", COMMANDS["eval"])
generate = Command("generate", COMMANDS["generate"])
export_gguf = Command("export_gguf", COMMANDS["export_gguf"])
