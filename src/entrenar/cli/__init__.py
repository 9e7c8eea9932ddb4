"""The command line: argparse lives only in this package (docs/design.md, "Layout").

main.py       `entrenar ...` and `python -m entrenar`: builds the parser, runs, exit codes, --json
registry.py   add_command and the shared --json/--device/--dtype options
formats.py, export.py, verify.py, data.py, tokenizer.py, models.py, train.py, evaluate.py: each command
group's options and handlers, calling library code
"""

from .main import build_parser, emit_json, main, strict_json

__all__ = ["build_parser", "emit_json", "main", "strict_json"]
