"""`--config FILE` and the Python API's keyword arguments: named values for a command's flags, checked against
the command's own parser (so a flag added to a command is a config key at once, with nothing else to list).

A key is a flag's name without its dashes (`seq_len` or `seq-len`; an alias such as `max_seq_len` too), or a
positional argument's name (`export gguf`'s `model`, `out`). Each value is converted and checked as the command
line would check its text (the flag's type and choices); a value of the wrong kind (text for a switch, a
fraction for an integer) is InputError (exit 2) naming the key and the file, and so is an unknown key, with the
nearest valid one. A `run.json` (what `pretrain`/`finetune` record, train/commands.py) is read as the run's
flags: its `config`, `lora` and `data` sections by field name (a flag's dest); what is not a flag of the
command there is provenance and ignored (RUN_JSON_PROVENANCE).

`apply` sets the values as the parser's defaults, so flags on the command line (parsed after) override them and a
required flag given in the file counts as given.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from ..errors import InputError

CONFIG_FLAG = "--config"
CONFIG_HELP = ("YAML (.yaml/.yml), TOML (.toml) or JSON file of this command's flags, keys as flag names without "
               "dashes (seq_len or seq-len); flags on the command line override it; a run's run.json re-runs "
               "that run (give a new --out) (none)")
# run.json's top-level keys besides its flag sections: where and how the run happened, not what to run
RUN_JSON_SECTIONS = ("config", "lora", "data")
RUN_JSON_PROVENANCE = ("command", "argv", "seed", "model", "tokenizer", "versions", "git_commit", "started_at",
                       "host", "distributed", "resumed")
# keys that are never a file's: the parser's own help, and --config itself (files do not nest)
NOT_KEYS = ("help", "config")


# what TRL / transformers / Axolotl / PEFT call some flags: an unknown key that is one of these names its flag
PEER_NAMES = {"learning_rate": "lr", "max_steps": "steps", "per_device_train_batch_size": "batch_size",
              "micro_batch_size": "batch_size", "gradient_accumulation_steps": "grad_accum", "lora_r": "rank",
              "lora_alpha": "alpha", "lora_dropout": "dropout", "lora_target_modules": "targets",
              "target_modules": "targets", "output_dir": "out", "model_name_or_path": "model", "base_model": "model",
              "max_length": "max_seq_len", "max_seq_length": "max_seq_len", "sequence_len": "max_seq_len",
              "warmup_steps": "warmup", "lr_scheduler_type": "schedule", "max_grad_norm": "clip",
              "gradient_checkpointing": "activation_checkpointing", "eval_steps": "eval_every",
              "save_steps": "save_every", "save_total_limit": "keep", "train_file": "data", "dataset": "data"}


def add_config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(CONFIG_FLAG, default=None, metavar="FILE", help=CONFIG_HELP)


class _PrePass(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # `--config` without its value: the real parse reports it
        raise _NoConfig(message)


class _NoConfig(Exception):
    pass


def config_path(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The --config value of `argv` (a pre-pass: the other flags are left to the real parse)."""
    if not any(CONFIG_FLAG in a.option_strings for a in parser._actions):
        return None
    pre = _PrePass(add_help=False, allow_abbrev=False)
    pre.add_argument(CONFIG_FLAG, default=None)
    try:
        known, _ = pre.parse_known_args(argv)
    except _NoConfig:
        return None
    return known.config


def leaf_parser(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the (sub)command `argv` names (`export gguf ...` -> gguf's), and the command's words."""
    words: list[str] = []
    for token in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or token not in subs[0].choices:
            break
        parser = subs[0].choices[token]
        words.append(token)
    return parser, words


def _value_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction))
            and a.dest != "config"]


def key_names(action: argparse.Action) -> list[str]:
    """The keys that name `action`: each long flag without dashes, in both spellings; a positional's dest."""
    names = [s.lstrip("-") for s in action.option_strings if s.startswith("--")] or [action.dest]
    return sorted({spelling for n in names for spelling in (n, n.replace("-", "_"), n.replace("_", "-"))})


def key_name(action: argparse.Action) -> str:
    """The key that names `action` first: its first long flag (or a positional's dest), with underscores."""
    first = next((s for s in action.option_strings if s.startswith("--")), None)
    return first.lstrip("-").replace("-", "_") if first else action.dest


def keys_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {k: a for a in _value_actions(parser) for k in key_names(a)}


def _flag(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.metavar or action.dest.upper()


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _convert_one(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    """One value as the command line would have parsed it (its type, its choices)."""
    def wrong(expected: str, why: str = "") -> InputError:
        return InputError(f"{where}: {key}: expected {expected} ({_flag(action)}), got {value!r} "
                          f"({_kind(value)}){why}")

    typ = action.type
    if isinstance(value, os.PathLike):  # the API's Path arguments are the command line's text
        value = os.fspath(value)
    if isinstance(value, (bool, dict, set)):
        raise wrong(_type_name(typ))
    if isinstance(value, (list, tuple)):
        if typ in (None, int, float, str):
            raise wrong(_type_name(typ) + " (one value, not a list)")
        value = ":".join(str(v) for v in value)  # a tuple-valued flag's text, e.g. --profile START:COUNT
    if typ is int:
        if not isinstance(value, (int, str)):
            raise wrong("an integer")
    elif typ is float:
        if not isinstance(value, (int, float, str)):
            raise wrong("a number")
    elif typ in (None, str) and not isinstance(value, str):
        raise wrong("text")
    if isinstance(value, str) or typ not in (int, float):  # text goes through the flag's own parser
        try:
            value = typ(str(value)) if typ is not None else value
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise wrong(_type_name(typ), f": {e}") from None
    elif typ is float:
        value = float(value)
    if action.choices is not None and value not in action.choices:
        raise InputError(f"{where}: {key}: {value!r} is not one of {', '.join(map(str, action.choices))} "
                         f"({_flag(action)})")
    return value


def _type_name(typ: Any) -> str:
    return {int: "an integer", float: "a number", str: "text", None: "text"}.get(
        typ, f"a value {getattr(typ, '__name__', 'of the flag')} reads")


def convert(action: argparse.Action, key: str, value: Any, where: str) -> Any:
    """`value` for `action`, checked: a switch takes true/false, a repeatable flag a list, others one value;
    null only where the flag's default is none."""
    if action.nargs == 0:  # store_true / store_false / store_const
        if not isinstance(value, bool):
            raise InputError(f"{where}: {key}: expected true or false ({_flag(action)} is a switch), got "
                             f"{value!r} ({_kind(value)})")
        return action.const if value else (not action.const if isinstance(action.const, bool) else action.default)
    if value is None:
        if action.default is None and not action.required:
            return None
        raise InputError(f"{where}: {key}: expected a value ({_flag(action)}), got null")
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*") or isinstance(action.nargs, int)
    if many:
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        return [_convert_one(action, key, v, where) for v in items]
    return _convert_one(action, key, value, where)


def unknown_key(key: str, valid: list[str], where: str, command: str) -> InputError:
    """The key is not a flag: name the nearest valid key (a peer's name for it, else by spelling)."""
    peer = PEER_NAMES.get(key.replace("-", "_"))
    near = [peer] if peer in valid else difflib.get_close_matches(key.replace("-", "_"), valid, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}?" if near else f"`entrenar {command} --help` lists the flags"
    return InputError(f"{where}: {key!r} is not a flag of `entrenar {command}`; {hint}")


def check_values(parser: argparse.ArgumentParser, values: Mapping[str, Any], where: str,
                 command: str) -> dict[str, Any]:
    """{dest: converted value} of `values` ({key: value}); InputError on an unknown key or a wrong value."""
    keys = keys_of(parser)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in values.items():
        key = str(key)
        if key in NOT_KEYS:
            raise InputError(f"{where}: {key!r} cannot be set here"
                             + (" (config files do not nest)" if key == "config" else ""))
        action = keys.get(key)
        if action is None:
            raise unknown_key(key, sorted({key_name(a) for a in keys.values()}), where, command)
        if action.dest in given:
            raise InputError(f"{where}: {key!r} and {given[action.dest]!r} name the same flag "
                             f"({_flag(action)}); give one")
        given[action.dest] = key
        out[action.dest] = convert(action, key, value, where)
    return out


def is_run_json(data: Mapping[str, Any]) -> bool:
    return isinstance(data.get("config"), dict) and "command" in data and ("argv" in data or "versions" in data)


def run_json_values(parser: argparse.ArgumentParser, data: Mapping[str, Any], where: str,
                    command: str) -> dict[str, Any]:
    """{dest: value} of a run.json: its flag sections by field name; fields that are no flag of `command` (the
    resolved reasons, other commands' fields, fixed settings such as spike_window) and the provenance are ignored.
    """
    if data["command"] != command:
        raise InputError(f"{where}: a run.json of `entrenar {data['command']}`; re-run it with "
                         f"`entrenar {data['command']} --config {where} --out NEW_RUN`")
    by_dest = {a.dest: a for a in _value_actions(parser) if a.option_strings and a.dest not in NOT_KEYS}
    out: dict[str, Any] = {}
    for section in RUN_JSON_SECTIONS:
        for name, value in (data.get(section) or {}).items():
            action = by_dest.get(name)
            if action is None or action.dest in ("json",):
                continue
            out[action.dest] = convert(action, name, value, f"{where} ({section})")
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML, TOML or JSON file; InputError naming the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--config {p}: no such file" + (" (a directory)" if p.is_dir() else ""))
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml", ".json"):
        raise InputError(f"--config {p}: unknown kind of file; name it .yaml, .yml, .toml or .json")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--config {p}: cannot be read ({e})") from None
    import yaml

    toml = _toml()
    try:
        if suffix == ".toml":
            data = toml.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, toml.TOMLDecodeError, json.JSONDecodeError) as e:  # the parsers' own messages
        raise InputError(f"--config {p}: not valid {suffix.lstrip('.').upper()}: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InputError(f"--config {p}: expected a mapping of flag names to values at the top, got "
                         f"{_kind(data)}")
    return data


def _toml() -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the tomli backport (a dependency there)
        import tomli as tomllib
    return tomllib


def file_values(parser: argparse.ArgumentParser, path: str | Path, command: str) -> dict[str, Any]:
    """{dest: value} of the file at `path` for `command`'s parser."""
    data = read_config_file(path)
    if is_run_json(data):
        return run_json_values(parser, data, str(path), command)
    return check_values(parser, data, str(path), command)


def apply(parser: argparse.ArgumentParser, values: Mapping[str, Any]) -> None:
    """`values` ({dest: value}) become the parser's defaults: the command line's flags still override them, and
    a required flag (or positional) given here is no longer required on the command line."""
    actions = {a.dest: a for a in _value_actions(parser)}
    for dest in values:
        action = actions[dest]
        action.required = False
        if not action.option_strings:  # a positional given by name: optional on the command line now
            action.nargs = "?" if action.nargs is None else ("*" if action.nargs == "+" else action.nargs)
    parser.set_defaults(**values)
