"""Training guards (IDs from DESIGN.md). Each raises GuardError naming cause and remedy.

- GUARD-NONFINITE        loss or gradient norm is NaN/inf
- GUARD-INIT-LOSS        a pretrained start is no better than a uniform guess at step 0
- GUARD-ZERO-LOSS-TOKENS a step with no loss tokens (never averaged in as 0)
- GUARD-SPIKE            rolling z-score of loss / grad-norm over a window
- GUARD-EVAL-ANOMALY     eval loss implausibly far below train loss, or perplexity ~1
"""

from __future__ import annotations

import math
from collections import deque

from ..errors import GuardError

NONFINITE_POLICIES = ("stop", "skip")
SPIKE_POLICIES = ("warn", "skip", "stop")


def check_nonfinite(loss: float, grad_norm: float, step: int, sample_ids: list, policy: str) -> bool:
    """True when the step must be skipped (policy skip); raises for policy stop; False when finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return False
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    if policy == "skip":
        return True
    raise GuardError(
        "GUARD-NONFINITE",
        f"{what} is non-finite at step {step} (loss={loss}, grad_norm={grad_norm}); "
        f"samples in this step: {sample_ids}. Training stopped; the last good checkpoint is kept.",
        "lower --lr or raise --warmup, use --clip, check those samples and the model's dtype "
        "(bf16 overflow); --on-nonfinite skip skips such steps and counts them",
        details={"step": step, "sample_ids": sample_ids, "loss": loss, "grad_norm": grad_norm})


def check_init_loss(eval_loss: float, vocab_size: int, source: str) -> None:
    """A pretrained model must beat the uniform guess (loss ln V) on its first eval."""
    uniform = math.log(vocab_size)
    if not math.isfinite(eval_loss) or eval_loss >= uniform:
        raise GuardError(
            "GUARD-INIT-LOSS",
            f"step-0 eval loss {eval_loss:.4f} of the pretrained start {source} is >= ln(vocab) = "
            f"{uniform:.4f}: the model is no better than uniform, so loading or the forward is wrong.",
            "check the weights' dtype (bf16 tagged as f16?), Q/K/V biases, RoPE pairing (neox vs gptj) "
            "and theta, RMSNorm eps, and that the tokenizer matches the model; `entrenar verify "
            "--model MODEL` bisects against transformers",
            details={"eval_loss": eval_loss, "ln_vocab": uniform})


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


class SpikeGuard:
    """GUARD-SPIKE over loss and grad-norm. Returns 'ok' | 'warn' | 'skip'; raises for stop."""

    def __init__(self, policy: str = "warn", window: int = 128, sigma: float = 6.0, min_history: int = 16,
                 early_factor: float = 2.0):
        if policy not in SPIKE_POLICIES:
            raise ValueError(f"spike policy {policy!r} not in {SPIKE_POLICIES}")
        self.policy, self.min_history, self.early_factor = policy, min_history, early_factor
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
        if early and self.reference is not None and self.reference > 0 and loss > self.early_factor * self.reference:
            spikes = [("loss", loss, None)]
        else:
            spikes = [(d.name, v, z) for d, v in ((self.loss, loss), (self.grad_norm, grad_norm))
                      if (z := d.update(v)) is not None]
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
