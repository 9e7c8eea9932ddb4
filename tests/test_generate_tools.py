"""`generate --chat --tools FILE` (issue 27 part 1): tool schemas rendered by the chat template, the calls the model
writes read back (tool_calls.parse_tool_calls) and printed as JSON; bad --tools files are exit 2."""

from __future__ import annotations

import json

import pytest

from entrenar.data.tool_calls import call_format, parse_tool_calls
from tests.helpers.cli import run_cli
from tests.helpers.tokenizers import QWEN, SMOLLM

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# ---- the parser --------------------------------------------------------------------------------------
def test_hermes_calls_are_read_in_order_with_the_text_around_them():
    text = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>')
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                            {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert parsed.content == "Let me check both." and parsed.errors == []


def test_no_call_is_just_the_text():
    for fmt in ("hermes", None):
        parsed = parse_tool_calls("The answer is 4.", fmt)
        assert parsed.calls == [] and parsed.content == "The answer is 4." and parsed.errors == []
    # an unknown format never reads calls, even where the text looks like one
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text, None).calls == [] and parse_tool_calls(text, None).content == text


def test_a_bare_call_object_is_a_call():
    """Qwen2.5-Coder-0.5B (Q4) answers a weather question with the JSON object alone, without the tags."""
    parsed = parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Paris"}}', "hermes")
    assert parsed.calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}] and parsed.content == ""
    not_a_call = parse_tool_calls('{"city": "Paris"}', "hermes")
    assert not_a_call.calls == [] and not_a_call.content == '{"city": "Paris"}'


@pytest.mark.parametrize("body,error", [
    ("{\"name\": \"f\", \"arguments\": {", "not JSON"),
    ("[1, 2]", "not a {\"name\""),
    ("{\"name\": \"f\", \"arguments\": [1]}", "arguments are not a JSON object"),
])
def test_malformed_blocks_stay_text_and_are_reported(body, error):
    text = f"ok <tool_call>\n{body}\n</tool_call> done"
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == [] and error in parsed.errors[0]
    assert parsed.content == text.strip()


def test_an_unclosed_last_call_is_read_and_reported():
    parsed = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": 1}}', "hermes")
    assert parsed.calls == [{"name": "f", "arguments": {"x": 1}}] and "not closed" in parsed.errors[0]


def test_call_format_is_keyed_by_the_template():
    from entrenar.tokenizer import load_tokenizer

    assert call_format(load_tokenizer(QWEN).chat_template) == "hermes"
    assert call_format(load_tokenizer(SMOLLM).chat_template) is None
    assert call_format(None) is None


# ---- the command -------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,flags,message", [
    (None, ["--chat"], "no such file"),
    ("{not json", ["--chat"], "not valid JSON"),
    (json.dumps({"name": "f"}), ["--chat"], "must be a non-empty list"),
    (json.dumps([{"name": "f"}]), ["--chat"], "[0] is not a function schema"),
    (json.dumps([WEATHER]), [], "--tools needs --chat"),
])
def test_bad_tools_file_is_exit_2(content, flags, message, tmp_path, capsys):
    path = tmp_path / "tools.json"
    if content is not None:
        path.write_text(content)
    code, result, _ = run_cli(["generate", "--model", "no-model-needed", "--prompt", "hi", "--tools", str(path),
                                 *flags, "--json"], capsys)
    assert code == 2 and message in result["error"] and "--tools" in result["error"], result


@pytest.mark.real_model
def test_tools_with_a_template_without_tool_support_is_exit_2(tmp_path, capsys):
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    code, result, _ = run_cli(["generate", "--model", SMOLLM, "--chat", "--prompt", "Weather in Paris?",
                               "--tools", str(tmp_path / "tools.json"), "--json"], capsys)
    assert code == 2 and "does not support tools" in result["error"] and "--chat-template" in result["error"]


@pytest.mark.real_model
def test_generate_prints_the_calls_qwen_emits(tmp_path, capsys, monkeypatch):
    """The packaged Qwen2.5-Coder-0.5B sees the schema in its prompt (the tools preamble: > 100 prompt tokens,
    the chat alone is ~30) and answers with a get_weather call, read back as JSON: under --json as
    `tool_calls`, in text mode as one `tool call: {...}` line per call. The text-mode command reuses the model
    the first one loaded (generate leaves it as it was): loading Qwen's GGUF is over half of each command."""
    from entrenar.peft import load as peft_load

    loaded: dict = {}
    real_load = peft_load.load_model

    def load_once(spec, **kwargs):
        key = (str(spec), tuple(sorted(kwargs.items())))
        if key not in loaded:
            loaded[key] = real_load(spec, **kwargs)
        return loaded[key]

    monkeypatch.setattr(peft_load, "load_model", load_once)
    (tmp_path / "tools.json").write_text(json.dumps([WEATHER]))
    argv = ["generate", "--model", QWEN, "--chat", "--prompt", "What is the weather in Paris?",
            "--max-new-tokens", "24", "--tools", str(tmp_path / "tools.json")]
    code, result, _ = run_cli(argv + ["--json"], capsys)
    assert code == 0, result
    assert result["tool_call_format"] == "hermes" and result["tool_call_errors"] == []
    assert result["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Paris"}}], result["text"]
    assert result["prompt_tokens"] > 100

    run = run_cli(argv, capsys)
    assert len(loaded) == 1  # both commands ran on the one model
    lines = [ln for ln in run.out.splitlines() if ln.startswith("tool call: ")]
    assert run[0] == 0 and [json.loads(ln[len("tool call: "):]) for ln in lines] == result["tool_calls"], run.out


def test_chat_template_needs_chat(tmp_path, capsys):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    code, result, _ = run_cli(["generate", "--model", "no-model-needed", "--prompt", "hi", "--chat-template",
                               str(tmp_path / "t.jinja"), "--json"], capsys)
    assert code == 2 and "--chat-template needs --chat" in result["error"]
