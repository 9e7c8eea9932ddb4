"""`torchrun --nproc-per-node 2 -m entrenar finetune --objective grpo` on the CPU (gloo) against one process.

The rule (docs/design.md, "GRPO"): W ranks x --batch-size B equal one process x --batch-size B*W. Every rank draws the
job's micro-batch of B*W prompts from the same cursor and rolls out its contiguous share of B prompts, request i of
rank r with the seed one process gives request r*B*G + i of the whole micro-batch; the loss is divided by the job's
units (dapo: every rank's completion tokens) and the gradients are SUM-reduced. So the union of the ranks' rollouts is
the one process's rollout, and with it the rewards, the losses, the step metrics and the LoRA weights.

  - LoRA under DDP, --grad-accum 2: rewards identical, losses and adapter weights within 1e-5 relative;
  - the step metrics of a 2-rank step are the job's (reward, its spread, KL, entropy, ... equal one process's);
  - --grpo-dynamic-sampling: the ranks refill their own groups from the shared cursor, the job's draws one process's;
  - resume under 2 ranks from a checkpoint continues the run;
  - --scale-rewards batch and --mode full without --parallel ddp under torchrun: exit 2 naming the flag.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli_process
from tests.test_distributed import _rewind, base_model, close, ok, sft_data, weights, worst_rel  # noqa: F401
from tests.test_grpo_train import grpo_args, prompts, records  # noqa: F401

METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completion_length", "truncated_share", "kl", "entropy",
           "clip_ratio", "loss_tokens")


def grpo(model: Path, data: tuple[Path, Path], out: Path, batch: int, steps: int = 2, extra: tuple = ()) -> list[str]:
    args = grpo_args(model, *data, out, steps=steps, extra=("--grad-accum", "2", "--save-every", "1", *extra))
    args[args.index("--batch-size") + 1] = str(batch)
    return args


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, base_model, prompts) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("grpo-one") / "run"
    ok(run_cli_process(grpo(base_model, prompts, out, 4)))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, base_model, prompts) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("grpo-two") / "run"
    ok(run_cli_process(grpo(base_model, prompts, out, 2), nproc=2))
    return out


def test_two_ranks_equal_one_process(one_process, two_ranks):
    a, b = records(two_ranks), records(one_process)
    assert [r["step"] for r in a] == [1, 2] == [r["step"] for r in b]
    # the same rollouts, the same rewards: their float64 mean equal but for the order of the sum over the ranks
    assert [r["reward"] for r in a] == pytest.approx([r["reward"] for r in b], rel=1e-12, abs=0)
    assert len({r["reward"] for r in b}) == 2  # two different rollouts
    assert close([r["loss"] for r in a], [r["loss"] for r in b])
    wa, wb = weights(two_ranks / "final/adapter_model.safetensors"), weights(one_process / "final/adapter_model.safetensors")
    assert len(wa) > 0 and worst_rel(wa, wb) <= 1e-5


def test_step_metrics_are_the_jobs(one_process, two_ranks):
    for x, y in zip(records(two_ranks), records(one_process), strict=True):
        for k in METRICS:
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-9), (k, x[k], y[k])
    assert records(two_ranks)[-1]["kl"] > 0.0


def test_loader_state_is_the_jobs(one_process, two_ranks):
    states = [json.loads((run / "checkpoints" / "latest" / "trainer_state.json").read_text())["data"]
              for run in (two_ranks, one_process)]
    keys = ("epoch", "position", "calls", "batch_size")
    assert [states[0][k] for k in keys] == [states[1][k] for k in keys]


def test_resume_under_two_ranks_continues_the_run(tmp_path, one_process, two_ranks, base_model, prompts):  # noqa: F811
    """From step 1's checkpoint of the 2-rank run, and of the one-process run (the same global batch), two ranks
    continue the run: the same rollout and loss at step 2."""
    for src in (two_ranks, one_process):
        rewound = tmp_path / src.parent.name
        _rewind(src, rewound, 1)
        res = ok(run_cli_process([*grpo(base_model, prompts, rewound, 2), "--resume", "auto"], nproc=2))
        assert res["start_step"] == 1
        a, b = records(rewound), records(one_process)
        assert [r["step"] for r in a] == [1, 2]
        assert [r["reward"] for r in a] == pytest.approx([r["reward"] for r in b], rel=1e-12, abs=0)
        assert close([r["loss"] for r in a], [r["loss"] for r in b])


def test_dynamic_sampling_two_ranks_draw_what_one_process_draws(tmp_path, base_model):  # noqa: F811
    """--grpo-dynamic-sampling 4 with half the prompts flat (no reward spread ever), so both ranks refill the same
    micro-batch in the same extra call: each rank drops its flat groups and refills them from the shared cursor; the
    job refills what one process refilling the whole micro-batch does (lower ranks' refills first, their request
    seeds after the lower ranks'), so rewards, drops and losses match."""
    from tests.test_grpo_dynamic_sampling import REWARD_PY, dyn_args

    (tmp_path / "r.py").write_text(REWARD_PY)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say word number {i}.",
                                        "kind": "flat" if i % 2 else "vowels"}) + "\n" for i in range(16)))
    runs = {}
    for nproc, batch in ((1, 4), (2, 2)):
        out = tmp_path / f"n{nproc}"
        args = dyn_args(base_model, data, tmp_path / "r.py", out, 4, extra=("--save-every", "1"))
        args[args.index("--batch-size") + 1] = str(batch)
        ok(run_cli_process(args, nproc=nproc))
        runs[nproc] = out
    a, b = records(runs[2]), records(runs[1])
    assert all(r["frac_groups_dropped"] > 0 for r in b)  # refills happened
    for k in ("frac_groups_dropped", "frac_reward_zero_std", "completion_length"):
        assert [r[k] for r in a] == pytest.approx([r[k] for r in b], rel=1e-12, abs=0), k
    assert [r["reward"] for r in a] == pytest.approx([r["reward"] for r in b], rel=1e-12, abs=0)
    assert close([r["loss"] for r in a], [r["loss"] for r in b])
    states = [json.loads((run / "checkpoints" / "latest" / "trainer_state.json").read_text())["data"]
              for run in (runs[2], runs[1])]
    assert (states[0]["epoch"], states[0]["position"]) == (states[1]["epoch"], states[1]["position"])


def test_scale_rewards_batch_under_torchrun_is_exit_2(tmp_path, base_model, prompts):  # noqa: F811
    out, needle = tmp_path / "run", "--scale-rewards batch under torchrun"
    proc = run_cli_process([*grpo(base_model, prompts, out, 2, steps=1), "--scale-rewards", "batch"], nproc=2)
    assert proc.returncode == 1 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]  # torchrun: 1; ranks: 2
    assert needle in proc.stderr and not out.exists()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_full_mode_equals_one_process(tmp_path, base_model, prompts, parallel):  # noqa: F811
    """--mode full: each rank's frozen reference copy; DDP replicas, or FSDP2 shards whose rollouts sample from a plain
    replica given the gathered weights each round (rollout_policy); the same run as one process."""
    runs = {}
    for nproc, batch in ((1, 4), (2, 2)):
        out = tmp_path / f"n{nproc}"
        ok(run_cli_process(grpo(base_model, prompts, out, batch, extra=("--mode", "full", "--parallel", parallel)),
                           nproc=nproc))
        runs[nproc] = out
    assert json.loads((runs[2] / "run.json").read_text())["distributed"]["parallel"] == parallel
    a, b = records(runs[2]), records(runs[1])
    assert [r["reward"] for r in a] == pytest.approx([r["reward"] for r in b], rel=1e-12, abs=0)
    assert close([r["loss"] for r in a], [r["loss"] for r in b]) and a[-1]["kl"] > 0
    assert worst_rel(weights(runs[2] / "final/model.safetensors"), weights(runs[1] / "final/model.safetensors")) <= 1e-5


def test_policy_forward_through_ddp_builds_the_completion_logits_only(monkeypatch):
    """Under DDP the loss's forward goes through DDP's forward (it prepares the gradient reduction), which would
    return the logits of every position ([N, T, V] fp32: tens of GB for long tool prompts); token_logps passes the
    completion positions through it (forward's head_at) so the head sees those only, as in one process: the same
    log-probs, entropy and gradients."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from entrenar.tensors import IGNORE_INDEX
    from entrenar.train.grpo import token_logps
    from tests.helpers.models import tiny_causal_lm, tiny_config

    model = tiny_causal_lm(tiny_config(), 1)
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, 8:11] = ids[:, 9:12]
    head_rows: list[tuple] = []
    real_linear = F.linear

    def spy(x, w, *a):
        if w is model.head_weight:
            head_rows.append(tuple(x.shape[:-1]))
        return real_linear(x, w, *a)

    want, want_ent = token_logps(model, ids, labels, 0.7, entropy=True)
    want.sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        monkeypatch.setattr(F, "linear", spy)
        got, got_ent = token_logps(ddp, ids, labels, 0.7, entropy=True)
        got.sum().backward()
    finally:
        dist.destroy_process_group()
    assert head_rows == [(9,)]  # 3 rows x 3 completion tokens, not (3, 12)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7) and torch.allclose(got_ent, want_ent, rtol=1e-6, atol=1e-7)
    for p, g in zip(model.parameters(), want_grads, strict=True):
        assert torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7)
