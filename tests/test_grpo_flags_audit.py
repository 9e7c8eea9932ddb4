"""An audit of `finetune --objective grpo`'s flags against docs/design.md ("GRPO"): for each flag, a test that fails
when the flag is silently ignored or mis-applied, where tests/test_grpo_*.py had none.

  - every GRPO number flag out of its range (and an unknown --loss-type / --scale-rewards, a non-finite --reward
    weight) is exit 2 naming the flag, before the run directory is made;
  - the flags of a CLI run reach the rollouts (the engine's temperature, top-p, max new tokens and G copies of each
    prompt) and the loss (its units under --loss-type grpo, --reward weights in the logged reward, the objective's
    epsilons, scaling, beta and KL bound), and the first step of a round at --temperature 0.7 has KL 0 and no
    clipped ratio: old and reference log-probs are those of the tempered distribution too;
  - the rollout batch at unit level: the --reward weights are summed into the reward that the advantages are built
    from (each --scale-rewards), reward/NAME stays unweighted; the old and reference log-probs are tempered; --beta 0
    computes no reference at all; --max-kl is a strict bound, 0 turns the guard off; --max-new-tokens is each
    prompt's room in --max-seq-len;
  - --reward python:FILE.py:FUNC with FUNC named `nan` / `inf` is that function, not a non-finite weight (a bug
    this audit found: it was refused as one).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers.cli import run_cli
from tests.test_distributed import base_model, sft_data  # noqa: F401
from tests.test_grpo_train import grpo_args, prompts, records  # noqa: F401

TWO_REWARDS_PY = '''\
def vowels(prompt, completion, row):
    text = completion.lower()
    return sum(text.count(v) for v in "aeiou") / max(1, len(text))


def length(prompt, completion, row):
    return float(len(completion))
'''


# ---- refusals: exit 2 naming the flag ------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,value", [
    ("--temperature", "0"), ("--temperature", "nan"), ("--top-p", "0"), ("--top-p", "1.5"),
    ("--max-new-tokens", "0"), ("--epsilon", "0"), ("--epsilon", "1"), ("--epsilon-high", "0"),
    ("--epsilon-high", "inf"), ("--grpo-iterations", "0"), ("--max-kl", "-1"), ("--max-kl", "nan"),
    ("--loss-type", "ppo"), ("--scale-rewards", "mean"), ("--reward", "WEIGHT_NAN"),
])
def test_bad_grpo_values_exit_2_naming_the_flag(tmp_path, base_model, prompts, flag, value):  # noqa: F811
    """A value the design rules out (a temperature or epsilon that is not > 0, a top-p outside (0, 1], no new tokens,
    no iteration, a negative KL bound, a name not among TRL's, a non-finite weight) is exit 2 naming the flag before
    anything is made, not a run that quietly trains with it."""
    data, reward = prompts
    out = tmp_path / "run"
    args = grpo_args(base_model, data, reward, out, steps=1)
    if flag == "--reward":
        value = f"python:{reward}:vowels:nan"
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    code, result, err = run_cli(args, capture=True)
    assert code == 2, (code, result, err)
    assert flag in result["error"], result
    assert not out.exists()  # refused before the run directory


# ---- a CLI run: every flag reaches the rollouts and the loss -------------------------------------------------------
@pytest.fixture(scope="module")
def flagged_run(tmp_path_factory, base_model, prompts):  # noqa: F811
    """Two steps with every GRPO flag off its default: (the run, each rollout call's (settings, prompts), the
    objective build_grpo made)."""
    from entrenar import engine
    from entrenar.train import grpo

    d = tmp_path_factory.mktemp("grpo-flags")
    (d / "r.py").write_text(TWO_REWARDS_PY)
    out = d / "run"
    args = grpo_args(base_model, prompts[0], prompts[1], out, steps=2, extra=(
        "--num-generations", "3", "--temperature", "0.7", "--top-p", "0.9", "--epsilon", "0.15",
        "--epsilon-high", "0.35", "--grpo-iterations", "2", "--loss-type", "grpo", "--scale-rewards", "none",
        "--max-kl", "50", "--beta", "0.02"))
    args[args.index("--max-new-tokens") + 1] = "5"
    i = args.index("--reward")
    args[i:i + 2] = ["--reward", f"python:{d / 'r.py'}:vowels:2.5", "--reward", f"python:{d / 'r.py'}:length:-0.5"]
    calls: list[tuple] = []
    built: list = []
    real_generate, real_build = engine.generate_many, grpo.build_grpo

    def generate_many(model, tokenizer, prompt_ids, settings, **kw):
        if settings.temperature > 0:  # the rollouts (qa's decoding is greedy)
            calls.append((settings, [list(p) for p in prompt_ids]))
        return real_generate(model, tokenizer, prompt_ids, settings, **kw)

    def build_grpo(*a, **kw):
        built.append(real_build(*a, **kw))
        return built[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "generate_many", generate_many)
        patch.setattr(grpo, "build_grpo", build_grpo)
        code, result, err = run_cli(args, capture=True)
    assert code == 0, (result, err)
    return out, calls, built[0], d / "r.py"


def test_sampling_flags_reach_the_engine(flagged_run):
    """--temperature, --top-p and --max-new-tokens are the engine's settings of every rollout call, each prompt
    asked --num-generations times; no completion is longer than --max-new-tokens."""
    out, calls, _, _ = flagged_run
    assert len(calls) == 1  # --grpo-iterations 2 over 2 steps: one round, one rollout (step 0's check replayed)
    for settings, prompt_ids in calls:
        assert (settings.temperature, settings.top_p, settings.max_new_tokens) == (0.7, 0.9, 5)
        assert len(prompt_ids) == 2 * 3  # --batch-size 2 prompts x --num-generations 3
        groups = [prompt_ids[g * 3:(g + 1) * 3] for g in range(2)]
        assert all(g[0] == g[1] == g[2] for g in groups) and groups[0] != groups[1]
    for r in records(out):
        assert 1 <= r["completion_length"] <= 5


def test_loss_flags_reach_the_objective_and_the_metrics(flagged_run):
    """The objective is built with the flags given (epsilons, scaling, beta, KL bound, iterations, the weights);
    --loss-type grpo's units are the step's completions; the logged reward is the --reward weights' sum of the
    unweighted reward/NAME means; the first step of the round (the policy at its start, --temperature 0.7) has KL 0
    to the reference and no clipped ratio: the rollout's old and reference log-probs are the tempered ones too."""
    out, _, obj, reward_py = flagged_run
    assert (obj.G, obj.temperature, obj.top_p, obj.max_new_tokens) == (3, 0.7, 0.9, 5)
    assert (obj.eps_low, obj.eps_high, obj.iterations, obj.beta) == (0.15, 0.35, 2, 0.02)
    assert (obj.loss_type, obj.scale_rewards, obj.watcher.max_kl) == ("grpo", "none", 50.0)
    assert obj.rewards.weights == [2.5, -0.5]
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2]
    vowels, length = f"reward/python:{reward_py}:vowels", f"reward/python:{reward_py}:length"
    for r in steps:
        assert r["loss_tokens"] == 2 * 3  # grpo: one unit per completion (dapo's would be the tokens)
        assert r["reward"] == pytest.approx(2.5 * r[vowels] - 0.5 * r[length], rel=1e-9, abs=1e-12)
    assert steps[0]["kl"] == 0.0 and steps[0]["clip_ratio"] == 0.0
    assert steps[1]["reward"] == steps[0]["reward"]  # the round's second step replays the rollout
    run = json.loads((out / "run.json").read_text())["config"]
    assert {k: run[k] for k in ("num_generations", "temperature", "top_p", "max_new_tokens", "epsilon",
                                "epsilon_high", "grpo_iterations", "loss_type", "scale_rewards", "max_kl",
                                "beta")} == {
        "num_generations": 3, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5, "epsilon": 0.15,
        "epsilon_high": 0.35, "grpo_iterations": 2, "loss_type": "grpo", "scale_rewards": "none", "max_kl": 50.0,
        "beta": 0.02}


# ---- unit level: one rollout batch through GRPOObjective -----------------------------------------------------------
COMPLETIONS = ["a", "bb", "ccc", "dddd", "ee", "f"]  # texts drawn by the fake sampler, by request seed


def fake_sampler(log: list[dict]):
    """A stand-in for grpo.sample_completions: request i gets COMPLETIONS[seed % 6] (ids: 1 + len copies of 5, the
    last the stop token when the text is short), and the call's arguments are logged."""
    from entrenar.train.grpo import Sampled

    def sample(model, tokenizer, prompt_ids, max_new_tokens, temperature, top_p, seed, seeds=None):
        log.append({"n": len(prompt_ids), "max_new_tokens": max_new_tokens, "temperature": temperature,
                    "top_p": top_p})
        out = []
        for s in seeds:
            text = COMPLETIONS[s % len(COMPLETIONS)]
            out.append(Sampled([5 + (s % 7)] * len(text) + [3], text, False))
        return out
    return sample


def prompt_examples(n: int) -> list:
    from entrenar.train.grpo import PromptExample

    return [PromptExample(np.asarray([10 + i, 20 + i, 30], dtype=np.int32), f"prompt {i}", {"i": i}, i + 1, 8)
            for i in range(n)]


def objective(monkeypatch: pytest.MonkeyPatch, log: list[dict], rewards, **kw):
    from entrenar.train import grpo
    from tests.helpers.models import tiny_causal_lm, tiny_config

    monkeypatch.setattr(grpo, "sample_completions", fake_sampler(log))
    obj = grpo.GRPOObjective(SimpleNamespace(pad_id=0, eos_id=3), rewards, **kw)
    model = tiny_causal_lm(tiny_config(), 2)
    obj.bind(model)
    return obj, model


def step_of(obj, model, batch) -> dict:
    """The step's metrics of one micro-batch, as the loop makes them (the loss's sums -> step_metrics)."""
    _, units, metrics = obj.loss(model, batch, torch.device("cpu"))
    return obj.step_metrics({k: float(v) for k, v in metrics.items()}, units)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_reward_weights_are_summed_into_the_advantages(monkeypatch, scale):
    """--reward length:2 --reward short:-0.5: each completion's reward is 2 x length - 0.5 x short, the advantages
    are that reward's (scaled by --scale-rewards as given), the logged reward its mean, reward/NAME each reward's
    unweighted mean."""
    from entrenar.train.grpo import group_advantages
    from entrenar.train.rewards import Rewards

    def length(texts, completions, rows):
        return [float(len(c)) for c in completions]

    def short(texts, completions, rows):
        return [1.0 if len(c) <= 2 else 0.0 for c in completions]

    log: list[dict] = []
    rewards = Rewards([length, short], ["length", "short"], [2.0, -0.5])
    obj, model = objective(monkeypatch, log, rewards, mode="full", beta=0.0, num_generations=3, max_new_tokens=8,
                           scale_rewards=scale)
    batch = obj.rollout(prompt_examples(2), seed=1)
    texts = [COMPLETIONS[(1 * 6 + i) % 6] for i in range(6)]  # request i's seed: seed x 6 + i
    lengths = torch.tensor([float(len(t)) for t in texts], dtype=torch.float64)
    shorts = torch.tensor([1.0 if len(t) <= 2 else 0.0 for t in texts], dtype=torch.float64)
    weighted = 2.0 * lengths - 0.5 * shorts
    expected, _ = group_advantages(weighted.float(), 3, scale)
    assert torch.equal(batch["advantages"], expected), (batch["advantages"], expected)
    if scale == "none":  # Dr. GRPO: the weighted reward less its group's mean, nothing else
        centred = (weighted.view(2, 3) - weighted.view(2, 3).mean(dim=1, keepdim=True)).flatten().float()
        assert torch.allclose(batch["advantages"], centred, atol=1e-6)
    m = step_of(obj, model, batch)
    assert m["reward"] == pytest.approx(float(weighted.mean()), rel=1e-12)
    assert m["reward/length"] == pytest.approx(float(lengths.mean()), rel=1e-12)
    assert m["reward/short"] == pytest.approx(float(shorts.mean()), rel=1e-12)


def test_rollout_log_probs_are_tempered(monkeypatch):
    """--temperature 0.5 --top-p 0.8 --max-new-tokens 5 --grpo-iterations 2 --beta 0.04 (full: a frozen copy as the
    reference): the rollout is asked with those settings, G copies of each prompt; its old and reference log-probs
    are log_softmax(logits / 0.5) of the completion tokens, so at the start the ratio is 1 and the KL exactly 0."""
    from entrenar.train.grpo import token_logps
    from entrenar.train.rewards import Rewards

    log: list[dict] = []
    rewards = Rewards([lambda p, c, r: [float(len(x)) for x in c]], ["length"], [1.0])
    obj, model = objective(monkeypatch, log, rewards, mode="full", beta=0.04, num_generations=2, temperature=0.5,
                           top_p=0.8, max_new_tokens=5, iterations=2)
    batch = obj.rollout(prompt_examples(2), seed=4)
    assert log == [{"n": 4, "max_new_tokens": 5, "temperature": 0.5, "top_p": 0.8}]
    mask = batch["labels"] != -100
    with torch.no_grad():
        tempered = token_logps(model, batch["input_ids"], batch["labels"], 0.5)[0]
        plain = token_logps(model, batch["input_ids"], batch["labels"], 1.0)[0]
    assert torch.allclose(batch["old_logps"], tempered, atol=1e-6)
    assert torch.allclose(batch["ref_logps"], tempered, atol=1e-6)
    assert (batch["old_logps"][mask] - plain[mask]).abs().max() > 1e-2  # the temperature matters here
    m = step_of(obj, model, batch)
    assert m["kl"] == pytest.approx(0.0, abs=1e-7) and m["clip_ratio"] == 0.0


def test_beta_zero_makes_no_reference(monkeypatch):
    """--beta 0: no reference copy is made (--mode full), no reference forward runs at the rollout, no KL is
    logged."""
    from entrenar.train.grpo import GRPOObjective
    from entrenar.train.rewards import Rewards

    def no_reference(self, ids, labels):
        raise AssertionError("a reference forward under --beta 0")

    monkeypatch.setattr(GRPOObjective, "reference_logps", no_reference)
    log: list[dict] = []
    rewards = Rewards([lambda p, c, r: [float(len(x)) for x in c]], ["length"], [1.0])
    obj, model = objective(monkeypatch, log, rewards, mode="full", beta=0.0, num_generations=2, max_new_tokens=5,
                           iterations=2)
    assert obj.reference_model is None
    batch = obj.rollout(prompt_examples(2), seed=0)
    assert "ref_logps" not in batch and "old_logps" in batch
    m = step_of(obj, model, batch)
    assert "kl" not in m and math.isfinite(m["entropy"])


def test_max_kl_is_a_strict_bound_and_zero_is_off():
    """GUARD-GRPO-KL: a KL equal to --max-kl passes, above it or non-finite stops the run (exit 3's GuardError);
    --max-kl 0 never stops it."""
    from entrenar.errors import GuardError
    from entrenar.train.grpo import GRPOWatch

    bound = GRPOWatch(0.5)
    assert bound.update({"step": 1, "kl": 0.5}) == []
    for kl in (0.5001, float("nan"), float("inf")):
        with pytest.raises(GuardError) as e:
            GRPOWatch(0.5).update({"step": 2, "kl": kl})
        assert e.value.guard_id == "GUARD-GRPO-KL" and "--max-kl 0.5" in str(e.value)
    off = GRPOWatch(0.0)
    for s, kl in enumerate((1e9, float("nan"), float("inf")), 1):
        assert off.update({"step": s, "kl": kl}) == []


def test_prompt_room_is_max_new_tokens(tmp_path):
    """--max-new-tokens is each prompt's room in --max-seq-len: a prompt whose tokens + N exceed it is skipped."""
    from entrenar.train.grpo import load_prompts

    class Tok:
        def supports_tools(self) -> bool:
            return False

        def encode_chat(self, messages, add_generation_prompt=True, tools=None):
            return SimpleNamespace(ids=[1] * len(messages[-1]["content"]))

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n}) + "\n" for n in (4, 6, 7)))
    kept, report = load_prompts(path, Tok(), 16, 10)
    assert [len(e.input_ids) for e in kept] == [4, 6] and report["too_long"] == 1
    assert all(len(e) == len(e.input_ids) + 10 for e in kept)
    kept, report = load_prompts(Path(path), Tok(), 16, 12)
    assert [len(e.input_ids) for e in kept] == [4] and report["too_long"] == 2


# ---- --reward NAME[:WEIGHT] --------------------------------------------------------------------------------------
def test_reward_weight_is_the_last_colon_field_only_when_a_name_is_left(tmp_path):
    """python:FILE.py:FUNC[:WEIGHT]: a function whose name float() reads (`nan`, `inf`, `Infinity`) is FUNC when no
    weight follows it, not a non-finite weight; after it a weight is read, and a non-finite weight of a builtin is
    still refused naming the spec."""
    from entrenar.errors import InputError
    from entrenar.train.rewards import parse_reward, parse_rewards

    user = tmp_path / "r.py"
    user.write_text("def nan(prompt, completion, row):\n    return 1.0\n\n\n"
                    "def inf(prompt, completion, row):\n    return 2.0\n\n\n"
                    "def Infinity(prompt, completion, row):\n    return 3.0\n")
    for func in ("nan", "inf", "Infinity"):
        name, reward, weight = parse_reward(f"python:{user}:{func}")
        assert (name, reward.func, weight) == (f"python:{user}:{func}", func, 1.0)
    rewards = parse_rewards([f"python:{user}:inf:2.5", f"python:{user}:nan:-1", "bfcl:0"])
    assert rewards.names == [f"python:{user}:inf", f"python:{user}:nan", "bfcl"]
    assert rewards.weights == [2.5, -1.0, 0.0]
    for spec in ("bfcl:nan", "tests:inf", f"python:{user}:inf:nan", f"python:{user}:nan:-inf"):
        with pytest.raises(InputError, match="the weight must be a finite number") as e:
            parse_reward(spec)
        assert f"--reward {spec}" in str(e.value)
