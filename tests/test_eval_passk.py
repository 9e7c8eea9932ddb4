"""pass@k in one engine call: `eval --task humaneval --samples K` hands each batch's problems x their missing samples
to the generator at once (request i seeded --seed + its sample), and the completions are those of one engine call
per sample; --resume generates only the (problem, sample) rows its --out lacks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from entrenar import engine
from entrenar.evaluate.harness import TaskEvalSettings, task_records
from entrenar.evaluate.sandbox import SandboxLimits
from entrenar.evaluate.tasks import Problem, load_problems, prompt_ids
from tests.helpers.cli import run_cli as main
from tests.helpers.tokenizers import tiny_tokenizer
from tests.test_eval_task import ADD, _tiny_dir

SEED, SAMPLES = 5, 3
REAL_GENERATE_MANY = engine.generate_many  # before any test patches it


def _problems(n: int) -> list[Problem]:
    """Problems of distinct prompts (each a little longer than the last), so each has its own completions."""
    return [Problem(f"t{i}", ADD.prompt.replace("Sum", "Sum" + " really" * i), ADD.test, "add") for i in range(n)]


def test_a_batch_of_problems_is_one_call_with_every_missing_sample():
    """The harness asks its generator once per batch of problems, for every (problem, sample) not done, each
    request with its sample index; records, their order and the done rows are as a call per sample gave them."""
    problems = _problems(3)
    tok = tiny_tokenizer()
    settings = TaskEvalSettings(samples=SAMPLES, batch_size=2, chat=False, limits=SandboxLimits(timeout_s=5))
    task_of = {tuple(prompt_ids(p, tok, False)): p.task_id for p in problems}
    calls: list[list[tuple[str, int]]] = []

    def complete(batch_ids, samples):  # (t0, sample 1) and every sample of t2 answer right
        calls.append([(task_of[tuple(ids)], s) for ids, s in zip(batch_ids, samples)])
        return ["    return a + b\n" if (task_of[tuple(ids)], s) in {("t0", 1), ("t2", 0), ("t2", 1), ("t2", 2)}
                else "    return 0\n" for ids, s in zip(batch_ids, samples)]

    seen: list[tuple[str, int]] = []
    records = task_records(problems, tok, complete, settings, on_record=lambda r: seen.append((r["task_id"],
                                                                                                r["sample"])))
    assert [sorted(c) for c in calls] == [[(t, s) for t in ("t1", "t2") for s in range(SAMPLES)],
                                          [("t0", s) for s in range(SAMPLES)]]  # longest prompts first
    assert [(r["task_id"], r["sample"]) for r in records] == [(p.task_id, s) for p in problems for s in range(SAMPLES)]
    assert [r["passed"] for r in records] == [False, True, False, False, False, False, True, True, True]
    assert sorted(seen) == sorted((r["task_id"], r["sample"]) for r in records)
    # resumed: rows done are kept as they are; only the rest are asked for, a batch with none left is not asked
    done = {(r["task_id"], r["sample"]): r for r in records if (r["task_id"], r["sample"]) not in
            {("t1", 0), ("t2", 2)}}
    calls.clear()
    again = task_records(problems, tok, complete, settings, done=done)
    assert [sorted(c) for c in calls] == [[("t1", 0), ("t2", 2)]]
    assert [r["passed"] for r in again] == [r["passed"] for r in records]
    assert all(again[i] is records[i] for i in range(len(records)) if (records[i]["task_id"], records[i]["sample"])
               in done)


@pytest.fixture()
def engine_calls(monkeypatch) -> list[dict]:
    """Every engine.generate_many call (entrenar_completer imports it when the command makes it): its model,
    tokenizer, prompts, settings and seeds."""
    calls: list[dict] = []

    def counted(model, tokenizer, prompts, settings, **kw):
        calls.append({"model": model, "tok": tokenizer, "prompts": [list(p) for p in prompts], "settings": settings,
                      "seeds": list(kw["seeds"]) if kw.get("seeds") is not None else None})
        return REAL_GENERATE_MANY(model, tokenizer, prompts, settings, **kw)

    monkeypatch.setattr(engine, "generate_many", counted)
    return calls


def _completions(path: Path) -> dict[tuple[str, int], str]:
    return {(r["task_id"], r["sample"]): r["completion"] for r in map(json.loads, path.read_text().splitlines())}


def test_cli_pass_at_k_is_one_engine_call_per_batch_equal_to_a_call_per_sample(tmp_path, capsys, engine_calls):
    """--samples 3 --temperature 0.8 on a tiny model: one generate_many per batch of problems holding all their
    samples, request i seeded --seed + its sample; every completion equals the engine called once per sample
    (seed --seed + s) as the harness did before; --resume generates only the missing rows, and they equal the
    uninterrupted run's (a request's draws depend on its seed and prompt only)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": p.task_id, "prompt": p.prompt, "test": p.test,
                                         "entry_point": p.entry_point}) + "\n" for p in _problems(3)))
    d = _tiny_dir(tmp_path, "m")
    out = tmp_path / "results.jsonl"
    argv = ["eval", "--task", "humaneval", "--model", str(d), "--data", str(tasks), "--samples", str(SAMPLES),
            "--temperature", "0.8", "--seed", str(SEED), "--max-new-tokens", "6", "--batch-size", "2",
            "--out", str(out), "--json"]
    code, js, err = main(argv, capsys)
    assert code == 0, err
    assert "problems 1-2 of 3: generating 3 samples each" in err, err
    problems = load_problems(tasks)
    tok = engine_calls[0]["tok"]
    ids = {p.task_id: prompt_ids(p, tok, True) for p in problems}
    task_of = {tuple(v): k for k, v in ids.items()}

    def asked(call: dict) -> list[tuple[str, int]]:  # (task, sample) of each request, the sample from its seed
        return sorted((task_of[tuple(p)], seed - SEED) for p, seed in zip(call["prompts"], call["seeds"]))

    assert [asked(c) for c in engine_calls] == [[(t, s) for t in ("t1", "t2") for s in range(SAMPLES)],
                                                [("t0", s) for s in range(SAMPLES)]]
    got = _completions(out)
    reference = {}
    for s in range(SAMPLES):  # the harness as it was: one engine call per sample, every prompt at seed + s
        settings = dataclasses.replace(engine_calls[0]["settings"], seed=SEED + s)
        results = REAL_GENERATE_MANY(engine_calls[0]["model"], tok, list(ids.values()), settings)
        reference.update({(t, s): r.text for t, r in zip(ids, results)})
    assert got == reference
    assert all(len({got[(t, s)] for s in range(SAMPLES)}) > 1 for t in ids)  # the samples differ: seeds matter

    # --resume with some rows done: one call for the batch that lacks rows, of those rows only
    kept = [line for line in out.read_text().splitlines()
            if (json.loads(line)["task_id"], json.loads(line)["sample"]) not in {("t1", 0), ("t2", 2), ("t1", 1)}]
    out.write_text("".join(line + "\n" for line in kept))
    engine_calls.clear()
    code, js, err = main([*argv, "--resume"], capsys)
    assert code == 0 and js["resumed"] == 6, err
    assert [asked(c) for c in engine_calls] == [[("t1", 0), ("t1", 1), ("t2", 2)]]
    assert "(3 of 6 not done yet)" in err, err
    assert _completions(out) == reference

