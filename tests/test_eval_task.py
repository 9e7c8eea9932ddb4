"""`entrenar eval --task humaneval`: the pass@k estimator, prompts (chat template + answer prefix, or the
raw prompt), code extraction and the tested program, task-file validation with file:line errors, the
harness's counting, the command's output (--out lines + JSON summary) and its bad input (exit 2)."""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path

import pytest

from entrenar.errors import InputError
from entrenar.evaluate.harness import (
    Completion,
    TaskEvalSettings,
    entrenar_completer,
    read_results,
    run_task_eval,
    task_records,
    truncation_note,
)
from entrenar.evaluate.sandbox import SandboxLimits
from entrenar.evaluate.tasks import (
    CHAT_RESPONSE_PREFIX,
    Problem,
    completion_done,
    extract_code,
    humaneval_path,
    humaneval_problems,
    load_problems,
    pass_at_k,
    program,
    prompt_ids,
)
from tests.helpers.cli import run_cli as main
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.helpers.tokenizers import tiny_tokenizer
from tests.test_sandbox import canonical_solutions

ADD = Problem("t/add", 'def add(a, b):\n    """Sum of a and b."""\n', "def check(candidate):\n"
              "    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n", "add")


# ---- pass@k ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 5, 10])
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_pass(n):
    """The estimator equals its definition: over all k-subsets of n samples (c passing), the fraction
    holding at least one pass."""
    for c in range(n + 1):
        for k in range(1, n + 1):
            subsets = list(combinations([True] * c + [False] * (n - c), k))
            exact = sum(any(s) for s in subsets) / len(subsets)
            assert math.isclose(pass_at_k(n, c, k), exact, abs_tol=1e-12), (n, c, k)
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100))


# ---- prompts, extraction, programs ----------------------------------------------------------------------
def test_chat_prompt_is_the_template_then_the_answer_prefix():
    tok = tiny_tokenizer()
    ids = prompt_ids(ADD, tok, chat=True)
    head = tok.encode_chat([{"role": "user", "content":
                             "Please provide a self-contained Python script that solves the following problem "
                             f"in a markdown code block:\n```\n{ADD.prompt.strip()}\n```\n"}],
                           add_generation_prompt=True).ids
    assert ids == head + tok.encode(CHAT_RESPONSE_PREFIX, add_special=False)
    assert "<|im_start|>assistant" in tok.decode(ids)
    assert prompt_ids(ADD, tok, chat=False) == tok.encode(ADD.prompt)


def test_chat_prompt_with_a_system_prompt():
    """--system-prompt-file: the text is the system message, before the same user turn and answer prefix."""
    tok = tiny_tokenizer()
    system = "You are Forge. Answer with code."
    user = ("Please provide a self-contained Python script that solves the following problem "
            f"in a markdown code block:\n```\n{ADD.prompt.strip()}\n```\n")
    head = tok.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": user}],
                           add_generation_prompt=True).ids
    ids = prompt_ids(ADD, tok, chat=True, system=system)
    assert ids == head + tok.encode(CHAT_RESPONSE_PREFIX, add_special=False)
    assert system in tok.decode(ids) and ids != prompt_ids(ADD, tok, chat=True)


def test_code_extraction_and_stop_rule():
    answer = "def add(a, b):\n    return a + b\n```\n\nThis adds.\n```python\nprint(1)\n```"
    assert extract_code(answer, chat=True) == "def add(a, b):\n    return a + b\n"
    assert extract_code("def add(a, b):\n    return a + b", chat=True) == "def add(a, b):\n    return a + b"
    assert completion_done(answer, chat=True) and not completion_done("def add(a, b):\n    return 1", chat=True)
    body = "    return a + b\n\ndef other():\n    pass\n"
    assert extract_code(body, chat=False) == "    return a + b\n"
    assert completion_done(body, chat=False) and not completion_done("    return a + b\n", chat=False)
    assert extract_code("    return a + b\nif __name__ == '__main__':\n", chat=False) == "    return a + b"


def test_program_keeps_the_prompts_imports_and_runs_check():
    p = Problem("t/imp", "from math import gcd\n\ndef f(a, b):\n    \"\"\"gcd\"\"\"\n",
                "def check(candidate):\n    assert candidate(4, 6) == 2\n", "f")
    full = program(p, "def f(a, b):\n    return gcd(a, b)\n", chat=True)
    assert full.startswith(p.prompt) and full.rstrip().endswith("check(f)")
    body = program(p, "    return gcd(a, b)\n", chat=True)  # no def: the code is the body
    assert body.startswith(p.prompt + "    return gcd")
    prose = Problem("t/prose", "Write f(a, b) returning their gcd.", p.test, "f")
    assert not program(prose, "def f(a, b):\n    return 2\n", chat=True).startswith("Write")


# ---- task files --------------------------------------------------------------------------------------
GOOD = {"prompt": ADD.prompt, "test": ADD.test, "entry_point": "add"}


@pytest.mark.parametrize("case,row,expect", [
    ("not-json", "{nope", "not valid JSON"),
    ("not-object", "[1, 2]", "must be a JSON object"),
    ("no-test", json.dumps({"prompt": "x", "entry_point": "f"}), '"test" must be a non-empty string, got missing'),
    ("bad-entry", json.dumps({**GOOD, "entry_point": "1f"}), "not a Python identifier"),
    ("test-syntax", json.dumps({**GOOD, "test": "def check(c):\n  assert (\n"}), '"test" is not valid Python'),
    ("no-check", json.dumps({**GOOD, "test": "def verify(c):\n    pass\n"}), "def check(candidate)"),
    ("dup-id", json.dumps({**GOOD, "task_id": "a"}) + "\n" + json.dumps({**GOOD, "task_id": "a"}), "repeats line 2"),
])
def test_task_file_errors_name_file_and_line(tmp_path, case, row, expect):
    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps({**GOOD, "task_id": "first"}) + "\n" + row + "\n")
    with pytest.raises(InputError) as e:
        load_problems(f)
    line = 3 if case == "dup-id" else 2
    assert f"{f}:{line}" in str(e.value) and expect in str(e.value), str(e.value)


def test_task_file_rows_default_their_id_to_the_line(tmp_path):
    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps(GOOD) + "\n\n" + json.dumps({**GOOD, "task_id": "mine"}) + "\n")
    assert [p.task_id for p in load_problems(f)] == ["line 1", "mine"]
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="no tasks"):
        load_problems(tmp_path / "empty.jsonl")


def test_humaneval_is_read_from_the_package():
    problems = humaneval_problems()
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    assert humaneval_path().name == "HumanEval.jsonl.gz"
    assert len({p.task_id for p in problems}) == 164


# ---- the harness counts what the sandbox says -----------------------------------------------------------
def test_harness_scores_each_sample_and_averages_pass_at_k():
    """A fake generator: sample s of problem i is right when (i + s) % 3 == 0, so the counts are known."""
    solutions = canonical_solutions()
    problems = humaneval_problems()[:3]
    tok = tiny_tokenizer()
    settings = TaskEvalSettings(samples=3, batch_size=2, chat=False, limits=SandboxLimits(timeout_s=5))
    by_prompt = {tuple(prompt_ids(p, tok, False)): i for i, p in enumerate(problems)}

    def complete(batch_ids, samples):
        out = []
        for ids, sample in zip(batch_ids, samples):
            i = by_prompt[tuple(ids)]
            right = solutions[problems[i].task_id]
            out.append(right if (i + sample) % 3 == 0 else "    return None\n")
        return out

    records = task_records(problems, tok, complete, settings)
    assert [(r["task_id"], r["sample"], r["passed"]) for r in records] == [
        (p.task_id, s, (i + s) % 3 == 0) for i, p in enumerate(problems) for s in range(3)]
    assert all(r["truncated"] is None for r in records)  # a generator of bare texts does not say
    summary = run_task_eval(problems, tok, complete, settings)
    assert summary["pass@1"] == pytest.approx(1 / 3) and "pass@10" not in summary
    assert summary["passed_problems"] == 3 and summary["problems"] == 3 and summary["truncated"] == 0


def test_completer_marks_completions_the_token_limit_cut():
    """entrenar_completer: a row stopped by the stop rule (or end-of-turn/EOS) is not truncated; one that ran to
    max_new_tokens is (GenerationResult.stop_reason); the records carry it (issue 38 item 11)."""
    tok = tiny_tokenizer()
    model = tiny_causal_lm(tiny_config("qwen2", vocab_size=len(tok), max_position_embeddings=512), 0)
    prompts = [prompt_ids(ADD, tok, chat=False)]
    cut = entrenar_completer(model, tok, 3, False, stop=lambda text: False)(prompts, [0])
    assert [(len(tok.encode(c.text, add_special=False)) > 0, c.truncated) for c in cut] == [(True, True)]
    stopped = entrenar_completer(model, tok, 3, False, stop=lambda text: True)(prompts, [0])
    assert [c.truncated for c in stopped] == [False]
    assert truncation_note(0, 5, "--max-new-tokens", 3) is None
    assert "2 of 5 completions stopped at --max-new-tokens 3" in truncation_note(2, 5, "--max-new-tokens", 3)
    settings = TaskEvalSettings(chat=False, limits=SandboxLimits(timeout_s=5))
    records = task_records([ADD], tok, lambda ids, s: [Completion("    return a + b\n", True)], settings)
    assert records[0]["truncated"] is True and records[0]["passed"]  # cut, yet what it wrote passes


# ---- the command -------------------------------------------------------------------------------------
def _tiny_dir(root: Path, name: str) -> Path:
    """A random qwen2-style model with the tiny tokenizer (byte-level: the chat prompt is ~300 tokens)."""
    from entrenar.formats import save_hf_dir

    tokenizer = tiny_tokenizer()
    cfg = tiny_config("qwen2", vocab_size=len(tokenizer), max_position_embeddings=1024)
    return save_hf_dir(tiny_causal_lm(cfg, 0, bias_std=0.3), root / name, tokenizer=tokenizer)


@pytest.fixture()
def tasks_file(tmp_path) -> Path:
    f = tmp_path / "tasks.jsonl"
    f.write_text("".join(json.dumps({**GOOD, "task_id": f"t{i}"}) + "\n" for i in range(3)))
    return f


def test_cli_task_eval_writes_results_and_summary(tmp_path, tasks_file, capsys):
    d = _tiny_dir(tmp_path, "m")
    out = tmp_path / "results.jsonl"
    code, js, err = main(["eval", "--task", "humaneval", "--model", str(d), "--data", str(tasks_file), "--limit",
                          "2", "--max-new-tokens", "6", "--batch-size", "2", "--out", str(out), "--json"], capsys)
    assert code == 0, err
    # progress on stderr, also under --json: before each batch decodes (minutes on a CPU) and after it
    assert "problems 1-2 of 2: generating" in err and "2/2 problems, 0 passing" in err, err
    assert js["ok"] and js["problems"] == 2 and js["pass@1"] == 0.0 and js["format"] == "chat"
    assert js["sandbox"]["isolation"].endswith("+audit-hook") and js["out"] == str(out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["task_id"] for x in lines] == ["t0", "t1"]
    assert all({"passed", "status", "error", "completion", "code"} <= set(x) for x in lines)
    assert all(not x["passed"] and x["error"] for x in lines)  # a random model writes no working code
    # 6 tokens end neither the answer nor its code block: cut by --max-new-tokens, counted and noted
    assert all(x["truncated"] is True for x in lines) and js["truncated"] == 2
    assert "note: 2 of 2 completions stopped at --max-new-tokens 6" in err
    code, js, err = main(["eval", "--task", "humaneval", "--model", str(d), "--data", str(tasks_file), "--limit",
                          "1", "--max-new-tokens", "4", "--prompt-format", "completion", "--json"], capsys)
    assert code == 0 and js["format"] == "completion" and js["problems"] == 1, err


def test_cli_task_eval_system_prompt_file(tmp_path, tasks_file, capsys):
    """--system-prompt-file reaches every prompt (each is longer by the system turn) and the summary; the
    completion format, a missing file and --task loss are exit 2."""
    d = _tiny_dir(tmp_path, "m")
    system = tmp_path / "system.txt"
    system.write_text("You are Forge, a careful engineer. " * 4)
    tokens = {}
    for name, extra in (("plain", []), ("system", ["--system-prompt-file", str(system)])):
        out = tmp_path / f"{name}.jsonl"
        code, js, err = main(["eval", "--task", "humaneval", "--model", str(d), "--data", str(tasks_file),
                              "--limit", "1", "--max-new-tokens", "2", "--out", str(out), *extra, "--json"], capsys)
        assert code == 0, err
        tokens[name] = json.loads(out.read_text().splitlines()[0])["prompt_tokens"]
    assert js["system_prompt_file"] == str(system)
    assert tokens["system"] > tokens["plain"] + len(system.read_text()) // 2  # byte-level tokenizer
    for argv, expect in (([*["--prompt-format", "completion"], "--system-prompt-file", str(system)], "chat format"),
                         (["--system-prompt-file", str(tmp_path / "missing.txt")], "no such file")):
        code, js, err = main(["eval", "--task", "humaneval", "--model", str(d), "--data", str(tasks_file),
                              "--limit", "1", *argv, "--json"], capsys)
        assert code == 2 and expect in js["error"], js
    code, js, _ = main(["eval", "--model", str(d), "--data", str(tasks_file), "--system-prompt-file", str(system),
                        "--json"], capsys)
    assert code == 2 and "--system-prompt-file applies to --task humaneval" in js["error"]


def test_cli_task_eval_overwrite_replaces_only_a_results_file(tmp_path, tasks_file, capsys):
    """--out FILE --overwrite replaces an earlier results JSONL (it was exit 2: 'cannot be created: FILE is a
    file'); a file that is not a results JSONL (a source file given by mistake) is exit 2, left byte-identical."""
    d = _tiny_dir(tmp_path, "m")
    out = tmp_path / "results.jsonl"
    argv = ["eval", "--task", "humaneval", "--model", str(d), "--data", str(tasks_file), "--limit", "1",
            "--max-new-tokens", "2", "--out", str(out), "--json"]
    for _ in range(2):
        code, _, err = main(argv + ["--overwrite"], capsys)
        assert code == 0, err
        assert len(out.read_text().splitlines()) == 1
    source = tmp_path / "solution.py"
    source.write_text("def f():\n    return 1\n")
    code, js, _ = main([*argv[:-3], "--out", str(source), "--overwrite", "--json"], capsys)
    assert code == 2 and "not a results JSONL file" in js["error"]
    assert source.read_text() == "def f():\n    return 1\n"


@pytest.mark.parametrize("case", ["loss-without-data", "task-flag-with-loss", "greedy-samples", "bad-task-file",
                                  "out-exists", "limit-negative"])
def test_cli_task_eval_bad_input_exits_2(tmp_path, tasks_file, capsys, case):
    d = _tiny_dir(tmp_path, "m")
    (tmp_path / "exists.jsonl").write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    task = ["--task", "humaneval", "--data", str(tasks_file)]
    argv, expect = {
        "loss-without-data": ([], "--data is required for --task loss"),
        "task-flag-with-loss": (["--data", str(tasks_file), "--samples", "4"], "--samples applies to --task humaneval"),
        "greedy-samples": ([*task, "--samples", "3"], "greedy samples are all the same"),
        "bad-task-file": (["--task", "humaneval", "--data", str(bad)], f"{bad}:2"),
        "out-exists": ([*task, "--out", str(tmp_path / "exists.jsonl")], "exists"),
        "limit-negative": ([*task, "--limit", "-1"], "--limit"),
    }[case]
    code, js, err = main(["eval", "--model", str(d), *argv, "--json"], capsys)
    assert code == 2 and js["ok"] is False, err
    assert expect in js["error"], js["error"]


# ---- results are not lost (issue 38 item 7) -------------------------------------------------------------
def _add_problems(n: int) -> list[Problem]:
    return [Problem(f"t{i}", ADD.prompt, ADD.test, "add") for i in range(n)]


def _rows(path: Path) -> list[tuple[str, int, bool]]:
    return [(r["task_id"], r["sample"], r["passed"]) for r in map(json.loads, path.read_text().splitlines())]


def test_rows_are_appended_as_problems_finish_and_an_interrupt_keeps_them(tmp_path):
    """Ctrl-C in the third batch: the rows of the first two are in --out (valid JSONL, each complete);
    --resume then runs only the rest, and the final file is an uninterrupted run's, in problem order."""
    problems = _add_problems(4)
    tok = tiny_tokenizer()
    settings = TaskEvalSettings(batch_size=1, chat=False, limits=SandboxLimits(timeout_s=5))
    out = tmp_path / "results.jsonl"
    made = {"model": "m", "max_new_tokens": 8}
    seen_in_out: list[int] = []
    calls: list[int] = []

    def complete(batch, samples):  # problem t1 and t3 answered right, t0 and t2 wrong
        calls.append(len(calls))
        seen_in_out.append(len(out.read_text().splitlines()) if out.exists() else 0)
        if interrupt and len(calls) == 3:
            raise KeyboardInterrupt
        return ["    return a + b\n" if len(calls) % 2 == 0 else "    return 0\n" for _ in batch]

    interrupt = True
    with pytest.raises(KeyboardInterrupt):
        run_task_eval(problems, tok, complete, settings, out, row_settings=made)
    assert seen_in_out == [0, 1, 2]  # each row was on disk before the next batch began
    assert len(_rows(out)) == 2 and all(json.loads(x)["settings"] == made for x in out.read_text().splitlines())
    first_two = {r[0] for r in _rows(out)}
    interrupt, calls[:] = False, []
    summary = run_task_eval(problems, tok, complete, settings, out, resume=True, row_settings=made)
    assert len(calls) == 2 and summary["resumed"] == 2 and summary["problems"] == 4
    rows = _rows(out)
    assert [r[0] for r in rows] == ["t0", "t1", "t2", "t3"]
    assert {r[0] for r in rows if r[0] in first_two} == first_two


def test_resume_drops_a_cut_last_row_and_refuses_other_settings(tmp_path):
    problems = _add_problems(2)
    made = {"model": "m", "temperature": 0.0}
    row = {"task_id": "t0", "sample": 0, "passed": True, "status": "passed", "settings": made}
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps(row) + "\n" + json.dumps({**row, "task_id": "t1"})[:25])  # killed mid-write
    assert list(read_results(out, problems, 1, made)) == [("t0", 0)]
    with pytest.raises(InputError, match=r"r.jsonl:1: made with other settings \(temperature: 0.0 there, not 0.8"):
        read_results(out, problems, 1, {**made, "temperature": 0.8})
    with pytest.raises(InputError, match="not among this run's 1 problems"):
        read_results(out, problems[1:], 1, made)


def test_cli_task_eval_out_in_a_missing_directory_is_made_before_the_model_loads(tmp_path, tasks_file, capsys):
    """It passed the check (an ancestor could hold it), ran the whole eval, then failed writing: exit 1. Then it was
    exit 2 asking the user to create the directory; now it is made, as `mkdir -p` would (CLI-OUT-PARENTS), before the
    model loads, so the rows are appended there as problems finish."""
    d = _tiny_dir(tmp_path, "m")
    out = tmp_path / "missing" / "deeper" / "x.jsonl"
    code, js, err = main(["eval", "--task", "humaneval", "--model", str(d), "--data", str(tasks_file), "--limit", "1",
                          "--max-new-tokens", "2", "--out", str(out), "--json"], capsys)
    assert code == 0 and len(out.read_text().splitlines()) == 1, err
    code, js, _ = main(["eval", "--task", "humaneval", "--model", str(tmp_path / "a_file.txt" / "x"), "--data",
                        str(tasks_file), "--out", str(tasks_file / "x.jsonl"), "--json"], capsys)
    assert code == 2 and "cannot be created" in js["error"], js  # under a file: still refused before the model


def test_cli_task_eval_resume_continues_and_refuses_another_eval(tmp_path, tasks_file, capsys):
    d = _tiny_dir(tmp_path, "m")
    out = tmp_path / "results.jsonl"
    argv = ["eval", "--task", "humaneval", "--model", str(d), "--data", str(tasks_file), "--max-new-tokens", "2",
            "--batch-size", "1", "--out", str(out), "--json"]
    code, js, err = main([*argv, "--limit", "1"], capsys)
    assert code == 0, err
    first = out.read_text()
    code, js, err = main([*argv, "--limit", "3"], capsys)  # exists: refused, and the advice names --resume
    assert code == 2 and "--resume" in js["error"]
    code, js, err = main([*argv, "--limit", "3", "--resume"], capsys)
    assert code == 0 and js["resumed"] == 1 and js["problems"] == 3, err
    assert "problems 1-1 of 3" not in err and out.read_text().startswith(first)
    assert [r[0] for r in _rows(out)] == ["t0", "t1", "t2"]
    whole = out.read_text()
    other = [("3" if a == "2" and argv[i - 1] == "--max-new-tokens" else a) for i, a in enumerate(argv)]
    code, js, err = main([*other, "--limit", "3", "--resume"], capsys)
    assert code == 2 and "made with other settings (max_new_tokens: 2 there, not 3)" in js["error"], js
    assert out.read_text() == whole
    code, js, _ = main([*argv, "--resume", "--overwrite"], capsys)
    assert code == 2 and "--resume" in js["error"]


def test_sandbox_workers_follow_the_cpus(monkeypatch):
    """Programs tested at once: the CPUs this process may use (16 on a GPU host: pass@10's 1,640 programs took 134 s
    two at a time there), at least 2, at most MAX_SANDBOX_WORKERS; the default of every task eval."""
    from entrenar.evaluate import harness

    for cpus, want in ((1, 2), (2, 2), (16, 16), (96, harness.MAX_SANDBOX_WORKERS)):
        monkeypatch.setattr(harness.os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert harness.sandbox_workers() == want
        assert harness.TaskEvalSettings().workers == want
