"""What a training step minimises: the objective part of the Trainer (train/loop.py).

An objective turns one batch into (loss sum, loss-token count, metrics) through the model's forward:
the sum over the batch's loss units (tokens for cross-entropy), a device scalar that is never read
back here (no host sync); the count from the loader's CPU tensors (no device sync); metrics, a dict
of device scalars summed over a step's micro-batches and ranks, handed back through
`step_metrics` (nothing for cross-entropy). Train and eval both call `loss`: one loss for both.

`uniform_loss(vocab_size)` is what a model that knows nothing scores under this objective (ln V for
cross-entropy): the reference of GUARD-INIT-LOSS, GUARD-EVAL-COLLAPSE and GUARD-EVAL-DIVERGED, which
ask the objective instead of assuming cross-entropy. A preference (DPO) objective plugs in here with
its own batch keys, loss, count and reference (ln 2 for a pairwise choice).

`counts(batch)` is a batch's (loss units, samples without any, tokens): what each micro-batch's loss sum
is divided by (the step's total over every rank), GUARD-ZERO-LOSS-TOKENS's count and tok/s's tokens.
Tokens for cross-entropy; pairs for a preference objective (each pair's loss is one unit, as TRL's mean
over pairs), so batch 4 == batch 1 x accumulation 4 == 2 ranks x batch 2 holds for either.

Preference objectives (`finetune --objective dpo|ipo|dpo-norm`, `PreferenceLoss`): batches of
data/preference.py ([B, 2, T]: chosen, rejected), both sequences of a micro-batch in one forward; the
reference log-probs come from the same model with its adapters switched off (LoRA / QLoRA: no second copy
of the weights) or from a frozen copy of the starting model made by `bind` (full fine-tuning: one more set of
weights in the compute dtype, unsharded on every rank; exact, so the step-0 loss is ln 2 to the last bit).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..tensors import IGNORE_INDEX, batch_counts
from . import guards


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device`. Pinned host memory first on CUDA: the copy is then truly
    asynchronous (from pageable memory it may wait for the stream, i.e. for the previous step's
    optimizer, before the host can queue the forward)."""
    pin = device.type == "cuda"
    return {k: ((v.pin_memory() if pin and v.device.type == "cpu" else v).to(device, non_blocking=True)
                if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()}


# The LM head runs only at the label positions when at most this share of a batch's positions has a label (SFT
# rows' responses after long prompts and padding); above it (pretraining) the gather would cost more than it saves.
HEAD_AT_MAX_SHARE = 0.9


def takes_head_at(model: torch.nn.Module) -> bool:
    """Whether `model` (or the module a DDP wrapper holds) is our CausalLM, whose forward takes `head_at`."""
    inner = getattr(model, "module", model)
    return hasattr(inner, "hidden_states") and hasattr(inner, "head_weight")


def head_positions(labels: torch.Tensor) -> torch.Tensor | None:
    """The flat positions (into B*T) of the labels that are not IGNORE_INDEX, for the model's `head_at`, or None
    when more than HEAD_AT_MAX_SHARE of the positions have one. Meant for the loader's CPU labels: no device sync."""
    keep = labels.reshape(-1) != IGNORE_INDEX
    n = int(keep.sum())
    if n > HEAD_AT_MAX_SHARE * keep.numel():
        return None
    return keep.nonzero().squeeze(1)


def model_inputs(b: dict) -> dict[str, Any]:
    """The model's keyword arguments from a batch besides input_ids and labels: the packed rows' positions and doc
    ids, and a padding-free row's spans (cu_seqlens, max_seqlen: data/sft.py, varlen.py) when the batch has them."""
    out = {"position_ids": b.get("position_ids"), "doc_ids": b.get("doc_ids")}
    if b.get("cu_seqlens") is not None:
        out["cu_seqlens"], out["max_seqlen"] = b["cu_seqlens"], b["max_seqlen"]
    return out


class Objective(Protocol):
    """The interface the Trainer and `evaluate` use (see the module docstring)."""

    name: str
    unit: str  # what counts() counts ("tokens", "pairs")
    uniform_name: str  # how guard messages name uniform_loss ("ln(vocab)")
    eval_anomaly: bool  # whether GUARD-EVAL-ANOMALY's leak checks apply
    lm_key: str  # the record key of the language-model NLL per token (GUARD-TRAIN-DIVERGED, -PREF-CHOSEN-DIVERGED)
    lm_name: str  # how the guards' messages name it
    perplexity: bool  # whether exp(loss) means something (a per-token cross-entropy): logged with the eval loss
    diverged: tuple[str, str]  # GUARD-EVAL-DIVERGED's (usual cause, remedy) for this objective's knobs
    loss_spikes: bool  # whether GUARD-SPIKE watches the loss (else the gradient norm only): guards.spike_guard

    def loss(self, model: torch.nn.Module, batch: dict, device: torch.device
             ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]: ...

    def count(self, batch: dict) -> int: ...

    def counts(self, batch: dict) -> tuple[int, int, int]: ...

    def uniform_loss(self, vocab_size: int) -> float: ...

    def step_metrics(self, sums: dict[str, float], loss_tokens: int) -> dict[str, Any]: ...

    def bind(self, model: torch.nn.Module) -> None: ...

    def check_start(self, loss: float, uniform: float, metrics: dict[str, Any], source: str) -> str: ...

    def check_first_gradient(self, grad_norm: float, trainable: int, eps: float) -> None: ...

    def watch(self, record: dict[str, Any]) -> list[str]: ...

    def progress_fields(self, record: dict[str, Any]) -> str: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


def format_fields(record: dict[str, Any], fields: tuple[tuple[str, str, str], ...]) -> str:
    """'label value ...' for each (label, record key, format spec) whose value is a finite number in `record`."""
    out = []
    for label, key, spec in fields:
        v = record.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append(f"{label} {v:{spec}}")
    return " ".join(out)


class CausalLMLoss:
    """Next-token cross-entropy: `model(input_ids, labels=...)` returns the summed CE over the labels
    that are not IGNORE_INDEX (already shifted by the loader) and their count."""

    name = "causal-lm"
    uniform_name = "ln(vocab)"
    unit = "tokens"  # what counts() counts: the loss's unit
    eval_anomaly = True  # GUARD-EVAL-ANOMALY applies (a perplexity near 1 is a leak)
    lm_key, lm_name = "loss", "train loss"  # the loss is the language model's NLL per token
    perplexity = True
    diverged = (guards.DIVERGED_CAUSE, guards.DIVERGED_REMEDY)
    loss_spikes = True

    head_at = True  # the head at the label positions only (head_positions); a run with CUDA graphs turns it off

    def loss(self, model: torch.nn.Module, batch: dict, device: torch.device
             ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        at = head_positions(batch["labels"]) if self.head_at and takes_head_at(model) else None
        b = to_device(batch if at is None else {**batch, "head_at": at}, device)
        return self.loss_sum(model, b), self.count(batch), {}

    @staticmethod
    def loss_sum(model: torch.nn.Module, b: dict) -> torch.Tensor:
        """The summed cross-entropy of a batch already on the device: no host read (a CUDA graph captures it, with
        no "head_at": its shapes must not change between replays)."""
        extra = {"head_at": b["head_at"]} if "head_at" in b else {}
        loss_sum, _ = model(b["input_ids"], labels=b["labels"], **model_inputs(b), **extra)
        return loss_sum

    def count(self, batch: dict) -> int:
        """Loss tokens of one batch, counted on the loader's (CPU) labels: no device sync."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def uniform_loss(self, vocab_size: int) -> float:
        """ln V: the cross-entropy of a uniform guess over the vocabulary."""
        return math.log(vocab_size)

    def counts(self, batch: dict) -> tuple[int, int, int]:
        return batch_counts(batch)

    def step_metrics(self, sums: dict[str, float], loss_tokens: int) -> dict[str, Any]:
        return {}  # the step's loss is the Trainer's own field

    def bind(self, model: torch.nn.Module) -> None:
        pass  # no reference model

    def check_start(self, loss: float, uniform: float, metrics: dict[str, Any], source: str) -> str:
        """GUARD-INIT-LOSS: a pretrained start must beat a uniform guess over the vocabulary (`uniform`, ln V)."""
        guards.check_init_loss(loss, uniform, source)
        return f"GUARD-INIT-LOSS ok: step-0 loss {loss:.4f} < ln(vocab) {uniform:.4f}"

    def check_first_gradient(self, grad_norm: float, trainable: int, eps: float) -> None:
        pass  # a cross-entropy's gradient at the start has no knob that scales it to nothing

    def watch(self, record: dict[str, Any]) -> list[str]:
        return []

    def progress_fields(self, record: dict[str, Any]) -> str:
        return ""  # the loss is the progress line's own field

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


# ---- preference tuning (DPO and variants) ------------------------------------------------------------
# --objective name -> TRL's DPOConfig.loss_type of the same loss (tests/test_dpo_parity.py checks each against
# trl's DPOTrainer): dpo = the sigmoid loss of Rafailov et al.; ipo = Azar et al.'s squared loss on per-token
# averaged log-ratios (TRL's normalisation, confirmed with the IPO authors); dpo-norm = the sigmoid loss on
# per-token averaged log-ratios (length-normalised DPO, TRL's "sigmoid_norm": long responses no longer win
# by length).
PREFERENCE_LOSSES = {"dpo": "sigmoid", "ipo": "ipo", "dpo-norm": "sigmoid_norm"}
OBJECTIVES = ("sft", *PREFERENCE_LOSSES, "grpo")  # grpo: train/grpo.py (its own objective and loader)
DEFAULT_BETA = 0.1  # TRL's default
REFERENCES = ("adapters-off", "frozen-copy")
CHOSEN_TOKENS = "_chosen_tokens"  # a metric sum only: the chosen responses' tokens, for nll/chosen


def sequence_logps(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed log-probability of its label tokens [N] (fp32), through the model's forward."""
    return -model(input_ids, labels=labels, per_token=True).sum(dim=-1)


class PreferenceLoss:
    """DPO (sigmoid), IPO and length-normalised DPO over batches of pairs (see the module docstring).

    loss(model, batch) -> (sum over the batch's pairs of the pair loss, pairs, metric sums); a pair without
    loss tokens in either sequence (a rank's dummy row) adds nothing and is not counted. Metrics are TRL's:
    rewards/chosen, rewards/rejected = beta x (policy - reference) log-prob of the response, rewards/margins,
    rewards/accuracies (chosen reward > rejected reward), logps/chosen, logps/rejected (policy), each the mean
    over the step's pairs."""

    uniform_name = "the loss at policy = reference"
    unit = "pairs"
    eval_anomaly = False  # a DPO loss near 0 is a well-separated pair, not a leak: no perplexity to judge
    # the policy's NLL per token of the chosen responses (the SFT loss on them): what the pairs' loss cannot see
    lm_key, lm_name = "nll/chosen", "train NLL per token of the chosen responses"
    perplexity = False  # exp of a pair loss is no perplexity (issue 38 item 10: "ppl 5.2e21" was logged)
    loss_spikes = True  # from ln 2 down: a jump up is the policy thrown off

    def __init__(self, name: str = "dpo", beta: float = DEFAULT_BETA, reference: str = "adapters-off",
                 details: bool = False):
        """`details` (`eval` on pairs): the metrics also sum the reference's log-probs (ref_logps/chosen,
        ref_logps/rejected) and the pairs whose two rewards are equal (rewards/ties: no win for accuracy)."""
        if name not in PREFERENCE_LOSSES:
            raise InputError(f"--objective {name!r} is not a preference objective ({', '.join(PREFERENCE_LOSSES)})")
        if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
            raise InputError(f"--beta must be a finite number > 0, got {beta}")
        assert reference in REFERENCES, reference
        self.name, self.beta, self.reference, self.details = name, float(beta), reference, details
        self.diverged = (guards.PREFERENCE_DIVERGED_CAUSE,
                         guards.PREFERENCE_DIVERGED_REMEDY.format(beta=self.beta, default=DEFAULT_BETA))
        self.loss_type = PREFERENCE_LOSSES[name]
        self.reference_model: torch.nn.Module | None = None
        self.watcher = guards.PreferenceWatch(self.uniform_loss(0), margin_guard=self.loss_type != "ipo")

    # -- the reference
    def bind(self, model: torch.nn.Module) -> None:
        """Before parallelism wraps `model` (build_trainer): a full fine-tune's frozen copy of it, in its compute
        dtype (after the precision's prepare_model); LoRA/QLoRA need adapters to switch off."""
        if self.reference == "frozen-copy":
            self.reference_model = copy.deepcopy(model).requires_grad_(False).eval()
            return
        from ..peft import lora_modules

        if not lora_modules(model):
            raise InputError("a preference objective with the adapters-off reference needs a LoRA/QLoRA model "
                             "(--mode lora|qlora); --mode full uses a frozen copy")

    def use_reference(self, reference: torch.nn.Module) -> None:
        """A reference model given rather than copied from the policy (`eval --ref-model`, a full fine-tune's
        starting model read from its run): frozen, used as bind's frozen copy is."""
        self.reference = "frozen-copy"
        self.reference_model = reference.requires_grad_(False).eval()

    def reference_logps(self, model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from ..peft import adapters_disabled

        with torch.no_grad():
            if self.reference_model is not None:
                return sequence_logps(self.reference_model, input_ids, labels)
            with adapters_disabled(model):
                return sequence_logps(model, input_ids, labels)

    # -- the loss
    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
                    ref_rejected: torch.Tensor, n_chosen: torch.Tensor, n_rejected: torch.Tensor) -> torch.Tensor:
        """Per-pair loss from summed log-probs (policy, reference) and response token counts: TRL's formulas."""
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if self.loss_type == "sigmoid":
            return -F.logsigmoid(self.beta * (chosen_ratio - rejected_ratio))
        delta = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
        if self.loss_type == "ipo":
            return (delta - 1 / (2 * self.beta)) ** 2
        return -F.logsigmoid(self.beta * delta)

    def loss(self, model: torch.nn.Module, batch: dict, device: torch.device
             ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        assert batch["input_ids"].dim() == 3 and batch["input_ids"].shape[1] == 2, \
            "a preference objective needs pair batches [B, 2, T] (data/preference.py)"
        B, _, T = batch["input_ids"].shape
        # chosen rows then rejected rows: one forward for both (as TRL's concatenated forward)
        ids = batch["input_ids"].transpose(0, 1).reshape(2 * B, T)
        labels = batch["labels"].transpose(0, 1).reshape(2 * B, T)
        lengths = (labels != IGNORE_INDEX).sum(dim=-1)  # on the loader's CPU tensors: no device sync
        valid_cpu = (lengths[:B] > 0) & (lengths[B:] > 0)
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        lengths, valid = lengths.to(device, non_blocking=True), valid_cpu.to(device, non_blocking=True)
        ref = self.reference_logps(model, ids, labels).float()
        logps = sequence_logps(model, ids, labels)
        losses = self.pair_losses(logps[:B], logps[B:], ref[:B], ref[B:], lengths[:B], lengths[B:])
        zero = torch.zeros_like(losses)
        with torch.no_grad():
            reward_c, reward_r = self.beta * (logps[:B] - ref[:B]), self.beta * (logps[B:] - ref[B:])
            metrics = {"rewards/chosen": torch.where(valid, reward_c, zero).sum(),
                       "rewards/rejected": torch.where(valid, reward_r, zero).sum(),
                       "rewards/margins": torch.where(valid, reward_c - reward_r, zero).sum(),
                       "rewards/accuracies": (valid & (reward_c > reward_r)).sum().float(),
                       "logps/chosen": torch.where(valid, logps[:B], zero).sum(),
                       "logps/rejected": torch.where(valid, logps[B:], zero).sum(),
                       CHOSEN_TOKENS: torch.where(valid, lengths[:B], torch.zeros_like(lengths[:B])).sum().float()}
            if self.details:
                metrics.update({"ref_logps/chosen": torch.where(valid, ref[:B], zero).sum(),
                                "ref_logps/rejected": torch.where(valid, ref[B:], zero).sum(),
                                "rewards/ties": (valid & (reward_c == reward_r)).sum().float()})
        return torch.where(valid, losses, zero).sum(), int(valid_cpu.sum()), metrics

    def count(self, batch: dict) -> int:
        return self.counts(batch)[0]

    def counts(self, batch: dict) -> tuple[int, int, int]:
        """(pairs with loss tokens in both sequences, pairs without, tokens of both sequences, padding included)."""
        per_seq = (batch["labels"] != IGNORE_INDEX).sum(dim=-1)  # [B, 2]
        valid = int(((per_seq[:, 0] > 0) & (per_seq[:, 1] > 0)).sum())
        return valid, int(per_seq.shape[0]) - valid, int(batch["input_ids"].numel())

    def uniform_loss(self, vocab_size: int) -> float:
        """The loss of a policy equal to its reference (every log-ratio 0): ln 2 for the sigmoid losses, (1/(2 beta))^2
        for IPO. The step-0 loss must be exactly this (check_start); GUARD-EVAL-COLLAPSE / -DIVERGED measure from it."""
        return (1 / (2 * self.beta)) ** 2 if self.loss_type == "ipo" else math.log(2)

    def step_metrics(self, sums: dict[str, float], loss_tokens: int) -> dict[str, Any]:
        """Means over the pairs of the step (or eval set); `loss_tokens` is their count."""
        n = max(int(loss_tokens), 1)
        sums = dict(sums)
        tokens = sums.pop(CHOSEN_TOKENS, 0.0)
        out = {k: v / n for k, v in sums.items()}
        if tokens and "logps/chosen" in sums:  # per token over the pairs: -logps/chosen summed / their tokens
            out["nll/chosen"] = -sums["logps/chosen"] / tokens
        return out

    def check_start(self, loss: float, uniform: float, metrics: dict[str, Any], source: str) -> str:
        """GUARD-INIT-LOSS for a preference objective: at step 0 the policy IS the reference, so the loss is
        exactly `uniform` (ln 2 for dpo) and every reward 0."""
        guards.check_preference_start(loss, uniform, metrics, self.name, source)
        return f"GUARD-INIT-LOSS ok: step-0 {self.name} loss {loss:.6f} = {uniform:.6f} (the reference is the start)"

    def check_first_gradient(self, grad_norm: float, trainable: int, eps: float) -> None:
        """GUARD-PREF-NO-GRADIENT for the sigmoid losses, whose start gradient is beta/2 x the margin's (IPO's grows
        as 1/beta: a small tau is no vanishing gradient)."""
        if self.loss_type != "ipo":
            guards.check_preference_gradient(grad_norm, trainable, eps, self.beta, self.name)

    def watch(self, record: dict[str, Any]) -> list[str]:
        return self.watcher.update(record)

    def progress_fields(self, record: dict[str, Any]) -> str:
        """The progress line's preference fields: the share of pairs whose chosen reward beats the rejected one, the
        mean reward margin."""
        return format_fields(record, (("acc", "rewards/accuracies", ".3f"), ("margin", "rewards/margins", ".3f")))

    def state_dict(self) -> dict[str, Any]:
        return self.watcher.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.watcher.load_state_dict(sd)


def objective_for(name: str, beta: float = DEFAULT_BETA, mode: str = "full") -> CausalLMLoss | PreferenceLoss:
    """The objective of `--objective NAME` (sft: cross-entropy) for `--mode`: a preference objective's reference
    is the adapters switched off (lora, qlora) or a frozen copy (full)."""
    if name == "sft":
        return CausalLMLoss()
    return PreferenceLoss(name, beta, "frozen-copy" if mode == "full" else "adapters-off")


__all__ = ["DEFAULT_BETA", "OBJECTIVES", "PREFERENCE_LOSSES", "CausalLMLoss", "Objective", "PreferenceLoss",
           "head_positions", "objective_for", "sequence_logps", "takes_head_at", "to_device"]
