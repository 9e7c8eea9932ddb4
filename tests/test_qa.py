"""`entrenar qa`: the gates on hand-made answers, then the golden prompts on the packaged models."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from entrenar.verify.qa import (
    GOLDEN,
    check_answer,
    gibberish_reasons,
    parse_errors,
    python_blocks,
    repeated_fragment,
)

CHAT_PROSE = next(g for g in GOLDEN if g.name == "chat-prose")
CHAT_CODE = next(g for g in GOLDEN if g.name == "chat-code")
PLAIN_PROSE = next(g for g in GOLDEN if g.name == "plain-prose")


# ---- gates on hand-made strings -----------------------------------------------------------------
@pytest.mark.parametrize("text", ["the cat sat. the cat sat. the cat sat. ", "ha ha ha ha", "Paris\nParis\nParis\n",
                                  "x = foo(1)\nx = foo(1)\nx = foo(1)\n"])
def test_repetition_is_caught(text):
    assert repeated_fragment(text) is not None


@pytest.mark.parametrize("text", ["The capital of France is Paris.", "[0, 0, 0, 0, 0]", "-" * 40, "    " * 8 + "pass",
                                  "def add(a, b):\n    return a + b\n", "Paris. Paris.", "1000000000000"])
def test_no_false_repetition(text):
    assert repeated_fragment(text) is None


def test_code_blocks_parse():
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    bad = "```python\ndef add(a, b)\n    return a + b\n```"
    assert python_blocks(good) == ["def add(a, b):\n    return a + b\n"]
    assert parse_errors(python_blocks(good)) == []
    assert parse_errors(python_blocks(bad)) and "line 1" in parse_errors(python_blocks(bad))[0]
    assert python_blocks("```js\nlet x = 1;\n```") == []
    assert python_blocks("```py\nx = (1,\n") == ["x = (1,\n"]  # unterminated block at the budget


def test_gibberish():
    assert gibberish_reasons("The capital of France is Paris.") == []
    assert gibberish_reasons("def add(a, b):\n    return a + b") == []
    assert gibberish_reasons("<|im_start|>assistant\nParis")
    assert gibberish_reasons("xkcd qwrtp zzkkz bcdfg plmnt srtvw")
    assert gibberish_reasons("\u2581\u00e2\u0122\u0142\u00c4\u0142 \u0120\u010a\u00c2\u00a0 \u00e2\u0122\u013b\u00c3")


def test_check_answer_gates():
    gates, _ = check_answer(CHAT_PROSE, "The capital of France is Paris.", stopped=True)
    assert all(gates.values()) and set(gates) == {"non_empty", "no_repetition", "stops", "no_refusal",
                                                                    "coherent"}
    gates, notes = check_answer(CHAT_PROSE, "The capital of France is Paris.", stopped=False)
    assert not gates["stops"] and any("end-of-turn" in n for n in notes)
    gates, notes = check_answer(CHAT_PROSE, "I like turtles very much.", stopped=True)
    assert not gates["coherent"] and any("Paris" in n for n in notes)
    gates, notes = check_answer(CHAT_PROSE, "I'm sorry, but as an AI I can't answer that.", stopped=True)
    assert not gates["no_refusal"] and any("refused" in n for n in notes)
    gates, _ = check_answer(CHAT_PROSE, "  \n", stopped=True)
    assert not gates["non_empty"]
    gates, _ = check_answer(CHAT_CODE, "```python\ndef add(a, b):\n    return a + b\n```", stopped=True)
    assert all(gates.values())
    gates, _ = check_answer(CHAT_CODE, "```python\ndef add(a, b)\n    return a + b\n```", stopped=True)
    assert not gates["code_parses"]
    gates, _ = check_answer(CHAT_CODE, "def add(a, b): return a + b", stopped=True)  # unfenced code
    assert gates["code_parses"] and gates["coherent"]
    gates, _ = check_answer(CHAT_CODE, "You can add them with def add and a plus sign.", stopped=True)
    assert not gates["code_parses"]
    gates, _ = check_answer(PLAIN_PROSE, " Paris, which is on the Seine", stopped=False)
    assert all(gates.values()) and "stops" not in gates


# ---- the golden prompts on the packaged models --------------------------------------------------------
PACKAGED = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]


MODEL_FIXTURES = {"smollm2-135m-instruct": "smollm_model", "qwen2.5-coder-0.5b-instruct": "qwen_model"}


@pytest.fixture
def loaded(request):
    """(model, tokenizer) of a packaged model; the model is conftest's shared session copy (read-only)."""
    from entrenar.tokenizer import load_tokenizer

    def get(name):
        return request.getfixturevalue(MODEL_FIXTURES[name]), load_tokenizer(name)

    return get


@pytest.mark.real_model
@pytest.mark.parametrize("name", PACKAGED)
def test_qa_passes_on_packaged_model(name, loaded):
    from entrenar.verify.qa import format_qa, run_qa

    model, tok = loaded(name)
    rep = run_qa(model, tok)
    assert rep["ok"] and rep["exit_code"] == 0, format_qa(rep)
    assert [p["name"] for p in rep["prompts"]] == [g.name for g in GOLDEN]


@pytest.mark.real_model
def test_qa_fails_on_corrupted_o_proj(loaded):
    from entrenar.verify.qa import format_qa, run_qa

    model, tok = loaded("smollm2-135m-instruct")
    model = copy.deepcopy(model)  # the shared model stays intact
    w = model.model.layers[0].self_attn.o_proj.weight
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w.copy_(w.reshape(-1)[torch.randperm(w.numel(), generator=gen)].reshape(w.shape))
    rep = run_qa(model, tok)
    assert not rep["ok"] and rep["exit_code"] == 1, format_qa(rep)
    failed = {g for p in rep["prompts"] for g, ok in p["gates"].items() if not ok}
    assert {"coherent", "no_repetition"} <= failed
    assert json.loads(json.dumps(rep))["diagnosis"].startswith("plain continuations fail")
