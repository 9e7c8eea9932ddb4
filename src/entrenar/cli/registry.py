"""Command registration, shared by every command module of `entrenar.cli`.

Library modules never import the CLI (issue 11: generate.py and merge.py imported `cli.add_command`,
so importing the library pulled in the command line); the option vocabularies (devices, dtypes) are
library code (`entrenar.devices`) read here. tests/test_layers.py checks both.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..devices import DEFAULT_DEVICE, DEVICE_CHOICES_HELP, DTYPE_AUTO_HELP

JSON_HELP = "print one JSON object as the last stdout line (also on errors: {\"ok\": false, ...})"

CommandFunc = Callable[[argparse.Namespace], dict[str, Any]]


def add_json_flag(p: argparse.ArgumentParser) -> None:
    """--json: the machine-readable contract (docs/design.md, "Command line")."""
    p.add_argument("--json", action="store_true", help=JSON_HELP)


def add_command(sub: argparse._SubParsersAction, name: str, func: CommandFunc, help: str,
                dest: str = "func") -> argparse.ArgumentParser:
    """A subcommand whose `func(args)` returns the JSON-able result dict.

    `dest` names the attribute the function is stored under (a nested group such as `data` keeps
    its own dispatcher in `func` and its subcommands' functions under another name)."""
    p = sub.add_parser(name, help=help, description=help)
    add_json_flag(p)
    p.set_defaults(**{dest: func})
    return p


def add_device_option(p: argparse.ArgumentParser, default: str = DEFAULT_DEVICE) -> None:
    """--device for every command. The value is checked once, by `entrenar.devices.resolve_device`,
    which `cli.main` applies to every command before it runs."""
    p.add_argument("--device", default=default, metavar="DEVICE",
                   help=f"{DEVICE_CHOICES_HELP} ({default})")


def add_dtype_option(p: argparse.ArgumentParser, choices: tuple[str, ...], what: str) -> None:
    """--dtype with 'auto' (the default) first; `entrenar.devices.resolve_dtype` turns it into a dtype once
    the device is known."""
    p.add_argument("--dtype", default="auto", choices=("auto", *choices),
                   help=f"{what}; {DTYPE_AUTO_HELP} (auto)")
