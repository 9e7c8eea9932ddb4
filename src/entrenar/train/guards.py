"""Training guards (IDs from docs/design.md). Each raises GuardError naming cause and remedy.

- GUARD-NONFINITE        loss or gradient norm is NaN/inf; also a non-finite eval loss, or weights
                         that are non-finite or exploded when a checkpoint or final/ would be written
- GUARD-INIT-LOSS        a pretrained start is no better than a uniform guess at step 0
- GUARD-ZERO-LOSS-TOKENS a step with no loss tokens (never averaged in as 0)
- GUARD-SPIKE            rolling z-score of loss / grad-norm over a window (grad-norm only for GRPO's surrogate)
- GUARD-EVAL-ANOMALY     eval loss implausibly far below train loss, or perplexity ~1
- GUARD-EVAL-COLLAPSE    eval loss back at ln(vocab) after having been well below it
- GUARD-EVAL-DIVERGED    eval loss far above the run's best eval: training destroyed the model
- GUARD-INIT-LOSS of a preference objective: the step-0 loss is not its value at policy = reference (ln 2)
- GUARD-PREF-MARGINS     (warning) preference reward margins running away past where the loss has a gradient
- GUARD-PREF-ACCURACY    (warning) preference accuracy stuck at 0.5 while the loss falls
- GUARD-PREF-NO-GRADIENT a dpo/dpo-norm run's first gradient below the optimizer's floor: --beta so small that
                         nothing trains (issue 38 item 11)
- GUARD-TASK-REGRESSION  the --eval-task metric dropped from step 0, significant by the paired exact McNemar test
- GUARD-PREF-CHOSEN-DIVERGED  a preference run's eval NLL per token of the chosen responses far above its best:
                         the pairs separate while the policy forgets the language (issue 38 item 5)
- GUARD-TRAIN-DIVERGED   a run without an eval set: its smoothed train loss far above its best (issue 38 item 5)
- GUARD-END-WORSE        (warning, in the summary's "warnings") a run that ends worse than it started
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import GuardError

NONFINITE_POLICIES = ("stop", "skip")
SPIKE_POLICIES = ("warn", "skip", "stop")
TASK_REGRESSION_POLICIES = ("warn", "stop")
# Weights whose largest magnitude grew this many times over the run's start are "exploded": an
# --lr 1e20 step leaves finite weights of ~1e20 that give NaN one step later, and a checkpoint of
# them is not a good one to resume from. Ordinary training moves the largest weight by far less.
EXPLODED_FACTOR = 1000.0
# GUARD-EVAL-COLLAPSE: the best eval so far was at most WELL_BELOW x ln(vocab), and now an eval is
# at least COLLAPSED x ln(vocab) (uniform prediction; --lr 1e6 took 0.586 -> 10.8027 = ln 49152), but
# not more than DIVERGED_MIN_RISE above it.
WELL_BELOW = 0.8
COLLAPSED = 0.98
# GUARD-EVAL-DIVERGED: an eval above best + max(DIVERGED_MIN_RISE, DIVERGED_GAP_FRACTION x (ln V - best)),
# best = the lowest eval of the run so far (step 0 included). The eval set is the same at every eval, so
# a rise comes from the weights alone: the destroyed runs of issue 28 rose by 8.5 (LoRA --lr 0.5 on
# SmolLM2: 0.9995 -> 9.51, ln V 10.80), 95 and 866 nats, while over-training only overfits (a tiny model,
# 100 epochs of 6 samples: 2.0 nats above its best, so a flat 1-nat rise would stop it). Half of the
# advantage over a uniform guess lost (more than halfway back to ln V) is a model that no longer knows
# what it knew; 1 nat (perplexity x2.7) is the floor where that advantage is small (a from-scratch start
# at ~ln V, a barely trained model). Measurements: docs/design.md, Guards.
DIVERGED_MIN_RISE = 1.0
DIVERGED_GAP_FRACTION = 0.5

NONFINITE_REMEDY = ("lower --lr or raise --warmup, use --clip, check those samples and the model's dtype "
                    "(bf16 overflow); --on-nonfinite skip skips such steps and counts them")


def check_nonfinite(loss: float, grad_norm: float, policy: str) -> str:
    """The verdict on one step: 'ok' when loss and gradient norm are finite, else the policy
    ('skip': drop the update and count it; 'stop': the caller keeps the last good state and
    raises nonfinite_error)."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return "ok"
    if policy not in NONFINITE_POLICIES:
        raise ValueError(f"non-finite policy {policy!r} not in {NONFINITE_POLICIES}")
    return policy


def nonfinite_error(loss: float, grad_norm: float, step: int, sample_ids: list, kept: str) -> GuardError:
    """GUARD-NONFINITE for a step whose loss or gradient norm is NaN/inf; `kept` names the last good
    checkpoint (or says that none was kept)."""
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    return GuardError(
        "GUARD-NONFINITE",
        f"{what} is non-finite at step {step} (loss={loss}, grad_norm={grad_norm}); "
        f"samples in this step: {sample_ids}. Training stopped; {kept}.",
        NONFINITE_REMEDY,
        details={"step": step, "sample_ids": sample_ids, "loss": loss, "grad_norm": grad_norm})


def weights_max_abs(params: Iterable[torch.Tensor]) -> float:
    """Largest |w| over the tensors (NaN if any is NaN, inf if any is inf). A max never overflows,
    unlike an L2 norm of 1e20-sized weights in fp32. One host read."""
    maxima = [p.detach().abs().max().float() for p in params if p.numel()]
    if not maxima:
        return 0.0
    stacked = torch.stack([m.to(maxima[0].device) for m in maxima])
    if torch.isnan(stacked).any():
        return float("nan")
    return float(stacked.max())


def weights_problem(params: Iterable[torch.Tensor], reference: float | None) -> str | None:
    """Why these weights are not good to keep (non-finite, or exploded relative to `reference`,
    the largest |w| at the start of the run), or None when they are."""
    return max_abs_problem(weights_max_abs(params), reference)


def max_abs_problem(top: float, reference: float | None) -> str | None:
    """weights_problem of weights whose largest |w| is `top` (over every rank's shard)."""
    if not math.isfinite(top):
        return f"the weights contain {'NaN' if math.isnan(top) else 'inf'}"
    if reference is not None and reference > 0 and top > EXPLODED_FACTOR * reference:
        return (f"the weights exploded: largest |w| {top:.3g} is {top / reference:.3g}x the {reference:.3g} "
                f"at the start of the run")
    return None


KEPT_CHECKPOINT_REMEDY = (NONFINITE_REMEDY + "; resume from the kept checkpoint with a lower --lr "
                          "(--resume auto --lr ...)")


def weights_error(where: str, problem: str, kept: str, step: int) -> GuardError:
    """GUARD-NONFINITE for weights found bad before a checkpoint or final/ is written from them."""
    return GuardError(
        "GUARD-NONFINITE",
        f"after step {step}, {problem}, so {where} was not written from them (an update with a "
        f"far too large learning rate destroys the model without a non-finite loss first); {kept}.",
        KEPT_CHECKPOINT_REMEDY,
        details={"step": step, "problem": problem})


def check_eval_finite(eval_loss: float, step: int, kept: str) -> None:
    """A NaN/inf eval loss means the weights are destroyed: never report success on them."""
    if not math.isfinite(eval_loss):
        raise GuardError(
            "GUARD-NONFINITE",
            f"eval loss is {eval_loss} at step {step}: the weights are destroyed (non-finite outputs), "
            f"so no final model is written; {kept}.",
            KEPT_CHECKPOINT_REMEDY,
            details={"step": step, "eval_loss": eval_loss})


def check_eval_collapse(eval_loss: float, best_eval_loss: float | None, uniform: float, step: int,
                        uniform_name: str = "ln(vocab)") -> None:
    """Eval loss back at `uniform` (the objective's loss of a uniform guess: ln(vocab) for cross-entropy)
    after having been well below it. Further above it than DIVERGED_MIN_RISE the model does not predict
    uniformly: GUARD-EVAL-DIVERGED (checked next) names that, and always fires there (its limit is below
    uniform + DIVERGED_MIN_RISE)."""
    if best_eval_loss is None or best_eval_loss > WELL_BELOW * uniform or eval_loss < COLLAPSED * uniform:
        return
    if eval_loss > uniform + DIVERGED_MIN_RISE:
        return
    raise GuardError(
        "GUARD-EVAL-COLLAPSE",
        f"at step {step}: eval loss {eval_loss:.4f} is back at {uniform_name} = {uniform:.4f} after having been "
        f"{best_eval_loss:.4f}: the model now predicts (almost) uniformly, so training destroyed it "
        f"(typically a learning rate far too large for this model and mode).",
        "lower --lr (or use --lr auto for LoRA/QLoRA), raise --warmup; resume from a checkpoint "
        "saved before the collapse with --resume PATH --lr ...",
        details={"step": step, "eval_loss": eval_loss, "best_eval_loss": best_eval_loss, "ln_vocab": uniform})


def diverged_limit(best_eval_loss: float, uniform: float) -> float:
    """The highest eval loss GUARD-EVAL-DIVERGED lets through after a best eval of `best_eval_loss`
    (`uniform`: the objective's loss of a uniform guess, ln(vocab) for cross-entropy)."""
    advantage = uniform - best_eval_loss  # over a uniform guess (< 0 for a start worse than it)
    return best_eval_loss + max(DIVERGED_MIN_RISE, DIVERGED_GAP_FRACTION * advantage)


DIVERGED_CAUSE = "typically a learning rate far too large for this model and mode, or --clip 0"
DIVERGED_REMEDY = ("lower --lr (10x is a good first try; --lr auto picks a fine-tuning rate for LoRA/QLoRA) and "
                   "keep --clip on (default 1.0: --clip 0 lets one update wreck the model); ")
# A preference loss is -log sigmoid(beta x margin) (IPO: (margin - 1/(2 tau))^2): its size and gradients scale
# with --beta, so a beta far too large diverges at any learning rate (issue 38 item 10: the message named only
# --lr; --beta 1000 on a tiny LoRA run went 0.69 -> 354 in 6 steps).
PREFERENCE_DIVERGED_CAUSE = ("typically a --beta too large (the loss and its gradients grow with beta x the "
                             "policy's log-ratio to its reference) or a learning rate too large, or --clip 0")
PREFERENCE_DIVERGED_REMEDY = ("lower --beta (this run's: {beta:g}; the default {default:g} is DPO's usual value) or "
                              "--lr (10x is a good first try), and keep --clip on (default 1.0); ")


def check_eval_diverged(eval_loss: float, best_eval_loss: float | None, uniform: float, step: int,
                        find_best_checkpoint: Callable[[], tuple[Path, int, float] | None],
                        uniform_name: str = "ln(vocab)", cause: str = DIVERGED_CAUSE,
                        remedy: str = DIVERGED_REMEDY) -> None:
    """An eval loss far above the run's best (diverged_limit): the model is destroyed, so the run stops
    at this eval. `find_best_checkpoint()` (called only when the guard fires) gives (path, step, eval
    loss) of the kept checkpoint with the lowest eval, named in the message, or None. `cause` / `remedy`: the
    objective's usual causes and knobs (a preference objective's --beta)."""
    if best_eval_loss is None:
        return
    limit = diverged_limit(best_eval_loss, uniform)
    if not eval_loss > limit:  # NaN: GUARD-NONFINITE's (check_eval_finite runs first)
        return
    best_checkpoint = find_best_checkpoint()
    if best_checkpoint is None:
        kept = "no checkpoint with an eval was kept (only one written at an eval step is known to be good)"
        then = ("start again with a new --out; --eval-every N with --save-every N keeps evaluated checkpoints "
                "to go back to")
    else:
        path, ckpt_step, ckpt_loss = best_checkpoint
        kept = f"the best checkpoint is {path} (eval loss {ckpt_loss:.4f} at step {ckpt_step})"
        then = f"continue from it with --resume {path} --lr ..., or start again with a new --out"
    raise GuardError(
        "GUARD-EVAL-DIVERGED",
        f"at step {step}: eval loss {eval_loss:.4f} is {eval_loss - best_eval_loss:.2f} nats above the run's best "
        f"eval {best_eval_loss:.4f}, past the limit {limit:.4f} (best + max({DIVERGED_MIN_RISE:g}, "
        f"{DIVERGED_GAP_FRACTION:g} x ({uniform_name} {uniform:.4f} - best))): training destroyed the model "
        f"({cause}). Training stopped at this eval and final/ was not written; {kept}.",
        remedy + then,
        details={"step": step, "eval_loss": eval_loss, "best_eval_loss": best_eval_loss, "limit": limit,
                 "ln_vocab": uniform, "checkpoint": None if best_checkpoint is None else str(best_checkpoint[0]),
                 "checkpoint_step": None if best_checkpoint is None else best_checkpoint[1]})


def _best_text(best_checkpoint: tuple[Path, int, float] | None, what: str) -> tuple[str, str]:
    """(what was kept, what to do next) for a divergence message, from the checkpoint to go back to."""
    if best_checkpoint is None:
        return (f"no checkpoint {what} was kept",
                "start again with a new --out; --save-every N keeps checkpoints to go back to")
    path, ckpt_step, value = best_checkpoint
    return (f"the checkpoint to go back to is {path} (step {ckpt_step}, {value:.4f})",
            f"continue from it with --resume {path} --lr ..., or start again with a new --out")


def check_chosen_diverged(nll: float, best_nll: float | None, ln_vocab: float, step: int,
                          find_best_checkpoint: Callable[[], tuple[Path, int, float] | None]) -> None:
    """GUARD-PREF-CHOSEN-DIVERGED: a preference run's eval NLL per token of the chosen responses (the SFT loss on
    them, -logps/chosen / tokens) above diverged_limit(best, ln V), best = its lowest eval of the run (step 0, the
    reference's, included). The preference loss alone cannot see this: a policy that ranks every pair right while
    it assigns its chosen responses a probability no better than a uniform guess over the vocabulary has a DPO
    loss near 0 (issue 38: LoRA DPO --lr 0.5, logps/chosen -11.7 -> -113.3, exit 0, answers "MarsMarsMars").
    The same limit as GUARD-EVAL-DIVERGED's (the eval pairs are the same at every eval, so a rise comes from the
    weights): likelihood displacement (DPO lowering chosen log-probs a little) stays far below half of the
    model's advantage over a uniform guess, which is what a destroyed model has lost."""
    if best_nll is None or not math.isfinite(best_nll):
        return
    limit = diverged_limit(best_nll, ln_vocab)
    if not nll > limit:  # NaN: GUARD-NONFINITE's
        return
    best_checkpoint = find_best_checkpoint()
    kept, then = _best_text(best_checkpoint, "with an eval")
    raise GuardError(
        "GUARD-PREF-CHOSEN-DIVERGED",
        f"at step {step}: the eval NLL per token of the chosen responses is {nll:.4f}, {nll - best_nll:.2f} nats "
        f"above its best {best_nll:.4f}, past the limit {limit:.4f} (best + max({DIVERGED_MIN_RISE:g}, "
        f"{DIVERGED_GAP_FRACTION:g} x (ln(vocab) {ln_vocab:.4f} - best))): the policy may still rank the pairs, "
        f"but it has lost what it knew of the language (its own chosen answers are now nearly as unlikely as a "
        f"uniform guess). Training stopped at this eval and final/ was not written; {kept}.",
        DIVERGED_REMEDY + "raise --beta (the KL to the reference holds the policy closer); " + then,
        details={"step": step, "nll_chosen": nll, "best_nll_chosen": best_nll, "limit": limit, "ln_vocab": ln_vocab,
                 "checkpoint": None if best_checkpoint is None else str(best_checkpoint[0]),
                 "checkpoint_step": None if best_checkpoint is None else best_checkpoint[1]})


# GUARD-TRAIN-DIVERGED: without an eval set, the train loss is the only view of the weights. One step's loss
# depends on its batch, so the guard reads the median of the last TRAIN_WINDOW (non-skipped) steps: one odd
# batch or a single spike (GUARD-SPIKE's) moves a median of 8 little, a destroyed model moves all of them.
# Its limit is GUARD-EVAL-DIVERGED's from the lowest median of the run (the first step's loss, before any
# update, included): issue 38's full fine-tune at --lr 5 without a val split went 5.48 -> 7611 (exit 0).
TRAIN_WINDOW = 8
TRAIN_MIN_STEPS = 3  # judged from the 3rd value on: a median of 2 is their mean, which one spike moves


def median(values: Iterable[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class TrainWatch:
    """The train series a run without an eval set is judged by (GUARD-TRAIN-DIVERGED, GUARD-END-WORSE): the
    objective's language-model loss per token (cross-entropy: the loss; preference: the chosen responses' NLL),
    smoothed as the median of the last TRAIN_WINDOW steps; its lowest median, and its first TRAIN_WINDOW values
    (the start END-WORSE compares with). Checkpointed with the trainer state."""

    def __init__(self, window: int = TRAIN_WINDOW):
        self.window = window
        self.recent: deque[float] = deque(maxlen=window)
        self.first: list[float] = []
        self.best: float | None = None

    def update(self, value: float) -> tuple[float, float | None]:
        """(the median after this value, the lowest median before it; None while fewer than TRAIN_MIN_STEPS values
        are in the window, so nothing is judged yet)."""
        best_before = self.best if len(self.recent) + 1 >= min(TRAIN_MIN_STEPS, self.window) else None
        self.recent.append(value)
        if len(self.first) < self.window:
            self.first.append(value)
        smoothed = median(self.recent)
        self.best = smoothed if self.best is None else min(self.best, smoothed)
        return smoothed, best_before

    def start(self) -> float | None:
        return median(self.first) if self.first else None

    def end(self) -> float | None:
        return median(self.recent) if self.recent else None

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "first": list(self.first), "best": self.best}

    def load_state_dict(self, sd: dict) -> None:
        self.recent.clear()
        self.recent.extend(sd.get("recent", []))
        self.first, self.best = list(sd.get("first", [])), sd.get("best")


def check_train_diverged(smoothed: float, best: float | None, ln_vocab: float, step: int, what: str,
                         last_checkpoint: Path | None) -> None:
    """GUARD-TRAIN-DIVERGED: the median of the last TRAIN_WINDOW train values (`what`) above diverged_limit(best,
    ln V). Every checkpoint was written after a step this guard passed, so the last one is named."""
    if best is None or not math.isfinite(best):
        return
    limit = diverged_limit(best, ln_vocab)
    if not smoothed > limit:
        return
    kept = (f"the last checkpoint is {last_checkpoint}" if last_checkpoint is not None else
            "no checkpoint was written yet (--save-every N writes them)")
    then = (f"continue from it with --resume {last_checkpoint} --lr ..., or start again with a new --out"
            if last_checkpoint is not None else "start again with a new --out")
    raise GuardError(
        "GUARD-TRAIN-DIVERGED",
        f"at step {step}: the {what} (median of the last {TRAIN_WINDOW} steps) is {smoothed:.4f}, "
        f"{smoothed - best:.2f} nats above its lowest {best:.4f}, past the limit {limit:.4f} (lowest + "
        f"max({DIVERGED_MIN_RISE:g}, {DIVERGED_GAP_FRACTION:g} x (ln(vocab) {ln_vocab:.4f} - lowest))): training "
        f"destroyed the model (this run has no eval set, so its train loss is what is judged). Training stopped "
        f"and final/ was not written; {kept}.",
        DIVERGED_REMEDY + "an eval set (--val-fraction, --val) lets GUARD-EVAL-DIVERGED judge held-out data; "
        + then,
        details={"step": step, "train_loss": smoothed, "best_train_loss": best, "limit": limit, "ln_vocab": ln_vocab,
                 "series": what, "checkpoint": None if last_checkpoint is None else str(last_checkpoint)})


def end_worse(start: float | None, end: float | None, what: str, start_text: str, end_text: str) -> dict | None:
    """GUARD-END-WORSE (a warning): the run ended with `what` above its start. A run that exits 0 on a model
    worse than it began with says so in its summary (issue 38: LoRA --lr 0.01, eval 3.90 -> 4.82, exit 0)."""
    if start is None or end is None or not (math.isfinite(start) and math.isfinite(end)) or not end > start:
        return None
    return {"guard": "GUARD-END-WORSE", "series": what, "start": start, "end": end,
            "message": f"GUARD-END-WORSE (warning): the {what} ended at {end:.4f} ({end_text}), above its "
                       f"{start:.4f} at the start ({start_text}): training made the model worse. The model is in "
                       f"final/ as asked; usually the learning rate is too high for this model and mode (lower "
                       f"--lr; --lr auto for LoRA/QLoRA) or the run too short to recover from its warm-up"}


def check_init_loss(eval_loss: float, uniform: float, source: str) -> None:
    """A pretrained model must beat the uniform guess (`uniform`: the objective's loss of it, ln V for
    cross-entropy) on its first eval."""
    if not math.isfinite(eval_loss) or eval_loss >= uniform:
        raise GuardError(
            "GUARD-INIT-LOSS",
            f"step-0 eval loss {eval_loss:.4f} of the pretrained start {source} is >= ln(vocab) = "
            f"{uniform:.4f}: the model is no better than uniform, so loading or the forward is wrong.",
            "check the weights' dtype (bf16 tagged as f16?), Q/K/V biases, RoPE pairing (neox vs gptj) "
            "and theta, RMSNorm eps, and that the tokenizer matches the model; `entrenar verify "
            "--model MODEL` bisects against transformers",
            details={"eval_loss": eval_loss, "ln_vocab": uniform})


# A preference objective's step 0: the policy is its reference, so every log-ratio is 0 and the loss is its
# start value exactly (the same forward twice; LoRA's B = 0 adds an exact 0). Rounding alone moves it by ~1e-7
# (a frozen copy under another parallel layout, bf16); a reference that is another model moves it by ~beta x the
# log-prob difference of a response (tens of nats): far above this.
PREFERENCE_START_TOLERANCE = 1e-3


def check_preference_start(loss: float, start: float, metrics: dict, objective: str, source: str) -> None:
    """GUARD-INIT-LOSS of a preference objective: step-0 loss == its value at policy = reference, rewards 0."""
    rewards = [abs(float(metrics.get(k) or 0.0)) for k in ("rewards/chosen", "rewards/rejected")]
    off = abs(loss - start) if math.isfinite(loss) else math.inf
    if off <= PREFERENCE_START_TOLERANCE * max(1.0, start) and max(rewards) <= PREFERENCE_START_TOLERANCE:
        return
    raise GuardError(
        "GUARD-INIT-LOSS",
        f"step-0 {objective} loss of {source} is {loss:.6f}, not {start:.6f} (the loss when the policy equals its "
        f"reference; mean rewards chosen {metrics.get('rewards/chosen')}, rejected {metrics.get('rewards/rejected')}, "
        f"both must be 0): the reference is not the starting policy, so every reward measures a difference that "
        f"was there before training.",
        "the reference must be the model training starts from: LoRA/QLoRA adapters zero at the start (B = 0; not a "
        "trained adapter continued as a new run), no dropout or other randomness in the forward that differs "
        "between the policy and reference passes, the same weights and dtype for both (--mode full copies the "
        "model after --dtype's cast)",
        details={"eval_loss": loss, "start": start, "rewards": rewards})


def check_preference_gradient(grad_norm: float, trainable: int, eps: float, beta: float, objective: str) -> None:
    """GUARD-PREF-NO-GRADIENT: the first step's gradient of a sigmoid preference loss (dpo, dpo-norm), taken at
    policy = reference before any update, whose root mean square over the `trainable` parameters is below the
    optimizer's `eps` (AdamW: update = lr x m / (sqrt(v) + eps), so a gradient under eps moves the weights in
    proportion to it: nothing trains). At the start -log sigmoid(beta x margin) has the gradient beta/2 x the
    margin's, so the cause is a --beta far too small: the loss stays ln 2 and the rewards 0 (both scale with beta;
    issue 38 item 11: "gnorm 0"). NaN is GUARD-NONFINITE's."""
    if not trainable or not eps or math.isnan(grad_norm):
        return
    floor = eps * math.sqrt(trainable)  # the norm of a gradient whose every element is eps
    if grad_norm >= floor:
        return
    margin = 2 * grad_norm / beta  # the gradient norm of the policy's log-ratio margin (beta-free)
    below = f"; on this model and data any --beta below {beta * floor / grad_norm:.2g} is" if grad_norm > 0 else ""
    raise GuardError(
        "GUARD-PREF-NO-GRADIENT",
        f"at step 0 (the first step's gradient, at policy = reference, before any update) the {objective} gradient "
        f"norm is {grad_norm:.3g} over {trainable:,} trainable parameters, {grad_norm / math.sqrt(trainable):.2g} per "
        f"parameter (RMS), below the optimizer's eps {eps:g}: its updates would shrink with the gradient, so nothing "
        f"would train. At the start this loss's gradient is beta/2 x that of the policy's log-ratio margin (here "
        f"{margin:.3g}), so --beta {beta:g} is far too small{below}: the loss would stay at ln 2 and every reward at "
        f"0 (they scale with beta). Training stopped before the first update: no checkpoint, no final/ (the same "
        f"--out can be used again).",
        "a larger --beta: 0.1 (the default, TRL's) is the usual value; the DPO papers use 0.01-0.5",
        details={"grad_norm": grad_norm, "trainable_parameters": trainable, "eps": eps, "beta": beta,
                 "floor": floor})


# GUARD-PREF-MARGINS: -log sigmoid(20) = 2e-9, so a sigmoid loss past a mean margin of 20 has no gradient left:
# the margins grow from the learning rate and momentum alone, the policy runs away from its reference (the KL
# term no longer holds it), usually by pushing the rejected log-probs (and with them the chosen ones) down.
MARGIN_LIMIT = 20.0
# GUARD-PREF-ACCURACY: over the last ACCURACY_WINDOW steps, accuracy within 0.5 +- ACCURACY_BAND while the loss
# is below STUCK_LOSS_FRACTION x its start: some pairs separate ever more while as many stay wrong.
ACCURACY_WINDOW = 16
ACCURACY_BAND = 0.1
STUCK_LOSS_FRACTION = 0.9


class PreferenceWatch:
    """The preference objectives' step warnings (each said once per run; their state is checkpointed)."""

    def __init__(self, start_loss: float, margin_guard: bool = True):
        self.start_loss, self.margin_guard = start_loss, margin_guard
        self.window: deque[tuple[float, float]] = deque(maxlen=ACCURACY_WINDOW)
        self.fired: list[str] = []

    def update(self, record: dict) -> list[str]:
        """Messages for this step's record (loss, rewards/margins, rewards/accuracies)."""
        if record.get("skipped") or not math.isfinite(record.get("loss", math.nan)):
            return []
        out = []
        margin, step = record.get("rewards/margins"), record.get("step")
        if self.margin_guard and margin is not None and margin > MARGIN_LIMIT and "margins" not in self.fired:
            self.fired.append("margins")
            out.append(f"GUARD-PREF-MARGINS (warning) at step {step}: mean reward margin {margin:.1f} > {MARGIN_LIMIT:g}, "
                       f"where the loss has no gradient left: the policy is running away from its reference "
                       f"(rewards chosen {record.get('rewards/chosen', 0):.1f}, rejected "
                       f"{record.get('rewards/rejected', 0):.1f}; chosen falling too is likelihood displacement). "
                       f"Usually the learning rate is too high or --beta too small, or the rejected responses are "
                       f"trivially told apart (another format or length); lower --lr, raise --beta, check the pairs")
        self.window.append((float(record["loss"]), float(record.get("rewards/accuracies", 0.5))))
        if len(self.window) == ACCURACY_WINDOW and "accuracy" not in self.fired:
            loss = sum(v[0] for v in self.window) / len(self.window)
            acc = sum(v[1] for v in self.window) / len(self.window)
            if abs(acc - 0.5) <= ACCURACY_BAND and loss < STUCK_LOSS_FRACTION * self.start_loss:
                self.fired.append("accuracy")
                out.append(f"GUARD-PREF-ACCURACY (warning) at step {step}: accuracy {acc:.2f} over the last "
                           f"{ACCURACY_WINDOW} steps while the loss fell to {loss:.4f} (start {self.start_loss:.4f}): "
                           f"half of the pairs separate ever more while the other half stay wrong. That usually "
                           f"means half of the data carries no learnable preference: chosen and rejected swapped in "
                           f"part of the data (two sources with opposite conventions), pairs that differ only after "
                           f"the --max-seq-len cut or in formatting, or batches of 2 pairs (accuracy takes 0, 0.5, 1 "
                           f"only); check the pairs, a larger --batch-size, --beta")
        return out

    def state_dict(self) -> dict:
        return {"window": [list(v) for v in self.window], "fired": list(self.fired)}

    def load_state_dict(self, sd: dict) -> None:
        self.window.clear()
        self.window.extend(tuple(v) for v in sd.get("window", []))
        self.fired = list(sd.get("fired", []))


def check_loss_tokens(total_tokens: int, step: int, sample_ids: list) -> None:
    if total_tokens == 0:
        raise GuardError(
            "GUARD-ZERO-LOSS-TOKENS",
            f"step {step} has no loss tokens in any micro-batch (samples {sample_ids}): every label "
            f"is -100, so the loss would be 0/0 and the model would train on nothing.",
            "check the loss mask: responses truncated away by --max-seq-len, a chat template whose "
            "assistant spans are not found, or labels not shifted; `entrenar data check` reports it",
            details={"step": step, "sample_ids": sample_ids})


class SpikeDetector:
    """Rolling z-score of a series; values flagged as spikes do not enter the window."""

    def __init__(self, name: str, window: int = 128, sigma: float = 6.0, min_history: int = 16):
        self.name, self.sigma, self.min_history = name, sigma, min_history
        self.values: deque[float] = deque(maxlen=window)

    def zscore(self, x: float) -> float | None:
        if len(self.values) < self.min_history:
            return None
        n = len(self.values)
        mean = sum(self.values) / n
        var = sum((v - mean) ** 2 for v in self.values) / (n - 1)
        # floor the spread so a flat history (std ~ 0) does not make tiny wiggles spikes
        std = max(math.sqrt(var), 1e-3 * abs(mean), 1e-8)
        return (x - mean) / std

    def update(self, x: float) -> float | None:
        """z-score of x if it is a spike (above +sigma), else None; non-spikes join the window."""
        z = self.zscore(x)
        if z is not None and z > self.sigma:
            return z
        self.values.append(x)
        return None

    def state_dict(self) -> dict:
        return {"values": list(self.values)}

    def load_state_dict(self, sd: dict) -> None:
        self.values.clear()
        self.values.extend(sd["values"])


def spike_guard(policy: str, window: int, sigma: float, objective: Any) -> SpikeGuard:
    """The run's GUARD-SPIKE: on the loss and the gradient norm, or the gradient norm only where the objective's
    loss is no fit whose jumps mean trouble (objective.loss_spikes False: GRPO's surrogate)."""
    return SpikeGuard(policy, window, sigma, watch_loss=getattr(objective, "loss_spikes", True))  # a user objective: True


class SpikeGuard:
    """GUARD-SPIKE over loss and grad-norm. Returns 'ok' | 'warn' | 'skip'; raises for stop."""

    def __init__(self, policy: str = "warn", window: int = 128, sigma: float = 6.0, min_history: int = 16,
                 early_factor: float = 2.0, watch_loss: bool = True):
        if policy not in SPIKE_POLICIES:
            raise ValueError(f"spike policy {policy!r} not in {SPIKE_POLICIES}")
        self.policy, self.min_history, self.early_factor = policy, min_history, early_factor
        self.watch_loss = watch_loss  # False: the gradient norm only (an objective whose loss is no fit: GRPO)
        self.loss = SpikeDetector("loss", window, sigma, min_history)
        self.grad_norm = SpikeDetector("grad_norm", window, sigma, min_history)
        self.count = 0
        # Before the window holds min_history losses a z-score is meaningless, so the loss is
        # compared with the run's starting loss instead: early_factor x above it is a spike (a
        # learning rate that throws a pretrained model off its minimum at step 1).
        self.reference: float | None = None
        self.first_seen = False

    def set_reference(self, loss: float) -> None:
        if math.isfinite(loss):
            self.reference = loss if self.reference is None else max(self.reference, loss)

    def check(self, loss: float, grad_norm: float, step: int, sample_ids: list) -> tuple[str, str]:
        early = len(self.loss.values) < self.min_history
        if not self.first_seen:  # reference = max(step-0 eval loss, first train loss)
            self.first_seen = True
            self.set_reference(loss)
        watched = ((self.loss, loss), (self.grad_norm, grad_norm)) if self.watch_loss else ((self.grad_norm, grad_norm),)
        if (self.watch_loss and early and self.reference is not None and self.reference > 0
                and loss > self.early_factor * self.reference):
            spikes = [("loss", loss, None)]
        else:
            spikes = [(d.name, v, z) for d, v in watched if (z := d.update(v)) is not None]
        if not spikes:
            return "ok", ""
        self.count += 1
        msg = "; ".join(f"{name} {v:.4g} is {z:.1f} sigma above its rolling mean" if z is not None else
                        f"{name} {v:.4g} is {v / self.reference:.1f}x the run's starting loss {self.reference:.4g} "
                        f"(within the first {self.min_history} steps)" for name, v, z in spikes)
        msg = f"GUARD-SPIKE at step {step}: {msg} (samples {sample_ids})"
        if self.policy == "stop":
            raise GuardError("GUARD-SPIKE", msg + ".",
                             "lower --lr, raise --warmup or --clip, inspect those samples; "
                             "--on-spike warn|skip continue past spikes",
                             details={"step": step, "sample_ids": sample_ids})
        return self.policy, msg

    def state_dict(self) -> dict:
        return {"loss": self.loss.state_dict(), "grad_norm": self.grad_norm.state_dict(), "count": self.count,
                "reference": self.reference, "first_seen": self.first_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.loss.load_state_dict(sd["loss"])
        self.grad_norm.load_state_dict(sd["grad_norm"])
        self.count = int(sd["count"])
        self.reference, self.first_seen = sd.get("reference"), bool(sd.get("first_seen", True))


def check_eval_anomaly(eval_loss: float, recent_train_loss: float | None, step: int,
                       ratio: float = 0.1, min_ppl: float = 1.01) -> None:
    """Eval far below train (< ratio x) or perplexity < min_ppl means eval is not measuring the task."""
    ppl = math.exp(min(eval_loss, 50.0))
    too_low = recent_train_loss is not None and recent_train_loss > 0 and eval_loss < ratio * recent_train_loss
    if ppl < min_ppl or too_low:
        why = (f"perplexity {ppl:.4f} < {min_ppl}" if ppl < min_ppl else
               f"eval loss {eval_loss:.4f} < {ratio} x recent train loss {recent_train_loss:.4f}")
        raise GuardError(
            "GUARD-EVAL-ANOMALY",
            f"at step {step}: {why}. Eval this good means it does not measure generalisation: the eval "
            f"set leaked into the training data, or eval loss is normalised differently from train.",
            "make sure --val / the val split shares no samples with the training data (deduplicate), "
            "and that eval divides the summed loss by its loss-token count",
            details={"step": step, "eval_loss": eval_loss, "train_loss": recent_train_loss, "ppl": ppl})


def task_regression(regressions: list[tuple[str, dict]], step: int, policy: str,
                    best: tuple[int, str, Path | None], export_hint: str) -> str | None:
    """GUARD-TASK-REGRESSION on the units (a task, or one BFCL category) of the panel whose change from step 0
    to `step` is a significant drop (evaluate.paired.panel_changes: exact McNemar on the unit's own problems,
    Holm-adjusted over the panel). `regressions` = [(unit, change)] of those units (empty: None). The warning
    (policy warn) or a GuardError (policy stop: exit 3) names each unit, its counts and the problems lost.
    `best` = (step, its target result as text, its checkpoint or None); `export_hint` says how to use it."""
    assert policy in TASK_REGRESSION_POLICIES, policy
    if not regressions:
        return None
    best_step, best_text, best_ckpt = best
    parts = []
    for unit, change in regressions:
        n, before, after, lost = change["problems"], change["passed_before"], change["passed_after"], change["lost"]
        shown = ", ".join(lost[:12]) + (f" and {len(lost) - 12} more" if len(lost) > 12 else "")
        parts.append(f"{unit} fell from {before}/{n} at step 0 to {after}/{n} (lost {len(lost)}: {shown}; gained "
                     f"{len(change['gained'])}; exact McNemar p = {change['p_value']:.3g}, Holm over the panel "
                     f"{change.get('p_holm', change['p_value']):.3g} < 0.05)")
    cause = (f"at step {step}: " + "; ".join(parts) + ": training is making the model worse at this while the "
             "loss may still fall (too high a --lr, too many steps or epochs on narrow data, data whose answers "
             "differ in form from what the task scores, nothing in the rows that keeps what the model could do)")
    if best_step == 0:
        where = "the best task result is the starting model (step 0): no trained weights beat it"
    elif best_ckpt is None:
        where = (f"the best task result was step {best_step} ({best_text}), but no checkpoint of that step "
                 f"was kept (--save-every equal to --eval-task-every keeps one at each task eval)")
    else:
        where = f"the best task result is step {best_step} ({best_text}), checkpoint {best_ckpt}: {export_hint}"
    remedy = ("lower --lr (or fewer --steps), mix general data into the rows (`entrenar data replay`), pull "
              "towards the base (--kl-to-base), or use --keep-best task; --on-task-regression stop ends such a "
              "run here")
    if policy == "warn":
        return f"GUARD-TASK-REGRESSION (warning): {cause}. {where[0].upper()}{where[1:]}. Remedy: {remedy}"
    unit, change = regressions[0]
    raise GuardError("GUARD-TASK-REGRESSION", f"{cause}. Training stopped; final/ was not written; {where}.",
                     remedy, details={"step": step, "task": unit, "units": [u for u, _ in regressions],
                                      "passed_before": change["passed_before"], "passed_after": change["passed_after"],
                                      "problems": change["problems"], "lost": change["lost"],
                                      "gained": change["gained"], "p_value": change["p_value"],
                                      "p_holm": change.get("p_holm", change["p_value"]), "best_step": best_step,
                                      "checkpoint": None if best_ckpt is None else str(best_ckpt)})
