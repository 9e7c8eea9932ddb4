"""`entrenar finetune --objective grpo` end to end on the CPU: a tiny model with the SmolLM2 tokenizer (tests/
test_distributed.py's), text prompts, a python: reward (the share of vowels in the completion) that makes each
run deterministic.

  - LoRA: the per-step metrics, step 0's KL to the adapters-off reference exactly 0 (GUARD-INIT-LOSS), step 1's KL 0
    (the policy is still the start), the reward rising under a high learning rate;
  - QLoRA and full (a frozen copy as the reference), and --beta 0 (no reference at all);
  - --grpo-iterations 2: the two steps of a round share their rollouts (same rewards), the second off-policy;
  - the same seed, the same run; resume from a checkpoint continues the run (same metrics);
  - a reward returning a non-number exits 2 naming FILE:LINE; unknown --reward, --reward without grpo, --val: exit 2;
  - GUARD-GRPO-KL stops the run (exit 3); GUARD-GRPO-ENTROPY and GUARD-REWARD-HACKING fire on their conditions.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch

from entrenar.fileio import read_jsonl
from tests.helpers.cli import run_cli
from tests.test_distributed import _rewind, base_model, sft_data  # noqa: F401

REWARD_PY = '''\
def vowels(prompt, completion, row):
    text = completion.lower()
    return sum(text.count(v) for v in "aeiou") / max(1, len(text))


def text_reward(prompt, completion, row):
    return "high"
'''
STEP_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completion_length", "truncated_share", "entropy",
             "clip_ratio", "rollout_tok_s", "reward/python:{}:vowels")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("grpo-data")
    (d / "r.py").write_text(REWARD_PY)
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say word number {i}."}) + "\n"
                                             for i in range(8)))
    return d / "prompts.jsonl", d / "r.py"


def grpo_args(model: Path, data: Path, reward: Path, out: Path, steps: int = 3, extra: tuple = ()) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--objective", "grpo", "--reward", f"python:{reward}:vowels", "--batch-size", "2", "--num-generations",
            "4", "--max-new-tokens", "6", "--max-seq-len", "64", "--lr", "1e-2", "--warmup", "0", "--seed", "3",
            "--device", "cpu", "--no-preflight", "--json", "--mode", "lora", "--rank", "4", *extra]


def records(run: Path) -> list[dict]:
    return [r for _, r in read_jsonl(run / "metrics.jsonl") if "reward" in r]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_model, prompts) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("grpo-lora") / "run"
    stderr = io.StringIO()  # the progress lines, for test_progress_lines_show_the_rollout_metrics
    with contextlib.redirect_stderr(stderr):
        code, result, _err = run_cli(grpo_args(base_model, *prompts, out, steps=4, extra=("--save-every", "2")),
                                     capture=True)
    assert code == 0, (result, stderr.getvalue())
    (out.parent / "stderr.txt").write_text(stderr.getvalue())
    return out


def test_lora_logs_the_rollout_metrics_and_starts_at_the_reference(lora_run, prompts):
    steps = records(lora_run)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        for k in STEP_KEYS:
            key = k.format(prompts[1])
            assert r.get(key) is not None and math.isfinite(r[key]), (key, r)
        assert 0.0 <= r["frac_reward_zero_std"] <= 1.0 and 0.0 <= r["truncated_share"] <= 1.0
        assert 1 <= r["completion_length"] <= 6
        assert r["loss_tokens"] == round(r["completion_length"] * 8)  # dapo's units: the completion tokens
    assert steps[0]["kl"] == 0.0  # step 1 runs on the starting policy: its KL to the reference is exactly 0
    assert steps[-1]["kl"] > 0.0  # and it moves
    step0 = json.loads((lora_run / "preflight.json").read_text())["step0"]["first_train_batch"]
    assert step0["kl"] == 0.0 and step0["reward"] == steps[0]["reward"]  # step 1 trained on step 0's rollout
    data = json.loads((lora_run / "checkpoints" / "latest" / "trainer_state.json").read_text())["data"]
    assert (data["epoch"], data["position"], data["calls"]) == (1, 0, 4)  # 4 x 2 of the 8 prompts: step 0 replayed
    run = json.loads((lora_run / "run.json").read_text())["config"]
    assert run["objective"] == "grpo" and run["beta"] == 0.04 and run["loss_type"] == "dapo"


def test_progress_lines_show_the_rollout_metrics(lora_run):
    """Each step's progress line (a plain line off a terminal) carries the step's GRPO means as metrics.jsonl has
    them: reward, its spread, the groups without spread, KL, entropy, completion length, the share cut."""
    err = (lora_run.parent / "stderr.txt").read_text()
    lines = {int(ln.split()[1].split("/")[0]): ln for ln in err.splitlines() if ln.startswith("step ") and "/4 " in ln}
    assert sorted(lines) == [1, 2, 3, 4], err
    for r in records(lora_run):
        line = lines[r["step"]]
        for text in (f"reward {r['reward']:.3f}", f"std {r['reward_std']:.3f}",
                     f"no-spread {r['frac_reward_zero_std']:.0%}", f"kl {r['kl']:.4f}", f"entropy {r['entropy']:.3f}",
                     f"len {r['completion_length']:.0f}", f"cut {r['truncated_share']:.0%}"):
            assert text in line, (text, line)
        assert "dropped" not in line  # no --grpo-dynamic-sampling: no groups dropped to report


def test_same_seed_same_run_and_resume_continues(tmp_path, lora_run, base_model, prompts):  # noqa: F811
    again = tmp_path / "again"
    code, _, err = run_cli(grpo_args(base_model, *prompts, again, steps=4), capture=True)
    assert code == 0, err
    assert [r["reward"] for r in records(again)] == [r["reward"] for r in records(lora_run)]
    assert [r["loss"] for r in records(again)] == [r["loss"] for r in records(lora_run)]
    rewound = tmp_path / "rewound"
    _rewind(lora_run, rewound, 2)  # the run as it was after step 2's checkpoint
    code, _, err = run_cli([*grpo_args(base_model, *prompts, rewound, steps=4), "--resume", "auto"], capture=True)
    assert code == 0, err
    a, b = records(rewound), records(lora_run)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert [r["reward"] for r in a] == [r["reward"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("extra", [("--mode", "full"), ("--mode", "qlora"), ("--beta", "0")],
                         ids=["full", "qlora", "beta0"])
def test_modes_and_no_reference(tmp_path, base_model, prompts, extra):  # noqa: F811
    out = tmp_path / "run"
    code, _, err = run_cli(grpo_args(base_model, *prompts, out, steps=2, extra=extra), capture=True)
    assert code == 0, err
    steps = records(out)
    assert len(steps) == 2 and all(math.isfinite(r["reward"]) for r in steps)
    if extra == ("--beta", "0"):
        assert all("kl" not in r for r in steps)  # no reference forward, no KL
    else:
        assert steps[0]["kl"] == 0.0
    if extra == ("--mode", "full"):
        assert (out / "final" / "model.safetensors").is_file()


def test_iterations_reuse_the_rollout(tmp_path, base_model, prompts):  # noqa: F811
    out = tmp_path / "run"
    code, _, err = run_cli(grpo_args(base_model, *prompts, out, steps=4, extra=("--grpo-iterations", "2",
                                                                               "--max-kl", "0")), capture=True)
    assert code == 0, err
    data = json.loads((out / "checkpoints" / "latest" / "trainer_state.json").read_text())["data"]
    assert (data["epoch"], data["position"], data["calls"]) == (0, 4, 4)  # two rounds drew 2 x 2 prompts
    r = records(out)
    assert r[0]["reward"] == r[1]["reward"] and r[2]["reward"] == r[3]["reward"]  # one rollout per round
    assert r[0]["reward"] != r[2]["reward"]
    assert r[0]["completion_length"] == r[1]["completion_length"]
    assert r[1]["loss"] != r[0]["loss"]  # the second step of a round is off the rollout's policy


def test_a_steps_micro_batches_roll_out_in_one_generation_call(tmp_path, base_model, prompts, monkeypatch):  # noqa: F811
    """--grad-accum 3: each step's three micro-batches are sampled by one engine call (a short call pays its prefill
    and graph captures whatever it generates), micro-batch j's requests with its own seed as rollout() alone would
    (seed_j * its requests + i), so the batches are those of one call per micro-batch."""
    from entrenar import engine
    from entrenar.train.grpo import GRPOLoader

    calls: list[list[int]] = []
    real = engine.generate_many

    def counted(model, tokenizer, prompts, settings, **kw):
        if settings.temperature > 0:  # the rollouts (qa's and evals' decoding is greedy)
            calls.append(list(kw["seeds"]))
        return real(model, tokenizer, prompts, settings, **kw)

    monkeypatch.setattr(engine, "generate_many", counted)
    out = tmp_path / "run"
    code, _, err = run_cli(grpo_args(base_model, *prompts, out, steps=2, extra=("--grad-accum", "3")), capture=True)
    assert code == 0, err
    assert len(calls) == 2, [len(c) for c in calls]  # one call a step, not one per micro-batch
    loader = GRPOLoader.__new__(GRPOLoader)
    loader.seed = 3  # grpo_args' --seed
    n = 2 * 4  # --batch-size prompts x --num-generations
    for step, seeds in enumerate(calls):
        assert seeds == [loader._seed(step, j) * n + i for j in range(3) for i in range(n)]
    data = json.loads((out / "checkpoints" / "latest" / "trainer_state.json").read_text())["data"]
    assert (data["position"], data["calls"]) == (12 % 8, 6)  # 2 steps x 3 micro-batches x 2 prompts of 8


def test_learns_the_reward(tmp_path, base_model, prompts):  # noqa: F811
    out = tmp_path / "run"
    code, _, err = run_cli(grpo_args(base_model, *prompts, out, steps=12, extra=(
        "--mode", "full", "--lr", "3e-2", "--beta", "0", "--max-kl", "0",
        # a tiny random policy finds the vowel gradient in 12 steps from some rollout seeds only (3 of seeds 3-7
        # under the engine's sampler, 2 under generate_batch's); seed 6 is one, the others stay flat at ~0.33
        "--seed", "6")), capture=True)
    assert code == 0, err
    r = records(out)
    rewards = [x["reward"] for x in r]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards  # more vowels
    assert r[-1]["entropy"] < r[0]["entropy"]  # by sharpening the policy


def test_bad_reward_return_exits_2_naming_file_line(tmp_path, base_model, prompts):  # noqa: F811
    data, reward = prompts
    args = grpo_args(base_model, data, reward, tmp_path / "run", steps=1)
    args[args.index("--reward") + 1] = f"python:{reward}:text_reward"
    code, result, _err = run_cli(args, capture=True)
    assert code == 2
    assert f"{reward.resolve()}:6" in result["error"] and "'high'" in result["error"], result


@pytest.mark.parametrize("change,needle", [
    (("--reward", "nope"), "unknown reward 'nope'"),
    (("--reward", "python:missing.py:f"), "not a Python file"),
    (("--num-generations", "1"), "--num-generations must be an integer >= 2"),
    (("--val", "x.jsonl"), "--objective grpo has no eval set"),
    (("--objective", "sft"), "--reward python:"),
    (("--beta", "-1"), "--beta must be a finite number >= 0"),
    (("--kl-to-base", "0.1"), "has its own reference term (--beta)"),
], ids=["unknown", "missing-file", "G1", "val", "reward-without-grpo", "negative-beta", "kl-to-base"])
def test_bad_flags_exit_2(tmp_path, base_model, prompts, change, needle):  # noqa: F811
    args = grpo_args(base_model, *prompts, tmp_path / "run", steps=1)
    flag, value = change
    if flag in args and flag not in ("--reward",):
        args[args.index(flag) + 1] = value
    elif flag == "--reward":
        args[args.index("--reward") + 1] = value
    else:
        args += [flag, value]
    code, result, _err = run_cli(args, capture=True)
    assert code == 2 and needle in result["error"], result


def test_kl_guard_stops_the_run(tmp_path, base_model, prompts):  # noqa: F811
    out = tmp_path / "run"
    code, result, _err = run_cli(grpo_args(base_model, *prompts, out, steps=4, extra=(
        "--lr", "3e-1", "--max-kl", "1e-6")), capture=True)
    assert code == 3 and result["guard"] == "GUARD-GRPO-KL", result
    assert "--max-kl 1e-06" in result["error"] and "raise --beta" in result["error"]


def test_entropy_guard_fires_on_collapse():
    from entrenar.train.grpo import ENTROPY_COLLAPSE_STEPS, GRPOWatch

    w = GRPOWatch()
    assert w.update({"step": 1, "entropy": 2.0, "reward": 0.1}) == []
    out = []
    for s in range(2, 2 + ENTROPY_COLLAPSE_STEPS):
        out += w.update({"step": s, "entropy": 0.01, "reward": 0.1})
    assert len(out) == 1 and out[0].startswith("GUARD-GRPO-ENTROPY") and "raise --temperature" in out[0]
    assert w.update({"step": 9, "entropy": 0.01}) == []  # once per collapse
    healthy = GRPOWatch()
    for s in range(1, 8):
        assert healthy.update({"step": s, "entropy": 2.0 - 0.1 * s}) == []


def test_reward_hacking_guard_fires_when_reward_rises_and_task_falls(tmp_path):
    """The guard reads the run's real task tracker (a panel: a target and a retained task, each its own unit with
    its own paired test): the retained task falling while the reward rose is named; a flat reward is a plain task
    regression (GUARD-TASK-REGRESSION's), not reward hacking."""
    from entrenar.evaluate.panel import PanelMember, TaskPanel
    from entrenar.train.distributed import DistContext
    from entrenar.train.grpo import GRPOObjective, GRPOWatch
    from entrenar.train.task_tracking import TaskTracker
    from tests.test_task_in_loop import SeededTask

    kept = SeededTask([[True] * 12, [True] * 12])
    falls = SeededTask([[True] * 12, [i >= 10 for i in range(12)]])  # 10 lost, none gained: p < 0.01
    falls.name = "humaneval"
    panel = TaskPanel([PanelMember(kept, "target"), PanelMember(falls, "retain")])
    task = TaskTracker(panel, DistContext(), tmp_path, every=8, steps=8, policy="warn", keep_best=False,
                       write_row=lambda row: None, message=lambda text: None)
    model = torch.nn.Linear(2, 2)
    for step in (0, 8):
        task.evaluate(step, model, list(model.parameters()), lambda s: None)
    obj = GRPOObjective.__new__(GRPOObjective)
    obj.watcher = GRPOWatch()
    for s in range(1, 9):
        obj.watcher.update({"step": s, "reward": 0.1 * s})
    assert obj.watch_task(0, task) == []
    warnings = obj.watch_task(8, task)
    assert len(warnings) == 1 and warnings[0].startswith("GUARD-REWARD-HACKING") and "humaneval fell" in warnings[0]
    assert "12/12" in warnings[0] and "2/12" in warnings[0]
    assert {"guard": "GUARD-REWARD-HACKING", "step": 8, "task": "humaneval"} in task.warnings
    flat = GRPOObjective.__new__(GRPOObjective)
    flat.watcher = GRPOWatch()
    for s in range(1, 9):
        flat.watcher.update({"step": s, "reward": 0.5})  # the reward did not rise: a plain task regression
    assert flat.watch_task(8, task) == []


def test_tool_rows_need_a_template_that_renders_tools(tmp_path, base_model, prompts):  # noqa: F811
    data = tmp_path / "calls.jsonl"
    data.write_text(json.dumps({"id": "x", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {}}}}], "messages": [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": {}}}]}]}) + "\n")
    args = grpo_args(base_model, data, prompts[1], tmp_path / "run", steps=1)
    args[args.index("--reward") + 1] = "bfcl"
    code, result, _err = run_cli(args, capture=True)
    assert code == 2 and f"{data}:1" in result["error"] and "--chat-template" in result["error"], result


def test_progress_fields_leave_out_what_a_step_lacks():
    """format_fields: a key the record lacks, a non-finite value or a bool is left out of the line; the share
    fields print as percentages; --grpo-dynamic-sampling's dropped groups appear when the record has them."""
    from entrenar.train.grpo import PROGRESS_FIELDS
    from entrenar.train.objective import format_fields

    line = format_fields({"reward": 0.5, "reward_std": float("nan"), "frac_reward_zero_std": 0.25,
                          "frac_groups_dropped": 0.455, "kl": True, "completion_length": 48.6}, PROGRESS_FIELDS)
    assert line == "reward 0.500 no-spread 25% dropped 46% len 49"
    assert format_fields({}, PROGRESS_FIELDS) == ""


def test_mix_sets_the_share_of_another_prompt_file(tmp_path, base_model, prompts):  # noqa: F811
    """--mix FILE:FRACTION with --objective grpo: FILE's prompts make FRACTION of the prompts (no-call prompts
    among call prompts, so a reward that pays for calls does not teach calling on every question)."""
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(3)))
    out = tmp_path / "run"
    code, _, err = run_cli(grpo_args(base_model, *prompts, out, steps=2, extra=("--mix", f"{other}:0.5")),
                           capture=True)
    assert code == 0, err
    report = json.loads((out / "data_report.json").read_text())
    assert report["mix"] == [{"file": str(other), "fraction": 0.5, "rows_in_file": 3, "rows_added": 8}]
    assert report["train_examples"] == 16  # 8 of --data's, 8 of the mixed file's (cycled)
    assert len(records(out)) == 2

