"""pass@k on BFCL: `eval --task bfcl --samples K --temperature T` asks each question K times (request i seeded --seed
+ its sample), scores every answer, and reports per category and overall pass@1 (the mean over samples) and pass@K
(any of K right) with humaneval's unbiased estimator; `correct`/`accuracy` stay sample 0's; --out rows carry
`sample`, --compare pairs sample 0 and --resume asks only the (question, sample) rows its --out lacks."""

from __future__ import annotations

import json

import pytest

from entrenar import engine
from entrenar.data.bfcl_data import ground_truth_calls
from entrenar.evaluate.bfcl import bfcl_prompt_ids, bfcl_records, load_bfcl, summarize_bfcl
from entrenar.evaluate.compare import compare_results
from tests.helpers.cli import run_cli as main
from tests.helpers.tokenizers import tiny_tokenizer
from tests.test_bfcl import TEMPLATE, render, tiny_dir  # noqa: F401  (tiny_dir: the module's tiny model)

REAL_GENERATE_MANY = engine.generate_many  # before any test patches it
NO_CALL = "No tool fits."
# question -> the samples answered right (of SAMPLES); simple_python_0 right only by sample 3
RIGHT = {"simple_python_0": {3}, "simple_python_1": set(range(8)), "irrelevance_0": {0, 2, 4, 6}, "irrelevance_1": set()}
SAMPLES = 8


def _questions():
    return load_bfcl(["simple_python", "irrelevance"], limit=2)


def _answer(q, right: bool) -> str:
    if q.answer is None:  # irrelevance: right iff no call
        return NO_CALL if right else render([{"name": "anything", "arguments": {}}], "hermes")
    return render(ground_truth_calls(q), "hermes") if right else "Let me think."


def _fake_complete(qs, tok, calls: list):
    """A Complete answering (question, sample) right iff RIGHT says so; each call's (task, sample) pairs recorded."""
    task_of = {tuple(bfcl_prompt_ids(q, tok)): q for q in qs}

    def complete(batch, samples):
        asked = [(task_of[tuple(ids)], s) for ids, s in zip(batch, samples)]
        calls.append([(q.task_id, s) for q, s in asked])
        return [_answer(q, s in RIGHT[q.task_id]) for q, s in asked]
    return complete


def _tok():
    tok = tiny_tokenizer()
    tok.set_chat_template(TEMPLATE.read_text(), "chatml_tools.jinja")
    return tok


def test_records_per_question_and_sample_and_pass_at_k_per_category():
    qs, tok, calls = _questions(), _tok(), []
    records = bfcl_records(qs, tok, _fake_complete(qs, tok, calls), batch_size=2, samples=SAMPLES)
    assert [(r["task_id"], r["sample"]) for r in records] == [(q.task_id, s) for q in qs for s in range(SAMPLES)]
    assert [r["passed"] for r in records] == [s in RIGHT[q.task_id] for q in qs for s in range(SAMPLES)]
    # one call per batch of 2 questions, holding every sample of each (sample indices passed along)
    assert len(calls) == 2 and all(len(c) == 2 * SAMPLES for c in calls)
    assert sorted(p for c in calls for p in c) == sorted((q.task_id, s) for q in qs for s in range(SAMPLES))
    s = summarize_bfcl(records)
    sp, irr = s["categories"]["simple_python"], s["categories"]["irrelevance"]
    assert s["samples"] == SAMPLES and {k for k in s if k.startswith("pass@")} == {"pass@1", "pass@8"}
    assert sp["pass@1"] == pytest.approx((1 / 8 + 1) / 2) and sp["pass@8"] == 1.0
    assert irr["pass@1"] == pytest.approx((4 / 8 + 0) / 2) and irr["pass@8"] == 0.5
    assert s["pass@1"] == pytest.approx((1 / 8 + 1 + 4 / 8 + 0) / 4) and s["pass@8"] == 0.75
    # correct / total / accuracy: one answer per question, its sample 0
    assert (sp["correct"], sp["total"], sp["accuracy"]) == (1, 2, 0.5)
    assert (irr["correct"], irr["total"], irr["accuracy"]) == (1, 2, 0.5)
    assert (s["passed_problems"], s["problems"], s["accuracy"]) == (2, 4, 0.5)


def test_a_question_right_only_by_sample_3_of_8_has_pass_at_8_of_one():
    q = _questions()[0]
    tok, calls = _tok(), []
    records = bfcl_records([q], tok, _fake_complete([q], tok, calls), samples=SAMPLES)
    s = summarize_bfcl(records)
    assert [r["passed"] for r in records] == [i == 3 for i in range(SAMPLES)]
    assert s["pass@1"] == pytest.approx(1 / 8) and s["pass@8"] == 1.0
    assert s["categories"]["simple_python"]["pass@8"] == 1.0 and s["accuracy"] == 0.0  # sample 0 was wrong


def test_pass_at_k_reports_humanevals_ks_and_the_samples():
    def rows(samples):  # one question, its last sample right
        return [{"task_id": "q", "category": "c", "passed": i == samples - 1, "sample": i} for i in range(samples)]

    assert [k for k in summarize_bfcl(rows(12)) if k.startswith("pass@")] == ["pass@1", "pass@10", "pass@12"]
    assert summarize_bfcl(rows(12))["pass@10"] == pytest.approx(10 / 12)  # the unbiased estimator: 1 - C(11,10)/C(12,10)
    assert summarize_bfcl(rows(10))["categories"]["c"]["pass@10"] == 1.0


def test_one_greedy_sample_gives_the_records_and_summary_keys_of_before():
    qs, tok, calls = _questions(), _tok(), []
    records = bfcl_records(qs, tok, _fake_complete(qs, tok, calls), batch_size=3)
    assert [s for c in calls for _, s in c] == [0] * 4 and [len(c) for c in calls] == [3, 1]
    assert [list(r) for r in records] == [["task_id", "category", "passed", "status", "error", "parse_error",
                                           "completion", "truncated", "calls", "prompt_tokens", "generate_seconds",
                                           "sample"]] * 4
    s = summarize_bfcl(records)
    assert set(s) == {"problems", "passed_problems", "accuracy", "truncated", "categories", "samples"}
    assert s["samples"] == 1 and all(set(c) == {"correct", "total", "accuracy", "truncated"}
                                     for c in s["categories"].values())


def test_resumed_samples_keep_done_rows_and_ask_only_the_missing():
    qs, tok, calls = _questions(), _tok(), []
    complete = _fake_complete(qs, tok, calls)
    records = bfcl_records(qs, tok, complete, batch_size=2, samples=4)
    missing = {("simple_python_1", 2), ("irrelevance_0", 0), ("irrelevance_0", 3)}
    done = {(r["task_id"], r["sample"]): r for r in records if (r["task_id"], r["sample"]) not in missing}
    calls.clear()
    again = bfcl_records(qs, tok, complete, batch_size=2, samples=4, done_rows=done)
    assert sorted(p for c in calls for p in c) == sorted(missing)
    assert all(again[i] is done[(r["task_id"], r["sample"])] for i, r in enumerate(records)
               if (r["task_id"], r["sample"]) in done)
    assert [(r["task_id"], r["sample"], r["passed"]) for r in again] == \
        [(r["task_id"], r["sample"], r["passed"]) for r in records]


# ---- the command ----------------------------------------------------------------------------------------
@pytest.fixture()
def engine_calls(monkeypatch) -> list[dict]:
    """Every engine.generate_many call: its prompts, settings and seeds."""
    calls: list[dict] = []

    def counted(model, tokenizer, prompts, settings, **kw):
        calls.append({"prompts": [list(p) for p in prompts], "settings": settings, "seeds": list(kw["seeds"])})
        return REAL_GENERATE_MANY(model, tokenizer, prompts, settings, **kw)

    monkeypatch.setattr(engine, "generate_many", counted)
    return calls


def _argv(model, out, *extra):
    return ["eval", "--task", "bfcl:simple_python,irrelevance", "--limit", "2", "--model", str(model),
            "--chat-template", str(TEMPLATE), "--max-new-tokens", "3", "--batch-size", "2", "--samples", "4",
            "--temperature", "1.0", "--top-p", "0.9", "--seed", "7", "--out", str(out), *extra]


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_cli_bfcl_samples_reach_the_engine_and_report_pass_at_k(tiny_dir, tmp_path, capsys, engine_calls):  # noqa: F811
    out = tmp_path / "bfcl.jsonl"
    code, js, err = main([*_argv(tiny_dir, out), "--json"], capsys)
    assert code == 0, err
    assert js["samples"] == 4 and js["problems"] == 4 and {"pass@1", "pass@4"} <= set(js)
    assert all({"pass@1", "pass@4"} <= set(c) for c in js["categories"].values())
    assert (js["temperature"], js["top_p"], js["seed"]) == (1.0, 0.9, 7)
    assert f"note: {js['truncated']} of 16 completions stopped at --max-new-tokens 3" in err  # every sample counted
    assert engine_calls and all((c["settings"].temperature, c["settings"].top_p) == (1.0, 0.9) for c in engine_calls)
    assert sorted(seed for c in engine_calls for seed in c["seeds"]) == sorted(7 + s for s in range(4) for _ in "abcd")
    rows = _rows(out)
    assert js["truncated"] == sum(r["truncated"] for r in rows) > 4
    ids = ["simple_python_0", "simple_python_1", "irrelevance_0", "irrelevance_1"]
    assert [(r["task_id"], r["sample"]) for r in rows] == [(t, s) for t in ids for s in range(4)]
    assert {(r["settings"]["samples"], r["settings"]["temperature"], r["settings"]["top_p"], r["settings"]["seed"])
            for r in rows} == {(4, 1.0, 0.9, 7)}
    assert len({r["completion"] for r in rows if r["task_id"] == "simple_python_0"}) > 1  # the samples differ
    run = main(_argv(tiny_dir, out, "--overwrite"), capsys)  # text mode: pass@1 and pass@4 per category
    assert run[0] == 0, run[2]
    table = run.out.splitlines()
    assert table[0].split() == ["category", "correct", "total", "accuracy", "truncated", "pass@1", "pass@4"]
    assert table[1].split()[0] == "simple_python" and len(table[1].split()) == 7
    assert table[4].startswith("pass@1 0.") and ", pass@4 " in table[4] and "(4 questions x 4 samples" in table[4]


def test_cli_bfcl_samples_need_a_temperature(tiny_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "never.jsonl"
    code, js, _ = main(["eval", "--model", str(tiny_dir), "--task", "bfcl", "--samples", "4", "--out", str(out),
                          "--json"], capsys)
    assert code == 2 and "--samples 4 with --temperature 0" in js["error"] and "--temperature" in js["error"], js
    assert not out.exists()


def test_cli_bfcl_compare_pairs_sample_0_of_sampled_files(tiny_dir, tmp_path, capsys):  # noqa: F811
    """BEFORE holds 4 samples per question: sample 0 the opposite of this eval's sample 0, the others equal to it.
    Paired on sample 0 every question changes (gained or lost); paired on any other sample none would."""
    first = tmp_path / "first.jsonl"
    code, _, err = main([*_argv(tiny_dir, first), "--json"], capsys)
    assert code == 0, err
    after0 = {r["task_id"]: (r["category"], r["passed"]) for r in _rows(first) if r["sample"] == 0}
    before = tmp_path / "before.jsonl"
    before.write_text("".join(json.dumps({"task_id": t, "category": c, "sample": s, "passed": p != (s == 0)}) + "\n"
                              for t, (c, p) in after0.items() for s in range(4)))
    code, js, err = main([*_argv(tiny_dir, tmp_path / "after.jsonl"), "--compare", str(before), "--json"], capsys)
    assert code == 0, err
    units = js["compare"]["units"]
    assert set(units) == {"bfcl:simple_python", "bfcl:irrelevance"}
    for unit, c in units.items():
        right = sum(p for cat, p in after0.values() if f"bfcl:{cat}" == unit)
        assert (c["passed_before"], c["passed_after"]) == (2 - right, right)
        assert (len(c["gained"]), len(c["lost"])) == (right, 2 - right)
    # swapped (the sampled files either side): paired on sample 0 again
    units = compare_results(tmp_path / "after.jsonl", before, "bfcl")["units"]
    assert all(len(c["gained"]) + len(c["lost"]) == 2 for c in units.values())


def test_cli_bfcl_resume_with_samples_keeps_done_rows(tiny_dir, tmp_path, capsys, engine_calls):  # noqa: F811
    out = tmp_path / "bfcl.jsonl"
    argv = [*_argv(tiny_dir, out), "--json"]
    code, js, err = main(argv, capsys)
    assert code == 0, err
    full = out.read_text().splitlines()
    dropped = {("simple_python_1", 2), ("irrelevance_0", 0), ("irrelevance_1", 3)}
    kept = [x for x in full if (json.loads(x)["task_id"], json.loads(x)["sample"]) not in dropped]
    out.write_text("".join(x + "\n" for x in kept))
    engine_calls.clear()
    code, js, err = main([*argv, "--resume"], capsys)
    assert code == 0 and js["resumed"] == 13 and js["samples"] == 4, err
    assert sorted(seed - 7 for c in engine_calls for seed in c["seeds"]) == [0, 2, 3]  # only the dropped samples
    again = out.read_text().splitlines()
    assert set(kept) <= set(again) and len(again) == 16
    # the regenerated rows equal the uninterrupted run's: each sample draws with --seed + s
    assert [{k: v for k, v in json.loads(x).items() if k != "generate_seconds"} for x in again] == \
        [{k: v for k, v in json.loads(x).items() if k != "generate_seconds"} for x in full]
    other = ["2" if i and argv[i - 1] == "--samples" else a for i, a in enumerate(argv)]  # another eval
    code, js, err = main([*other, "--resume"], capsys)
    assert code == 2 and "made with other settings" in js["error"], js


@pytest.mark.parametrize("extra", [["--samples", "2", "--temperature", "0.5"], ["--temperature", "0.5"],
                                   ["--top-p", "0.9"], ["--seed", "3"]])
def test_cli_chat_still_refuses_the_sampling_flags(tiny_dir, capsys, extra):  # noqa: F811
    code, js, _ = main(["eval", "--model", str(tiny_dir), "--task", "chat", *extra, "--json"], capsys)
    assert code == 2 and f"{extra[0]} applies to --task humaneval or bfcl, not --task chat" in js["error"], js
