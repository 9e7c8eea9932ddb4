"""Tool-call arguments against their tool's JSON schema (issue 38 item 11): types (JSON Schema's names and BFCL's
float/dict/tuple/any), required and unknown parameters, enum values; `data check` lists every row, tool, parameter
and problem, finetune refuses before step 0 (GUARD-DATA, exit 2) naming the first rows, --skip-invalid skips and
counts them (bad_tool_arguments). The tiny byte-level tokenizer with the packaged chatml_tools.jinja: no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entrenar.data.sft import load_sft
from entrenar.data.tool_calls import argument_problems, value_problems
from entrenar.errors import GuardError
from tests.helpers.cli import run_cli as main
from tests.helpers.tokenizers import tiny_tokenizer

TEMPLATE = Path(__file__).resolve().parents[1] / "src" / "entrenar" / "templates" / "chatml_tools.jinja"
FORECAST = {"type": "function", "function": {
    "name": "forecast", "description": "The weather of the next days.",
    "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["C", "F"]},
        "hourly": {"type": "boolean", "default": None}, "hours": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}}}


def row(arguments: dict, tools: list | None = None) -> dict:
    return {"tools": tools or [FORECAST], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "forecast",
                                                                                "arguments": arguments}}]}]}


def problems(arguments: dict, tools: list | None = None) -> list[tuple[str, str]]:
    r = row(arguments, tools)
    return [(p["parameter"], p["problem"]) for p in argument_problems(r["messages"], r["tools"])]


@pytest.mark.parametrize("arguments,expect", [
    ({"city": "Paris", "days": 3}, []),
    ({"city": "Paris", "days": 3.0, "unit": "F", "hourly": None, "hours": [1, 2], "where": {"lat": 1, "x": 0}}, []),
    ({"city": "Paris", "days": "3"}, [("days", '"3" is a string; the schema says integer')]),
    ({"city": "Paris", "days": True}, [("days", "true is a boolean; the schema says integer")]),
    ({"city": "Paris", "days": 2.5}, [("days", "2.5 is a number; the schema says integer")]),
    ({"city": "Paris"}, [("days", "required, missing")]),
    ({"city": "Paris", "days": 3, "town": "x"},
     [("town", "not in the schema (its parameters: city, days, hourly, hours, unit, where)")]),
    ({"city": "Paris", "days": 3, "unit": "K"}, [("unit", '"K" is not one of the schema\'s enum values ("C", "F")')]),
    ({"city": "Paris", "days": 3, "unit": None}, [("unit", "null; the schema says string")]),
    ({"city": "Paris", "days": 3, "hours": [1, "2"]}, [("hours[1]", '"2" is a string; the schema says integer')]),
    ({"city": "Paris", "days": 3, "where": {"lat": "48.8"}},
     [("where.lat", '"48.8" is a string; the schema says number')]),
    ({"city": "Paris", "days": 3, "where": {}}, [("where.lat", "required, missing")]),
])
def test_each_kind_of_argument_problem_is_named(arguments, expect):
    assert problems(arguments) == expect


def test_bfcl_type_names_nullable_enum_items_and_additional_properties():
    """BFCL's Python type names (as its function docs write them), a list of types, an array whose enum lists
    items, true is not 1 in an enum, additionalProperties false/true/a schema."""
    assert value_problems(1, {"type": "float"}, "x") == []
    assert value_problems({"a": 1}, {"type": "dict"}, "x") == [] and value_problems([1, 2], {"type": "tuple"}, "x") == []
    assert value_problems({"a": [1]}, {"type": "any"}, "x") == [] and value_problems(3, {"type": "str"}, "x")
    assert value_problems("3", {"type": "float"}, "x") == [("x", '"3" is a string; the schema says float')]
    assert value_problems(None, {"type": ["string", "null"]}, "x") == []
    assert value_problems(None, {"type": "integer", "nullable": True}, "x") == []
    assert value_problems(3, {"type": "mystery"}, "x") == []  # a type name not known is not judged
    assert value_problems(["a", "c"], {"type": "array", "enum": ["a", "b"]}, "x") == [
        ("x[1]", '"c" is not one of the schema\'s enum values ("a", "b")')]
    assert value_problems(True, {"enum": [1, 2]}, "x") and value_problems(1.0, {"enum": [1, 2]}, "x") == []
    strict = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    assert value_problems({"a": "s", "b": 1}, strict, "x") == [("x.b", "not in the schema (its keys: a)")]
    typed = {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}
    assert value_problems({"b": "1"}, typed, "x") == [("x.b", '"1" is a string; the schema says integer')]
    open_tool = {"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": True}}}
    assert problems({"city": "Paris", "extra": 1}, [open_tool]) == []
    no_schema = {"type": "function", "function": {"name": "forecast"}}  # nothing to judge against
    assert problems({"anything": 1}, [no_schema]) == []


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = row({"city": "Paris", "days": 3})
BAD_ROWS = [GOOD, row({"city": "Paris", "days": "3"}), GOOD, row({"days": 2, "town": "Oslo"}), GOOD]


def test_load_sft_lists_every_bad_row_then_refuses_or_skips_them(tmp_path):
    tok = tiny_tokenizer(chat_template=TEMPLATE.read_text())
    data = write_rows(tmp_path / "rows.jsonl", BAD_ROWS)
    with pytest.raises(GuardError) as e:
        load_sft(data, tok, 4096)
    assert e.value.guard_id == "GUARD-DATA" and e.value.exit_code == 2
    text = str(e.value)
    assert "2 rows call a tool with arguments its JSON schema does not allow" in text
    assert "line 2: forecast argument 'days': \"3\" is a string; the schema says integer" in text
    assert "line 4: forecast argument 'city': required, missing" in text and "'town': not in the schema" in text
    assert "--skip-invalid" in text and "data check" in text
    assert e.value.details["tool_arguments"]["rows"] == 2 and e.value.details["tool_arguments"]["problems"] == 3
    examples, report = load_sft(data, tok, 4096, skip_invalid=True)  # 2 of 5 skipped: under the 0.5 default
    assert len(examples) == 3 and report.skipped == {"bad_tool_arguments": 2}
    with pytest.raises(GuardError, match="more than --max-skip-fraction 0.3"):
        load_sft(data, tok, 4096, skip_invalid=True, max_skip_fraction=0.3)
    assert load_sft(write_rows(tmp_path / "good.jsonl", [GOOD] * 2), tok, 4096)[1].to_dict()["tool_arguments"] == {
        "rows": 0, "problems": 0, "listed": []}


@pytest.fixture()
def tiny_dir(tmp_path) -> Path:
    """A random tiny model with the byte-level tokenizer (whose own ChatML template renders no tools)."""
    from entrenar.formats import save_hf_dir
    from tests.helpers.models import tiny_causal_lm, tiny_config

    tok = tiny_tokenizer()
    cfg = tiny_config("qwen2", vocab_size=len(tok), max_position_embeddings=1024)
    return save_hf_dir(tiny_causal_lm(cfg, 0), tmp_path / "m", tokenizer=tok)


def test_data_check_lists_them_and_finetune_refuses_before_step_0(tiny_dir, tmp_path, capsys):
    data = write_rows(tmp_path / "rows.jsonl", BAD_ROWS)
    check = ["data", "check", "--model", str(tiny_dir), "--data", str(data), "--max-seq-len", "4096",
             "--chat-template", str(TEMPLATE)]
    code, js, err = main([*check, "--json"], capsys)
    assert code == 2 and js["guard"] == "GUARD-DATA", js
    listed = js["details"]["tool_arguments"]["listed"]
    assert [(p["line"], p["tool"], p["parameter"]) for p in listed] == [
        (2, "forecast", "days"), (4, "forecast", "city"), (4, "forecast", "town")]
    # the report (printed before the guard decides) names each row, tool, parameter and problem
    assert "tool-call arguments that break their tool's JSON schema: 3 in 2 rows (exit 2 unless --skip-invalid)" in err
    assert "line 4: forecast argument 'town': not in the schema (its parameters:" in err
    code, js, err = main([*check, "--skip-invalid", "--json"], capsys)
    assert code == 0 and js["report"]["skipped"] == {"bad_tool_arguments": 2} and js["report"]["kept"] == 3, js
    out = tmp_path / "run"
    code, js, err = main(["finetune", "--model", str(tiny_dir), "--data", str(data), "--out", str(out), "--mode",
                          "lora", "--steps", "2", "--batch-size", "1", "--max-seq-len", "4096", "--chat-template",
                          str(TEMPLATE), "--no-preflight", "--json"], capsys)
    assert code == 2 and js["guard"] == "GUARD-DATA" and "line 2: forecast argument 'days'" in js["error"], js
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()  # refused before step 0
