"""Tests that kill the mutants the suite let live (issue 16 item 5).

``tools/mutants.py --operators`` applies one-operator mutants (+/-, *//, </<=, constants, and/or,
dropped calls) to the numerically critical functions listed in tools/mutation_targets.yaml. Each test
here is named after the survivor it kills; the mutant is quoted in its docstring, and each was run
red against that mutant (``tools/mutants.py --operators --target NAME``).
"""

from __future__ import annotations

import pytest
import torch

from entrenar.generate import sample_next
from tests.helpers.models import tiny_causal_lm, tiny_config


# ---- generation sampling (src/entrenar/generate.py: sample_next) -------------------------------------
def _draws(logits: torch.Tensor, temperature: float, top_p: float, n: int = 300) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return [sample_next(logits, temperature, top_p, gen) for _ in range(n)]


def test_temperature_divides_the_logits():
    """Mutant: ``logits / temperature`` -> ``logits * temperature``. A low temperature must sharpen the
    distribution (all draws are the argmax), a high one flatten it (every token drawn)."""
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert set(_draws(logits, 0.02, 1.0)) == {3}
    hot = _draws(logits, 50.0, 1.0)
    assert set(hot) == {0, 1, 2, 3}
    # at temperature 50 the probabilities are within 6% of uniform: no token takes half the draws
    assert max(hot.count(i) for i in range(4)) < 0.4 * len(hot)


def test_temperature_sampling_follows_softmax_of_scaled_logits():
    """At temperature 2 the draw frequencies match softmax(logits / 2) (not softmax(logits * 2))."""
    logits = torch.tensor([0.0, 1.0, 2.0])
    n = 4000
    draws = _draws(logits, 2.0, 1.0, n)
    want = torch.softmax(logits / 2.0, dim=-1)
    got = torch.tensor([draws.count(i) / n for i in range(3)])
    assert torch.allclose(got, want, atol=0.03), (got, want)


def test_top_p_excludes_a_token_whose_preceding_mass_already_reaches_p():
    """Mutant: ``before >= top_p`` -> ``before > top_p``. Two equally likely tokens (0.5 each, exact in
    binary) and top_p 0.5: the nucleus is the first token alone, so every draw is the same token."""
    draws = _draws(torch.zeros(2), 1.0, 0.5, 200)
    assert len(set(draws)) == 1


# ---- schedule and optimizer groups (src/entrenar/train/optim.py) -------------------------------------
def test_every_trainable_parameter_is_optimized_once_and_1d_ones_without_decay():
    """Mutant: the no-decay group dropped from param_groups -- norms and biases would never train."""
    from entrenar.config import ModelConfig
    from entrenar.model import CausalLM
    from entrenar.train.optim import build_optimizer

    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                 num_kv_heads=1, attention_bias=True, architecture="qwen2"))
    opt = build_optimizer(model, 1e-3, 0.1)
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    for g in opt.param_groups:
        assert g["weight_decay"] == (0.1 if g["params"][0].dim() >= 2 else 0.0)


def test_warmup_reaches_the_peak_exactly_and_never_passes_it():
    """Mutants: ``step < warmup`` -> ``<=`` (step `warmup` gets (w+1)/w x peak) and ``warmup > 0`` ->
    ``warmup > 1`` (a one-step warmup starts below the peak)."""
    from entrenar.train.optim import Schedule

    s = Schedule(1.0, warmup=4, total=20, kind="cosine", min_ratio=0.1)
    lrs = [s.lr_at(i) for i in range(21)]
    assert lrs[4] == 1.0 and max(lrs) == 1.0
    assert Schedule(1.0, warmup=1, total=20).lr_at(0) == 1.0


def test_cosine_and_linear_differ_between_their_end_points():
    """Mutant: ``kind == "linear"`` -> ``!=`` swaps the two decays; they agree at 0, 1/2 and 1 of the
    decay, so only a point like 1/4 tells them apart (cosine 0.854, linear 0.75)."""
    import math

    from entrenar.train.optim import Schedule

    cos = Schedule(1.0, warmup=0, total=100, kind="cosine", min_ratio=0.0)
    lin = Schedule(1.0, warmup=0, total=100, kind="linear", min_ratio=0.0)
    assert cos.lr_at(25) == 0.5 * (1 + math.cos(math.pi / 4))
    assert lin.lr_at(25) == 0.75


def test_schedule_with_no_decay_steps_stays_finite():
    """Mutant: ``max(1, total - warmup)`` -> ``max(0, ...)``: total == warmup divides by zero after warmup."""
    from entrenar.train.optim import Schedule

    s = Schedule(1.0, warmup=10, total=10, min_ratio=0.1)
    assert s.lr_at(10) == 1.0 and s.lr_at(11) == 0.1


# ---- guards (src/entrenar/train/guards.py) -----------------------------------------------------------
def test_nonfinite_verdict_needs_both_loss_and_grad_norm_finite():
    """Mutant: ``isfinite(loss) and isfinite(grad_norm)`` -> ``or``: a NaN loss with a finite gradient
    norm (or the reverse) would be applied as an ordinary update."""
    from entrenar.train.guards import check_nonfinite

    assert check_nonfinite(1.0, 2.0, "stop") == "ok"
    assert check_nonfinite(float("nan"), 2.0, "stop") == "stop"
    assert check_nonfinite(1.0, float("inf"), "skip") == "skip"


def test_exploded_weights_threshold_is_a_factor_over_the_start():
    """Mutants: ``top > EXPLODED_FACTOR * reference`` -> ``>=`` or ``/ reference``, and ``reference > 0``
    -> ``>= 0`` (a zero start would call every later weight exploded)."""
    import torch

    from entrenar.train.guards import EXPLODED_FACTOR, weights_problem

    ref = 0.01
    at_limit = torch.tensor([EXPLODED_FACTOR * ref])
    assert weights_problem([at_limit], ref) is None  # exactly the factor: not yet exploded
    assert "exploded" in weights_problem([at_limit * 2], ref)  # 2000x the start (not 1000 / 0.01 = 1e5)
    assert weights_problem([torch.tensor([5.0])], 0.0) is None  # no reference scale: cannot judge


def test_eval_collapse_boundaries_are_inclusive():
    """Mutants: ``best > WELL_BELOW * uniform`` -> ``>=`` and ``eval < COLLAPSED * uniform`` -> ``<=``.
    The guard fires when the best eval was at most WELL_BELOW x ln V and the eval is at least COLLAPSED x ln V."""
    import math

    import pytest

    from entrenar.errors import GuardError
    from entrenar.train.guards import COLLAPSED, WELL_BELOW, check_eval_collapse

    uniform = math.log(100)
    with pytest.raises(GuardError, match="GUARD-EVAL-COLLAPSE|back at ln"):
        check_eval_collapse(COLLAPSED * uniform, WELL_BELOW * uniform, uniform, step=7)
    check_eval_collapse(COLLAPSED * uniform * 0.999, WELL_BELOW * uniform, uniform, step=7)  # not yet collapsed


def test_init_loss_equal_to_ln_vocab_is_no_better_than_uniform():
    """Mutant: ``eval_loss >= uniform`` -> ``>``: a step-0 loss of exactly ln V (a uniform model) passed."""
    import math

    import pytest

    from entrenar.errors import GuardError
    from entrenar.train.guards import check_init_loss

    with pytest.raises(GuardError):
        check_init_loss(math.log(1000), math.log(1000), "m")
    check_init_loss(math.log(1000) * 0.99, math.log(1000), "m")


def test_spike_zscore_uses_the_sample_std_from_min_history_values_on():
    """Mutants: ``len(values) < min_history`` -> ``<=`` (scoring starts one value late) and the sample
    variance's ``n - 1`` -> ``n + 1`` (z-scores inflated, ordinary steps become spikes)."""
    import math
    import statistics

    import pytest

    from entrenar.train.guards import SpikeDetector

    d = SpikeDetector("loss", window=8, sigma=6.0, min_history=3)
    for v in (1.0, 3.0):
        assert d.update(v) is None
    assert d.zscore(5.0) is None  # two values: no score yet
    d.update(2.0)
    values = [1.0, 3.0, 2.0]
    assert d.zscore(5.0) == pytest.approx((5.0 - 2.0) / statistics.stdev(values))
    assert math.isclose(d.zscore(2.0), 0.0, abs_tol=1e-12)


def test_spike_std_floor_is_a_thousandth_of_the_mean():
    """Mutants: the std floor ``1e-3 * abs(mean)`` -> ``1e-3 / abs(mean)`` or ``2e-3 * ...``. A flat
    history of 2.0 floors the std at 0.002: +0.011 (5.5 sigma) is no spike, +0.013 (6.5 sigma) is."""
    from entrenar.train.guards import SpikeDetector

    def flat() -> SpikeDetector:
        d = SpikeDetector("loss", window=32, sigma=6.0, min_history=16)
        for _ in range(16):
            d.update(2.0)
        return d

    assert flat().update(2.011) is None
    assert flat().update(2.013) is not None


def test_spike_is_more_than_sigma_not_equal():
    """Mutant: ``z > sigma`` -> ``>=``. History -1, -1, 1, 1, 0 has mean 0 and sample std 1 exactly, so 6.0
    is exactly 6 sigma: not a spike (it joins the window); 6.5 is."""
    from entrenar.train.guards import SpikeDetector

    d = SpikeDetector("loss", window=32, sigma=6.0, min_history=5)
    for v in (-1.0, -1.0, 1.0, 1.0, 0.0):
        d.update(v)
    assert d.zscore(6.0) == 6.0
    assert d.update(6.0) is None and len(d.values) == 6


def _guard(min_history: int = 3):
    from entrenar.train.guards import SpikeGuard

    return SpikeGuard("warn", window=32, sigma=6.0, min_history=min_history)


def test_early_spike_phase_uses_the_first_train_loss_as_reference():
    """Mutants: ``if not self.first_seen`` -> ``if self.first_seen`` and the ``set_reference(loss)`` call
    dropped: without a reference the early phase sees nothing (a step-1 blow-up passes)."""
    g = _guard()
    assert g.check(2.0, 1.0, 1, [])[0] == "ok"
    verdict, msg = g.check(5.0, 1.0, 2, [])
    assert verdict == "warn" and "starting loss" in msg


def test_early_spike_reference_must_be_positive():
    """Mutants: ``self.reference > 0`` -> ``>= 0`` (a zero starting loss makes every loss a spike) and
    ``> 1`` (a starting loss below 1 disables the early check)."""
    g = _guard()
    assert g.check(0.0, 1.0, 1, [])[0] == "ok" and g.check(0.1, 1.0, 2, [])[0] == "ok"
    g = _guard()
    g.check(0.5, 1.0, 1, [])
    assert g.check(1.2, 1.0, 2, [])[0] == "warn"  # 2.4x a starting loss of 0.5


def test_early_phase_ends_when_the_window_holds_min_history_losses():
    """Mutant: ``len(values) < min_history`` -> ``<=`` in SpikeGuard.check: the early (starting-loss)
    rule would still judge the step after the window is full; the z-score must."""
    g = _guard(min_history=3)
    for step in range(3):
        assert g.check(2.0, 1.0, step, [])[0] == "ok"
    verdict, msg = g.check(4.5, 1.0, 3, [])
    assert verdict == "warn" and "sigma" in msg and "starting loss" not in msg


def test_early_spike_is_above_twice_the_starting_loss_not_at_it():
    """Mutant: ``loss > early_factor * reference`` -> ``>=``: exactly 2x the starting loss is no spike."""
    g = _guard()
    g.check(2.0, 1.0, 1, [])
    assert g.check(4.0, 1.0, 2, [])[0] == "ok"
    assert g.check(4.01, 1.0, 3, [])[0] == "warn"


# ---- the training step's loss normalisation and the eval (src/entrenar/train/loop.py) ------------------
def _tiny_lm():
    return tiny_causal_lm(tiny_config(vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                      num_kv_heads=1), 0)


def _batches() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for rows, length in ((2, 7), (1, 11), (3, 5)):
        ids = torch.randint(0, 50, (rows, length), generator=g)
        labels = torch.full_like(ids, -100)
        labels[:, :-1] = ids[:, 1:]
        labels[0, :2] = -100  # unequal loss-token counts per row and per batch
        out.append({"input_ids": ids, "labels": labels})
    return out


def test_step_gradients_are_those_of_the_token_mean_loss():
    """Mutant: each micro-batch backpropagates ``loss_sum * total_tokens`` instead of ``/ total_tokens``.
    AdamW is nearly scale-invariant and clipping rescales, so training curves hide it; the gradients
    themselves (and the logged grad norm) must be those of sum(loss) / tokens of the whole step."""
    from entrenar.train.loop import backward_micro_batches
    from entrenar.train.objective import CausalLMLoss

    micro = _batches()
    tokens = sum(CausalLMLoss().count(b) for b in micro)
    model = _tiny_lm()
    summed = backward_micro_batches(model, micro, torch.device("cpu"), "fp32", tokens)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = _tiny_lm()
    total = sum(ref(b["input_ids"], labels=b["labels"])[0] for b in micro)
    (total / tokens).backward()
    assert float(summed) == pytest.approx(float(total.detach()), rel=1e-6)
    for n, p in ref.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=1e-7), n


def test_evaluate_is_the_token_weighted_mean_over_exactly_max_batches():
    """Mutants in evaluate: the token count or batch count starting at 1, ``n_batches -= 1``, and
    ``i >= max_batches`` -> ``>`` (one batch too many)."""
    from entrenar.train.loop import evaluate

    model, micro = _tiny_lm(), _batches()
    with torch.no_grad():
        sums = [float(model(b["input_ids"], labels=b["labels"])[0]) for b in micro]
        counts = [int((b["labels"] != -100).sum()) for b in micro]
    ev = evaluate(model, micro, max_batches=2)
    assert ev["batches"] == 2 and ev["tokens"] == counts[0] + counts[1]
    assert ev["loss"] == pytest.approx((sums[0] + sums[1]) / (counts[0] + counts[1]), rel=1e-9)
    full = evaluate(model, micro)
    assert full["batches"] == 3 and full["tokens"] == sum(counts)


class _ModeLoss(torch.nn.Module):
    """A model whose per-token loss is 1 in eval mode and 9 in train mode (as dropout would differ)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids, labels=None, position_ids=None, doc_ids=None):
        n = (labels != -100).sum()
        return self.w * (9.0 if self.training else 1.0) * n, n


def test_evaluate_runs_in_eval_mode_and_restores_the_mode():
    """Mutants: ``model.eval()`` dropped (eval with dropout on) and ``model.train(was_training)`` dropped
    (training continues in eval mode: dropout silently off)."""
    from entrenar.train.loop import evaluate

    m = _ModeLoss().train()
    assert evaluate(m, _batches())["loss"] == 1.0
    assert m.training
    assert evaluate(m.eval(), _batches())["loss"] == 1.0 and not m.training


def _metrics(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _grad_norms_at_update(monkeypatch) -> list[float]:
    """Record the total gradient norm AdamW sees at each update (after clipping)."""
    seen: list[float] = []
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return seen


def test_clip_bounds_the_gradient_the_optimizer_sees(tmp_path, monkeypatch):
    """Mutant: ``clip > 0`` -> ``clip > 1``: --clip 1.0 (or any clip <= 1) silently stops clipping. AdamW
    hides gradient scale, so the check is on the gradients at the update, not on the weights."""
    from tests.test_train_loop import run

    seen = _grad_norms_at_update(monkeypatch)
    result = run(tmp_path / "clip", 3, clip=0.05)
    assert len(seen) == 3 and max(seen) <= 0.05 * (1 + 1e-4), seen
    assert result is not None


def test_clip_zero_means_no_clipping(tmp_path, monkeypatch):
    """Mutant: ``clip > 0`` -> ``clip >= 0``: --clip 0 (documented: off) would clip every gradient to zero."""
    from tests.test_train_loop import run

    seen = _grad_norms_at_update(monkeypatch)
    run(tmp_path / "noclip", 3, clip=0.0)
    logged = [r["grad_norm"] for r in _metrics(tmp_path / "noclip")]
    assert len(seen) == 3 and min(seen) > 0
    assert seen == pytest.approx(logged, rel=1e-5)


# ---- SFT label runs (src/entrenar/data/sft.py) -----------------------------------------------------------
def test_assistant_runs_include_a_run_that_reaches_the_end():
    """Mutant: the final ``runs.append((start, len(mask)))`` dropped: a trailing run is lost."""
    from entrenar.data.sft import assistant_runs

    assert assistant_runs([False, True, True, False, True]) == [(1, 3), (4, 5)]
    assert assistant_runs([True, True]) == [(0, 2)]
    assert assistant_runs([]) == []


# ---- LoRA init, dropout, dtypes and merge (src/entrenar/peft/lora.py) --------------------------------------
def _lora(base: torch.nn.Linear, **kw):
    from entrenar.peft.lora import LoRALinear

    return LoRALinear(base, rank=kw.pop("rank", 8), alpha=kw.pop("alpha", 16.0),
                      generator=torch.Generator().manual_seed(0), **kw)


def test_lora_a_init_is_kaiming_uniform_with_a_sqrt5_like_peft():
    """Mutant: ``a=math.sqrt(5)`` -> ``sqrt(6)``: A's init bound must be 1/sqrt(in_features) (nn.Linear's
    and peft's), not 0.93x that."""
    import math

    layer = _lora(torch.nn.Linear(64, 32), rank=16)
    bound = 1 / math.sqrt(64)
    top = float(layer.lora_A.weight.detach().abs().max())
    assert 0.97 * bound < top <= bound
    assert torch.count_nonzero(layer.lora_B.weight) == 0


def test_lora_dropout_is_applied_in_training_only():
    """Mutant: ``nn.Dropout(dropout) if dropout > 0`` -> ``> 1``: --lora-dropout 0.5 silently ignored."""
    layer = _lora(torch.nn.Linear(16, 16), dropout=0.5)
    with torch.no_grad():
        layer.lora_B.weight.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(4, 16)
    torch.manual_seed(0)
    a, b = layer.train()(x), layer(x)
    assert not torch.equal(a, b)
    assert torch.equal(layer.eval()(x), layer(x))


def test_lora_over_a_bf16_base_runs_without_autocast():
    """Mutant: ``if not torch.is_autocast_enabled(...)`` -> ``if ...enabled``: bf16 activations would meet
    the fp32 adapter matrices outside autocast (a dtype error)."""
    layer = _lora(torch.nn.Linear(16, 8).to(torch.bfloat16))
    y = layer(torch.randn(3, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 8)


def test_merge_keeps_the_base_dtype_and_freezes_the_merged_weights():
    """Mutants in merge_in_place: ``dtype or base dtype`` -> ``and`` (a bf16 model merged into fp32
    linears) and ``requires_grad_(False)`` dropped / True."""
    from entrenar.peft.lora import merge_in_place

    model = torch.nn.Sequential(_lora(torch.nn.Linear(16, 8).to(torch.bfloat16)))
    assert merge_in_place(model) == 1
    lin = model[0]
    assert type(lin) is torch.nn.Linear and lin.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in lin.parameters())


def test_merge_onto_original_without_the_weight_is_an_input_error():
    """Mutant: ``original is None or name not in original`` -> ``and``: a missing 16-bit weight would be
    a KeyError traceback instead of an InputError (exit 2) naming it."""
    import pytest as _pytest

    from entrenar.errors import InputError
    from entrenar.peft.lora import base_weight
    from entrenar.peft.nf4_linear import NF4Linear

    base = NF4Linear(torch.nn.Linear(64, 64))
    with _pytest.raises(InputError, match="layers.0.q_proj"):
        base_weight(base, "layers.0.q_proj", "original", {})
    with _pytest.raises(InputError):
        base_weight(base, "layers.0.q_proj", "original", None)


# ---- NF4 (src/entrenar/kernels/nf4.py) ---------------------------------------------------------------------
def test_nf4_zero_block_stores_the_zero_code():
    """Mutant: ``absmax == 0`` -> ``== 1`` in _codes: an all-zero block divides 0/0 and stores code 15 (1.0)
    instead of the code of 0.0 (its values still dequantize to 0, but the codes differ from bitsandbytes')."""
    from entrenar.kernels import nf4

    w = torch.zeros(4, 64)
    w[1] = torch.linspace(-1, 1, 64)
    codes = nf4.unpack_codes(nf4.quantize(w)).view(4, 64)
    zero_code = int(torch.argmin(nf4.nf4_table().abs()))
    assert torch.all(codes[0] == zero_code) and torch.all(codes[2:] == zero_code)


def test_nf4_value_on_a_midpoint_takes_the_lower_level():
    """Mutant: ``bucketize(..., right=False)`` -> ``right=True``: a value exactly between two NF4 levels
    must take the lower one (argmin's tie rule, as bitsandbytes), not the upper."""
    from entrenar.kernels import nf4

    table = nf4.nf4_table()
    mid = (table[1:] + table[:-1]) / 2
    block = torch.zeros(64)
    block[0] = 1.0  # absmax 1: values are their own scaled values
    block[1:16] = mid
    codes = nf4.unpack_codes(nf4.quantize(block))
    assert codes[1:16].tolist() == list(range(15))


def test_nf4_flat_scale_groups_store_a_finite_factor():
    """Mutant: ``group_absmax == 0`` -> ``== 1`` in double_quantize_scales: a group of equal block scales
    would store the factor 128 / 0 = inf (and NaN int8 scales)."""
    from entrenar.kernels import nf4

    w = torch.ones(4, 64) * torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None]
    q = nf4.quantize(w)
    assert torch.isfinite(q.factor).all()
    assert torch.equal(nf4.dequantize_reference(q), w)


def test_eval_anomaly_thresholds():
    """Mutants in check_eval_anomaly: ``eval < ratio * train`` -> ``<=`` or ``ratio / train``, the
    ``train > 0`` guard -> ``> 1`` (no check for train losses below 1), and ``ppl < min_ppl`` -> ``<=``."""
    import pytest as _pytest

    from entrenar.errors import GuardError
    from entrenar.train.guards import check_eval_anomaly

    check_eval_anomaly(0.2, 2.0, step=1)  # exactly 0.1 x train: not below it
    with _pytest.raises(GuardError, match="recent train loss"):
        check_eval_anomaly(0.1, 2.0, step=1)  # 0.05 x train (ratio / train would be 0.05: not caught)
    with _pytest.raises(GuardError, match="recent train loss"):
        check_eval_anomaly(0.05, 0.8, step=1)  # a train loss below 1 is still compared
    check_eval_anomaly(0.0, None, step=1, min_ppl=1.0)  # perplexity exactly min_ppl: not below it
    with _pytest.raises(GuardError, match="recent train loss"):
        check_eval_anomaly(0.0, 5.0, step=1, min_ppl=1.0)  # named by the ratio, not by the perplexity
