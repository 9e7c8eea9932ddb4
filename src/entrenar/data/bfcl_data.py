"""The Berkeley Function Calling Leaderboard's single-turn questions, read from the `bfcl-eval` PyPI package's
data files (never its code: its dependencies are far too heavy), their functions as OpenAI tools, and the calls
its ground truth describes. `evaluate/bfcl.py` scores models on them; `data sft-from-bfcl` turns the live_*
categories into tool-call SFT rows. docs/design.md ("BFCL") is the prose of every rule here.

A question file is `bfcl_eval/data/BFCL_v4_<category>.json` (JSON lines: id, question [[messages of each
turn]], function [schemas]); the answers are `bfcl_eval/data/possible_answer/BFCL_v4_<category>.json` (id,
ground_truth: a list of {function name: {parameter: [allowed values]}}, "" among the values = may be left out).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from .bfcl_words import PYTHON_HINT, name_words

BFCL_PACKAGE = "bfcl-eval==2026.3.23"
# Single-turn Python categories (scored by the AST rules for Python). Java and JavaScript need bfcl-eval's
# string-to-type converters, which are not ported: they are refused by name (parse_bfcl_spec).
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance", "live_simple",
              "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance", "live_relevance")
NOT_PORTED = ("simple_java", "simple_javascript")
ALIASES = {"simple": "simple_python"}
DEFAULT_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
# Categories without ground truth: irrelevance ones are right iff no call is made, live_relevance iff one is.
NO_ANSWER = ("irrelevance", "live_irrelevance", "live_relevance")
# The live categories with calls to train on (disjoint from every non-live category by construction: other files).
LIVE_CALL_CATEGORIES = ("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
# bfcl_eval/utils.py _get_language_specific_hint: appended to every function description when BFCL loads data.
# bfcl_eval/constants/type_mappings.py GORILLA_TO_OPENAPI (the Python types of BFCL's docs -> JSON schema).
GORILLA_TO_OPENAPI = {"integer": "integer", "number": "number", "float": "number", "string": "string",
                      "boolean": "boolean", "bool": "boolean", "array": "array", "list": "array", "dict": "object",
                      "object": "object", "tuple": "array", "any": "string"}


@dataclass(frozen=True)
class BfclQuestion:
    task_id: str  # BFCL's id, e.g. "simple_python_0"
    category: str
    messages: list[dict[str, Any]]  # the first (only) turn's messages
    functions: list[dict[str, Any]]  # BFCL's function docs (with BFCL's Python hint in each description)
    answer: list[dict[str, dict[str, list[Any]]]] | None  # ground truth; None for NO_ANSWER categories


def parse_bfcl_spec(spec: str) -> list[str]:
    """"bfcl" -> the default categories; "bfcl:simple_python,multiple" -> those (aliases resolved, order kept,
    repeats dropped). Unknown or not-ported categories are InputError naming the valid ones."""
    head, _, rest = spec.partition(":")
    if head != "bfcl":
        raise InputError(f"--task {spec}: not a BFCL task (bfcl or bfcl:CATEGORY,...)")
    if not _:
        return list(DEFAULT_CATEGORIES)
    names = [ALIASES.get(c.strip(), c.strip()) for c in rest.split(",")]
    valid = ", ".join(CATEGORIES) + " (simple = simple_python)"
    out: list[str] = []
    for name in names:
        if name in NOT_PORTED:
            raise InputError(f"--task {spec}: {name} is not supported (its values are Java/JavaScript source "
                             f"strings that bfcl-eval's type converters read; not ported); valid: {valid}")
        if name not in CATEGORIES:
            raise InputError(f"--task {spec}: unknown BFCL category {name!r}; valid: {valid}")
        if name not in out:
            out.append(name)
    return out


def bfcl_data_dir() -> Path:
    """bfcl_eval/data inside the installed package, found without importing it."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"BFCL needs the data of the PyPI package {BFCL_PACKAGE}, which is not installed: "
                         f"pip install --no-deps {BFCL_PACKAGE}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data"
    if not (path / f"BFCL_v4_{CATEGORIES[0]}.json").is_file():
        raise InputError(f"{path}: BFCL's question files are missing; reinstall {BFCL_PACKAGE} (--no-deps)")
    return path


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise InputError(f"{path}: missing from the installed bfcl_eval package; reinstall {BFCL_PACKAGE}")
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_bfcl(categories: list[str] | tuple[str, ...], limit: int = 0) -> list[BfclQuestion]:
    """The questions of each category in file order (the first `limit` of each when > 0), with answers."""
    root = bfcl_data_dir()
    out: list[BfclQuestion] = []
    for category in categories:
        assert category in CATEGORIES, category
        entries = _read_lines(root / f"BFCL_v4_{category}.json")
        if limit:
            entries = entries[:limit]
        answers: dict[str, Any] = {}
        if category not in NO_ANSWER:
            answers = {a["id"]: a["ground_truth"] for a in _read_lines(root / "possible_answer" /
                                                                       f"BFCL_v4_{category}.json")}
        for e in entries:
            assert len(e["question"]) == 1, f"{e['id']}: not single-turn"
            functions = copy.deepcopy(e["function"])
            for f in functions:
                f["description"] = f.get("description", "") + PYTHON_HINT
            out.append(BfclQuestion(e["id"], category, e["question"][0], functions,
                                    None if category in NO_ANSWER else answers[e["id"]]))
    return out


# ---- BFCL's function docs as OpenAI tools ---------------------------------------------------------------
def tool_name(name: str) -> str:
    """BFCL's rule for OpenAI-style models (model_handler/utils.py convert_to_tool): '.' -> '_'."""
    return re.sub(r"\.", "_", name)


def _cast_types(properties: dict[str, Any]) -> dict[str, Any]:
    """bfcl_eval's _cast_to_openai_type with GORILLA_TO_OPENAPI: each property's BFCL type -> JSON schema (an
    unknown or missing type is "string"; float gets format "float" and says so in its description), recursing
    into object properties and array items as BFCL does."""
    for value in properties.values():
        kind = value.get("type")
        if kind == "float":
            value["format"] = "float"
            value["description"] = value.get("description", "") + " This is a float type value."
        value["type"] = GORILLA_TO_OPENAPI.get(kind, "string") if kind is not None else "string"
        if value["type"] in ("array", "object"):
            if "properties" in value:
                value["properties"] = _cast_types(value["properties"])
            elif "items" in value:
                items = value["items"]
                items["type"] = GORILLA_TO_OPENAPI.get(items.get("type"), "string")
                if items["type"] == "array" and "items" in items:
                    items["items"]["type"] = GORILLA_TO_OPENAPI.get(items["items"].get("type"), "string")
                elif items["type"] == "object" and "properties" in items:
                    items["properties"] = _cast_types(items["properties"])
    return properties


def openai_tools(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL function docs -> `tools=` of a chat template: {"type": "function", "function": {name (dots as
    underscores), description, parameters (JSON schema of type object)}}."""
    tools = []
    for f in copy.deepcopy(functions):
        params = f.get("parameters") or {"properties": {}}
        params["type"] = "object"
        params["properties"] = _cast_types(params.get("properties", {}))
        fn = {"name": tool_name(f["name"]), "description": f.get("description", ""), "parameters": params}
        tools.append({"type": "function", "function": fn})
    return tools


# ---- the calls the ground truth describes (SFT targets) -----------------------------------------------
def _first_allowed(allowed: list[Any]) -> tuple[bool, Any]:
    """The first allowed value that is not BFCL's "" (left-out) marker: (found, value)."""
    for value in allowed:
        if value != "":
            return True, value
    return False, None


def _concrete(value: Any, schema: dict[str, Any]) -> Any:
    """One allowed value -> the argument to write. A dict parameter's allowed value maps each key to its own
    allowed values (BFCL's dict_checker), as does each dict of an array of dicts; float parameters get floats."""
    kind = schema.get("type")
    if kind == "float" and type(value) is int:
        return float(value)
    if kind == "dict" and isinstance(value, dict):
        return _concrete_dict(value, schema.get("properties", {}))
    if kind in ("array", "tuple") and isinstance(value, list):
        items = schema.get("items", {})
        if items.get("type") == "dict":
            return [_concrete_dict(d, items.get("properties", {})) if isinstance(d, dict) else d for d in value]
        if items.get("type") == "float":
            return [float(v) if type(v) is int else v for v in value]
    return value


def _concrete_dict(value: dict[str, Any], properties: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, allowed in value.items():
        if not isinstance(allowed, list):
            out[key] = allowed
            continue
        found, v = _first_allowed(allowed)
        if found:
            out[key] = _concrete(v, properties.get(key, {}))
    return out


def ground_truth_calls(question: BfclQuestion) -> list[dict[str, Any]]:
    """The calls of the ground truth as {"name" (as the tool is named), "arguments"}: for each parameter its
    first allowed value, a parameter whose only allowed value is "" (or that the function doc lacks) left out.
    A few BFCL answers cannot be met at all (a required parameter whose only allowed value is "" or none):
    `evaluate.bfcl.score` tells them."""
    calls = _answer_calls(question, None)
    assert calls is not None
    return calls


def conforming_calls(question: BfclQuestion, tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """ground_truth_calls whose arguments also meet the JSON schemas of `tools` (openai_tools of the question, as
    the model is shown them; `data check` judges the rows against them, tool_calls.argument_problems): each
    parameter's first allowed value its schema accepts; none accepted: left out where BFCL allows "", else None
    (the answer contradicts its own function's schema: a value outside the enum or of another type, 13 live
    questions)."""
    return _answer_calls(question, {t["function"]["name"]: t["function"]["parameters"] for t in tools})


def _answer_calls(question: BfclQuestion, schemas: dict[str, dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    from .tool_calls import value_problems

    assert question.answer is not None, f"{question.task_id}: {question.category} has no ground truth"
    docs = {f["name"]: f for f in question.functions}
    calls = []
    for entry in question.answer:
        (name, params), = entry.items()
        props = docs[name]["parameters"]["properties"]
        shown = None if schemas is None else schemas[tool_name(name)].get("properties", {})
        args = {}
        for param, allowed in params.items():
            if param not in props:  # a few answers name a parameter the doc lacks: left out
                continue
            values = [_concrete(v, props[param]) for v in allowed if v != ""]
            if shown is not None:
                values = [v for v in values if not value_problems(v, shown.get(param), param)]
                if not values and "" not in allowed:
                    return None
            if values:
                args[param] = values[0]
        calls.append({"name": tool_name(name), "arguments": args})
    return calls


def with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """The messages with `system` as the system message: before the question's own system text when it has
    one (a few live questions do), else as a new first message. A copy; None: unchanged."""
    messages = [dict(m) for m in messages]
    if system is None:
        return messages
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = system + "\n\n" + messages[0]["content"]
    else:
        messages.insert(0, {"role": "system", "content": system})
    return messages


# ---- live_* -> SFT rows (`entrenar data sft-from-bfcl`) ------------------------------------------------
# The answer of an irrelevance row (--irrelevance): plain text, no call.
NO_CALL_ANSWER = "None of the available functions can answer this request, so I will not call any of them."


def answerable(question: BfclQuestion) -> bool:
    """Whether BFCL's rules can be met at all: each required parameter of a called function has an allowed
    value other than "", and each answer parameter the doc lacks may be left out. Five live questions fail."""
    assert question.answer is not None
    docs = {f["name"]: f for f in question.functions}
    for entry in question.answer:
        (name, params), = entry.items()
        doc = docs[name]["parameters"]
        for param in doc.get("required", []):
            if not _first_allowed(params.get(param, []))[0]:
                return False
        if any(p not in doc["properties"] and "" not in allowed for p, allowed in params.items()):
            return False
    return True


def _no_call_row(question: BfclQuestion, donor: BfclQuestion, system: str | None) -> dict[str, Any]:
    from .tool_calls import validate_tools

    return {"id": f"{question.task_id}+tools-of-{donor.task_id}",
            "tools": validate_tools(openai_tools(donor.functions)),
            "messages": with_system(question.messages, system) + [{"role": "assistant", "content": NO_CALL_ANSWER}]}


def swapped_no_call_rows(questions: list[BfclQuestion], n: int, system: str | None = None,
                         seed: int = 0, matched: bool = False, nearest: bool = False) -> list[dict[str, Any]]:
    """n no-call rows: a question with calls shown another question's functions instead of its own, answered
    with NO_CALL_ANSWER. A donor is taken only when no subject word of its function names is among the
    question's (name_words), so the shown functions are about something else; each question at most once, in
    an order fixed by seed. This teaches telling a function that fits from one that does not, which the
    live_irrelevance rows alone teach poorly (a small model learns "call" or "never call"). matched: the donor is
    of the question's own category and shows as many functions as the question's own, so the no-call rows match
    the call rows' distribution (category, tools shown) and nothing but the fit of the functions tells them
    apart. nearest: the donor is the one closest in topic that still cannot answer (bfcl_nearest.nearest_donors),
    within the matched pool when matched."""
    import random

    rng = random.Random(seed)
    order = list(range(len(questions)))
    rng.shuffle(order)
    if nearest:
        from .bfcl_nearest import nearest_donors

        group = (lambda i: (questions[i].category, len(questions[i].functions))) if matched else None
        return [_no_call_row(questions[i], questions[j], system) for i, j, _ in
                nearest_donors(questions, order, n, group)]
    words = [name_words(q.functions) for q in questions]
    rows: list[dict[str, Any]] = []
    for i in order:
        if len(rows) >= n:
            break
        pool = [j for j in range(len(questions)) if questions[j].category == questions[i].category
                and len(questions[j].functions) == len(questions[i].functions)] if matched else None
        for _ in range(20 if pool is None or pool else 0):  # a few tries for a donor on another subject
            j = rng.choice(pool) if pool else rng.randrange(len(questions))
            if j != i and not (words[i] & words[j]) and questions[j].functions:
                rows.append(_no_call_row(questions[i], questions[j], system))
                break
    return rows


def sft_rows_from_bfcl(categories: list[str] | tuple[str, ...] = LIVE_CALL_CATEGORIES, system: str | None = None,
                       irrelevance: bool = False,
                       swapped_no_call: int = 0, matched: bool = False,
                       nearest: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Tool-call SFT rows (design.md "SFT rows with tool calls") from BFCL's live categories: the question,
    its functions as `tools`, and an assistant turn whose `tool_calls` are the ground truth's calls, each
    argument one its tool's schema accepts (conforming_calls; questions without such an answer are left out and
    listed in `schema_conflicts`). Only live_* categories: BFCL's scored non-live categories are other files, so the
    rows are disjoint from them by construction. irrelevance: also live_irrelevance's questions answered in
    plain text (NO_CALL_ANSWER). swapped_no_call: also that many of these questions shown other questions'
    functions and answered without a call (swapped_no_call_rows; matched, nearest: its donor choice). Returns
    (rows, counts)."""
    from .tool_calls import normalize_message, tool_names, validate_tools

    for c in categories:
        if c not in LIVE_CALL_CATEGORIES:
            raise InputError(f"--categories: {c!r} is not one of {', '.join(LIVE_CALL_CATEGORIES)} (rows come only "
                             f"from BFCL's live categories with calls, disjoint from the scored non-live ones)")
    rows: list[dict[str, Any]] = []
    counts: dict[str, Any] = {"per_category": {}, "unanswerable": [], "schema_conflicts": []}
    questions = load_bfcl(categories)
    for q in questions:
        if not answerable(q):
            counts["unanswerable"].append(q.task_id)
            continue
        tools = validate_tools(openai_tools(q.functions))
        truth = conforming_calls(q, tools)
        if truth is None:  # a row that taught a value its own schema forbids would fail `data check`
            counts["schema_conflicts"].append(q.task_id)
            continue
        calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in truth]
        answer = normalize_message({"role": "assistant", "content": "", "tool_calls": calls}, 0, tool_names(tools))
        rows.append({"id": q.task_id, "tools": tools, "messages": with_system(q.messages, system) + [answer]})
        counts["per_category"][q.category] = counts["per_category"].get(q.category, 0) + 1
    if irrelevance:
        for q in load_bfcl(["live_irrelevance"]):
            if not q.functions:
                continue
            tools = validate_tools(openai_tools(q.functions))
            rows.append({"id": q.task_id, "tools": tools, "messages": with_system(q.messages, system) +
                         [{"role": "assistant", "content": NO_CALL_ANSWER}]})
            counts["per_category"]["live_irrelevance"] = counts["per_category"].get("live_irrelevance", 0) + 1
    if swapped_no_call:
        swapped = swapped_no_call_rows(questions, swapped_no_call, system, matched=matched, nearest=nearest)
        if len(swapped) < swapped_no_call:
            raise InputError(f"--swapped-no-call {swapped_no_call}: these categories give {len(swapped)} such rows "
                             f"(each question at most once{', each donor function set at most twice' if nearest else ''}); "
                             f"ask for at most {len(swapped)}")
        rows.extend(swapped)
        counts["swapped_no_call"] = len(swapped)
        counts["swapped_matched"] = matched
        counts["swapped_nearest"] = nearest
        if nearest:
            from .bfcl_nearest import mean_similarity

            counts["swapped_mean_similarity"] = mean_similarity(questions, swapped)
    counts["rows"] = len(rows)
    return rows, counts


def write_sft_from_bfcl(out: str | Path, categories: list[str] | tuple[str, ...] = LIVE_CALL_CATEGORIES,
                        system: str | None = None, irrelevance: bool = False,
                        overwrite: bool = False, swapped_no_call: int = 0, matched: bool = False,
                        nearest: bool = False) -> dict[str, Any]:
    """`data sft-from-bfcl`: the rows as JSONL at `out` (written atomically); an existing `out` only with
    overwrite, and only when it is a JSONL file (CLI-OVERWRITE-OWN)."""
    from ..fileio import atomic_write
    from ..outpaths import check_jsonl_out

    out = check_jsonl_out(out, overwrite)
    rows, counts = sft_rows_from_bfcl(categories, system, irrelevance, swapped_no_call, matched, nearest)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return {**counts, "out": str(out), "categories": list(categories), "irrelevance": irrelevance}
