"""`finetune --objective grpo --grpo-dynamic-sampling N` (DAPO's dynamic sampling) on the CPU, with test_grpo_train's
tiny model and a reward that is constant on the prompts of kind "flat" (their groups never have reward spread) and
the share of vowels of the completion on the others:

  - N > 0: every micro-batch trained on has reward spread in each of its groups (no all-zero advantage group), the
    flat prompts' groups were dropped and replaced by further prompts of the cursor (more than --batch-size x
    --grad-accum consumed a step), the metrics count them (frac_groups_dropped) and the extra calls' seeds are new;
  - N = 0: the code before dynamic sampling: the same prompts in each micro-batch and the same seeds in each rollout
    call (a stored digest of them, not of the sampled tokens, which a CPU's other ISA may round differently);
  - the same seed, the same batches (the drop and the refills are deterministic); a resume from a checkpoint
    continues the run (the same refills and rewards);
  - no group with spread found at all: the micro-batch keeps its last drawn groups and the step says so;
  - --grpo-dynamic-sampling < 0, or without --objective grpo: exit 2 naming the flag.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import run_cli
from tests.test_distributed import _rewind, base_model, sft_data  # noqa: F401
from tests.test_grpo_train import records

REWARD_PY = '''\
def flat_or_vowels(prompt, completion, row):
    if row.get("kind") == "flat":
        return 0.5
    text = completion.lower()
    return sum(text.count(v) for v in "aeiou") / max(1, len(text))
'''
PROMPTS = 16


def is_flat(line: int) -> bool:
    """Whether the prompt of this line of the data (1-based) is of kind "flat": its groups never have spread."""
    return line % 3 == 2
# sha256 of dyn_args(N=0)'s draws (each micro-batch's prompt lines, each rollout call's seeds) computed by the code
# before dynamic sampling existed (without the flag): N = 0 draws what it drew
BEFORE_DYNAMIC_SAMPLING = "1aa684b5f6f1cdf4462bad8bbc0da90ec703edd985abe20f91d7aab7f11a3ecd"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("grpo-dyn-data")
    (d / "r.py").write_text(REWARD_PY)
    (d / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"Say word number {i}.", "kind": "flat" if is_flat(i + 1) else "vowels"}) + "\n"
        for i in range(PROMPTS)))
    return d / "prompts.jsonl", d / "r.py"


def dyn_args(model: Path, data: Path, reward: Path, out: Path, n: int, steps: int = 2, seed: int = 3,
             extra: tuple = ()) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--objective", "grpo", "--reward", f"python:{reward}:flat_or_vowels", "--batch-size", "2",
            "--grad-accum", "2", "--num-generations", "4", "--max-new-tokens", "6", "--max-seq-len", "64",
            "--lr", "1e-2", "--warmup", "0", "--seed", str(seed), "--device", "cpu", "--no-preflight", "--json",
            "--mode", "lora", "--rank", "4", "--grpo-dynamic-sampling", str(n), *extra]


def run_recording(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[list[dict], list[list[int]]]:
    """Run the CLI in this process; (each micro-batch the loader handed the loop, each rollout call's seeds)."""
    from entrenar import engine
    from entrenar.train.grpo import GRPOLoader

    batches: list[dict] = []
    calls: list[list[int]] = []
    real_next, real_generate = GRPOLoader.next_batch, engine.generate_many

    def next_batch(self):
        batch = real_next(self)
        batches.append(batch)
        return batch

    def generate_many(model, tokenizer, prompts, settings, **kw):
        if settings.temperature > 0:  # the rollouts
            calls.append(list(kw["seeds"]))
        return real_generate(model, tokenizer, prompts, settings, **kw)

    with monkeypatch.context() as patch:  # undone after the run: a second run records afresh
        patch.setattr(GRPOLoader, "next_batch", next_batch)
        patch.setattr(engine, "generate_many", generate_many)
        code, result, err = run_cli(args, capture=True)
    assert code == 0, (result, err)
    return batches, calls


def digest(batches: list[dict]) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update(b["input_ids"].numpy().tobytes())
        h.update(b["labels"].numpy().tobytes())
        h.update(json.dumps([round(float(a), 4) for a in b["advantages"]]).encode())
    return h.hexdigest()


def draws(batches: list[dict], calls: list[list[int]]) -> str:
    """sha256 of what a run drew: each micro-batch's prompt lines and each rollout call's seeds."""
    drawn = [[int(line) for line in b["sample_ids"]] for b in batches]
    return hashlib.sha256(json.dumps([drawn, calls]).encode()).hexdigest()


def data_state(run: Path) -> dict:
    return json.loads((run / "checkpoints" / "latest" / "trainer_state.json").read_text())["data"]


@pytest.fixture(scope="module")
def dyn_run(tmp_path_factory, base_model, data) -> tuple[Path, list[dict], list[list[int]]]:  # noqa: F811
    """Four steps with --grpo-dynamic-sampling 4, a checkpoint every 2: (the run, its micro-batches, its rollout
    calls' seeds)."""
    out = tmp_path_factory.mktemp("grpo-dyn") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        batches, calls = run_recording(monkeypatch, dyn_args(base_model, *data, out, n=4, steps=4,
                                                             extra=("--save-every", "2")))
    return out, batches, calls


def test_every_trained_group_has_reward_spread(dyn_run):
    from entrenar.train.grpo import ROLLOUT_SUMS

    out, batches, calls = dyn_run
    assert len(batches) == 2 + 4 * 2  # step 0's check of the first step's batches, then 4 steps x --grad-accum 2
    for b in batches:
        flat = (b["advantages"].view(-1, 4) == 0).all(dim=1)
        assert not flat.any(), b["advantages"]  # no group without spread trained on
        assert len(b["sample_ids"]) == 2  # the micro-batch was refilled to --batch-size groups
        assert not any(is_flat(line) for line in b["sample_ids"]), b["sample_ids"]  # the "vowels" rows only
        sums = dict(zip(ROLLOUT_SUMS, b["rollout"].tolist(), strict=False))
        assert sums["zero_std_groups"] == 0 and sums["short_groups"] == 0
        assert sums["dropped_groups"] == sums["drawn_groups"] - 2  # (the shuffled cursor may draw no flat one)
        # the dropped groups' tokens were generated too
        assert (sums["generated_tokens"] > sums["completion_tokens"]) == (sums["dropped_groups"] > 0)
    # each step: one first call, then one extra call for both micro-batches' refills at least
    assert len(calls) >= 4
    first_call_seeds = {s for c in calls for s in c if s >= 0}
    extra_seeds = [s for c in calls for s in c if s < 0]
    assert extra_seeds and len(set(extra_seeds)) == len(extra_seeds) and not first_call_seeds & set(extra_seeds)
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["frac_reward_zero_std"] == 0.0 and 0.0 < r["frac_groups_dropped"] < 1.0
        assert "dynamic_sampling_note" not in r
    # the cursor moved past every prompt drawn: more than the 4 x 2 x 2 prompts of four steps without refills
    drawn = sum(dict(zip(ROLLOUT_SUMS, b["rollout"].tolist(), strict=False))["drawn_groups"] for b in batches[2:])
    st = data_state(out)
    assert drawn > 16 and st["epoch"] * PROMPTS + st["position"] == drawn


def test_off_is_the_code_before_it(tmp_path, monkeypatch, base_model, data):  # noqa: F811
    batches, calls = run_recording(monkeypatch, dyn_args(base_model, *data, tmp_path / "run", n=0))
    assert len(calls) == 2 and all(s >= 0 for c in calls for s in c)  # one call a step, no extra seeds
    flat_groups = [(b["advantages"].view(-1, 4) == 0).all(dim=1) for b in batches]
    assert any(f.any() and not f.all() for f in flat_groups)  # a micro-batch mixes flat groups with others: kept
    assert draws(batches, calls) == BEFORE_DYNAMIC_SAMPLING
    assert "frac_groups_dropped" not in records(tmp_path / "run")[0]


def test_same_seed_same_batches(tmp_path, monkeypatch, base_model, data, dyn_run):  # noqa: F811
    from entrenar.train.grpo import ROLLOUT_SUMS

    _, a, calls_a = dyn_run
    b, calls_b = run_recording(monkeypatch, dyn_args(base_model, *data, tmp_path / "again", n=4, steps=1))
    a = a[:len(b)]  # step 0's check and step 1
    assert calls_a[:len(calls_b)] == calls_b and digest(a) == digest(b)
    timed = ROLLOUT_SUMS.index("rollout_seconds")
    for x, y in zip(a, b, strict=True):  # the same groups drawn and dropped (all but the seconds)
        keep = torch.arange(len(x["rollout"])) != timed
        assert torch.equal(x["rollout"][keep], y["rollout"][keep])


def test_resume_continues_the_run(tmp_path, base_model, data, dyn_run):  # noqa: F811
    """A copy of the run as it was after step 2's checkpoint, resumed: the refilled steps 3-4 draw the same prompts
    (the cursor saved is after step 2's refills) and the same rewards."""
    run, _, _ = dyn_run
    rewound = tmp_path / "rewound"
    _rewind(run, rewound, 2)  # the run as it was after step 2's checkpoint
    code, _, err = run_cli([*dyn_args(base_model, *data, rewound, n=4, steps=4, extra=("--save-every", "2")),
                            "--resume", "auto"], capture=True)
    assert code == 0, err
    a, b = records(rewound), records(run)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    for key in ("reward", "frac_groups_dropped", "completion_length"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert data_state(rewound) == data_state(run)


def test_no_spread_found_keeps_the_last_groups_and_says_so(tmp_path, monkeypatch, base_model, data):  # noqa: F811
    """Every prompt flat: the one extra call finds no group with spread, so each micro-batch trains on its last drawn
    groups (never empty) and the step's metrics carry the note."""
    from entrenar.train.grpo import ROLLOUT_SUMS

    flat_only = tmp_path / "flat.jsonl"
    flat_only.write_text("".join(json.dumps({"prompt": f"Say word number {i}.", "kind": "flat"}) + "\n"
                                 for i in range(8)))
    out = tmp_path / "run"
    batches, calls = run_recording(monkeypatch, dyn_args(base_model, flat_only, data[1], out, n=1, steps=1))
    assert len(calls) == 2  # the first call and one extra call for both micro-batches
    for b in batches:
        sums = dict(zip(ROLLOUT_SUMS, b["rollout"].tolist(), strict=False))
        assert len(b["sample_ids"]) == 2 and b["input_ids"].shape[0] == 2 * 4
        assert (sums["drawn_groups"], sums["dropped_groups"], sums["short_groups"]) == (4, 2, 2)
        assert sums["zero_std_groups"] == 2
    assert len({line for b in batches[2:] for line in b["sample_ids"]}) == 4  # the extra call's 4 prompts
    assert data_state(out)["epoch"] * 8 + data_state(out)["position"] == 8  # all 8 drawn: 4 first, 4 refills
    (r,) = records(out)
    assert r["frac_reward_zero_std"] == 1.0 and r["frac_groups_dropped"] == 0.5
    assert "4 group(s) with reward spread still missing after --grpo-dynamic-sampling 1" in r["dynamic_sampling_note"]


@pytest.mark.parametrize("change,needle", [
    (("--grpo-dynamic-sampling", "-1"), "--grpo-dynamic-sampling must be an integer >= 0"),
    (("--objective", "sft"), "--grpo-dynamic-sampling 2 replaces GRPO groups"),
], ids=["negative", "without-grpo"])
def test_bad_flags_exit_2(tmp_path, base_model, data, change, needle):  # noqa: F811
    args = dyn_args(base_model, *data, tmp_path / "run", n=2, steps=1)
    flag, value = change
    args[args.index(flag) + 1] = value
    if flag == "--objective":  # --reward has its own refusal without grpo
        i = args.index("--reward")
        del args[i:i + 2]
    code, result, _err = run_cli(args, capture=True)
    assert code == 2 and needle in result["error"], result
