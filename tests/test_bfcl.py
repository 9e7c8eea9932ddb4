"""BFCL (`eval --task bfcl[:CATEGORIES]`, issue 35 part 2): the category spec, the questions read from the
bfcl-eval package, their functions as OpenAI tools, calls read back from text (hermes blocks, fenced, bare JSON,
Python syntax), the score proven equal to bfcl-eval's own AST checker on hundreds of (output, answer) cases,
the command's summary and bad input, the packaged ChatML tools template and the live_* -> SFT rows converter.

bfcl-eval's checker (`bfcl_eval/eval_checker/ast_eval/ast_checker.py`) is imported for real; only
`bfcl_eval.constants.model_config` is stubbed (it imports every model handler and their SDKs), with one model
entry whose `underscore_to_dot` is True: BFCL's setting for models that see dotted names as underscores, which is
what our tools show. Irrelevance verdicts are compared with BFCL's relevance rule (`bfcl_eval.utils.
is_empty_output` on the decoded calls), imported with BFCL_PROJECT_ROOT in a temporary directory (its
constants create result directories on import).
"""

from __future__ import annotations

import copy
import importlib
import json
import random
import sys
import types
from pathlib import Path

import pytest

from entrenar.data.bfcl_data import (
    CATEGORIES,
    DEFAULT_CATEGORIES,
    LIVE_CALL_CATEGORIES,
    NO_ANSWER,
    ground_truth_calls,
    openai_tools,
)
from entrenar.data.tool_calls import validate_tools
from entrenar.errors import InputError
from entrenar.evaluate.bfcl import (
    BfclQuestion,
    bfcl_prompt_ids,
    bfcl_records,
    load_bfcl,
    parse_bfcl_spec,
    parse_calls,
    score,
    summarize_bfcl,
)
from entrenar.evaluate.harness import Completion
from tests.helpers.cli import run_cli as main
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.helpers.tokenizers import tiny_tokenizer

TEMPLATE = Path(__file__).resolve().parents[1] / "src" / "entrenar" / "templates" / "chatml_tools.jinja"
PARITY_MODEL = "entrenar_parity"  # BFCL's checker reads its config as "entrenar/parity"


# ---- bfcl-eval's own checker -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bfcl_eval_checker(tmp_path_factory):
    """(ast_checker, Language.PYTHON, is_empty_output) from the installed bfcl-eval, heavy imports stubbed."""
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {"entrenar/parity": types.SimpleNamespace(underscore_to_dot=True)}
    saved = {k: sys.modules.get(k) for k in ("bfcl_eval.constants.model_config",)}
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "bfcl_eval.constants.model_config", stub)
    mp.setenv("BFCL_PROJECT_ROOT", str(tmp_path_factory.mktemp("bfcl-root")))
    try:
        checker = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
        enums = importlib.import_module("bfcl_eval.constants.enums")
        utils = importlib.import_module("bfcl_eval.utils")
        yield checker.ast_checker, enums.Language.PYTHON, utils.is_empty_output
    finally:
        mp.undo()
        assert all(sys.modules.get(k) is v for k, v in saved.items())


# ---- building outputs: right, wrong and malformed --------------------------------------------------------
def _other_value(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 7
    if isinstance(v, float):
        return v + 1.5
    if isinstance(v, str):
        return v + " zq"  # standardization drops the space, not the letters
    if isinstance(v, list):
        return v + [v[0]] if v else ["zq"]
    if isinstance(v, dict):
        return {**v, "zq": 1}
    return "zq"


def _other_type(v):
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, str):
        return 12345
    if isinstance(v, list):
        return json.dumps(v)
    if isinstance(v, dict):
        return [v]
    return 0


def _with_args(calls, i, fn):
    out = copy.deepcopy(calls)
    out[i]["arguments"] = fn(out[i]["arguments"])
    return out


def _last_allowed(question: BfclQuestion):
    """The ground truth with each parameter's last allowed value (another right answer where several are)."""
    calls = []
    for (name, params), call in zip((next(iter(a.items())) for a in question.answer), ground_truth_calls(question)):
        args = dict(call["arguments"])
        for p, allowed in params.items():
            rest = [a for a in allowed if a != ""]
            if p in args and rest and not isinstance(rest[-1], (dict, list)):
                args[p] = rest[-1]
        calls.append({"name": call["name"], "arguments": args})
    return calls


def variants(question: BfclQuestion, rng: random.Random) -> list[tuple[str, list[dict]]]:
    """(kind, calls) for one question with an answer."""
    right = ground_truth_calls(question)
    out = [("right", right), ("last-allowed", _last_allowed(question))]
    i = rng.randrange(len(right))
    args = right[i]["arguments"]
    required = [p for p in question.functions[0]["parameters"]["required"]]
    out.append(("wrong-name", [dict(c, name=c["name"] + "_v2") if k == i else c for k, c in enumerate(right)]))
    if args:
        p = rng.choice(sorted(args))
        out.append(("missing-param", _with_args(right, i, lambda a: {k: v for k, v in a.items() if k != p})))
        out.append(("wrong-value", _with_args(right, i, lambda a: {**a, p: _other_value(a[p])})))
        out.append(("wrong-type", _with_args(right, i, lambda a: {**a, p: _other_type(a[p])})))
        strs = [k for k, v in args.items() if isinstance(v, str)]
        if strs:
            q = rng.choice(strs)
            out.append(("string-case", _with_args(right, i, lambda a: {**a, q: a[q].upper() + "."})))
        floats = [k for k, v in args.items() if isinstance(v, float) and v == int(v)]
        if floats:
            out.append(("int-for-float", _with_args(right, i, lambda a: {**a, floats[0]: int(a[floats[0]])})))
    if required:
        out.append(("no-required", _with_args(right, 0, lambda a: {k: v for k, v in a.items() if k not in required})))
    out.append(("extra-param", _with_args(right, i, lambda a: {**a, "unexpected_zq": 1})))
    out.append(("empty-args", _with_args(right, i, lambda a: {})))
    if len(right) > 1:
        out.append(("swapped", list(reversed(right))))
        out.append(("one-too-few", right[:-1]))
    out.append(("one-too-many", right + [right[0]]))
    out.append(("none", []))
    return out


def render(calls: list[dict], style: str) -> str:
    """Text a model might write for these calls."""
    if style == "hermes":
        return "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)
    if style == "fenced":
        return "```json\n" + "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls) + "```"
    if style == "json":
        return json.dumps([{"name": c["name"], "parameters": c["arguments"]} for c in calls])
    assert style == "python"
    return "[" + ", ".join(f"{c['name']}(" + ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items()) + ")"
                           for c in calls) + "]"


MALFORMED = ["I'm sorry, I can't help with that.", "<tool_call>\n{\"name\": \"f\", \"arguments\": {oops\n</tool_call>",
             "```python\nprint('hello')\n```", "{\"name\": 5, \"arguments\": {}}", ""]
PARITY_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple")


def parity_cases():
    rng = random.Random(0)
    cases = []
    for category in PARITY_CATEGORIES:
        questions = load_bfcl([category])
        for q in rng.sample(questions, 12):
            for n, (kind, calls) in enumerate(variants(q, rng)):
                cases.append((q, kind, render(calls, ("hermes", "fenced", "json", "python")[n % 4])))
            cases.append((q, "malformed", rng.choice(MALFORMED)))
    for q in rng.sample(load_bfcl(["irrelevance"]), 20):
        fn = q.functions[0]
        call = {"name": fn["name"].replace(".", "_"), "arguments": {p: 1 for p in fn["parameters"]["required"]}}
        cases += [(q, "irrelevant-call", render([call], "hermes")), (q, "no-call", MALFORMED[0]),
                  (q, "no-call", MALFORMED[1])]
    return cases


def test_score_equals_bfcl_eval_ast_checker(bfcl_eval_checker):
    """Our verdict equals bfcl-eval's on every case: right answers (first or last allowed values, ints for
    floats, other case/punctuation), wrong ones (function name, a parameter missing, a required one missing,
    a value, a type, an extra parameter, empty arguments, parallel calls swapped, one call too few or many, no
    call) in four writings (hermes, fenced hermes, a JSON list, Python calls), and malformed text."""
    ast_checker, python, is_empty_output = bfcl_eval_checker
    cases = parity_cases()
    assert len(cases) >= 300
    verdicts: dict[str, list[bool]] = {}
    mismatches = []
    for q, kind, text in cases:
        calls, _ = parse_calls(text)
        ours, why = score(q, calls)
        decoded = [{c["name"]: c["arguments"]} for c in calls]
        if q.category in NO_ANSWER:
            theirs = is_empty_output(decoded)  # irrelevance: right iff BFCL decodes no call
        else:
            try:
                theirs = ast_checker(q.functions, decoded, q.answer, python, q.category, PARITY_MODEL)["valid"]
            except (AttributeError, TypeError, KeyError):  # BFCL's checker crashes on some malformed arguments
                theirs = False
        verdicts.setdefault(kind, []).append(ours)
        if ours != theirs:
            mismatches.append((q.task_id, kind, text[:200], ours, theirs, why))
    assert not mismatches, mismatches[:5]
    every = [v for vs in verdicts.values() for v in vs]
    assert sum(every) > 0.25 * len(every) and sum(not v for v in every) > 0.25 * len(every), \
        {k: (sum(v), len(v)) for k, v in verdicts.items()}
    # the case builder does what it says: right answers pass, and each wrong kind fails (mostly: BFCL allows a
    # few, e.g. a "wrong type" string where the answers hold strings, read as a variable)
    assert all(verdicts["right"]) and sum(verdicts["last-allowed"]) >= 0.9 * len(verdicts["last-allowed"])
    assert all(verdicts["swapped"]) and all(verdicts["int-for-float"]) and all(verdicts["string-case"])
    for kind in ("wrong-name", "wrong-value", "extra-param", "one-too-few", "one-too-many", "none", "malformed",
                 "irrelevant-call"):
        assert not any(verdicts[kind]), kind
    assert all(verdicts["no-call"])
    print({k: f"{sum(v)}/{len(v)} pass" for k, v in verdicts.items()}, len(cases))


# ---- categories, questions, tools --------------------------------------------------------------------
def test_bfcl_spec_defaults_aliases_and_unknown_categories():
    assert parse_bfcl_spec("bfcl") == list(DEFAULT_CATEGORIES)
    assert parse_bfcl_spec("bfcl:simple,multiple,simple_python") == ["simple_python", "multiple"]
    with pytest.raises(InputError, match="unknown BFCL category 'simpel'.*valid: simple_python"):
        parse_bfcl_spec("bfcl:simpel")
    with pytest.raises(InputError, match="simple_java is not supported"):
        parse_bfcl_spec("bfcl:simple_java")


def test_questions_and_answers_load_per_category_with_limit():
    qs = load_bfcl(["simple_python", "irrelevance", "live_parallel"], limit=3)
    assert [q.category for q in qs] == ["simple_python"] * 3 + ["irrelevance"] * 3 + ["live_parallel"] * 3
    assert qs[0].task_id == "simple_python_0" and qs[0].messages[0]["role"] == "user"
    assert qs[0].answer and qs[3].answer is None
    assert all(f["description"].endswith("Python 3 syntax.") for q in qs for f in q.functions)
    sizes = {c: len(load_bfcl([c])) for c in ("simple_python", "multiple", "live_relevance")}
    assert sizes == {"simple_python": 400, "multiple": 200, "live_relevance": 16}


def test_functions_become_openai_tools_with_json_schema_types():
    q = next(q for q in load_bfcl(["parallel_multiple"]) if any("." in f["name"] for f in q.functions))
    tools = validate_tools(openai_tools(q.functions))
    assert all("." not in t["function"]["name"] for t in tools)
    assert [t["function"]["name"] for t in tools] == [f["name"].replace(".", "_") for f in q.functions]
    doc = {"name": "a.b", "description": "d", "parameters": {"type": "dict", "required": ["x"], "properties": {
        "x": {"type": "float", "description": "x"}, "t": {"type": "tuple", "items": {"type": "integer"}},
        "d": {"type": "dict", "properties": {"k": {"type": "any"}}}, "n": {"type": "array", "items": {"type": "float"}}}}}
    (tool,) = openai_tools([doc])
    props = tool["function"]["parameters"]["properties"]
    assert tool["function"]["name"] == "a_b" and tool["function"]["parameters"]["type"] == "object"
    assert props["x"] == {"type": "number", "format": "float", "description": "x This is a float type value."}
    assert props["t"]["type"] == "array" and props["d"]["type"] == "object"
    assert props["d"]["properties"]["k"]["type"] == "string" and props["n"]["items"]["type"] == "number"
    assert doc["parameters"]["type"] == "dict"  # the question's own docs are left as they are


# ---- reading calls back ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', [("f", {"a": 1})]),
    ('```json\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n```', [("f", {"a": 1})]),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}'
     + '</tool_call>', [("f", {}), ("g", {"b": 2})]),
    ('{"name": "f", "parameters": {"a": "x"}}', [("f", {"a": "x"})]),
    ('[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}] Done.', [("f", {"a": 1}), ("g", {})]),
    ('```json\n{"name": "f", "arguments": {"a": [1, 2]}}\n```', [("f", {"a": [1, 2]})]),
    ('[f(a=1, b="x"), math.sqrt(x=-2.5)]', [("f", {"a": 1, "b": "x"}), ("math.sqrt", {"x": -2.5})]),
    ("f(a={'k': [1, 2]}, b=True, c=None, d=some_name)", [("f", {"a": {"k": [1, 2]}, "b": True, "c": None,
                                                                "d": "some_name"})]),
    ("```python\nf(a=1)\n```", [("f", {"a": 1})]),
    ("The answer is 42.", []), ("f(1, 2)", []), ("f(a=open('x').read())", []), ("", []),
    ('{"name": "f", "arguments": 3}', []),
])
def test_parse_calls_reads_every_format(text, calls):
    got, _ = parse_calls(text)
    assert [(c["name"], c["arguments"]) for c in got] == calls


def test_parse_calls_reports_a_block_that_is_no_call():
    calls, error = parse_calls('<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>')
    assert calls == [] and "not JSON" in error


# ---- the score ------------------------------------------------------------------------------------------
def test_irrelevance_and_relevance_rules():
    irr, rel = load_bfcl(["irrelevance"], 1)[0], load_bfcl(["live_relevance"], 1)[0]
    call = [{"name": "anything", "arguments": {}}]
    assert score(irr, []) == (True, None) and not score(irr, call)[0]
    assert score(rel, call) == (True, None) and not score(rel, [])[0]


def test_dotted_names_are_read_back_from_their_tool_names():
    q = next(q for q in load_bfcl(["simple_python"]) if "." in q.functions[0]["name"])
    right = ground_truth_calls(q)
    assert "." not in right[0]["name"] and score(q, right) == (True, None)
    dotted = [dict(right[0], name=q.functions[0]["name"])]
    assert score(q, dotted)[0]  # the name BFCL's docs use is the same function
    assert not score(q, [dict(right[0], name=right[0]["name"] + "x")])[0]


def test_records_and_summary_per_category():
    qs = load_bfcl(["simple_python", "irrelevance"], limit=2)
    tok = tiny_tokenizer()
    tok.set_chat_template(TEMPLATE.read_text(), "chatml_tools.jinja")
    answers = {q.task_id: render(ground_truth_calls(q), "hermes") if q.answer else "No tool fits." for q in qs}
    answers["simple_python_1"] = "Let me think."
    by_ids = {tuple(bfcl_prompt_ids(q, tok)): answers[q.task_id] for q in qs}
    seen = []

    def complete(batch, samples):  # "Let me think." stopped at the token limit (issue 38 item 11)
        seen.append(len(batch))
        return [Completion(by_ids[tuple(ids)], by_ids[tuple(ids)] == "Let me think.") for ids in batch]

    records = bfcl_records(qs, tok, complete, batch_size=3)
    assert seen == [3, 1] and [r["task_id"] for r in records] == [q.task_id for q in qs]
    assert [r["passed"] for r in records] == [True, False, True, True]
    assert [r["truncated"] for r in records] == [False, True, False, False]
    assert records[0]["calls"] == ground_truth_calls(qs[0]) and records[1]["error"]
    assert {"task_id", "category", "passed", "status", "error", "completion", "calls", "prompt_tokens",
            "generate_seconds"} <= set(records[0])
    s = summarize_bfcl(records)
    assert s["problems"] == 4 and s["passed_problems"] == 3 and s["accuracy"] == 0.75 and s["truncated"] == 1
    assert s["categories"] == {"simple_python": {"correct": 1, "total": 2, "accuracy": 0.5, "truncated": 1},
                               "irrelevance": {"correct": 2, "total": 2, "accuracy": 1.0, "truncated": 0}}


def test_prompt_renders_tools_and_refuses_a_template_without_them():
    q = load_bfcl(["simple_python"], 1)[0]
    tok = tiny_tokenizer()
    with pytest.raises(InputError, match="does not support tools.*--chat-template chatml_tools .packaged"):
        bfcl_prompt_ids(q, tok)
    tok.set_chat_template(TEMPLATE.read_text(), "chatml_tools.jinja")
    text = tok.decode(bfcl_prompt_ids(q, tok, system="Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "calculate_triangle_area"' in text
    assert text.endswith(q.messages[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n")


# ---- the command ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from entrenar.formats import save_hf_dir

    tokenizer = tiny_tokenizer()
    cfg = tiny_config("qwen2", vocab_size=len(tokenizer), max_position_embeddings=4096)
    return save_hf_dir(tiny_causal_lm(cfg, 0, bias_std=0.3), tmp_path_factory.mktemp("m") / "m", tokenizer=tokenizer)


def test_cli_bfcl_summary_per_category(tiny_dir, tmp_path, capsys):
    out = tmp_path / "bfcl.jsonl"
    code, js, err = main(["eval", "--task", "bfcl:simple_python,irrelevance", "--limit", "2", "--model",
                          str(tiny_dir), "--chat-template", str(TEMPLATE), "--max-new-tokens", "3",
                          "--out", str(out), "--json"], capsys)
    assert code == 0, err
    assert "questions 1-4 of 4: generating" in err
    assert js["task"] == "bfcl:simple_python,irrelevance" and js["problems"] == 4 and js["max_new_tokens"] == 3
    assert js["categories"]["simple_python"]["total"] == 2 and js["categories"]["irrelevance"]["total"] == 2
    assert js["categories"]["simple_python"]["correct"] == 0  # a random model calls nothing
    assert js["passed_problems"] == sum(c["correct"] for c in js["categories"].values())
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["task_id"] for x in lines] == ["simple_python_0", "simple_python_1", "irrelevance_0", "irrelevance_1"]
    # 3 tokens of a random model end no answer: each is cut by --max-new-tokens, counted and noted
    assert all(x["truncated"] is True for x in lines) and js["truncated"] == 4
    assert js["categories"]["irrelevance"]["truncated"] == 2
    assert "note: 4 of 4 completions stopped at --max-new-tokens 3" in err and "a larger --max-new-tokens" in err
    run = main(["eval", "--task", "bfcl:simple", "--limit", "1", "--model", str(tiny_dir),
                "--chat-template", str(TEMPLATE), "--max-new-tokens", "2"], capsys)
    assert run[0] == 0, run[2]
    table = run.out.splitlines()
    assert table[0].split() == ["category", "correct", "total", "accuracy", "truncated"]
    assert table[1].split() == ["simple_python", "0", "1", "0.0000", "1"] and table[2].startswith("all ")


def test_cli_bfcl_rows_are_kept_as_questions_finish_and_resume_continues(tiny_dir, tmp_path, capsys, monkeypatch):
    """An interrupted `--limit 20` BFCL eval kept none of its 8 finished questions: now each row is appended to
    --out as its question is scored, Ctrl-C says how many are kept there, --resume asks only the rest, and the
    progress lines carry an ETA."""
    from entrenar.evaluate import harness

    real = harness.entrenar_completer
    calls: list[int] = []
    seen_in_out: list[int] = []
    out = tmp_path / "sub" / "bfcl.jsonl"  # its directory is made (CLI-OUT-PARENTS)

    def completer(*a, **k):
        complete = real(*a, **k)

        def wrapped(batch, samples):
            calls.append(len(batch))
            seen_in_out.append(len(out.read_text().splitlines()))
            if interrupt and len(calls) == 3:
                raise KeyboardInterrupt
            return complete(batch, samples)
        return wrapped

    monkeypatch.setattr(harness, "entrenar_completer", completer)
    argv = ["eval", "--task", "bfcl:simple_python,irrelevance", "--limit", "2", "--model", str(tiny_dir),
            "--chat-template", str(TEMPLATE), "--max-new-tokens", "2", "--batch-size", "1", "--out", str(out),
            "--json"]
    interrupt = True
    code, js, err = main(argv, capsys)
    assert code == 130 and "the 2 of 4 questions done so far are in" in js["error"] and "--resume" in js["error"], js
    assert seen_in_out == [0, 1, 2]  # each row on disk before the next question was asked
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(kept) == 2 and all(r["settings"]["max_new_tokens"] == 2 for r in kept)
    assert "ETA" in err
    interrupt, calls[:] = False, []
    code, js, err = main([*argv, "--resume"], capsys)
    assert code == 0 and js["resumed"] == 2 and js["problems"] == 4, err
    assert calls == [1, 1]  # only the two questions not answered before
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == ["simple_python_0", "simple_python_1", "irrelevance_0", "irrelevance_1"]
    assert {r["task_id"]: r for r in rows if r["task_id"] in {k["task_id"] for k in kept}} == \
        {k["task_id"]: k for k in kept}  # the kept rows as they were
    other = ["3" if i and argv[i - 1] == "--max-new-tokens" else a for i, a in enumerate(argv)]  # another eval
    code, js, err = main([*other, "--resume"], capsys)
    assert code == 2 and "made with other settings" in js["error"], js


@pytest.mark.parametrize("extra, expect", [
    (["--task", "bfcl:nope"], "unknown BFCL category 'nope'"),
    (["--task", "bfcl", "--samples", "2"], "--samples 2 with --temperature 0"),
    (["--task", "bfcl", "--timeout", "3"], "--timeout applies to --task humaneval"),
    (["--task", "bfcl", "--prompt-format", "chat"], "--prompt-format applies to --task humaneval"),
    (["--task", "bfcl", "--data", "x.jsonl"], "--data does not apply to --task bfcl"),
    (["--task", "bfcl:simple", "--limit", "1"], "does not render tools"),
])
def test_cli_bfcl_bad_input_exits_2(tiny_dir, capsys, extra, expect):
    code, js, err = main(["eval", "--model", str(tiny_dir), *extra, "--json"], capsys)
    assert code == 2 and expect in (js or {}).get("error", "") + err, (js, err)


# ---- the ChatML tools template --------------------------------------------------------------------------
def test_chatml_tools_template_renders_and_masks_tool_rows():
    """Text rows render as SmolLM2's own template writes them; with tools the schemas are in the system turn,
    and the trained tokens are exactly each assistant turn (calls as hermes blocks) through <|im_end|>; the
    calls read back from the trained text are the row's."""
    from entrenar.data.tool_calls import call_format, parse_tool_calls

    smol = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
            "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    ours, theirs = tiny_tokenizer(chat_template=TEMPLATE.read_text()), tiny_tokenizer(chat_template=smol)
    assert ours.supports_tools() and call_format(ours.chat_template) == "hermes"
    for chat in ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]):
        assert ours.render_chat(chat, add_generation_prompt=True).text == \
            theirs.render_chat(chat, add_generation_prompt=True).text
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    calls = [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
             {"type": "function", "function": {"name": "f", "arguments": {"x": 2}}}]
    messages = [{"role": "user", "content": "f of 1 and 2?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "one"}, {"role": "tool", "content": "two"},
                {"role": "assistant", "content": "one, two"}]
    text = ours.render_chat(messages, tools=tools).text
    assert '<tools>\n{"type": "function", "function": {"name": "f"' in text
    assert "<|im_start|>user\n<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>" \
           "<|im_end|>" in text
    enc = ours.encode_chat(messages, tools=tools)
    trained = ours.decode([t for t, m in zip(enc.ids, enc.assistant_mask) if m])
    first = ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call><|im_end|>')
    assert trained == first + "one, two<|im_end|>"
    read = parse_tool_calls(first.removesuffix("<|im_end|>"), "hermes")
    assert [(c["name"], c["arguments"]) for c in read.calls] == [("f", {"x": 1}), ("f", {"x": 2})]


# ---- live_* -> SFT rows ------------------------------------------------------------------------------------
def test_sft_rows_from_bfcl_live_are_valid_disjoint_and_score_as_passed(tmp_path):
    """Every row validates as a tool-call row, comes from a live category only (no id of a scored non-live
    category), its assistant calls score as passed on its own question (the targets are right answers) and meet
    their tools' JSON schemas (issue 38 item 11: `data check` judges them; 13 answers contradict their own schema
    and are left out, listed)."""
    from entrenar.data.bfcl_data import sft_rows_from_bfcl
    from entrenar.data.sft import load_sft
    from entrenar.data.tool_calls import argument_problems

    rows, counts = sft_rows_from_bfcl()
    live = {q.task_id: q for q in load_bfcl(list(LIVE_CALL_CATEGORIES))}
    # the questions left out are exactly those whose ground truth BFCL's rules reject
    assert counts["unanswerable"] == [i for i, q in live.items() if not score(q, ground_truth_calls(q))[0]]
    assert len(counts["unanswerable"]) == 5 and len(counts["schema_conflicts"]) == 13
    assert len(rows) == len(live) - 5 - 13 == counts["rows"]
    assert counts["per_category"] == {"live_simple": 256, "live_multiple": 1038, "live_parallel": 16,
                                      "live_parallel_multiple": 23}
    scored_ids = {q.task_id for q in load_bfcl([c for c in CATEGORIES if not c.startswith("live_")])}
    assert not scored_ids & {r["id"] for r in rows}
    for row in rows:
        calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in row["messages"][-1]["tool_calls"]]
        assert score(live[row["id"]], calls) == (True, None), row["id"]
        assert argument_problems(row["messages"], row["tools"]) == [], row["id"]
    for task_id in counts["schema_conflicts"]:  # BFCL's answer breaks the schema the model is shown
        q = live[task_id]
        assert argument_problems([{"role": "assistant", "tool_calls": [
            {"function": c} for c in ground_truth_calls(q)]}], openai_tools(q.functions)), task_id
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows[::60]))
    tok = tiny_tokenizer(chat_template=TEMPLATE.read_text())
    examples, report = load_sft(f, tok, 1 << 17)  # byte-level tokens: the longest row is ~10k
    assert len(examples) == len(rows[::60]) and report.to_dict()["tools"]["rows_with_calls"] == len(examples)


def test_cli_sft_from_bfcl(tmp_path, capsys):
    out = tmp_path / "live.jsonl"
    sysfile = tmp_path / "sys.txt"
    sysfile.write_text("You call functions.")
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(out), "--categories", "live_parallel",
                          "--system-prompt-file", str(sysfile), "--json"], capsys)
    assert code == 0, err
    assert js["rows"] == 16 and js["per_category"] == {"live_parallel": 16} and js["unanswerable"] == []
    assert js["schema_conflicts"] == []
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    # the system text first; a question with its own system message keeps it after (one live_parallel does)
    assert all(r["messages"][0]["role"] == "system" and r["messages"][0]["content"].startswith("You call functions.")
               for r in rows)
    assert sum(r["messages"][0]["content"] != "You call functions." for r in rows) == 1
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(out), "--categories", "live_parallel", "--json"], capsys)
    assert code == 2 and "already exists" in js["error"]
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(out), "--categories", "live_parallel",
                          "--irrelevance", "--overwrite", "--json"], capsys)
    assert code == 0 and js["per_category"]["live_irrelevance"] == 880 and js["rows"] == 16 + 880
    assert json.loads(out.read_text().splitlines()[-1])["messages"][-1]["content"].startswith("None of the")
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(tmp_path / "x.jsonl"), "--categories",
                          "simple_python", "--json"], capsys)
    assert code == 2 and "disjoint from the scored non-live ones" in js["error"]
    source = tmp_path / "keep.py"  # --overwrite replaces an earlier JSONL only (CLI-OVERWRITE-OWN)
    source.write_text("def f():\n    return 1\n")
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(source), "--categories", "live_parallel",
                          "--overwrite", "--json"], capsys)
    assert code == 2 and source.read_text() == "def f():\n    return 1\n"


@pytest.mark.real_model
def test_bfcl_rows_on_smollm2_with_the_packaged_template(tmp_path):
    """SmolLM2-135M-Instruct's tokenizer with chatml_tools.jinja: BFCL rows (calls, parallel calls, a no-call
    answer) load with every end-of-turn trained and each trained tool turn read back as the row's calls (the
    data check of design.md "SFT rows with tool calls"); its own template is refused for them."""
    from entrenar.data.bfcl_data import sft_rows_from_bfcl
    from entrenar.data.sft import load_sft
    from entrenar.tokenizer import load_tokenizer, use_chat_template_file

    rows, _ = sft_rows_from_bfcl(["live_simple", "live_parallel"], system="Call functions.", irrelevance=True)
    picked = rows[:4] + [r for r in rows if r["id"].startswith("live_parallel")][:3] + rows[-2:]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in picked))
    tok = load_tokenizer("smollm2-135m-instruct")
    with pytest.raises(InputError, match="does not support tools"):
        load_sft(f, tok, 4096)
    use_chat_template_file(tok, TEMPLATE)
    examples, report = load_sft(f, tok, 4096)
    d = report.to_dict()
    assert len(examples) == len(picked) and report.eot_trained == len(picked) and not report.eot_not_trained_lines
    assert d["tools"]["rows_with_calls"] == len(picked) - 2 and d["tools"]["calls"] >= len(picked) - 2 + 3


def test_swapped_no_call_rows_show_functions_on_another_subject(tmp_path, capsys):
    """`data sft-from-bfcl --swapped-no-call N`: N more rows, each a live question with calls shown another live
    question's functions instead of its own and answered with the no-call sentence. The donor's function names
    share no subject word with the question's own (so the shown functions do not fit), each question is used at
    most once, the rows are the same on every run, and asking for more than the categories hold is exit 2."""
    from entrenar.data.bfcl_data import NO_CALL_ANSWER, name_words, sft_rows_from_bfcl

    assert name_words([{"name": "requests.get_weatherForecast"}, {"name": "Movies_1_FindMovies"}]) == {
        "requests", "weather", "forecast", "movies"}
    live = {q.task_id: q for q in load_bfcl(["live_simple"])}
    rows, counts = sft_rows_from_bfcl(["live_simple"], swapped_no_call=200)
    swapped = [r for r in rows if "+tools-of-" in r["id"]]
    assert counts["swapped_no_call"] == len(swapped) == 200 and counts["rows"] == len(rows) == 256 + 200
    questions = [r["id"].split("+tools-of-")[0] for r in swapped]
    assert len(set(questions)) == 200
    for row in swapped:
        own, donor = (live[i] for i in row["id"].split("+tools-of-"))
        assert own.task_id != donor.task_id and not name_words(own.functions) & name_words(donor.functions), row["id"]
        assert row["tools"] == validate_tools(openai_tools(donor.functions))
        assert row["messages"][:-1] == own.messages
        assert row["messages"][-1] == {"role": "assistant", "content": NO_CALL_ANSWER}
    assert sft_rows_from_bfcl(["live_simple"], swapped_no_call=200)[0] == rows  # fixed order
    out = tmp_path / "rows.jsonl"
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(out), "--categories", "live_parallel",
                          "--swapped-no-call", "10", "--json"], capsys)
    assert code == 0 and js["swapped_no_call"] == 10 and js["rows"] == 26, err
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(out), "--categories", "live_parallel",
                          "--swapped-no-call", "17", "--overwrite", "--json"], capsys)
    assert code == 2 and "ask for at most 16" in js["error"]
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(out), "--categories", "live_parallel",
                          "--swapped-no-call", "-1", "--overwrite", "--json"], capsys)
    assert code == 2 and "must be >= 0" in js["error"]
