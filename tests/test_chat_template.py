"""Chat templates: rendered text and ids identical to transformers' apply_chat_template, one BOS
at most, assistant spans/masks covering each assistant message through its end-of-turn token,
and a template that raises is an InputError."""

from __future__ import annotations

import pytest

from entrenar.errors import InputError
from entrenar.tokenizer import load_tokenizer
from tests.helpers.tokenizers import CHATML, QWEN, SMOLLM, hf_gguf_tokenizer, tiny_tokenizer

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
TURNS = [
    ({"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}),
    ({"role": "user", "content": "Write a Python function that adds two numbers.\n\tThanks!"},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b"}),
    ({"role": "user", "content": "Ünïcödé — 日本語 🙂 and   three spaces"},
     {"role": "assistant", "content": "  Leading spaces, trailing newline\n"}),
]


def conversations():
    """(id, messages, add_generation_prompt): 1/2/3 turns, +/- system, +/- generation prompt
    (with the prompt the chat ends on a user message, without it on the assistant's answer)."""
    out = []
    for n in (1, 2, 3):
        for system in (False, True):
            msgs = [SYSTEM] if system else []
            for i in range(n):
                msgs += list(TURNS[i])
            tag = f"{n}turn-{'sys' if system else 'nosys'}"
            out.append((tag + "-answered", msgs, False))
            out.append((tag + "-genprompt", msgs[:-1], True))
    return out


CONVS = conversations()


def _hf_ids(hf, msgs, gen):
    ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module", params=[SMOLLM, QWEN])
def pair(request):
    return load_tokenizer(request.param), hf_gguf_tokenizer(request.param)


def test_render_and_ids_match_transformers(pair):
    ours, hf = pair
    for tag, msgs, gen in CONVS:
        rendered = ours.render_chat(msgs, add_generation_prompt=gen)
        assert rendered.text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen), tag
        ids = ours.encode_chat(msgs, add_generation_prompt=gen).ids
        assert ids == _hf_ids(hf, msgs, gen), tag
        # one BOS at most: every BOS id comes from a BOS the template wrote (add_bos is off here)
        assert ids.count(ours.bos_id) == rendered.text.count(ours.bos_token), tag
        assert ids[:2] != [ours.bos_id, ours.bos_id], tag


def _masked_runs(tok, enc) -> list[str]:
    runs, cur = [], []
    for i, m in zip(enc.ids, enc.assistant_mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def test_assistant_mask_is_answers_through_end_of_turn(pair):
    ours, _ = pair
    for tag, msgs, gen in CONVS:
        enc = ours.encode_chat(msgs, add_generation_prompt=gen)
        assert len(enc.assistant_mask) == len(enc.ids)
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        runs = _masked_runs(ours, enc)
        assert len(runs) == len(answers), tag
        for run, answer in zip(runs, answers):
            # a token may straddle the span start ("\n" + leading spaces of the answer): at most
            # template whitespace before the answer, nothing after its end-of-turn
            assert run.endswith(answer + ours.eot_token), (tag, run)
            assert not run[: len(run) - len(answer + ours.eot_token)].strip(), (tag, run)
        # every end-of-turn closing an answer is trained; the ones closing system/user turns are not
        eot_mask = [m for i, m in zip(enc.ids, enc.assistant_mask) if i == ours.eot_id]
        assert sum(eot_mask) == len(answers), tag
        rendered = ours.render_chat(msgs, add_generation_prompt=gen)
        assert [rendered.text[a:b] for a, b in rendered.assistant_spans] == [a + ours.eot_token for a in answers]


SHORT_ANSWERS = [  # answers that also occur earlier in the rendered text (SmolLM2's default system prompt)
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    [{"role": "user", "content": "Who?"}, {"role": "assistant", "content": "Hugging Face"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"},
     {"role": "user", "content": "y"}, {"role": "assistant", "content": "a"}],
]


@pytest.mark.parametrize("msgs", SHORT_ANSWERS)
def test_short_answers_are_located_in_their_own_turn(pair, msgs):
    """Regression: spans were found with str.find from the start of the text, so a short answer
    matched inside the template's default system prompt and the real answer went untrained."""
    ours, _ = pair
    rendered = ours.render_chat(msgs)
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert [rendered.text[a:b] for a, b in rendered.assistant_spans] == [a + ours.eot_token for a in answers]
    for (a, _b), answer in zip(rendered.assistant_spans, answers):
        # each answer sits right after its own assistant header, not inside an earlier turn
        assert rendered.text[:a].endswith("assistant\n"), rendered.text[:a][-40:]
    runs = _masked_runs(ours, ours.encode_chat(msgs))
    assert [r.strip() for r in runs] == [a + ours.eot_token for a in answers]


def test_span_without_end_of_turn_mutation_is_caught(pair):
    """Mutation: spans stop at the content (no end-of-turn) -> the model would never learn to stop."""
    ours, _ = pair
    mutated = load_tokenizer(ours.source)
    mutated.eot_token = None
    _, msgs, gen = CONVS[2]  # 2 turns, answered
    enc = mutated.encode_chat(msgs, add_generation_prompt=gen)
    runs = _masked_runs(mutated, enc)
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert not all(run.endswith(a + ours.eot_token) for run, a in zip(runs, answers))


# ---- BOS ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template_writes_bos", [False, True])
def test_exactly_one_bos_when_model_adds_bos(template_writes_bos):
    template = ("{{ bos_token }}" if template_writes_bos else "") + CHATML
    tok = tiny_tokenizer(add_bos=True, chat_template=template)
    for _, msgs, gen in CONVS:
        ids = tok.encode_chat(msgs, add_generation_prompt=gen).ids
        assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_second_bos_mutation_is_caught(monkeypatch):
    """Mutation: prepend BOS even when the template already wrote it -> two BOS tokens."""
    from entrenar.tokenizer import ChatTokenizer

    tok = tiny_tokenizer(add_bos=True, chat_template="{{ bos_token }}" + CHATML)
    monkeypatch.setattr(ChatTokenizer, "prepends_bos", lambda self, text: self.add_bos)
    ids = tok.encode_chat(CONVS[0][1]).ids
    assert ids[:2] == [tok.bos_id, tok.bos_id]


def test_no_bos_when_model_does_not_add_it():
    tok = tiny_tokenizer(add_bos=False)
    for _, msgs, gen in CONVS:
        assert tok.bos_id not in tok.encode_chat(msgs, add_generation_prompt=gen).ids


# ---- jinja environment like transformers -----------------------------------------------------------
BLOCKY = """{% for message in messages %}
    {% if message['role'] == 'system' %}
<<SYS>>{{ message['content'] }}<</SYS>>
    {% else %}
[{{ message['role'] | upper }}] {{ message | tojson }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT] {% endif %}"""


def test_trim_lstrip_and_tojson_match_transformers(tmp_path):
    from transformers import AutoTokenizer

    tok = tiny_tokenizer(chat_template=BLOCKY)
    tok.save_hf(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [SYSTEM, *TURNS[2]]
    for gen in (False, True):
        text = tok.render_chat(msgs, add_generation_prompt=gen).text
        assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert '"Ünïcödé' in text  # tojson keeps unicode as is (no \\u escapes, no HTML escaping)


def test_generation_markers_render_like_transformers(tmp_path):
    from transformers import AutoTokenizer

    template = CHATML.replace("message['content'] + '<|im_end|>' + '\n'}}",
                              "message['content']}}{% if message['role'] == 'assistant' %}{% generation %}"
                              "{{'<|im_end|>'}}{% endgeneration %}{% else %}{{'<|im_end|>'}}{% endif %}{{'\n'}}")
    assert "generation" in template
    tok = tiny_tokenizer(chat_template=template)
    tok.save_hf(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [*TURNS[0], *TURNS[1]]
    assert tok.render_chat(msgs).text == hf.apply_chat_template(msgs, tokenize=False)
    assert [tok.render_chat(msgs).text[a:b] for a, b in tok.render_chat(msgs).assistant_spans] == [
        "4<|im_end|>", "def add(a, b):\n    return a + b<|im_end|>"]


def test_strftime_now_available():
    tok = tiny_tokenizer(chat_template="{{ strftime_now('%Y') }}|{{ messages[0]['content'] }}")
    assert tok.render_chat([{"role": "user", "content": "x"}]).text[:2] == "20"


# ---- errors -----------------------------------------------------------------------------------------
def test_template_that_raises_is_input_error():
    tok = tiny_tokenizer(chat_template="{% if messages[0]['role'] != 'system' %}"
                                       "{{ raise_exception('a system message is required') }}{% endif %}ok")
    with pytest.raises(InputError, match="a system message is required"):
        tok.render_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InputError, match="a system message is required"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.render_chat([SYSTEM]).text == "ok"


def test_bad_templates_and_messages_are_input_errors():
    with pytest.raises(InputError, match="does not compile"):
        tiny_tokenizer(chat_template="{% for m in messages %}").render_chat([SYSTEM])
    with pytest.raises(InputError, match="no chat template"):
        tiny_tokenizer(chat_template=None).render_chat([SYSTEM])
    with pytest.raises(InputError, match="non-empty list"):
        tiny_tokenizer().render_chat([])
    with pytest.raises(InputError, match="'role'"):
        tiny_tokenizer().render_chat([{"content": "no role"}])
    with pytest.raises(InputError, match="verbatim"):  # a template that rewrites content: no span to find
        tiny_tokenizer(chat_template="{% for m in messages %}{{ m['content'] | upper }}{% endfor %}").render_chat(
            [{"role": "assistant", "content": "abc"}])


def test_sandbox_blocks_python_internals():
    tok = tiny_tokenizer(chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(InputError):
        tok.render_chat([SYSTEM])


@pytest.mark.parametrize("spec", ["chatml_tools", "qwen2_tools_json.jinja"])
def test_a_packaged_template_is_taken_by_name(spec, tmp_path, monkeypatch):
    """--chat-template NAME reads the template shipped in the package (an installed user has no src/ tree); a file
    of that name where the command runs is read instead (a path always means the file)."""
    from importlib.resources import files

    from entrenar.tokenizer import use_chat_template_file

    monkeypatch.chdir(tmp_path)
    tok = tiny_tokenizer()
    use_chat_template_file(tok, spec)
    name = spec.removesuffix(".jinja")
    assert tok.chat_template == files("entrenar").joinpath("templates", f"{name}.jinja").read_text()
    assert tok.chat_template_source == f"--chat-template {spec} (packaged)"
    (tmp_path / spec).write_text("{{ messages[0]['content'] }}")
    use_chat_template_file(tok, spec)
    assert tok.chat_template == "{{ messages[0]['content'] }}" and "packaged" not in tok.chat_template_source
    with pytest.raises(InputError, match=r"--chat-template chatml: cannot read .* a packaged template's name "
                                         r"\(chatml_tools, qwen2_tools_json\)"):
        use_chat_template_file(tok, "chatml")
