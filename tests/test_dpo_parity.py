"""Preference objectives against TRL's DPOTrainer (trl is a test dependency): the same tiny model, the same batch,
the same beta -> the same loss, gradients and metrics.

TRL's own loss code runs: a DPOTrainer is built on a tiny transformers LlamaForCausalLM (policy) with a
reference copy, and its `_compute_loss(model, inputs)` (what `compute_loss` calls for a step) is given the batch
in TRL's collated form (chosen rows then rejected rows, attention_mask, completion_mask). Ours is
`PreferenceLoss.loss` on our CausalLM loaded from the same weights, with the batch in our pair form ([B, 2, T],
shifted labels on the response). The policy is the reference plus a perturbation, so the log-ratios are not 0
and every term of the loss matters. Pairs have prompts and responses of different lengths (padding), so a
length normalisation or a mask off by one shows.

Bounds (fp32, CPU): loss and metrics relative 1e-5 (measured <= 5.3e-7: our forward matches transformers to
~1e-6 relL2 in the logits, and a response's log-prob sums ~10 of them); every parameter's gradient relL2
<= 1e-4 (measured <= 1.1e-6; a wrong mask, normalisation or reference moves them by > 1e-2).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from entrenar.tensors import IGNORE_INDEX, rel_l2
from entrenar.train.objective import PREFERENCE_LOSSES, PreferenceLoss
from tests.helpers.models import make_hf_model

trl = pytest.importorskip("trl")

BETA = 0.2
# (prompt length, chosen length, rejected length) per pair: unequal, so padding and lengths matter
PAIRS = [(5, 4, 7), (9, 6, 2), (3, 8, 8)]
LOSS_BOUND, GRAD_BOUND = 1e-5, 1e-4


def _batch(vocab: int, seed: int = 0) -> tuple[dict, dict]:
    """(TRL's collated batch, ours) for PAIRS of random tokens (prompt shared by chosen and rejected)."""
    g = torch.Generator().manual_seed(seed)
    T = max(p + max(c, r) for p, c, r in PAIRS)
    B = len(PAIRS)
    ids = torch.zeros(2 * B, T, dtype=torch.long)
    completion = torch.zeros(2 * B, T, dtype=torch.long)
    attention = torch.zeros(2 * B, T, dtype=torch.long)
    for i, (p, c, r) in enumerate(PAIRS):
        prompt = torch.randint(3, vocab, (p,), generator=g)
        for row, n in ((i, c), (B + i, r)):
            ids[row, :p] = prompt
            ids[row, p:p + n] = torch.randint(3, vocab, (n,), generator=g)
            completion[row, p:p + n] = 1
            attention[row, :p + n] = 1
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(completion[:, 1:].bool(), ids[:, 1:], IGNORE_INDEX)
    ours = {"input_ids": torch.stack([ids[:B], ids[B:]], dim=1), "labels": torch.stack([labels[:B], labels[B:]], dim=1),
            "sample_ids": list(range(B))}
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}, ours


def _trl_trainer(policy, reference, loss_type: str, tmp_path):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(policy.config.vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", pad_token="t0")
    rows = Dataset.from_list([{"prompt": "t5 t6", "chosen": " t7", "rejected": " t8"}] * 2)  # unused: we feed batches
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, loss_type=[loss_type], report_to=[],
                         use_cpu=True, bf16=False, max_length=None, per_device_train_batch_size=2)
    return trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=rows, processing_class=tok)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF policy, HF reference, our policy, our reference): the policy is the reference perturbed."""
    from entrenar.formats import load_model

    reference = make_hf_model("llama", seed=4)
    policy = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=g))
    out = tmp_path_factory.mktemp("dpo-parity")
    policy.save_pretrained(out / "policy")
    reference.save_pretrained(out / "reference")
    ours = load_model(str(out / "policy"), dtype=torch.float32).train()
    ours_ref = load_model(str(out / "reference"), dtype=torch.float32)
    return policy.train(), reference, ours, ours_ref


@pytest.mark.parametrize("objective", sorted(PREFERENCE_LOSSES))
def test_loss_gradients_and_metrics_equal_trl(objective, models, tmp_path):
    hf_policy, hf_ref, ours, ours_ref = models
    trl_batch, our_batch = _batch(hf_policy.config.vocab_size)
    trainer = _trl_trainer(hf_policy, hf_ref, PREFERENCE_LOSSES[objective], tmp_path)
    hf_policy.zero_grad()
    trl_loss = trainer._compute_loss(hf_policy, trl_batch, False)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    obj = PreferenceLoss(objective, BETA, "frozen-copy")
    obj.reference_model = ours_ref
    ours.zero_grad()
    loss_sum, pairs, sums = obj.loss(ours, our_batch, torch.device("cpu"))
    assert pairs == len(PAIRS)
    (loss_sum / pairs).backward()
    metrics = obj.step_metrics({k: float(v) for k, v in sums.items()}, pairs)

    ours_loss, trl_value = float(loss_sum.detach()) / pairs, float(trl_loss.detach())
    assert abs(ours_loss - trl_value) <= LOSS_BOUND * abs(trl_value), (ours_loss, trl_value)
    assert not math.isclose(ours_loss, obj.uniform_loss(0), rel_tol=1e-3)  # the perturbation shows in the loss
    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
              "logps/rejected"):
        assert abs(metrics[k] - trl_metrics[k]) <= LOSS_BOUND * max(1.0, abs(trl_metrics[k])), (k, metrics[k],
                                                                                                trl_metrics[k])
    hf_grads = {n: p.grad for n, p in hf_policy.named_parameters()}
    worst = 0.0
    for name, p in ours.named_parameters():
        assert p.grad is not None and name in hf_grads, name
        worst = max(worst, rel_l2(p.grad, hf_grads[name]))
    assert worst <= GRAD_BOUND, worst


def test_step_zero_loss_is_exactly_its_start_value_with_the_reference_as_policy(models):
    """The reference equal to the policy: every log-ratio is 0, the loss ln 2 (dpo, dpo-norm) or 1/(4 beta^2) (ipo)."""
    _, _, ours, _ = models
    _, batch = _batch(ours.cfg.vocab_size, seed=1)
    for objective in PREFERENCE_LOSSES:
        obj = PreferenceLoss(objective, BETA, "frozen-copy")
        obj.bind(ours)
        with torch.no_grad():
            loss_sum, pairs, sums = obj.loss(ours, batch, torch.device("cpu"))
        assert float(loss_sum) / pairs == pytest.approx(obj.uniform_loss(0), rel=1e-7), objective
        assert float(sums["rewards/margins"]) == 0.0


def test_a_pair_without_loss_tokens_adds_nothing_and_is_not_counted(models):
    """A rank's dummy row (all labels ignored, train/distributed.slice_rows) must not add ln 2 to the loss."""
    _, _, ours, ours_ref = models
    _, batch = _batch(ours.cfg.vocab_size, seed=2)
    obj = PreferenceLoss("dpo", BETA, "frozen-copy")
    obj.reference_model = ours_ref
    with torch.no_grad():
        full, n, _ = obj.loss(ours, batch, torch.device("cpu"))
        batch["labels"][1] = IGNORE_INDEX
        part, m, _ = obj.loss(ours, batch, torch.device("cpu"))
    assert (n, m) == (3, 2) and obj.counts(batch)[:2] == (2, 1)
    keep = {"input_ids": batch["input_ids"][[0, 2]], "labels": batch["labels"][[0, 2]]}
    with torch.no_grad():
        two, _, _ = obj.loss(ours, keep, torch.device("cpu"))
    assert float(part) == pytest.approx(float(two), rel=1e-6) and float(part) < float(full)
