"""Tool-call SFT rows (issue 27 part 1): rows with tools, assistant tool_calls and tool results, rendered by
the model's own chat template; the loss mask equals, token by token, the mask transformers'
apply_chat_template(..., return_assistant_tokens_mask=True) gives for the same template with {% generation %}
markers around each assistant turn's content, calls and end-of-turn; tool results are never trained;
malformed calls are file:line errors (exit 2); a template without tool support is exit 2 naming it.

Only tokenizers are loaded (GGUF metadata, no weights).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from entrenar.cli import main
from entrenar.data import sft
from entrenar.data.sft import IGNORE_INDEX, load_sft, row_to_chat, shifted_labels
from entrenar.errors import InputError
from tests.helpers.tokenizers import QWEN, SMOLLM, hf_gguf_tokenizer

pytestmark = pytest.mark.real_model  # the packaged GGUFs' tokenizers and chat templates

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search_code", "description": "Search the repository.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TOOLS = [WEATHER, SEARCH]


def call(name: str, arguments, as_string: bool = False, **extra) -> dict:
    return {"type": "function", "function": {"name": name,
                                             "arguments": json.dumps(arguments) if as_string else arguments}, **extra}


USER = {"role": "user", "content": "What is the weather in Paris?"}
ROWS = {
    "text-only": {"messages": [USER, {"role": "assistant", "content": "I cannot look that up."}]},
    "text-only-with-tools": {"tools": TOOLS, "messages": [USER, {"role": "assistant", "content": "Sunny, I think."}]},
    "single-call": {"tools": TOOLS, "messages": [
        USER, {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"})]}]},
    "call-string-args-with-content": {"tools": TOOLS, "messages": [
        {"role": "system", "content": "You are a weather bot."}, USER,
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [call("get_weather", {"city": "Paris", "unit": "C"}, as_string=True, id="c1")]}]},
    "several-calls": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris and Oslo, and find parse_args."},
        {"role": "assistant", "content": None, "tool_calls": [
            call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Oslo"}),
            call("search_code", {"query": "def parse_args"})]}]},
    "tool-results-then-answer": {"tools": TOOLS, "messages": [
        USER, {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"}, id="a")]},
        {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}", "tool_call_id": "a",
         "name": "get_weather"},
        {"role": "assistant", "content": "It is 21 degrees and clear in Paris."}]},
    "multi-turn": {"tools": TOOLS, "messages": [
        {"role": "system", "content": "Be brief."}, USER,
        {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"}),
                                             call("get_weather", {"city": "Lyon"})]},
        {"role": "tool", "content": "paris: 21 C"}, {"role": "tool", "content": "lyon: 18 C"},
        {"role": "assistant", "content": "Paris 21 C, Lyon 18 C."},
        {"role": "user", "content": "Where is parse_args defined?"},
        {"role": "assistant", "content": "Searching.", "tool_calls": [call("search_code", {"query": "parse_args"})]},
        {"role": "tool", "content": "src/cli.py:12: def parse_args(argv):"},
        {"role": "assistant", "content": "In src/cli.py, line 12."}]},
    # the result's text also occurs inside the call's JSON: a search for the next message's content from the
    # call turn's start would end the turn inside its own arguments
    "result-repeats-an-argument": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Find it."},
        {"role": "assistant", "tool_calls": [call("search_code", {"query": "def parse_args"})]},
        {"role": "tool", "content": "def parse_args"}, {"role": "assistant", "content": "Found it."}]},
}
TOOL_RESULTS = ["{\"temp\": 21, \"sky\": \"clear\"}", "paris: 21 C", "lyon: 18 C", "src/cli.py:12: def parse_args(argv):"]


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def replace_once(text: str, find: str, replace: str) -> str:
    assert text.count(find) == 1, f"the packaged template changed: {find!r} is not there once"
    return text.replace(find, replace)


def qwen_generation_template(template: str) -> str:
    """Qwen2.5's template with {% generation %} around what the model writes in an assistant turn: its text,
    its tool calls and its end-of-turn token (not the header or the newline after <|im_end|>). Text and tool
    turns both go through the tool branch, which writes the same characters for them."""
    t = replace_once(template, ' or (message.role == "assistant" and not message.tool_calls) %}', " %}")
    t = replace_once(t, """        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}""", """        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- generation %}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}""")
    t = replace_once(t, """            {{- '\\n<tool_call>\\n{"name": "' }}""",
                     """            {%- if message.content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' }}""")
    return replace_once(t, """        {%- endfor %}
        {{- '<|im_end|>\\n' }}""", """        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}""")


def smollm_generation_template(template: str) -> str:
    return replace_once(template, "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
                                  "'\n'}}",
                        "{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
                        "{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}{% else %}"
                        "{{message['content'] + '<|im_end|>'}}{% endif %}{{'\n'}}")


@pytest.fixture(scope="module")
def qwen():
    from entrenar.tokenizer import load_tokenizer

    return load_tokenizer(QWEN)


@pytest.fixture(scope="module")
def smol():
    from entrenar.tokenizer import load_tokenizer

    return load_tokenizer(SMOLLM)


@pytest.fixture(scope="module")
def qwen_dir(qwen, tmp_path_factory):
    return str(qwen.save_hf(tmp_path_factory.mktemp("qwen-tokenizer")))


@pytest.fixture(scope="module")
def smol_dir(smol, tmp_path_factory):
    return str(smol.save_hf(tmp_path_factory.mktemp("smol-tokenizer")))


def transformers_mask(hf, template: str, messages, tools) -> tuple[list[int], list[bool]]:
    out = hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                 return_assistant_tokens_mask=True, return_dict=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def check_masks_equal(tok, hf, marked: str, rows: dict, tmp_path) -> None:
    """Our mask (the unmodified template, our span code) == transformers' generation mask, token by token,
    at both levels: encode_chat's mask and load_sft's shifted labels."""
    path = write_jsonl(tmp_path / "rows.jsonl", list(rows.values()))
    examples, report = load_sft(path, tok, 4096)
    assert report.kept == len(rows) and report.eot_trained == len(rows), report.to_dict()
    for (tag, row), ex in zip(rows.items(), examples):
        messages, tools = row_to_chat(row)
        hf_ids, hf_mask = transformers_mask(hf, marked, copy.deepcopy(messages), tools)
        assert any(hf_mask), tag
        enc = tok.encode_chat(messages, tools=tools) if tools else tok.encode_chat(messages)
        assert enc.ids == hf_ids, tag
        assert enc.assistant_mask == hf_mask, (tag, [i for i, (a, b) in enumerate(zip(enc.assistant_mask, hf_mask))
                                                     if a != b])
        # a sample ends at its last trained token (what follows the last end-of-turn trains nothing)
        n = len(ex)
        assert n == max(i for i, m in enumerate(hf_mask) if m) + 1, tag
        assert ex.input_ids.tolist() == hf_ids[:n], tag
        assert ex.labels.tolist() == shifted_labels(np.asarray(hf_ids[:n]), np.asarray(hf_mask[:n])).tolist(), tag


def test_marked_templates_render_like_the_packaged_ones(qwen, smol):
    """The {% generation %} copies write the same characters as the packaged templates (else the comparison
    below would compare different texts)."""
    hf = hf_gguf_tokenizer(QWEN)
    marked = qwen_generation_template(qwen.chat_template)
    for tag, row in ROWS.items():
        messages, tools = row_to_chat(row)
        text = hf.apply_chat_template(copy.deepcopy(messages), tools=tools, chat_template=marked, tokenize=False)
        assert text == qwen.render_chat(messages, tools=tools).text, tag
        assert text == hf.apply_chat_template(copy.deepcopy(messages), tools=tools, tokenize=False), tag
    hf_smol = hf_gguf_tokenizer(SMOLLM)
    marked = smollm_generation_template(smol.chat_template)
    messages, _ = row_to_chat(ROWS["text-only"])
    assert hf_smol.apply_chat_template(messages, chat_template=marked, tokenize=False) == \
        smol.render_chat(messages).text


def test_qwen_mask_equals_transformers_generation_mask(qwen, tmp_path):
    check_masks_equal(qwen, hf_gguf_tokenizer(QWEN), qwen_generation_template(qwen.chat_template), ROWS, tmp_path)


def test_smollm_text_rows_mask_equals_transformers_generation_mask(smol, tmp_path):
    rows = {"text-only": ROWS["text-only"],
            "multi-turn": {"messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                        {"role": "user", "content": "Who made you?"},
                                        {"role": "assistant", "content": "\n\nHugging Face  "}]}}
    check_masks_equal(smol, hf_gguf_tokenizer(SMOLLM), smollm_generation_template(smol.chat_template), rows,
                      tmp_path)


def test_tool_results_and_schemas_are_not_trained(qwen, tmp_path):
    """What the model reads (tool results, the tools preamble, user turns) carries no loss; its calls do."""
    path = write_jsonl(tmp_path / "rows.jsonl", [ROWS["multi-turn"], ROWS["tool-results-then-answer"]])
    examples, _ = load_sft(path, qwen, 4096)
    for ex in examples:
        trained = qwen.decode([t for t in ex.labels.tolist() if t != IGNORE_INDEX])
        for result in TOOL_RESULTS:
            assert result not in trained
        assert "<tool_response>" not in trained and "# Tools" not in trained and "description" not in trained
        assert '"name": "get_weather", "arguments": {"city": "Paris"}' in trained
    call_id = qwen.tokenizer.token_to_id("<tool_call>")  # a control token of Qwen2.5's vocabulary
    assert call_id is not None and all(call_id in ex.labels.tolist() for ex in examples)


MALFORMED = [  # (row, message, skip reason)
    ({"tools": TOOLS, "messages": [USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": Paris}"}}]}]},
     "arguments are not valid JSON", "bad_tool_call"),
    ({"tools": TOOLS, "messages": [USER, {"role": "assistant", "tool_calls": [call("get_weather", [1, 2])]}]},
     "arguments must be a JSON object", "bad_tool_call"),
    ({"tools": TOOLS, "messages": [USER, {"role": "assistant", "tool_calls": [call("send_email", {})]}]},
     "unknown tool 'send_email'", "bad_tool_call"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [call("get_weather", {})]}]},
     'unknown tool \'get_weather\' (tools of this row: none: the row has no "tools")', "bad_tool_call"),
    ({"tools": TOOLS, "messages": [USER, {"role": "tool", "content": "21 C"},
                                   {"role": "assistant", "content": "21 C."}]},
     "no assistant tool call precedes it", "tool_without_call"),
    ({"tools": TOOLS, "messages": [USER, {"role": "assistant", "tool_calls": [call("get_weather", {}, id="x")]},
                                   {"role": "tool", "content": "1", "tool_call_id": "y"},
                                   {"role": "assistant", "content": "ok"}]},
     "tool_call_id 'y' matches no call", "tool_without_call"),
    ({"tools": TOOLS, "messages": [USER, {"role": "assistant", "tool_calls": [call("get_weather", {})]},
                                   {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
                                   {"role": "assistant", "content": "ok"}]},
     "all 1 calls of the assistant turn before it are answered", "tool_without_call"),
    ({"tools": {"get_weather": {}}, "messages": [USER, {"role": "assistant", "content": "x"}]},
     '"tools" must be a non-empty list', "bad_tools"),
    ({"tools": [{"name": "get_weather"}], "messages": [USER, {"role": "assistant", "content": "x"}]},
     '"tools"[0] is not a function schema', "bad_tools"),
    ({"tools": TOOLS, "messages": [USER, {"role": "assistant", "tool_calls": []}]},
     "tool_calls must be a non-empty list", "bad_tool_call"),
    ({"tools": TOOLS, "prompt": "hi", "completion": "there"}, '"tools" needs the "messages" form', "unknown_format"),
]


@pytest.mark.parametrize("row,message,reason", MALFORMED, ids=[m[2] + str(i) for i, m in enumerate(MALFORMED)])
def test_malformed_tool_rows_exit_2_with_file_and_line(row, message, reason, qwen_dir, tmp_path, capsys):
    good = ROWS["tool-results-then-answer"]
    path = write_jsonl(tmp_path / "bad.jsonl", [good, row, good])
    rc = main(["data", "check", "--model", qwen_dir, "--data", path, "--max-seq-len", "512"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{path}:2: " in err and message in err, err

    rc = main(["data", "check", "--model", qwen_dir, "--data", path, "--max-seq-len", "512", "--skip-invalid",
               "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["report"]
    assert rc == 0 and report["skipped"] == {reason: 1} and report["kept"] == 2


def test_data_check_counts_tool_rows(qwen_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", list(ROWS.values()))
    rc = main(["data", "check", "--model", qwen_dir, "--data", path, "--max-seq-len", "1024", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])["report"]
    # rows with tools: 7; rows with calls: 6; calls 1+1+3+1+3+1 = 10; results 1+3+1 = 5
    assert report["tools"] == {"rows_with_tools": 7, "rows_with_calls": 6, "calls": 10, "results": 5}
    assert report["eot_trained"] == report["kept"] == len(ROWS)
    assert "tool calls: 10 in 6 rows" in captured.err


def test_template_without_tool_support_is_exit_2_naming_it(smol_dir, qwen, tmp_path, capsys):
    """SmolLM2's template never uses `tools` or `tool_calls`: it would drop the schemas and calls silently."""
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS["text-only"], ROWS["single-call"]])
    rc = main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "512"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{path}:2: " in err and f"chat template of {smol_dir} does not support tools" in err, err
    assert "--chat-template" in err
    # text-only rows still work with that template
    text_only = write_jsonl(tmp_path / "t.jsonl", [ROWS["text-only"]])
    assert main(["data", "check", "--model", smol_dir, "--data", text_only, "--max-seq-len", "512"]) == 0
    capsys.readouterr()
    # a template that renders tools, given by the user, is used instead
    template = tmp_path / "qwen.jinja"
    template.write_text(qwen.chat_template)
    rc = main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "512",
               "--chat-template", str(template), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["report"]["tools"]["calls"] == 1


def test_chat_template_file_errors_are_exit_2(smol_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS["text-only"]])
    rc = main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "512",
               "--chat-template", str(tmp_path / "missing.jinja")])
    assert rc == 2 and "--chat-template" in capsys.readouterr().err
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    rc = main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "512",
               "--chat-template", str(bad)])
    assert rc == 2 and "does not compile" in capsys.readouterr().err


def test_a_template_that_drops_tool_results_is_refused(qwen, tmp_path):
    """A template that uses tools but writes no `tool` messages would train calls without their results."""
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(QWEN)
    tok.set_chat_template(replace_once(qwen.chat_template, "{{- message.content }}\n        {{- '\\n</tool_response>' }}",
                                       "{{- '\\n</tool_response>' }}"), "dropped.jinja")
    messages, tools = row_to_chat(ROWS["tool-results-then-answer"])
    with pytest.raises(InputError, match="dropped.jinja.*tool result"):
        tok.encode_chat(messages, tools=tools)


def test_row_to_messages_keeps_text_rows_unchanged():
    """Rows without tools are what they were (the DPO rows and older callers use row_to_messages)."""
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert sft.row_to_messages(row) == row["messages"]
    assert row_to_chat(row) == (row["messages"], None)


def test_finetune_trains_tool_rows_with_a_given_template_and_saves_it(smol, qwen, tmp_path, capsys):
    """finetune --chat-template FILE: a SmolLM2-vocabulary model trains tool-call rows rendered by Qwen2.5's
    template (SmolLM2's own has no tools: exit 2 without the flag), and final/ carries that template, so
    `generate --chat` on the run renders chats as they were trained."""
    import torch

    from entrenar.formats import save_hf_dir
    from entrenar.tokenizer import load_tokenizer
    from tests.helpers.models import tiny_causal_lm, tiny_config

    rows = [ROWS["single-call"], ROWS["tool-results-then-answer"], ROWS["several-calls"], ROWS["text-only"]] * 2
    data = write_jsonl(tmp_path / "tools.jsonl", rows)
    template = tmp_path / "qwen.jinja"
    template.write_text(qwen.chat_template)
    tok = load_tokenizer(SMOLLM)
    tok.set_chat_template(qwen.chat_template, str(template))
    ids = {i for messages, tools in map(row_to_chat, rows) for i in tok.encode_chat(messages, tools=tools).ids}
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                      tie_word_embeddings=True, max_position_embeddings=512)
    m = tiny_causal_lm(cfg, 0)
    gen = torch.Generator().manual_seed(1)
    d = torch.randn(cfg.hidden_size, generator=gen)
    with torch.no_grad():  # the data's tokens share a direction: a start better than uniform (GUARD-INIT-LOSS)
        for i in sorted(ids):
            m.model.embed_tokens.weight[i] = 4 * d / d.norm() + 0.1 * torch.randn(cfg.hidden_size, generator=gen)
    base = save_hf_dir(m, tmp_path / "base", smol)
    argv = ["finetune", "--model", str(base), "--data", data, "--mode", "full", "--steps", "2", "--batch-size", "2",
            "--max-seq-len", "512", "--val-fraction", "0.25", "--no-preflight", "--json"]
    code = main(argv + ["--out", str(tmp_path / "refused")])
    assert code == 2 and "does not support tools" in capsys.readouterr().out
    code = main(argv + ["--out", str(tmp_path / "run"), "--chat-template", str(template)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())["train"]
    assert report["tools"]["calls"] == 10 and report["eot_trained"] == report["kept"] == 8
    assert load_tokenizer(tmp_path / "run" / "final").chat_template == qwen.chat_template


def test_a_tool_turn_mask_off_its_calls_is_guard_data(qwen, tmp_path, monkeypatch):
    """The report reads each trained tool turn back (content + calls, in the template's call format): a span
    that starts inside the call block, or stops before it, trains text that is not the call -> GUARD-DATA."""
    from entrenar.errors import GuardError
    from entrenar.tokenizer import ChatTokenizer

    real = ChatTokenizer._tool_turn_span
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS["single-call"], ROWS["call-string-args-with-content"]])
    assert load_sft(path, qwen, 4096)[1].eot_trained == 2
    for shift in (lambda s, e: (s + 12, e), lambda s, e: (s, s + 1)):
        monkeypatch.setattr(ChatTokenizer, "_tool_turn_span", lambda self, *a, f=shift: f(*real(self, *a)))
        with pytest.raises(GuardError, match="not exactly the assistant turns"):
            load_sft(path, qwen, 4096)
