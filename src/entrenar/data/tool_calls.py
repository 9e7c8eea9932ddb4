"""Tool calls in the OpenAI / Hugging Face chat format: SFT rows that carry them, and calls in generated text.

A row may carry ``tools`` (function schemas), assistant messages with ``tool_calls`` and ``tool`` messages
(the results):

  {"tools": [{"type": "function", "function": {"name": "get_weather", "description": "...",
                                                "parameters": {"type": "object", "properties": {...}}}}],
   "messages": [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"type": "function", "function":
                    {"name": "get_weather", "arguments": {"city": "Paris"}}}]},    (or arguments as a JSON string)
                {"role": "tool", "content": "{\"temp\": 21}"},                   (optional "name", "tool_call_id")
                {"role": "assistant", "content": "It is 21 degrees."}]}

``normalize_message`` and ``check_sequence`` validate them (``ToolCallError``: a skip reason + message; the SFT
loader adds file:line); ``argument_problems`` checks each call's arguments against its tool's JSON schema (types,
required and unknown parameters, enum values; issue 38 item 11). Arguments become JSON objects (dicts), as chat templates expect (Qwen2.5 writes
``arguments | tojson``). ``parse_tool_calls`` reads the calls a model wrote back out of its text, in the format
its chat template teaches (``call_format``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

# Skip reasons (stable keys of DataReport.skipped) for rows with malformed tools or calls.
TOOL_REASONS = ("bad_tools", "bad_tool_call", "tool_without_call", "bad_tool_arguments")


class ToolCallError(Exception):
    """A malformed tool schema, call or result: a skip reason + a message (without file:line)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ---- validation ---------------------------------------------------------------------------------
def validate_tools(tools: Any, where: str = '"tools"') -> list[dict[str, Any]]:
    """A list of function schemas in the OpenAI format -> the list; ToolCallError("bad_tools") otherwise."""
    def bad(msg: str) -> ToolCallError:
        return ToolCallError("bad_tools", f"{where}{msg}; each tool is {{\"type\": \"function\", \"function\": "
                                          f"{{\"name\": ..., \"description\": ..., \"parameters\": {{JSON schema}}}}}}")

    if not isinstance(tools, list) or not tools:
        raise bad(f" must be a non-empty list of tool schemas, got {type(tools).__name__}")
    names: set[str] = set()
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f"[{k}] is not a function schema")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
            raise bad(f"[{k}] has no valid function name (got {name!r})")
        if name in names:
            raise bad(f"[{k}] repeats the function name {name!r}")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad(f"[{k}] ({name}) description must be a string")
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise bad(f"[{k}] ({name}) parameters must be a JSON schema of type object")
    return tools


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or []}


def _call_arguments(raw: Any, where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ToolCallError("bad_tool_call", f"{where} arguments are not valid JSON ({e.msg} at column "
                                                 f"{e.colno}): {raw[:80]!r}") from None
    if not isinstance(raw, dict):
        raise ToolCallError("bad_tool_call", f"{where} arguments must be a JSON object, got {type(raw).__name__}")
    return raw


def normalize_call(call: Any, where: str, known: set[str]) -> dict[str, Any]:
    """One entry of an assistant's ``tool_calls`` -> {"type": "function", "function": {name, arguments: dict}}."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict) \
            or call.get("type", "function") != "function":
        raise ToolCallError("bad_tool_call", f"{where} must be {{\"type\": \"function\", \"function\": "
                                             f"{{\"name\": ..., \"arguments\": ...}}}}")
    fn = call["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError("bad_tool_call", f"{where} has no function name")
    if name not in known:
        listed = ", ".join(sorted(known)) if known else 'none: the row has no "tools"'
        raise ToolCallError("bad_tool_call", f"{where} calls unknown tool {name!r} (tools of this row: {listed})")
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": name, "arguments": _call_arguments(fn.get("arguments", {}), where)}}
    if "id" in call:
        if not isinstance(call["id"], str):
            raise ToolCallError("bad_tool_call", f"{where} id must be a string")
        out["id"] = call["id"]
    return out


def normalize_message(m: dict[str, Any], i: int, known: set[str]) -> dict[str, Any]:
    """An assistant message with ``tool_calls`` or a ``tool`` message -> its normalized form."""
    role = m.get("role")
    content = m.get("content")
    if role == "tool":
        if not isinstance(content, str):
            raise ToolCallError("bad_tool_call", f"messages[{i}] (tool) content must be a string (the tool's "
                                                 f"result), got {type(content).__name__}")
        out = {"role": "tool", "content": content}
        for key in ("name", "tool_call_id"):
            if key in m:
                if not isinstance(m[key], str):
                    raise ToolCallError("bad_tool_call", f"messages[{i}] (tool) {key} must be a string")
                out[key] = m[key]
        return out
    assert role == "assistant" and "tool_calls" in m, "normalize_message: not a tool message"
    calls = m["tool_calls"]
    if not isinstance(calls, list) or not calls:
        raise ToolCallError("bad_tool_call", f"messages[{i}] (assistant) tool_calls must be a non-empty list")
    if content is not None and not isinstance(content, str):
        raise ToolCallError("bad_tool_call", f"messages[{i}] (assistant) content must be a string or null")
    return {"role": "assistant", "content": content or "",
            "tool_calls": [normalize_call(c, f"messages[{i}].tool_calls[{j}]", known) for j, c in enumerate(calls)]}


def check_sequence(messages: list[dict[str, Any]]) -> None:
    """Every ``tool`` message answers a call of the assistant turn before it (only results in between)."""
    calls: list[dict[str, Any]] = []  # the calls of the last assistant turn, answered in order
    answered = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            calls, answered = m.get("tool_calls") or [], 0
        elif m["role"] == "tool":
            if answered >= len(calls):
                what = (f"all {len(calls)} calls of the assistant turn before it are answered" if calls
                        else "no assistant tool call precedes it")
                raise ToolCallError("tool_without_call", f"messages[{i}] is a tool result but {what}")
            ids = [c["id"] for c in calls if "id" in c]
            if "tool_call_id" in m and ids and m["tool_call_id"] not in ids:
                raise ToolCallError("tool_without_call", f"messages[{i}] tool_call_id {m['tool_call_id']!r} "
                                                         f"matches no call before it ({', '.join(ids)})")
            names = [c["function"]["name"] for c in calls]
            if "name" in m and m["name"] not in names:
                raise ToolCallError("tool_without_call", f"messages[{i}] answers {m['name']!r}, which the "
                                                         f"assistant did not call ({', '.join(names)})")
            answered += 1
        else:
            calls, answered = [], 0


# ---- arguments against the tool's JSON schema ---------------------------------------------------------
# The JSON type a value must have for each schema type name: JSON Schema's, and the Python names of BFCL's function
# docs (data/bfcl_data.py GORILLA_TO_OPENAPI: float, dict, tuple, any; `data sft-from-bfcl` writes them converted).
# "any" (None) takes every value; a name not listed here is not judged.
SCHEMA_TYPES: dict[str, str | None] = {
    "integer": "integer", "int": "integer", "number": "number", "float": "number", "string": "string",
    "str": "string", "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "tuple": "array",
    "object": "object", "dict": "object", "null": "null", "any": None}
ENUM_SHOWN = 8  # enum values named in a problem's message


# bool before int: a bool is an int to isinstance, never an "integer" to JSON
_JSON_TYPES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def json_type(value: Any) -> str:
    """The JSON type of a parsed JSON value (bool is "boolean", never "integer")."""
    return next((name for cls, name in _JSON_TYPES if isinstance(value, cls)), type(value).__name__)


def _is_type(value: Any, want: str) -> bool:
    """JSON Schema's rule: an integer is a number; a number with no fractional part (3.0) is an integer."""
    have = json_type(value)
    if want == "number":
        return have in ("integer", "number")
    if want == "integer" and have == "number":
        return math.isfinite(value) and float(value).is_integer()
    return have == want


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def _in_enum(value: Any, enum: list[Any]) -> bool:
    """JSON equality: true is not 1 (Python's True == 1), 1 is 1.0."""
    numeric = ("integer", "number")
    return any(value == e and (json_type(value) == json_type(e) or
                               (json_type(value) in numeric and json_type(e) in numeric)) for e in enum)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _enum_problem(value: Any, enum: list[Any]) -> str:
    shown = ", ".join(_show(e) for e in enum[:ENUM_SHOWN]) + (", ..." if len(enum) > ENUM_SHOWN else "")
    return f"{_show(value)} is not one of the schema's enum values ({shown})"


def value_problems(value: Any, schema: Any, path: str) -> list[tuple[str, str]]:
    """(parameter path, what is wrong) for one argument value against its JSON schema: its type (JSON Schema's
    names and BFCL's; a list of names is any of them), enum (on an array whose enum lists items, not arrays: each
    item, as such schemas mean), an object's properties and an array's items, recursively. null is accepted where
    the schema's default is null or it is "nullable" (the schema names null as the value left unset)."""
    if not isinstance(schema, dict):
        return []
    if value is None and (schema.get("nullable") is True or ("default" in schema and schema["default"] is None)):
        return []
    names = schema.get("type")
    names = names if isinstance(names, list) else [] if names is None else [names]
    wanted = [SCHEMA_TYPES.get(n, "?") if isinstance(n, str) else "?" for n in names]
    judged = names and "?" not in wanted and None not in wanted  # "any" or a name not known: not judged
    if judged and not any(_is_type(value, w) for w in wanted):  # type: ignore[arg-type]
        have = json_type(value)
        what = "null" if have == "null" else f"{_show(value)} is {'an' if have[0] in 'aeiou' else 'a'} {have}"
        return [(path, f"{what}; the schema says {' or '.join(str(n) for n in names)}")]
    out: list[tuple[str, str]] = []
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        if isinstance(value, list) and not any(isinstance(e, list) for e in enum):
            out += [(f"{path}[{i}]", _enum_problem(v, enum)) for i, v in enumerate(value) if not _in_enum(v, enum)]
        elif not _in_enum(value, enum):
            out.append((path, _enum_problem(value, enum)))
    if isinstance(value, dict):
        out += object_problems(value, schema, path)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += value_problems(item, schema["items"], f"{path}[{i}]")
    return out


def object_problems(value: dict[str, Any], schema: dict[str, Any], path: str = "") -> list[tuple[str, str]]:
    """An object against an object schema: each "required" key present, each declared property's value against its
    schema. Keys outside "properties": the tool's own parameters (path "") take no other argument (a function called
    with an argument it does not declare fails), unless "additionalProperties" allows them; a nested object (a
    request body, a record) takes other keys, as JSON Schema's default, unless "additionalProperties" is false.
    An "additionalProperties" schema judges the other keys' values."""
    out: list[tuple[str, str]] = []
    required = schema.get("required")
    for key in required if isinstance(required, list) else []:
        if isinstance(key, str) and key not in value:
            out.append((_join(path, key), "required, missing"))
    props = schema.get("properties")
    if not isinstance(props, dict):
        return out
    extra = schema.get("additionalProperties", path != "")
    for key, item in value.items():
        if key in props:
            out += value_problems(item, props[key], _join(path, key))
        elif isinstance(extra, dict):
            out += value_problems(item, extra, _join(path, key))
        elif extra is not True:
            known = ", ".join(sorted(props)) or "none"
            out.append((_join(path, key), f"not in the schema (its {'keys' if path else 'parameters'}: {known})"))
    return out


def argument_problems(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Every call's arguments in normalized `messages` against the `parameters` schema of the tool it names:
    [{"call": "messages[i].tool_calls[j]", "tool", "parameter" (a path: "unit", "options.days", "dates[1]"),
    "problem"}]. A tool without a parameters schema is not judged; a call of a tool not in `tools` is
    normalize_call's error."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools or []}
    out = []
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call["function"]
            params = schemas.get(fn["name"])
            if not isinstance(params, dict):
                continue
            for parameter, problem in object_problems(fn["arguments"], params):
                out.append({"call": f"messages[{i}].tool_calls[{j}]", "tool": fn["name"], "parameter": parameter,
                            "problem": problem})
    return out


def describe_argument_problem(p: dict[str, Any]) -> str:
    """One problem as a line of text: "get_weather argument 'days': "3" is a string; the schema says integer"."""
    return f"{p['tool']} argument {p['parameter']!r}: {p['problem']}"


def has_tool_parts(messages: list[dict[str, Any]], tools: Any) -> bool:
    """Whether a chat needs a template that renders tools: schemas, calls or results."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


# ---- calls in generated text ------------------------------------------------------------------------
# The formats chat templates teach, keyed by a marker the template writes. Qwen2.5 (and Hermes/NousResearch
# models): <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block per call.
CALL_FORMATS = {"hermes": "<tool_call>"}
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedCalls:
    content: str  # the text outside the call blocks
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"} in order
    errors: list[str] = field(default_factory=list)  # blocks that are not a call (kept in content)


def call_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches, or None when it is not one we can read back."""
    for name, marker in CALL_FORMATS.items():
        if chat_template and marker in chat_template:
            return name
    return None


def parse_tool_calls(text: str, fmt: str | None) -> ParsedCalls:
    """The calls in a model's text. No known format, or no call in the text: the text alone.

    hermes: each <tool_call>{"name", "arguments"}</tool_call> block (the last may be unclosed when generation
    stopped); a reply that is nothing but one such JSON object, without the tags, is a call too."""
    if fmt is None:
        return ParsedCalls(text)
    assert fmt == "hermes", f"parse_tool_calls: unknown format {fmt!r}"
    parsed = ParsedCalls("")
    kept: list[str] = []
    at = 0
    for match in _HERMES_BLOCK.finditer(text):
        body = match.group(1)
        call, error = _hermes_call(body)
        kept.append(text[at:match.start()])
        if call is None:
            parsed.errors.append(f"{error}: {match.group(0)[:120]!r}")
            kept.append(match.group(0))
        else:
            if not match.group(0).rstrip().endswith("</tool_call>"):
                parsed.errors.append(f"call {call['name']!r} not closed with </tool_call> (generation stopped?)")
            parsed.calls.append(call)
        at = match.end()
    kept.append(text[at:])
    parsed.content = "".join(kept).strip()
    if not parsed.calls and not parsed.errors:
        bare = _bare_calls(parsed.content)  # small Qwen models often write the call object without its tags
        if bare:
            parsed.calls, parsed.content = bare, ""
    return parsed


_FENCED = re.compile(r"^```[A-Za-z]*\s*\n(.*?)\n?```$", re.DOTALL)


def _bare_calls(text: str) -> list[dict[str, Any]]:
    """A reply that is nothing but a call object, or a JSON list of them, optionally as one ```json block
    (how Qwen2.5-Coder-0.5B answers, and what templates/qwen2_tools_json.jinja trains); else []."""
    fenced = _FENCED.match(text.strip())
    body = fenced.group(1) if fenced else text
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return []
    calls = [_hermes_call(json.dumps(o))[0] for o in (obj if isinstance(obj, list) and obj else [obj])]
    return calls if all(c is not None for c in calls) else []  # type: ignore[return-value]


def _hermes_call(body: str) -> tuple[dict[str, Any] | None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'not a {"name": ..., "arguments": ...} object'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, "arguments are not valid JSON"
    if not isinstance(args, dict):
        return None, "arguments are not a JSON object"
    return {"name": obj["name"], "arguments": args}, ""


def turn_matches(text: str, message: dict[str, Any], fmt: str | None) -> bool:
    """Whether the trained text of an assistant turn (without its end-of-turn token) is exactly its content
    and tool calls: read back with the template's call format, or, without one, content then each name."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    content = (message.get("content") or "").strip()
    if fmt is not None:
        parsed = parse_tool_calls(text, fmt)
        return (not parsed.errors and parsed.content == content
                and [(c["name"], c["arguments"]) for c in parsed.calls] == calls)
    if not text.strip().startswith(content):
        return False
    at = len(text) - len(text.lstrip()) + len(content)
    for name, _ in calls:
        at = text.find(name, at)
        if at < 0:
            return False
        at += len(name)
    return True


def count_row(counts: dict[str, int], messages: list[dict[str, Any]], tools: Any) -> None:
    """Add one kept row to the report's tool counts."""
    calls = sum(len(m.get("tool_calls") or []) for m in messages)
    counts["rows_with_tools"] += bool(tools)
    counts["rows_with_calls"] += calls > 0
    counts["calls"] += calls
    counts["results"] += sum(m["role"] == "tool" for m in messages)


def load_tools_file(path: str) -> list[dict[str, Any]]:
    """`generate --tools FILE`: a JSON list of function schemas (InputError, exit 2, naming the file)."""
    from pathlib import Path

    from ..errors import InputError

    file = Path(path)
    if not file.is_file():
        raise InputError(f"--tools {file}: no such file (a JSON list of tool schemas)")
    try:
        tools = json.loads(file.read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"--tools {file}: not valid JSON ({e})") from e
    try:
        return validate_tools(tools, where=f"--tools {file}:")
    except ToolCallError as e:
        raise InputError(str(e)) from e
