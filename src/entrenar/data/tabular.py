"""SFT and preference rows the way users have them: local JSONL, JSON, Parquet and CSV files and
`datasets.save_to_disk` folders, with a column mapping (``--columns``).

Sources (never a hub name: a path that does not exist is exit 2, nothing is downloaded):
  .jsonl .jsonl.gz     one JSON object per line (fileio.read_jsonl; needs nothing else)     FILE:LINE
  .json                a JSON array of objects, or JSON Lines under a .json name           FILE:row N
  .parquet .csv        through Hugging Face `datasets` (the optional extra ``datasets``)   FILE:row N
  a directory          `datasets.load_from_disk` (a Dataset; a DatasetDict names its splits) DIR:row N
Rows read through `datasets` drop null fields (a columnar file writes null where a row has no such field),
so a row reads as the JSON object it was written from.

``--columns`` (``Columns``): ``KEY=COLUMN,...`` reads only the named columns, each under its canonical KEY
(prompt, response, completion, system, messages, conversations, instruction, input, output, chosen,
rejected, tools), or a layout by name: ``alpaca`` (instruction, input, output; system if present) or
``sharegpt`` (conversations of {"from", "value"} turns, from human/gpt/system; system, chosen, rejected if
present), optionally followed by KEY=COLUMN overrides (``sharegpt,conversations=chats``). A row without a
named column is an invalid row (FILE:ROW, like every other validation error).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..fileio import MAX_ROW_CHARS, read_jsonl

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
DATASETS_SUFFIXES = {".parquet": "parquet", ".csv": "csv"}
ROW_SUFFIXES = (*JSONL_SUFFIXES, ".json", *DATASETS_SUFFIXES)
SOURCES_HELP = "a JSONL file, a JSON, Parquet or CSV file, or a datasets.save_to_disk folder"
DATASETS_EXTRA = "pip install 'entrenar[datasets]'"

COLUMN_KEYS = ("prompt", "response", "completion", "system", "messages", "conversations", "instruction", "input",
               "output", "chosen", "rejected", "tools")
# layout -> {KEY: (column, required)}
LAYOUTS: dict[str, dict[str, tuple[str, bool]]] = {
    "alpaca": {"instruction": ("instruction", True), "input": ("input", False), "output": ("output", True),
               "system": ("system", False)},
    "sharegpt": {"conversations": ("conversations", True), "system": ("system", False),
                 "chosen": ("chosen", False), "rejected": ("rejected", False)},
}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
COLUMNS_HELP = ("read rows through a column mapping: KEY=COLUMN,... (KEY: " + ", ".join(COLUMN_KEYS) + "), or a "
                "layout by name: alpaca (instruction/input/output) or sharegpt (conversations of from/value turns), "
                "optionally followed by KEY=COLUMN overrides")


class ColumnError(Exception):
    """A row the column mapping cannot read: reason key (sft.INVALID_REASONS) + message (without FILE:ROW)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ---- sources ----------------------------------------------------------------------------------------
def is_dataset_dir(path: str | Path) -> bool:
    """A folder `datasets.save_to_disk` wrote (a Dataset: state.json; a DatasetDict: dataset_dict.json)."""
    p = Path(path)
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def is_row_source(path: str | Path) -> bool:
    """Whether `path` is something this module reads rows from (a file, or a save_to_disk folder)."""
    return Path(path).is_file() or is_dataset_dir(path)


def check_source(path: Path, what: str) -> None:
    """InputError (exit 2) unless `path` is a readable row source; never looked up on a hub."""
    if Path(path).is_file() or is_dataset_dir(path):
        return
    from ..fileio import describe_path

    raise InputError(f"{path}: {describe_path(path)}; {what} is {SOURCES_HELP} (a local path: entrenar never "
                     f"downloads a data set by name)")


def _datasets(path: Path, kind: str) -> Any:
    """The `datasets` module, offline: only local paths are ever passed to it."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise InputError(f"{path}: reading {kind} needs Hugging Face `datasets` (the optional extra `datasets`): "
                         f"{DATASETS_EXTRA}; or give the rows as JSONL, which needs nothing else") from None
    datasets.disable_progress_bars()
    return datasets


def _drop_nulls(value: Any) -> Any:
    """A row read from a columnar file without the nulls its schema filled in for absent fields."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _dataset_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    import tempfile

    suffix = path.suffix.lower()
    kind = DATASETS_SUFFIXES.get(suffix, "a datasets.save_to_disk folder")
    ds_mod = _datasets(path, kind)
    with tempfile.TemporaryDirectory(prefix="entrenar-datasets-") as cache:  # no cache left behind
        try:
            if path.is_dir():
                ds = ds_mod.load_from_disk(str(path), keep_in_memory=True)
                if isinstance(ds, ds_mod.DatasetDict):
                    splits = ", ".join(ds)
                    raise InputError(f"{path}: a DatasetDict with splits {splits}; give one split's folder "
                                     f"(e.g. {path / next(iter(ds), 'train')})")
            elif suffix == ".parquet":
                ds = ds_mod.Dataset.from_parquet(str(path), cache_dir=cache, keep_in_memory=True)
            else:
                ds = ds_mod.Dataset.from_csv(str(path), cache_dir=cache, keep_in_memory=True)
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 -- pyarrow / pandas / datasets errors: the file, not a bug here
            raise InputError(f"{path}: cannot be read as {kind} ({type(e).__name__}: {e})") from None
        for i, row in enumerate(ds, 1):
            yield i, f"{path}:row {i}", _drop_nulls(row)


def _json_rows(path: Path, on_error: Callable[[int, json.JSONDecodeError], None]
               ) -> Iterator[tuple[int, str, Any]]:
    """A .json file: one array of objects (FILE:row N), or JSON Lines (FILE:LINE) as `datasets` also reads it."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason}); JSON must be UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg != "Extra data":
            raise InputError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        for lineno, row in read_jsonl(path, on_error=on_error, max_line_chars=MAX_ROW_CHARS):  # JSON Lines under a .json name
            yield lineno, f"{path}:{lineno}", row
        return
    if isinstance(data, dict) and not any(isinstance(v, list) for v in data.values()):
        data = [data]  # one row written as a single object
    if not isinstance(data, list):
        lists = [k for k, v in data.items() if isinstance(v, list)]
        raise InputError(f"{path}: a JSON object, not an array of rows; its list fields are {', '.join(lists)}: "
                         f"write the rows as a top-level array or as JSON Lines")
    for i, row in enumerate(data, 1):
        yield i, f"{path}:row {i}", row


def iter_rows(path: str | Path, on_error: Callable[[int, json.JSONDecodeError], None]
              ) -> Iterator[tuple[int, str, Any]]:
    """(row number, "FILE:ROW" for messages, row) of every row of a source; a malformed JSONL line goes to
    `on_error` (which may raise). JSONL rows are numbered by line, the others by record from 1."""
    path = Path(path)
    name = path.name.lower()
    if path.is_dir():
        yield from _dataset_rows(path)
    elif name.endswith(".json"):
        yield from _json_rows(path, on_error)
    elif path.suffix.lower() in DATASETS_SUFFIXES:
        yield from _dataset_rows(path)
    else:  # .jsonl, .jsonl.gz and any other name: JSON Lines, as before
        for lineno, row in read_jsonl(path, on_error=on_error, max_line_chars=MAX_ROW_CHARS):
            yield lineno, f"{path}:{lineno}", row


# ---- column mapping ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Columns:
    """A parsed --columns: KEY -> (source column, required), and the layout it started from."""

    spec: str
    mapping: tuple[tuple[str, str, bool], ...]

    def apply(self, row: Any) -> dict[str, Any]:
        """The row under canonical keys (the forms data/sft.py and data/preference.py read), or ColumnError."""
        if not isinstance(row, dict):
            raise ColumnError("not_an_object", f"row is a JSON {type(row).__name__}, not an object")
        out: dict[str, Any] = {}
        for key, column, required in self.mapping:
            if row.get(column) is not None:
                out[key] = row[column]
            elif required:
                # an empty CSV cell or a null reads as absent (columnar files write null for a missing field)
                raise ColumnError("empty_content", f"no {column!r} value (--columns {self.spec} reads it as "
                                                   f"{key}); the row has {', '.join(sorted(row)[:12]) or 'nothing'}")
        if "response" in out:
            out["completion"] = out.pop("response")
        if isinstance(out.get("tools"), str):  # a tools column written as JSON text (CSV, LLaMA-Factory)
            try:
                out["tools"] = json.loads(out["tools"])
            except json.JSONDecodeError as e:
                raise ColumnError("unknown_format", f"the tools column is not JSON ({e.msg})") from None
        if "conversations" in out:
            out["messages"] = sharegpt_messages(out.pop("conversations"), "conversations")
            for key in ("chosen", "rejected"):  # sharegpt preference rows: one {"from": "gpt", ...} turn each
                if isinstance(out.get(key), (dict, list)):
                    turns = out[key] if isinstance(out[key], list) else [out[key]]
                    out[key] = sharegpt_messages(turns, key)
        return _with_system(out)


def _with_system(out: dict[str, Any]) -> dict[str, Any]:
    """A mapped system column as the conversation's first message (dropped when empty)."""
    system = out.pop("system", None)
    if system is None or (isinstance(system, str) and not system.strip()):
        return out
    if not isinstance(system, str):
        raise ColumnError("unknown_format", f"the system column must be a string, got {type(system).__name__}")
    first = {"role": "system", "content": system}
    if isinstance(out.get("messages"), list):
        messages = out["messages"]
        if not (messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"):
            out["messages"] = [first, *messages]  # also a preference row's prompt messages
        return out
    prompt = out.get("prompt")
    if "instruction" in out:  # alpaca with a system column: the instruction form as messages
        extra = out.get("input")
        prompt = out.get("instruction")
        if isinstance(prompt, str) and isinstance(extra, str) and extra.strip():
            prompt = prompt + "\n\n" + extra
        out = {"prompt": prompt, "completion": out.get("output")}
    if "chosen" in out and "rejected" in out:
        out["prompt"] = [first, *(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])]
        return out
    return {"messages": [first, {"role": "user", "content": prompt},
                         {"role": "assistant", "content": out.get("completion")}]}


def sharegpt_messages(turns: Any, key: str) -> list[dict[str, Any]]:
    """ShareGPT turns ({"from": "human"|"gpt"|"system", "value": ...}; {"role", "content"} also read) -> chat
    messages, or ColumnError naming the turn."""
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)  # a conversations column written as JSON text (CSV)
        except json.JSONDecodeError as e:
            raise ColumnError("unknown_format", f"{key} is a string that is not JSON ({e.msg})") from None
    if not isinstance(turns, list) or not turns:
        raise ColumnError("unknown_format" if turns else "empty_content",
                          f"{key} must be a non-empty list of {{\"from\", \"value\"}} turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ColumnError("unknown_format", f"{key}[{i}] is not an object")
        who = turn.get("from", turn.get("role"))
        role = SHAREGPT_ROLES.get(who) if isinstance(who, str) else None
        if role is None:
            raise ColumnError("unknown_role", f"{key}[{i}] is from {who!r}; sharegpt turns are from "
                                              f"{', '.join(SHAREGPT_ROLES)} (tool turns: give the rows as "
                                              f"messages with tool_calls)")
        out.append({"role": role, "content": turn.get("value", turn.get("content"))})
    return out


def parse_columns(spec: str | None) -> Columns | None:
    """--columns -> Columns (None when not given); a bad spec is InputError naming the flag and the fix."""
    if spec is None or not spec.strip():
        return None
    mapping: dict[str, tuple[str, bool]] = {}
    for i, part in enumerate(p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" not in part:
            if i == 0 and part in LAYOUTS:
                mapping.update(LAYOUTS[part])
                continue
            near = difflib.get_close_matches(part, list(LAYOUTS), n=1)
            raise InputError(f"--columns {spec}: {part!r} is not a layout name ({' or '.join(LAYOUTS)}, given "
                             f"first) or a KEY=COLUMN pair" + (f"; did you mean {near[0]}?" if near else ""))
        key, column = (s.strip() for s in part.split("=", 1))
        if key not in COLUMN_KEYS:
            near = difflib.get_close_matches(key, COLUMN_KEYS, n=1)
            raise InputError(f"--columns {spec}: unknown key {key!r}" + (f" (did you mean {near[0]}?)" if near else "")
                             + f"; keys are {', '.join(COLUMN_KEYS)}")
        if not column:
            raise InputError(f"--columns {spec}: {key}= names no column")
        mapping[key] = (column, True)
    if not mapping:
        raise InputError(f"--columns {spec!r}: no columns named; give KEY=COLUMN pairs or a layout "
                         f"({', '.join(LAYOUTS)})")
    if "response" in mapping and "completion" in mapping:
        raise InputError(f"--columns {spec}: response and completion are the same key; give one")
    return Columns(spec, tuple((k, c, r) for k, (c, r) in mapping.items()))


__all__ = [
    "COLUMNS_HELP",
    "COLUMN_KEYS",
    "LAYOUTS",
    "ColumnError",
    "Columns",
    "check_source",
    "is_dataset_dir",
    "is_row_source",
    "iter_rows",
    "parse_columns",
    "sharegpt_messages",
]
