"""Fine-tunes that keep what the model could do: `data replay` (the base's own answers as rows), `finetune --mix
FILE:FRACTION`, `--kl-to-base BETA` (exact against a float64 reference), matched no-call rows, `eval --compare`
(per-category paired verdicts of two models) and GUARD-QA (qa's gates on the base and on the final model).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from entrenar.data.mixing import mix_examples, parse_mix
from entrenar.data.replay import builtin_prompts, read_prompts, replay_rows
from entrenar.errors import GuardError, InputError
from entrenar.evaluate.chat_task import CHAT_SET
from entrenar.evaluate.compare import compare_results, read_units
from entrenar.evaluate.harness import Completion
from entrenar.train import qa_gate
from entrenar.train.kl_to_base import SFTWithKL, token_kl
from entrenar.train.metrics import read_jsonl
from tests.helpers.cli import run_cli as main
from tests.test_eval_task import _tiny_dir


# ---- replay -----------------------------------------------------------------------------------------------
def test_builtin_replay_prompts_are_disjoint_from_the_chat_task():
    prompts = builtin_prompts()
    assert len(prompts) == 200 and len({p["prompt"] for p in prompts}) == 200
    chat = {r.prompt.lower() for r in CHAT_SET}
    assert not chat & {p["prompt"].lower() for p in prompts}


class _Tok:
    chat_template = "x"

    def encode_chat(self, messages, add_generation_prompt=True):
        from types import SimpleNamespace

        return SimpleNamespace(ids=[len(m["content"]) for m in messages])


def test_replay_keeps_answers_that_pass_the_chat_gates_and_retries_samples():
    prompts = [{"id": "a", "prompt": "Explain a thing.", "topic": "explain"},
               {"id": "b", "prompt": "Write a Python function f.", "topic": "code"},
               {"id": "c", "prompt": "Explain something else.", "topic": "explain"}]
    answers = {0: {"Explain a thing.": "It is a thing that does things.", "Write a Python function f.":
                   "```python\ndef f(:\n```", "Explain something else.": "I'm sorry, as an AI I cannot help."},
               1: {"Write a Python function f.": "```python\ndef f():\n    return 1\n```",
                   "Explain something else.": "I cannot answer that."}}
    by_len = {}

    def complete(batch_ids, samples):
        out = []
        for ids, sample in zip(batch_ids, samples):
            prompt = by_len[ids[-1]]
            out.append(Completion(answers[sample][prompt], False))
        return out

    for p in prompts:
        by_len[len(p["prompt"])] = p["prompt"]
    rows, counts = replay_rows(prompts, _Tok(), complete, samples=2, batch_size=2, system="Be brief.")
    assert [r["id"] for r in rows] == ["a", "b"] and counts["dropped_ids"] == {"c": ["no_refusal"]}
    assert rows[1]["messages"][-1]["content"].startswith("```python\ndef f():")
    assert rows[0]["messages"][0] == {"role": "system", "content": "Be brief."}


def test_replay_prompts_file_errors_name_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"nope": 1}\n')
    with pytest.raises(InputError, match=r"p.jsonl:2"):
        read_prompts(str(f))


def test_cli_replay_refuses_an_existing_out_before_loading(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    out.write_text("{}\n")
    code, _, err = main(["data", "replay", "--model", "no-such-model", "--out", str(out), "--json"], capsys)
    assert code == 2 and "already exists" in err


# ---- mixing -----------------------------------------------------------------------------------------------
class _Ex:
    def __init__(self, name, kl=False):
        self.name, self.kl = name, kl


def test_mix_adds_the_stated_fraction_cycling_through_a_short_file():
    from dataclasses import dataclass

    @dataclass
    class Ex:
        name: str
        kl: bool = False

    main_rows = [Ex(f"m{i}") for i in range(70)]
    extra = [Ex(f"r{i}") for i in range(10)]
    mixed, report = mix_examples(main_rows, ["r.jsonl:0.3"], lambda p: extra, seed=1, mark_kl=True)
    assert len(mixed) == 100 and report[0]["rows_added"] == 30 and report[0]["rows_in_file"] == 10
    added = mixed[70:]
    assert all(e.kl for e in added) and not any(e.kl for e in mixed[:70])
    assert {e.name for e in added} == {f"r{i}" for i in range(10)}  # every replay row used, 3 times each


@pytest.mark.parametrize("spec", ["r.jsonl", "r.jsonl:0", "r.jsonl:1", "r.jsonl:x", ":0.3"])
def test_mix_spec_errors(spec):
    with pytest.raises(InputError, match="FILE:FRACTION"):
        parse_mix(spec)


# ---- --kl-to-base ------------------------------------------------------------------------------------------
def test_token_kl_is_the_float64_forward_kl():
    torch.manual_seed(0)
    logits, ref = torch.randn(3, 5, 11), torch.randn(3, 5, 11)
    p_ref = torch.softmax(ref.double(), -1)
    expect = (p_ref * (p_ref.log() - torch.log_softmax(logits.double(), -1))).sum(-1)
    assert torch.allclose(token_kl(logits, ref).double(), expect, rtol=1e-5, atol=1e-6)
    assert token_kl(ref, ref).abs().max() < 1e-6


def test_sft_with_kl_loss_and_gradient_equal_a_float64_reference():
    from tests.test_train_loop import tiny_model

    policy = tiny_model()
    objective = SFTWithKL(0.7, "frozen-copy")
    objective.bind(policy)  # the base: a copy of the start
    with torch.no_grad():  # move the policy away from the base so the KL is not 0
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 64, (2, 9))
    labels = ids.clone()
    labels[:, :3] = -100
    labels[:, :-1], labels[:, -1] = labels[:, 1:].clone(), -100
    kl_mask = torch.tensor([[True] * 9, [False] * 9])
    batch = {"input_ids": ids, "labels": labels, "kl_mask": kl_mask}
    loss, n, metrics = objective.loss(policy, batch, torch.device("cpu"))
    loss.backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    # the reference in float64: a double copy of each model, CE + beta * KL(base || policy) on row 0's label tokens
    pol64, base64 = tiny_model().double(), objective.reference_model
    pol64.load_state_dict({k: v.double() for k, v in policy.state_dict().items()})
    pol64.zero_grad()
    logits = pol64(ids)
    with torch.no_grad():
        ref_logits = base64.double()(ids)
    valid = labels != -100
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    p_ref = torch.softmax(ref_logits, -1)
    kl = (p_ref * (torch.log_softmax(ref_logits, -1) - torch.log_softmax(logits, -1))).sum(-1)
    ref_loss = ce + 0.7 * (kl * (kl_mask & valid)).sum()
    ref_loss.backward()
    assert n == int(valid.sum()) and float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert float(metrics["kl_to_base"]) > 0
    for g, p in zip(grads, pol64.parameters()):
        assert torch.allclose(g.double(), p.grad, rtol=1e-4, atol=1e-6)


def test_sft_with_kl_is_plain_cross_entropy_at_the_start():
    from entrenar.train.objective import CausalLMLoss
    from tests.test_train_loop import tiny_model

    policy = tiny_model()
    objective = SFTWithKL(1.0, "frozen-copy")
    objective.bind(policy)
    ids = torch.randint(0, 64, (2, 7))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    batch = {"input_ids": ids, "labels": labels, "kl_mask": torch.ones(2, 7, dtype=torch.bool)}
    loss, _, metrics = objective.loss(policy, batch, torch.device("cpu"))
    plain, _, _ = CausalLMLoss().loss(policy, {"input_ids": ids, "labels": labels}, torch.device("cpu"))
    assert float(loss) == pytest.approx(float(plain), rel=1e-5) and abs(float(metrics["kl_to_base"])) < 1e-5


@pytest.fixture()
def rows(tmp_path) -> Path:
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"add {i} and {i}"},
                                                  {"role": "assistant", "content": f"{2 * i}"}]}) + "\n"
                         for i in range(8)))
    return f


def test_cli_finetune_mix_and_kl_to_base(tmp_path, rows, capsys):
    model = _tiny_dir(tmp_path, "m")
    replay = tmp_path / "replay.jsonl"
    replay.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                       {"role": "assistant", "content": w}]}) + "\n"
                              for w in ("yes", "no", "maybe")))
    out = tmp_path / "run"
    code, _, err = main(["finetune", "--model", str(model), "--data", str(rows), "--out", str(out), "--mode", "lora",
                         "--batch-size", "4", "--steps", "2", "--no-preflight", "--val-fraction", "0", "--json",
                          "--mix", f"{replay}:0.5", "--kl-to-base", "0.5"], capsys)
    assert code == 0, err
    report = json.loads((out / "data_report.json").read_text())
    assert report["mix"][0]["rows_added"] == 8 and report["train_examples"] == 16
    assert "--mix" in err and "8 rows added" in err
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "task" not in r]
    assert all("kl_to_base" in r for r in steps)


@pytest.mark.parametrize("flags,expect", [
    (["--kl-to-base", "0.5"], "--kl-rows mix pulls the rows --mix adds"),
    (["--kl-to-base", "-1"], "--kl-to-base must be a finite number >= 0"),
    (["--mix", "x.jsonl:2"], "FILE:FRACTION"),
])
def test_cli_mix_and_kl_flags_are_checked(tmp_path, rows, capsys, flags, expect):
    model = _tiny_dir(tmp_path, "m")
    code, _, err = main(["finetune", "--model", str(model), "--data", str(rows), "--out", str(tmp_path / "run"),
                         "--mode", "lora", "--steps", "1", "--batch-size", "2", "--no-preflight", "--json", *flags],
                        capsys)
    assert code == 2 and expect in err, err


# ---- matched no-call rows ----------------------------------------------------------------------------------
def test_matched_swapped_rows_take_donors_of_the_same_category_and_tool_count():
    from entrenar.data.bfcl_data import BfclQuestion, swapped_no_call_rows

    def q(i, cat, names):
        return BfclQuestion(f"{cat}_{i}", cat, [{"role": "user", "content": f"q{i}"}],
                            [{"name": n, "description": "d", "parameters": {"type": "dict", "properties": {},
                                                                            "required": []}} for n in names], None)

    qs = [q(0, "live_simple", ["weather_now"]), q(1, "live_simple", ["stock_price"]),
          q(2, "live_multiple", ["music_play", "music_stop"]), q(3, "live_multiple", ["tax_rate", "tax_due"]),
          q(4, "live_multiple", ["lamp_on"])]
    rows = swapped_no_call_rows(qs, 5, matched=True, seed=0)
    by_id = {x.task_id: x for x in qs}
    assert rows
    for r in rows:
        own, donor = r["id"].split("+tools-of-")
        assert by_id[own].category == by_id[donor].category
        assert len(by_id[own].functions) == len(by_id[donor].functions) == len(r["tools"])
    assert not any(r["id"].startswith("live_multiple_4+") for r in rows)  # no donor with one function there


# ---- near-miss no-call rows (--swapped-nearest) ---------------------------------------------------------------
def _bq(i: int, user: str, functions: list[tuple[str, str, list[str]]], cat: str = "live_simple"):
    """A BFCL question with these (name, description, parameter names) functions; its answer calls the first."""
    from entrenar.data.bfcl_data import BfclQuestion

    docs = [{"name": n, "description": d, "parameters": {"type": "dict", "required": [],
                                                         "properties": {p: {"type": "float"} for p in ps}}}
            for n, d, ps in functions]
    return BfclQuestion(f"{cat}_{i}", cat, [{"role": "user", "content": user}], docs, [{functions[0][0]: {}}])


TRIANGLE = ("triangle_area", "Calculate the area of a triangle from its base and height.", ["base", "height"])
BMI = ("determine_body_mass_index", "Body mass index of a person from weight and height.", ["weight", "height"])


def _near_miss_questions():
    return [_bq(0, "What is the area of a triangle with base 10 and height 5?", [TRIANGLE]),
            _bq(1, "My BMI at 70 kg and 1.8 m?", [BMI]),
            _bq(2, "Weather in Paris now?", [("get_weather", "Current weather of a city.", ["city"])]),
            _bq(3, "Area of a triangle, base 3, height 4", [TRIANGLE]),
            # the closest of all and yet it answers a triangle's area: excluded (its description holds the
            # question's own function's subject words)
            _bq(4, "Measure my square of side 2", [("polygon_measure", "Area of a triangle or a square from sides.",
                                                    ["sides", "height"])])]


def test_nearest_swapped_rows_pick_the_on_topic_donor_that_cannot_answer():
    """--swapped-nearest: a triangle-area question is shown the body-mass-index function (on topic: height),
    never another triangle-area function or one whose description answers it (polygon_measure), and not the
    off-topic weather one while bmi is there; each donor's function set at most twice; fixed by the seed."""
    from entrenar.data.bfcl_data import swapped_no_call_rows
    from entrenar.data.bfcl_nearest import TopicIndex, nearest_donors

    qs = _near_miss_questions()
    index = TopicIndex(qs)
    assert index.similarity(0, 4) > index.similarity(0, 1) > index.similarity(0, 2) == 0.0
    assert not index.cannot_answer(0, 3) and not index.cannot_answer(0, 4) and index.cannot_answer(0, 1)
    # the user asks in the donor's own words (body mass index), though the question's function is named otherwise
    health = ("health_metrics", "Health metrics of a person from weight and height.", ["weight", "height"])
    asks_bmi = _bq(6, "Body mass index of a 70 kg, 1.8 m adult?", [health])
    assert not TopicIndex([*qs, asks_bmi]).cannot_answer(5, 1)
    # a donor taking the question's subject as a parameter (play a song at a volume) could answer "volume 20"
    volume = [_bq(7, "Make the volume 20", [("set_volume", "Set the speaker's volume.", ["volume"])]),
              _bq(8, "Play Yellow", [("play_spotify_song", "Plays a song on Spotify.", ["query", "volume"])])]
    assert not TopicIndex([*qs, *volume]).cannot_answer(5, 6)
    assert [(i, j) for i, j, _ in nearest_donors(qs, [0, 3, 1, 2, 4], 2)] == [(0, 1), (3, 1)]
    # a third triangle question: bmi's function set was shown twice already, so it gets the weather one
    qs.append(_bq(5, "Triangle with base 6 and height 2: its area?", [TRIANGLE]))
    assert [(i, j) for i, j, _ in nearest_donors(qs, [0, 3, 5, 1, 2, 4], 3)] == [(0, 1), (3, 1), (5, 2)]
    for seed in range(4):
        rows = swapped_no_call_rows(qs, 6, nearest=True, seed=seed)
        assert rows == swapped_no_call_rows(qs, 6, nearest=True, seed=seed)
        pairs = [tuple(int(x.rsplit("_", 1)[1]) for x in r["id"].split("+tools-of-")) for r in rows]
        assert len(rows) == len({i for i, _ in pairs}) >= 5 and all(TopicIndex(qs).cannot_answer(i, j)
                                                                    for i, j in pairs)
        assert all(j in (1, 2) for i, j in pairs if i in (0, 3, 5)) and [j for _, j in pairs].count(1) <= 2


def test_nearest_swapped_rows_on_the_packaged_live_data(tmp_path, capsys):
    """On BFCL's live_* questions the near-miss donors are closer in topic than random ones, every pair passes
    the can't-answer rule, and with --swapped-matched they keep category and tool count. The CLI flag works end
    to end and is exit 2 without --swapped-no-call."""
    from entrenar.data import bfcl_data as bd
    from entrenar.data.bfcl_nearest import TopicIndex, function_set_key, mean_similarity

    qs = bd.load_bfcl(bd.LIVE_CALL_CATEGORIES)
    index, at = TopicIndex(qs), {q.task_id: i for i, q in enumerate(qs)}
    for matched in (False, True):
        near = bd.swapped_no_call_rows(qs, 300, matched=matched, nearest=True)
        pairs = [tuple(at[x] for x in r["id"].split("+tools-of-")) for r in near]
        assert len(near) == 300 and len({i for i, _ in pairs}) == 300
        assert all(index.cannot_answer(i, j) for i, j in pairs)
        sets = [function_set_key(qs[j].functions) for _, j in pairs]
        assert max(sets.count(k) for k in sets) <= 2
        if matched:
            assert all(qs[i].category == qs[j].category and len(qs[i].functions) == len(qs[j].functions)
                       for i, j in pairs)
        random_rows = bd.swapped_no_call_rows(qs, 300, matched=matched)
        assert mean_similarity(qs, near) > 1.5 * mean_similarity(qs, random_rows)
    out = tmp_path / "rows.jsonl"
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(out), "--swapped-no-call", "50",
                          "--swapped-nearest", "--json"], capsys)
    assert code == 0 and js["swapped_no_call"] == 50 and js["swapped_nearest"] is True, err
    assert js["swapped_mean_similarity"] > 0
    assert sum("+tools-of-" in json.loads(line)["id"] for line in out.read_text().splitlines()) == 50
    assert bd.sft_rows_from_bfcl(swapped_no_call=50, nearest=True)[1]["swapped_mean_similarity"] == \
        js["swapped_mean_similarity"]
    code, js, err = main(["data", "sft-from-bfcl", "--out", str(out), "--swapped-nearest", "--overwrite",
                          "--json"], capsys)
    assert code == 2 and "--swapped-nearest" in js["error"] and "--swapped-no-call N" in js["error"]


# ---- eval --compare -----------------------------------------------------------------------------------------
def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_compare_judges_each_bfcl_category_on_its_own(tmp_path):
    before = [{"task_id": f"s{i}", "category": "simple_python", "passed": False} for i in range(12)] + \
        [{"task_id": f"i{i}", "category": "irrelevance", "passed": True} for i in range(12)]
    after = [{"task_id": f"s{i}", "category": "simple_python", "passed": True} for i in range(12)] + \
        [{"task_id": f"i{i}", "category": "irrelevance", "passed": False} for i in range(12)]
    c = compare_results(_write(tmp_path / "b.jsonl", before), _write(tmp_path / "a.jsonl", after), "bfcl")
    assert c["units"]["bfcl:simple_python"]["verdict"] == "improved"
    assert c["units"]["bfcl:irrelevance"]["verdict"] == "regressed"
    assert any("bfcl:irrelevance: 12/12 before -> 0/12 after" in line for line in c["lines"])


def test_compare_reads_a_runs_task_eval_units_and_refuses_bad_rows(tmp_path):
    f = _write(tmp_path / "s.jsonl", [{"task_id": "t0", "passed": True, "unit": "chat"}])
    assert read_units(f, "x") == {"chat": {"t0": True}}
    bad = _write(tmp_path / "bad.jsonl", [{"task_id": "t0", "passed": True}, {"id": 3}])
    with pytest.raises(InputError, match="bad.jsonl:2"):
        read_units(bad, "humaneval")


def test_cli_eval_compare_needs_out(tmp_path, capsys):
    model = _tiny_dir(tmp_path, "m")
    before = _write(tmp_path / "b.jsonl", [{"task_id": "chat/fact-000", "passed": True}])
    code, _, err = main(["eval", "--task", "chat", "--model", str(model), "--compare", str(before), "--json"], capsys)
    assert code == 2 and "give --out" in err


def test_cli_eval_task_chat_with_compare(tmp_path, capsys):
    model = _tiny_dir(tmp_path, "m")
    out = tmp_path / "a.jsonl"
    before = _write(tmp_path / "b.jsonl", [{"task_id": f"chat/fact-00{i}", "passed": True} for i in range(2)])
    code, js, err = main(["eval", "--task", "chat", "--model", str(model), "--limit", "2", "--max-new-tokens", "3",
                          "--out", str(out), "--compare", str(before), "--json"], capsys)
    assert code == 0, err
    assert js["problems"] == 2 and js["compare"]["units"]["chat"]["problems"] == 2
    assert isinstance(js["base_answer_logp"], float)
    assert [json.loads(x)["task_id"] for x in out.read_text().splitlines()] == ["chat/fact-000", "chat/fact-001"]


# ---- GUARD-QA ----------------------------------------------------------------------------------------------
def _rep(**gates_by_prompt):
    return {"prompts": [{"name": n, "gates": g, "output": "out", "notes": []} for n, g in gates_by_prompt.items()]}


def test_guard_qa_fires_only_on_prompts_the_base_passed():
    base = _rep(p={"coherent": True, "stops": True}, q={"coherent": True, "non_empty": False})
    final = _rep(p={"coherent": False, "stops": True}, q={"coherent": False, "non_empty": False})
    found = qa_gate.judge(base, final, "warn")
    assert found["guard"] == "GUARD-QA" and [(x["prompt"], x["gates"]) for x in found["lost"]] == [("p", ["coherent"])]
    assert qa_gate.judge(base, base, "warn") is None
    with pytest.raises(GuardError) as e:
        qa_gate.judge(base, final, "stop")
    assert e.value.guard_id == "GUARD-QA" and e.value.exit_code == 3
    assert qa_gate.judge(base, final, "off") is None


def test_qa_diagnosis_blames_a_refusal_not_the_template():
    from entrenar.verify.qa import GOLDEN, PromptResult, check_answer, diagnose

    def result(gp, text):
        gates, notes = check_answer(gp, text, True)
        return PromptResult(gp.name, gp.kind, gp.topic, gp.prompt, text, 5, "eot", 0.1, gates, notes)

    plain = [result(g, "Paris" if g.topic == "prose" else "a + b") for g in GOLDEN if g.kind == "plain"]
    chat = {g.topic: g for g in GOLDEN if g.kind == "chat"}
    code_ok = result(chat["code"], "```python\ndef add(a, b):\n    return a + b\n```")
    refused = result(chat["prose"], "I'm sorry for any confusion, but as an AI, I can't answer personal questions.")
    assert not refused.gates["no_refusal"]
    assert diagnose(plain + [refused, code_ok]).startswith("a chat answer refused or degraded")
    garbled = result(chat["prose"], "<|im_start|> assistant <|im_end|> Paris")
    assert "chat template / special tokens" in diagnose(plain + [garbled, code_ok])
    assert diagnose(plain + [result(chat["prose"], "Paris is the capital."), code_ok]) is None


@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_cli_guard_qa_after_a_finetune(tmp_path, rows, capsys, monkeypatch, policy):
    """The base passes qa and final/ fails it (qa's reports seeded): a named warning in the summary, exit 0 (warn),
    or exit 3 after final/ is written (stop)."""
    reports = iter([_rep(**{"chat-prose": {"coherent": True, "no_refusal": True}}),
                    _rep(**{"chat-prose": {"coherent": False, "no_refusal": False}})])
    monkeypatch.setattr(qa_gate, "qa_report", lambda model, tokenizer, device, dtype, log: next(reports))
    model = _tiny_dir(tmp_path, "m")
    out = tmp_path / "run"
    code, js, err = main(["finetune", "--model", str(model), "--data", str(rows), "--out", str(out), "--mode", "lora",
                          "--steps", "1", "--batch-size", "2", "--no-preflight", "--json",
                          *(["--on-qa-fail", "stop"] if policy == "stop" else [])], capsys)
    assert (out / "final").is_dir()
    if policy == "stop":
        assert code == 3 and js["guard"] == "GUARD-QA" and "chat-prose" in js["error"], err
        return
    assert code == 0, err
    [w] = [w for w in js["warnings"] if w["guard"] == "GUARD-QA"]
    assert w["lost"][0]["prompt"] == "chat-prose" and "GUARD-QA" in err and js["qa"]["final_ok"] is False
