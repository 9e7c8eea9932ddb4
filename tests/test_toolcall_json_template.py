"""templates/qwen2_tools_json.jinja and the fenced / list call replies it trains (issue 35).

The packaged Qwen2.5-Coder-0.5B cannot be taught its `<tool_call>` token by a LoRA (that embedding row is nearly
parallel to `<|im_start|>`'s), so the template writes an assistant turn's calls as the ```json block the model
already answers with; prompts must stay exactly Qwen2.5's, and the calls must read back (data check, BFCL).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import entrenar
from entrenar.data.tool_calls import parse_tool_calls
from entrenar.evaluate.bfcl import parse_calls

TEMPLATE = Path(entrenar.__file__).parent / "templates" / "qwen2_tools_json.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _call(name: str, **args) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


@pytest.mark.parametrize("text,expect", [
    ('```json\n{"name": "f", "arguments": {"a": 1}}\n```', [("f", {"a": 1})]),
    ('```json\n[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]\n```',
     [("f", {"a": 1}), ("g", {})]),
    ('[{"name": "f", "arguments": {"a": 1}}]', [("f", {"a": 1})]),
    ('{"name": "f", "arguments": {"a": 1}}', [("f", {"a": 1})]),
    ('```json\n[{"name": "f", "arguments": {}}, {"no": "call"}]\n```', []),  # one non-call: not a call reply
    ("```json\n[]\n```", []),
    ("I cannot help with that.", []),
])
def test_a_reply_of_calls_reads_back_fenced_or_as_a_list(text, expect):
    got = parse_tool_calls(text, "hermes")
    assert [(c["name"], c["arguments"]) for c in got.calls] == expect
    assert got.content == ("" if expect else text.strip())


def _render(template: str, messages: list, **kw) -> str:
    """The template rendered by the project's own chat rendering (tokenizer.render_chat)."""
    from tests.helpers.tokenizers import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.set_chat_template(template, str(TEMPLATE))
    return tok.render_chat(messages, **kw).text


def test_the_template_writes_calls_as_a_json_block_that_reads_back():
    template = TEMPLATE.read_text()
    one = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", city="Paris")]}]
    text = _render(template, one, tools=TOOLS)
    turn = text.split("<|im_start|>assistant\n", 1)[1]
    assert turn == '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```<|im_end|>\n'
    two = [one[0], {"role": "assistant", "content": "",
                    "tool_calls": [_call("get_weather", city="Paris"), _call("get_weather", city="Rome")]}]
    turn = _render(template, two, tools=TOOLS).split("<|im_start|>assistant\n", 1)[1]
    body = turn.removesuffix("<|im_end|>\n")
    assert [c["name"] for c in parse_tool_calls(body, "hermes").calls] == ["get_weather", "get_weather"]
    assert [c["name"] for c in parse_calls(body)[0]] == ["get_weather", "get_weather"]  # BFCL's reader too
    assert "<tool_call>\n{" not in turn  # never the special token the model cannot emit


@pytest.mark.real_model
def test_prompts_are_exactly_qwens_own(qwen_path):
    """Only assistant turns with calls differ: a prompt (system, user, tools, generation prompt) renders as the
    packaged Qwen2.5-Coder's own template renders it, so the base's BFCL numbers do not move."""
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(str(qwen_path))
    ours = load_tokenizer(str(qwen_path))
    ours.set_chat_template(TEMPLATE.read_text(), str(TEMPLATE))
    for messages in ([{"role": "user", "content": "Weather in Paris?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]):
        for tools in (TOOLS, None):
            a = tok.encode_chat(messages, add_generation_prompt=True, tools=tools).ids
            b = ours.encode_chat(messages, add_generation_prompt=True, tools=tools).ids
            assert a == b
