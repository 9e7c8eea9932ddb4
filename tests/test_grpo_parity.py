"""GRPO's loss against TRL's own: `GRPOTrainer._compute_loss` of the installed trl is called on a minimal trainer
state (the attributes its loss reads; its log-prob forward replaced by fixed log-probs that require grad), and our
`grpo_per_token_loss` + `grpo_loss_sum` must give the same loss and the same gradient w.r.t. the log-probs, within
1e-6 relative on the CPU, for each loss_type, with and without the KL term, with and without old log-probs, and
over two micro-batches of a step (the loop's normalisation). The k3 KL against a float64 reference; the
advantages against TRL's formula (group / batch / none); the tempered token log-probs and entropies against trl's
selective_log_softmax and entropy_from_logits.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from entrenar.train.grpo import (
    LOSS_TYPES,
    group_advantages,
    grpo_loss_sum,
    grpo_per_token_loss,
    per_token_kl,
    token_logps,
)

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = trl_grpo.GRPOTrainer
MAX_LEN = 7  # max_completion_length


class _Accelerator:
    num_processes = 1
    process_index = 0
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *, loss_type: str, beta: float,
             old: torch.Tensor | None, ref: torch.Tensor | None, eps_low: float = 0.2, eps_high: float = 0.28,
             grad_accum: int = 1, num_items: float | None = None) -> torch.Tensor:
    """TRL's GRPOTrainer._compute_loss on a state holding only what the loss reads."""
    N = logps.shape[0]
    entropies = torch.rand(logps.shape, generator=torch.Generator().manual_seed(5))
    source = inspect.getsource(GRPOTrainer._compute_loss)

    three = "entropies, aux_loss" in source  # newer trl: (logps, entropies, aux_loss)

    def forward(*args, **kwargs):
        return (logps, entropies, None) if three else (logps, entropies)

    state = SimpleNamespace(
        _get_per_token_logps_and_entropies=forward, aux_loss_enabled=False, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, vllm_importance_sampling_correction=False,
                             steps_per_generation=grad_accum),  # a step's rollouts: its micro-batches (TRL default)
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum, max_completion_length=MAX_LEN, accelerator=_Accelerator(),
        _entropy_bonus_enabled=False, entropy_coef=0.0, _metrics={"train": defaultdict(list),
                                                                    "eval": defaultdict(list)},
        mask_truncated_completions=False)
    inputs = {"prompt_ids": torch.ones(N, 3, dtype=torch.long), "prompt_mask": torch.ones(N, 3, dtype=torch.long),
              "completion_ids": torch.ones(mask.shape, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": advantages,
              "num_items_in_batch": torch.tensor(float(mask.sum()) if num_items is None else num_items)}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return GRPOTrainer._compute_loss(state, None, inputs)


def case(seed: int, N: int = 6, T: int = MAX_LEN) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(N, T, generator=g) * 3
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    # old log-probs within and beyond the clip range of both signs; a reference further away
    old = logps + (torch.rand(N, T, generator=g) - 0.5) * 0.8
    ref = logps + (torch.rand(N, T, generator=g) - 0.5) * 2.0
    adv = torch.randn(N, generator=g)
    return {"logps": logps, "mask": mask, "old": old, "ref": ref, "adv": adv}


def ours(logps, mask, adv, *, loss_type, beta, old, ref, eps_low=0.2, eps_high=0.28):
    per_token, _, _ = grpo_per_token_loss(logps, logps.detach() if old is None else old, adv, ref, beta, eps_low,
                                          eps_high)
    return grpo_loss_sum(per_token, mask, loss_type, MAX_LEN)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_old", [False, True], ids=["one-iteration", "old-logps"])
def test_loss_and_gradient_equal_trl(loss_type, beta, with_old):
    c = case(11)
    old = c["old"] if with_old else None
    ref = c["ref"] if beta else None
    a = c["logps"].clone().requires_grad_(True)
    s, units = ours(a, c["mask"], c["adv"], loss_type=loss_type, beta=beta, old=old, ref=ref)
    loss = s / units
    loss.backward()
    b = c["logps"].clone().requires_grad_(True)
    expected = trl_loss(b, c["mask"], c["adv"], loss_type=loss_type, beta=beta, old=old, ref=ref)
    expected.backward()
    assert rel(loss.detach(), expected.detach()) <= 1e-6, (float(loss), float(expected))
    assert rel(a.grad, b.grad) <= 1e-6
    assert b.grad.abs().sum() > 0  # a loss that moves the log-probs


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_micro_batches_are_trls_step(loss_type):
    """The loop divides the step's summed loss sums by its summed units: over two micro-batches that is TRL's loss of
    a step with gradient accumulation 2 (grpo, bnpo, dr_grpo: each micro-batch's loss / 2; dapo: / the step's
    tokens), value and gradient."""
    c = case(3, N=8)
    halves = [slice(0, 4), slice(4, 8)]
    a = c["logps"].clone().requires_grad_(True)
    sums = [ours(a[h], c["mask"][h], c["adv"][h], loss_type=loss_type, beta=0.04, old=c["old"][h], ref=c["ref"][h])
            for h in halves]
    total = sum(s for s, _ in sums) / sum(u for _, u in sums)
    total.backward()
    b = c["logps"].clone().requires_grad_(True)
    expected = sum(trl_loss(b[h], c["mask"][h], c["adv"][h], loss_type=loss_type, beta=0.04, old=c["old"][h],
                            ref=c["ref"][h], grad_accum=2, num_items=float(c["mask"].sum())) for h in halves)
    expected.backward()
    assert rel(total.detach(), expected.detach()) <= 1e-6
    assert rel(a.grad, b.grad) <= 1e-6


def test_clip_higher_equals_trl():
    c = case(21)
    a = c["logps"].clone().requires_grad_(True)
    s, u = ours(a, c["mask"], c["adv"], loss_type="dapo", beta=0.0, old=c["old"], ref=None, eps_low=0.1, eps_high=0.4)
    (s / u).backward()
    b = c["logps"].clone().requires_grad_(True)
    trl_loss(b, c["mask"], c["adv"], loss_type="dapo", beta=0.0, old=c["old"], ref=None, eps_low=0.1,
             eps_high=0.4).backward()
    assert rel(a.grad, b.grad) <= 1e-6


def test_kl_is_k3_in_float64():
    c = case(7)
    kl = per_token_kl(c["logps"], c["ref"])
    d = c["ref"].double() - c["logps"].double()
    reference = torch.exp(d) - d - 1
    assert rel(kl, reference) <= 1e-6
    assert (kl >= 0).all() and float(per_token_kl(c["logps"], c["logps"]).abs().max()) == 0.0
    # k3 is an unbiased estimator of KL(policy || reference): its mean under samples of the policy is the KL
    g = torch.Generator().manual_seed(0)
    p, q = torch.softmax(torch.randn(16, generator=g, dtype=torch.float64), 0), \
        torch.softmax(torch.randn(16, generator=g, dtype=torch.float64), 0)
    exact = float((p * (p.log() - q.log())).sum())
    via_k3 = float((p * per_token_kl(p.log(), q.log())).sum())
    assert via_k3 == pytest.approx(exact, rel=1e-12)


def trl_advantages(rewards: torch.Tensor, G: int, scale: str) -> torch.Tensor:
    """TRL's _generate_and_score_completions, sum_then_normalize (transcribed: it is not callable alone)."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    return adv / (std + 1e-4) if scale != "none" else adv


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_formula(scale):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 0.0, 3.0])
    adv, std = group_advantages(rewards, 4, scale)
    assert torch.allclose(adv, trl_advantages(rewards, 4, scale), rtol=1e-6, atol=1e-7)
    assert float(std[1]) == 0.0 and float(adv[4:8].abs().max()) == 0.0  # a group without spread: no signal


def test_token_logps_and_entropy_equal_trls_tempered():
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=g)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, :2] = -100

    class Head(torch.nn.Module):
        def forward(self, ids):
            return logits

    lp, ent = token_logps(Head(), torch.zeros(3, 5, dtype=torch.long), labels, 0.7, entropy=True)
    expected = selective_log_softmax(logits / 0.7, labels.clamp(min=0))
    keep = labels != -100
    assert rel(lp[keep], expected[keep]) <= 1e-6 and float(lp[~keep].abs().max()) == 0.0
    assert rel(ent[keep], entropy_from_logits(logits / 0.7)[keep]) <= 1e-6 and float(ent[~keep].abs().max()) == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_objective_loss_on_a_model_equals_trl(loss_type):
    """GRPOObjective.loss on a rollout batch (prompt + completion rows, the rollout's old and reference log-probs)
    through a tiny model: loss and every parameter gradient equal TRL's _compute_loss given the same model's
    tempered log-probs of the completion tokens."""
    from entrenar.train.grpo import ROLLOUT_SUMS, GRPOObjective
    from tests.helpers.models import tiny_causal_lm, tiny_config

    torch.manual_seed(0)
    N, T = 4, MAX_LEN
    model = tiny_causal_lm(tiny_config(), 3)
    ids = torch.randint(0, 97, (N, T))
    labels = torch.full((N, T), -100)
    for r, (p, c) in enumerate([(2, 4), (3, 3), (2, 2), (1, 5)]):  # prompt and completion lengths
        labels[r, p - 1:p - 1 + c] = ids[r, p:p + c]
    with torch.no_grad():
        base = token_logps(model, ids, labels, 0.7)[0]
    mask = labels != -100
    old = torch.where(mask, base + (torch.rand(N, T) - 0.5) * 0.6, torch.zeros(()))
    ref = torch.where(mask, base + (torch.rand(N, T) - 0.5) * 1.5, torch.zeros(()))
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1])
    batch = {"input_ids": ids, "labels": labels, "advantages": adv, "old_logps": old, "ref_logps": ref,
             "rollout": torch.zeros(len(ROLLOUT_SUMS), dtype=torch.float64)}
    obj = GRPOObjective(None, SimpleNamespace(names=[], weights=[]), mode="full", beta=0.04, temperature=0.7,
                        max_new_tokens=MAX_LEN, epsilon=0.2, epsilon_high=0.28, loss_type=loss_type)
    s, units, metrics = obj.loss(model, batch, torch.device("cpu"))
    assert units == obj.counts(batch)[0]
    (s / units).backward()
    ours_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logps = token_logps(model, ids, labels, 0.7)[0]
    trl_loss(logps, mask, adv, loss_type=loss_type, beta=0.04, old=old, ref=ref).backward()
    assert rel((s / units).detach(), trl_loss(logps.detach(), mask, adv, loss_type=loss_type, beta=0.04, old=old,
                                              ref=ref)) <= 1e-6
    for n, p in model.named_parameters():
        assert rel(ours_grads[n], p.grad) <= 1e-6, n
    kl = per_token_kl(base.double(), ref.double())
    assert float(metrics["_kl"]) == pytest.approx(float((kl * mask).sum()), rel=1e-6)


def test_completion_only_head_equals_the_full_forward():
    """token_logps applies our model's head to the completion positions only: the same log-probs, entropies and
    gradients as from the forward's logits of every position."""
    from tests.helpers.models import tiny_causal_lm, tiny_config

    model = tiny_causal_lm(tiny_config(), 1)
    ids = torch.randint(0, 97, (3, 9), generator=torch.Generator().manual_seed(4))
    labels = torch.full((3, 9), -100)
    labels[0, 2:6], labels[1, 4:8], labels[2, 0:3] = ids[0, 3:7], ids[1, 5:9], ids[2, 1:4]

    class Forward(torch.nn.Module):  # the model seen through its forward only
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x)

    fast, ent_fast = token_logps(model, ids, labels, 0.8, entropy=True)
    fast.sum().backward()
    g_fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full, ent_full = token_logps(Forward(model), ids, labels, 0.8, entropy=True)
    full.sum().backward()
    assert rel(fast.detach(), full.detach()) <= 1e-6 and rel(ent_fast, ent_full) <= 1e-6
    assert all(rel(a, p.grad) <= 1e-6 for a, p in zip(g_fast, model.parameters(), strict=True))
