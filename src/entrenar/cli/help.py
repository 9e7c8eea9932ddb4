"""`entrenar help [TOPIC | COMMAND...]`: the longer texts that one line of --help points to (`--dtype`: what each
choice trades), and any command's --help."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from ..errors import InputError
from ..train.config import DTYPE_GUIDE
from .registry import add_command


def _dtype_text() -> str:
    width = max(len(k) for k in DTYPE_GUIDE) + 2
    lines = ["--dtype (pretrain, finetune, eval): the compute dtype. Default auto.", ""]
    for name, text in DTYPE_GUIDE.items():
        body = textwrap.wrap(text, 100 - width)
        lines += [f"  {name:<{width}}{body[0]}", *(" " * (width + 2) + rest for rest in body[1:])]
    return "\n".join(lines)


# topic -> the text `entrenar help TOPIC` prints
TOPICS = {"dtype": _dtype_text}


def cmd_help(args: argparse.Namespace) -> dict[str, Any]:
    from .main import build_parser

    words = list(args.topic)
    if not words:
        text = ("entrenar help TOPIC: " + ", ".join(TOPICS) + "\nentrenar help COMMAND: the command's --help\n\n"
                + build_parser().format_help())
    elif len(words) == 1 and words[0] in TOPICS:
        text = TOPICS[words[0]]()
    else:
        from .config_file import leaf_parser

        parser, known = leaf_parser(build_parser(), words)
        if not known or len(known) != len(words):
            raise InputError(f"help: no topic or command {' '.join(words)!r}; topics: {', '.join(TOPICS)}; "
                             f"commands: `entrenar --help`")
        text = parser.format_help()
    if not args.json:
        print(text)
    return {"topic": " ".join(words), "text": text}


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "help", cmd_help, "longer help: a topic (dtype) or a command's --help")
    p.add_argument("topic", nargs="*", metavar="TOPIC|COMMAND",
                   help=f"a topic ({', '.join(TOPICS)}) or a command, e.g. `data pack` (none: the list)")
