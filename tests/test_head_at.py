"""The LM head applied at the label positions only (`CausalLM.forward(head_at=...)`, `objective.head_positions`):
an SFT batch's prompts and padding never reach the head's matmuls, at the same loss and gradients as the head over
every position."""

from __future__ import annotations

import dataclasses

import torch

from entrenar.tensors import IGNORE_INDEX
from entrenar.train.grpo import token_logps
from entrenar.train.objective import HEAD_AT_MAX_SHARE, CausalLMLoss, head_positions
from tests.helpers.models import tiny_causal_lm, tiny_config


def sft_batch(seed: int = 0, rows: int = 3, length: int = 24) -> dict:
    """Rows of a prompt (ignored), a short response (labelled) and right padding (ignored): the SFT shape."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (rows, length), generator=gen)  # tiny_config: 97 tokens
    labels = torch.full((rows, length), IGNORE_INDEX)
    for r, (start, end) in enumerate([(10, 14), (5, 8), (15, 21)][:rows]):
        labels[r, start:end] = ids[r, start + 1:end + 1]
    return {"input_ids": ids, "labels": labels}


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss, n, _ = CausalLMLoss().loss(model, batch, torch.device("cpu"))
    loss.backward()
    assert n == int((batch["labels"] != IGNORE_INDEX).sum())
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm().clamp(min=1e-30))


def test_sft_loss_and_gradients_equal_the_head_over_every_position(monkeypatch):
    model = tiny_causal_lm(tiny_config(), seed=3).float()
    batch = sft_batch()
    loss_at, grads_at = loss_and_grads(model, batch)
    monkeypatch.setattr("entrenar.train.objective.head_positions", lambda labels: None)  # the head everywhere
    loss_all, grads_all = loss_and_grads(model, batch)
    assert abs(loss_at - loss_all) <= 1e-6 * abs(loss_all)
    assert grads_at.keys() == grads_all.keys() and grads_all
    for k in grads_all:
        assert rel_l2(grads_at[k], grads_all[k]) <= 1e-6, k


def test_the_head_sees_only_the_label_rows(monkeypatch):
    model = tiny_causal_lm(tiny_config(), seed=3).float()
    batch = sft_batch()
    seen = []
    fused_ops = model.ops
    fused = fused_ops.linear_cross_entropy

    def spy(hidden, weight, labels, **kw):
        seen.append(hidden.shape[0])
        return fused(hidden, weight, labels, **kw)

    monkeypatch.setattr(type(model), "ops", property(lambda m: dataclasses.replace(fused_ops, linear_cross_entropy=spy)))
    CausalLMLoss().loss(model, batch, torch.device("cpu"))
    assert seen == [int((batch["labels"] != IGNORE_INDEX).sum())]  # 13 of 72 positions


def test_head_positions_skip_mostly_labelled_batches():
    labels = torch.arange(40).view(2, 20)
    labels[0, 0] = IGNORE_INDEX  # 39 of 40 labelled: pretraining's shape, the gather would not pay
    assert head_positions(labels) is None
    labels[:, :5] = IGNORE_INDEX  # 30 of 40 = 0.75 <= HEAD_AT_MAX_SHARE
    assert 30 / 40 <= HEAD_AT_MAX_SHARE
    at = head_positions(labels)
    assert at.tolist() == [i for i in range(40) if i % 20 >= 5]
    assert head_positions(torch.full((2, 3), IGNORE_INDEX)).numel() == 0


def test_a_batch_without_labels_gives_zero_loss_and_gradients():
    model = tiny_causal_lm(tiny_config(), seed=3).float()
    batch = sft_batch()
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    loss, grads = loss_and_grads(model, batch)
    assert loss == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_grpo_token_logps_through_forward_equal_the_full_logits():
    model = tiny_causal_lm(tiny_config(), seed=3).float()
    batch = sft_batch()
    logps, ent = token_logps(model, batch["input_ids"], batch["labels"], 0.7, entropy=True)
    logits = model(batch["input_ids"]).float() / 0.7
    full = torch.log_softmax(logits, -1).gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
    mask = batch["labels"] != IGNORE_INDEX
    assert rel_l2(logps[mask], full[mask]) <= 1e-6
    assert float(logps[~mask].abs().max()) == 0.0 and float(ent[~mask].abs().max()) == 0.0


def test_a_run_with_cuda_graphs_applies_the_head_everywhere_in_every_step(tmp_path, monkeypatch):
    """A captured step's shapes cannot follow each batch's label count, so a run with graphs turns head_at off for
    its eager steps too (warm-ups, refused shapes): the run equals an eager run with the head everywhere, bit for
    bit (with head_at left on in its eager steps, the first steps' rounding would differ)."""
    from entrenar.model import CausalLM
    from entrenar.train import cuda_graphs as cg
    from tests.helpers.graphs import ReplayedStep
    from tests.test_cuda_graphs import SAME_T, _trained

    monkeypatch.setattr(cg, "capture", lambda fn, pool: ReplayedStep(fn))
    monkeypatch.setattr(cg, "warmup", lambda fn, device: fn())
    monkeypatch.setattr(CausalLM, "_check_ids", lambda self, ids: None)
    graph_rows, graph_weights = _trained(tmp_path, "graphs", "on", steps=5, **SAME_T)
    assert CausalLMLoss.head_at  # the class default stays on: only the graph run's objective turned it off
    monkeypatch.setattr(CausalLMLoss, "head_at", False)
    eager_rows, eager_weights = _trained(tmp_path, "eager", "off", steps=5, **SAME_T)
    assert graph_rows == eager_rows
    for k, v in eager_weights.items():
        assert torch.equal(graph_weights[k], v), k
