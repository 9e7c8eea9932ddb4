"""`eval --task bfcl[:CATEGORIES]`: BFCL's single-turn questions through the model's chat template with their
functions as `tools=`, the calls read back from the generated text, and BFCL's AST rules as the score.

The AST rules (`_simple`, `_parallel_no_order`, `_multiple` and their helpers) are bfcl-eval 2026.3.23's
`eval_checker/ast_eval/ast_checker.py` for Python, ported rule for rule (Apache-2.0, Copyright the Gorilla/BFCL
authors), including its quirks (one level of nested type checks, greedy matching of parallel calls): tests/
test_bfcl.py shows the verdicts equal to that checker's on hundreds of (output, answer) cases. docs/design.md
("BFCL") is the prose of every rule here.
"""

from __future__ import annotations

import ast
import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..data.bfcl_data import (
    BfclQuestion,
    load_bfcl,
    openai_tools,
    parse_bfcl_spec,
    tool_name,
    with_system,
)
from ..data.tool_calls import parse_tool_calls
from ..errors import InputError
from .harness import (
    Complete,
    completion_parts,
    eta_text,
    mean_pass_at_k,
    no_early_stop,
    pass_ks,
    truncated_count,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "BfclQuestion",
    "bfcl_prompt_ids",
    "bfcl_records",
    "load_bfcl",
    "no_early_stop",
    "parse_bfcl_spec",
    "parse_calls",
    "score",
    "summarize_bfcl",
]

DEFAULT_MAX_NEW_TOKENS = 256


# ---- prompts ------------------------------------------------------------------------------------------
def bfcl_prompt_ids(question: BfclQuestion, tokenizer, system: str | None = None) -> list[int]:
    """The question's messages (after `system`, if given: as the system message, or before the question's own
    system text) rendered by the model's chat template with the functions as `tools=`, plus the generation
    prompt. A template that does not render tools is exit 2 naming --chat-template (tokenizer.encode_chat)."""
    messages = with_system(question.messages, system)
    if not tokenizer.supports_tools():
        raise InputError(f"--task bfcl: the chat template of {tokenizer.chat_template_source} does not support "
                         f"tools (it never uses the `tools` variable and `tool_calls`), so BFCL's functions cannot "
                         f"be shown to the model; give one that does: --chat-template chatml_tools (packaged, for "
                         f"ChatML models such as SmolLM2 and Qwen2.5) or --chat-template FILE")
    return tokenizer.encode_chat(messages, add_generation_prompt=True, tools=openai_tools(question.functions)).ids


# ---- reading calls back -------------------------------------------------------------------------------
_FENCE = re.compile(r"```[a-zA-Z0-9_+-]*[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)


def _json_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"name": obj["name"], "arguments": args} if isinstance(args, dict) else None


def _json_calls(text: str) -> list[dict[str, Any]] | None:
    """A JSON call object or a list of them at the start of `text` (after blanks); trailing prose ignored."""
    text = text.strip()
    if not text or text[0] not in "[{":
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_json_call(x) for x in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


def _literal(node: ast.AST) -> Any:
    """A keyword argument's value: a Python literal; a bare name is its text (BFCL reads a variable so)."""
    if isinstance(node, ast.Name):
        return node.id
    return ast.literal_eval(node)


def _python_call(node: ast.AST) -> dict[str, Any]:
    if not isinstance(node, ast.Call):
        raise TypeError("not a call")
    parts = []
    func = node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        raise TypeError("not a named function")
    parts.append(func.id)
    if node.args:
        raise ValueError("positional arguments (BFCL's calls name every argument)")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError("**kwargs")
        args[kw.arg] = _literal(kw.value)
    return {"name": ".".join(reversed(parts)), "arguments": args}


def _python_calls(text: str) -> list[dict[str, Any]] | None:
    """`f(a=1)` or `[f(a=1), g(b="x")]` with literal arguments (parsed with ast, never evaluated)."""
    text = text.strip().strip("'")
    if not text:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
        nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
        calls = [_python_call(n) for n in nodes]
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return calls or None


def parse_calls(text: str) -> tuple[list[dict[str, Any]], str | None]:
    """The calls a model wrote, each {"name", "arguments"}, and what could not be read (None: nothing).

    In order of preference: hermes <tool_call>{json}</tool_call> blocks anywhere (also inside code fences);
    else the whole reply, or the body of a ``` fence, as a JSON call object or list of them ("arguments" or
    "parameters"), or as Python call syntax. No call found: an empty list."""
    if "<tool_call>" in text:
        parsed = parse_tool_calls(text, "hermes")
        return parsed.calls, "; ".join(parsed.errors) or None
    candidates = [text] + [m.group(1) for m in _FENCE.finditer(text)]
    for candidate in candidates:
        calls = _json_calls(candidate)
        if calls is None:
            calls = _python_calls(candidate)
        if calls is not None:
            return calls, None
    return [], None


# ---- BFCL's AST rules (ast_checker.py, Python) ---------------------------------------------------------
PYTHON_TYPE_MAPPING = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list,
                       "tuple": list, "dict": dict, "any": str}
PYTHON_NESTED_TYPE_CHECK_LIST = ("array", "tuple")


def _bad(error: str, kind: str) -> dict[str, Any]:
    return {"valid": False, "error": [error], "error_type": kind}


def _find_description(docs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for doc in docs:
        if doc["name"] == name:
            return doc
    return None


def _answer_type(possible: list[Any]) -> type | None:
    for answer in possible:
        if answer != "":  # "" marks an optional parameter
            return type(answer)
    return None


def _type_check(param: str, value: Any, possible: list[Any], expected_desc: str, expected: type,
                nested: type | None) -> dict[str, Any]:
    """BFCL's type_checker: the value's exact type is the documented one (nested: one level deep, against each
    list among the possible answers), or the type of the possible answers (then a "variable")."""
    result: dict[str, Any] = {"valid": True, "error": [], "is_variable": False, "error_type": "type_error:simple"}
    is_variable = False
    answer_type = _answer_type(possible)
    if answer_type is not None and answer_type != expected:
        is_variable = True
    if type(value) == expected:
        if nested is None:
            result["is_variable"] = is_variable
            return result
        for item in possible:
            flag = True
            if type(item) == list:
                for v in value:
                    if not _type_check(param, v, item, str(nested), nested, None)["valid"]:
                        flag = False
                        break
            if flag:
                return {"valid": True, "error": [], "is_variable": is_variable}
        result["valid"] = False
        result["error"] = [f"Nested type checking failed for parameter {param!r}."]
        result["error_type"] = "type_error:nested"
    answer_type = _answer_type(possible)
    if answer_type is not None and type(value) == answer_type:
        result["is_variable"] = True
        return result
    result["valid"] = False
    result["error"].append(f"Incorrect type for parameter {param!r}. Expected type {expected_desc}, got "
                           f"{type(value).__name__}. Parameter value: {value!r}.")
    result["error_type"] = "type_error:simple"
    return result


def standardize_string(text: str) -> str:
    """BFCL's standardize_string: drop spaces and ,./-_*^, lowercase, single quotes as double quotes."""
    return re.sub(r"[ \,\.\/\-\_\*\^]", "", text).lower().replace("'", '"')


def _std(value: Any) -> Any:
    return standardize_string(value) if type(value) == str else value


def _string_check(param: str, value: str, possible: list[Any]) -> dict[str, Any]:
    if standardize_string(value) not in [standardize_string(p) for p in possible if type(p) == str]:
        return _bad(f"Invalid value for parameter {param!r}: {value!r}. Expected one of {possible}. "
                    f"Case insensitive.", "value_error:string")
    return {"valid": True, "error": []}


def _list_check(param: str, value: list, possible: list[Any]) -> dict[str, Any]:
    got = [_std(v) for v in value]
    if got not in [[_std(v) for v in p] for p in possible]:
        return _bad(f"Invalid value for parameter {param!r}: {value!r}. Expected one of {possible}.",
                    "value_error:list/tuple")
    return {"valid": True, "error": []}


def _dict_check(param: str, value: dict, possibles: list[Any]) -> dict[str, Any]:
    """BFCL's dict_checker: each key among one possible answer's keys with a value among its allowed ones,
    each key of that answer present unless "" is allowed. Only the last possible answer's error is kept."""
    result: dict[str, Any] = {"valid": False, "error": [], "error_type": "dict_checker:unclear"}
    for possible in possibles:
        if possible == "":
            continue
        result = {"valid": False, "error": [], "error_type": "dict_checker:unclear"}
        flag = True
        for key, v in value.items():
            if key not in possible:
                result["error"].append(f"Unexpected dict key parameter: '{key}'.")
                result["error_type"] = "value_error:dict_key"
                flag = False
                break
            allowed = [_std(a) for a in possible[key]]
            if _std(v) not in allowed:
                result["error"].append(f"Invalid value for parameter {key!r}: {v!r}. Expected one of {allowed}.")
                result["error_type"] = "value_error:dict_value"
                flag = False
                break
        for key, allowed in possible.items():
            if key not in value and "" not in allowed:
                result["error"].append(f"Missing dict key parameter: '{key}'.")
                result["error_type"] = "value_error:dict_key"
                flag = False
                break
        if flag:
            return {"valid": True, "error": []}
    return result


def _list_dict_check(param: str, value: list, possibles: list[Any]) -> dict[str, Any]:
    """BFCL's list_dict_checker: as many dicts as one possible answer, each matching it in order."""
    result: dict[str, Any] = {"valid": False, "error": [], "error_type": "list_dict_checker:unclear"}
    for possible in possibles:
        flag = True
        if len(value) != len(possible):
            result = _bad("Wrong number of dictionaries in the list.", "value_error:list_dict_count")
            continue
        for i in range(len(value)):
            result = _dict_check(param, value[i], [possible[i]])
            if not result["valid"]:
                flag = False
                break
        if flag:
            return {"valid": True, "error": []}
    return result


def _simple(doc: dict[str, Any], output: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """BFCL's simple_function_checker for Python: output and answer are each {function name: arguments}."""
    possible = next(iter(answer.values()))
    name = doc["name"]
    details = doc["parameters"]["properties"]
    required = doc["parameters"]["required"]
    if name not in output:
        return _bad(f"Function name {name!r} not found in model output.", "simple_function_checker:wrong_func_name")
    params = output[name]
    for param in required:
        if param not in params:
            return _bad(f"Missing required parameter: {param!r}.", "simple_function_checker:missing_required")
    for param, value in params.items():
        if param not in details or param not in possible:
            return _bad(f"Unexpected parameter: {param!r}.", "simple_function_checker:unexpected_param")
        expected_desc = details[param]["type"]
        expected = PYTHON_TYPE_MAPPING[expected_desc]
        nested = None
        if expected_desc in PYTHON_NESTED_TYPE_CHECK_LIST:
            nested = PYTHON_TYPE_MAPPING[details[param]["items"]["type"]]
        if expected_desc == "tuple" and type(value) == tuple:
            value = list(value)
        if expected_desc == "float" and type(value) == int:
            value = float(value)
        checked = _type_check(param, value, possible[param], expected_desc, expected, nested)
        if not checked["valid"]:
            return checked
        if not checked["is_variable"]:
            if expected == dict:
                result = _dict_check(param, value, possible[param])
            elif expected == list and nested == dict:
                result = _list_dict_check(param, value, possible[param])
            elif expected == str:
                result = _string_check(param, value, possible[param])
            elif expected == list:
                result = _list_check(param, value, possible[param])
            else:
                result = None
            if result is not None:
                if not result["valid"]:
                    return result
                continue
        if value not in possible[param]:
            return _bad(f"Invalid value for parameter {param!r}: {value!r}. Expected one of {possible[param]}.",
                        "value_error:others")
    for param in possible:
        if param not in params and "" not in possible[param]:
            return _bad(f"Optional parameter {param!r} not provided and not marked as optional.",
                        "simple_function_checker:missing_optional")
    return {"valid": True, "error": []}


def _parallel_no_order(docs: list[dict[str, Any]], outputs: list[dict[str, Any]],
                       answers: list[dict[str, Any]]) -> dict[str, Any]:
    """BFCL's parallel_function_checker_no_order: each answer, in order, takes the first unmatched output
    that passes it (greedy, as BFCL; not a maximum matching)."""
    if len(outputs) != len(answers):
        return _bad("Wrong number of functions.", "parallel_function_checker_no_order:wrong_count")
    matched: list[int] = []
    for i, answer in enumerate(answers):
        doc = _find_description(docs, next(iter(answer)))
        result: dict[str, Any] = {"valid": False}
        for index in range(len(outputs)):
            if index in matched:
                continue
            result = _simple(doc, outputs[index], answer)  # type: ignore[arg-type]
            if result["valid"]:
                matched.append(index)
                break
        if not result["valid"]:
            return _bad(f"Could not find a matching function among the model's calls for answer {i}.",
                        "parallel_function_checker_no_order:cannot_find_match")
    return {"valid": True, "error": []}


def _multiple(docs: list[dict[str, Any]], outputs: list[dict[str, Any]],
              answers: list[dict[str, Any]]) -> dict[str, Any]:
    if len(outputs) != len(answers):
        return _bad("Wrong number of functions.", "multiple_function_checker:wrong_count")
    doc = _find_description(docs, next(iter(answers[0])))
    return _simple(doc, outputs[0], answers[0])  # type: ignore[arg-type]


def ast_check(docs: list[dict[str, Any]], outputs: list[dict[str, Any]], answers: list[dict[str, Any]],
              category: str) -> dict[str, Any]:
    """BFCL's ast_checker for Python: outputs as [{name: arguments}] with BFCL's (dotted) names."""
    if "parallel" in category:
        return _parallel_no_order(docs, outputs, answers)
    if "multiple" in category:
        return _multiple(docs, outputs, answers)
    if len(outputs) != 1:
        return _bad("Wrong number of functions.", "simple_function_checker:wrong_count")
    return _simple(docs[0], outputs[0], answers[0])


def score(question: BfclQuestion, calls: list[dict[str, Any]]) -> tuple[bool, str | None]:
    """Whether the calls answer the question by BFCL's rules, and why not. irrelevance categories: right iff
    there is no call; live_relevance: iff there is one; others: the AST rules, a call's name read back from
    the tool name it was shown (dots as underscores) to BFCL's."""
    if "irrelevance" in question.category:
        return (not calls, None if not calls else f"{len(calls)} call(s) where none is relevant")
    if question.category == "live_relevance":
        return (bool(calls), None if calls else "no call")
    assert question.answer is not None
    names = {tool_name(f["name"]): f["name"] for f in question.functions}
    outputs = [{names.get(c["name"], c["name"]): c["arguments"]} for c in calls]
    try:
        result = ast_check(question.functions, outputs, question.answer, question.category)
    except (AttributeError, TypeError, KeyError) as e:  # BFCL's checker raises too (e.g. a list of non-dicts
        return False, f"malformed arguments: {type(e).__name__}: {e}"  # where dicts are due): a wrong answer
    return (True, None) if result["valid"] else (False, "; ".join(str(e) for e in result["error"]))


# ---- the eval ------------------------------------------------------------------------------------------
def _bfcl_record(question: BfclQuestion, sample: int, text: str, truncated: bool | None, prompt_tokens: int,
                 seconds: float) -> dict[str, Any]:
    """One answer to `question`, read back and scored."""
    calls, parse_error = parse_calls(text)
    passed, error = score(question, calls)
    return {"task_id": question.task_id, "category": question.category, "passed": passed,
            "status": "passed" if passed else "failed", "error": error, "parse_error": parse_error,
            "completion": text, "truncated": truncated, "calls": calls, "prompt_tokens": prompt_tokens,
            "generate_seconds": round(seconds, 3), "sample": sample}


def bfcl_records(questions: Sequence[BfclQuestion], tokenizer, complete: Complete, batch_size: int = 8,
                 system: str | None = None, log: Callable[[str], None] | None = None, *, samples: int = 1,
                 done_rows: dict[tuple[str, int], dict[str, Any]] | None = None,
                 on_record: Callable[[dict[str, Any]], None] | None = None,
                 row_settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """`samples` answers to each question (greedy or sampled: as `complete` decodes), read back and scored: one
    record per (question, sample), in question order then sample order. `complete` gets a batch of `batch_size`
    questions at once, each with its samples not done yet (harness.Complete: the prompt once per sample, each
    request with its sample index). `done_rows` ({(task_id, sample): row}, harness.read_results for --resume) are
    taken as they are; `on_record` gets each new record as soon as it is scored (the CLI appends it to --out);
    `row_settings` goes into each new record."""
    start = time.perf_counter()
    done_rows = done_rows or {}
    ids = [bfcl_prompt_ids(q, tokenizer, system) for q in questions]
    records: list[dict[str, Any] | None] = [done_rows.get((q.task_id, s)) for q in questions for s in range(samples)]
    # similar lengths together, longest first; answers already made (--resume) are not asked again
    order = sorted((i for i in range(len(questions)) if None in records[i * samples:(i + 1) * samples]),
                   key=lambda i: -len(ids[i]))
    done, todo, made_here = len(questions) - len(order), sum(1 for r in records if r is None), 0
    for at in range(0, len(order), batch_size):
        batch = order[at:at + batch_size]
        missing = [(i, s) for i in batch for s in range(samples) if records[i * samples + s] is None]
        if log is not None:
            log(f"questions {done + 1}-{done + len(batch)} of {len(questions)}: generating"
                + (f" {len(missing)} answers ({samples} samples each)" if samples > 1 else ""))
        t0 = time.perf_counter()
        made = [completion_parts(c) for c in complete([ids[i] for i, _ in missing], [s for _, s in missing])]
        seconds = (time.perf_counter() - t0) / len(missing)
        assert len(made) == len(missing), (len(made), len(missing))
        for (i, s), (text, truncated) in zip(missing, made):
            record = _bfcl_record(questions[i], s, text, truncated, len(ids[i]), seconds)
            if row_settings is not None:
                record["settings"] = row_settings
            records[i * samples + s] = record
            if on_record is not None:
                on_record(record)
        done, made_here = done + len(batch), made_here + len(missing)
        if log is not None:
            passed = sum(1 for r in records if r is not None and r["passed"])
            elapsed = time.perf_counter() - start
            log(f"{done}/{len(questions)} questions, {passed} {'correct' if samples == 1 else 'correct answers'} "
                f"so far ({elapsed:.0f} s, {eta_text(made_here, todo, elapsed)})")
    assert all(r is not None for r in records)
    return records  # type: ignore[return-value]


def _pass_counts(records: Sequence[dict[str, Any]]) -> tuple[int, dict[str, list[int]]]:
    """(the answers per question, {category: each question's count of right answers}), over every sample."""
    counts: dict[tuple[str, str], list[int]] = {}  # (category, task id) -> [answers, right answers]
    for r in records:
        n_c = counts.setdefault((r["category"], r["task_id"]), [0, 0])
        n_c[0] += 1
        n_c[1] += int(r["passed"])
    samples = min((n for n, _ in counts.values()), default=1)
    assert all(n == samples for n, _ in counts.values()), "every question needs the same number of samples"
    per_category: dict[str, list[int]] = {}
    for (category, _), (_, right) in counts.items():
        per_category.setdefault(category, []).append(right)
    return samples, per_category


def summarize_bfcl(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy overall and per category (in the order first seen), with counts; "truncated": the answers the token
    limit cut (overall and per category, every sample's). `correct`/`total`/`accuracy` and `passed_problems`/
    `problems`/`accuracy` count one answer per question: its sample 0. "samples": the answers per question; with
    more than one, "pass@k" per category and overall (harness.mean_pass_at_k, the unbiased estimator over every
    sample of a question) for k = 1, 10, 100 up to the samples and k = the samples."""
    cats: dict[str, dict[str, Any]] = {}
    for r in records:
        c = cats.setdefault(r["category"], {"correct": 0, "total": 0, "truncated": 0})
        c["truncated"] += int(bool(r.get("truncated")))
        if r.get("sample", 0) == 0:
            c["total"] += 1
            c["correct"] += int(r["passed"])
    samples, passes = _pass_counts(records)
    ks = sorted({*pass_ks(samples), samples}) if samples > 1 else []  # one sample: accuracy is pass@1
    for name, c in cats.items():
        c["accuracy"] = c["correct"] / c["total"]
        c.update(mean_pass_at_k(passes[name], samples, ks))
    passed, problems = sum(c["correct"] for c in cats.values()), sum(c["total"] for c in cats.values())
    return {"problems": problems, "passed_problems": passed, "accuracy": passed / problems if problems else 0.0,
            "truncated": truncated_count(records), "categories": cats, "samples": samples,
            **mean_pass_at_k([c for right in passes.values() for c in right], samples, ks)}
