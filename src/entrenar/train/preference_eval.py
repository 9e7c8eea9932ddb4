"""`entrenar eval --data PAIRS.jsonl` (issue 38 item 11): a model's DPO implicit rewards on preference pairs,
beta * (logp_policy - logp_reference) of each chosen and rejected response, against a reference model.

The numbers are the trainer's: `evaluate` (train/loop.py) with the run's own PreferenceLoss, whose `loss` computes
every log-prob through `sequence_logps` (no second copy), so eval of a run's final/ on its eval pairs reproduces the
last row of its eval.jsonl. `details` adds what only eval reports: the reference's log-probs and the tied pairs.

The reference (`plan_reference`, before any model loads), in order:
  --ref-model MODEL          that model (its vocabulary and tokenizer must be the policy's);
  a LoRA/QLoRA adapter       (MODEL is one, a LoRA run, or --adapter DIR) the same model with its adapters switched
                             off: its base, as a LoRA preference run's reference was;
  a full fine-tune's run     (MODEL is RUN, RUN/final or one of its checkpoints) the model the run started from, as
                             its run.json records it: what the run's frozen copy was made of;
  anything else              no reference: exit 2 naming --ref-model.
beta: --beta, else the run's when MODEL is a preference run, else DEFAULT_BETA; the loss is the run's objective
(dpo for any other model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from ..formats import resolve_model
from ..peft import adapter_path, is_adapter_dir
from .checkpoint import RUN_JSON, run_record_problem
from .objective import DEFAULT_BETA, PREFERENCE_LOSSES, PreferenceLoss

KINDS = ("--ref-model", "adapters-off", "run-start")
# eval's keys -> the trainer's metric of the same number (metrics.jsonl / eval.jsonl)
TRAINER_KEYS = {"reward_accuracy": "rewards/accuracies", "reward_margin": "rewards/margins",
                "reward_chosen": "rewards/chosen", "reward_rejected": "rewards/rejected",
                "logps_chosen": "logps/chosen", "logps_rejected": "logps/rejected", "nll_chosen": "nll/chosen"}
DETAIL_KEYS = {"ref_logps_chosen": "ref_logps/chosen", "ref_logps_rejected": "ref_logps/rejected",
               "reward_ties": "rewards/ties"}


@dataclass
class Reference:
    """What the policy is measured against: `kind` (KINDS), `model` (its MODEL spec), and the run the evaluated
    model belongs to (its directory and run.json), when it is one of ours."""

    kind: str
    model: str
    run_dir: Path | None = None
    run: dict[str, Any] | None = None

    def describe(self) -> str:
        if self.kind == "adapters-off":
            return f"the base without the adapter ({self.model})"
        if self.kind == "run-start":
            return f"the model its run started from ({self.model})"
        return f"--ref-model {self.model}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model, **({"run": str(self.run_dir)} if self.kind == "run-start"
                                                          else {})}


def run_of(model_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """(RUN, its run.json) for RUN/final and RUN/checkpoints/step-N of a run of ours (run_record_problem), else None."""
    real = Path(model_dir).resolve()
    if real.name == "final":
        run = real.parent
    elif real.parent.name == "checkpoints":
        run = real.parent.parent
    else:
        return None
    if run_record_problem(run) is not None:
        return None
    return run, json.loads((run / RUN_JSON).read_text())


def _started_from(record: dict[str, Any] | None) -> str | None:
    """The MODEL a full fine-tune started from (its frozen copy's weights), as its run.json records it."""
    if not record or record.get("command") != "finetune" or (record.get("config") or {}).get("mode") != "full":
        return None
    spec = (record.get("model") or {}).get("spec")
    return spec if isinstance(spec, str) and spec else None


def plan_reference(model_spec: str, adapter: str | None, ref_model: str | None) -> Reference:
    """The reference of `eval MODEL [--adapter DIR] [--ref-model REF]` on pairs (the module docstring), found
    before any model loads: a model without one is exit 2 naming --ref-model."""
    from ..peft.base_location import locate_base

    path = resolve_model(model_spec)
    adapter_dir = adapter_path(adapter) if adapter else (path if is_adapter_dir(path) else None)
    found = run_of(adapter_dir if adapter_dir is not None else path)
    run_dir, record = found if found is not None else (None, None)
    if ref_model is not None:
        resolve_model(ref_model)  # not a model: exit 2 now
        return Reference("--ref-model", str(ref_model), run_dir, record)
    if adapter_dir is not None:
        base = str(model_spec) if adapter else locate_base(path, str(model_spec))[0]
        return Reference("adapters-off", base, run_dir, record)
    start = _started_from(record)
    if start is not None:
        try:
            resolve_model(start)
        except InputError as e:
            raise InputError(f"{model_spec}: the model its run {run_dir} started from (run.json: {start}) is the "
                             f"reference, and it cannot be read here ({e}); give the reference with --ref-model "
                             f"MODEL") from e
        return Reference("run-start", start, run_dir, record)
    raise InputError(f"eval on preference pairs measures MODEL's rewards against a reference model, and {model_spec} "
                     f"has none of its own: it is neither a LoRA/QLoRA adapter (whose reference is its base without "
                     f"the adapter) nor a full fine-tune's run (whose reference is the model its run.json records it "
                     f"started from). Give the reference with --ref-model MODEL (e.g. the model it was fine-tuned "
                     f"from)")


def objective_for_eval(ref: Reference, beta: float | None) -> tuple[PreferenceLoss, str]:
    """(the PreferenceLoss that measures the pairs, where its beta came from: "--beta", "run" or "default")."""
    config = (ref.run or {}).get("config") or {}
    preference_run = config.get("objective") in PREFERENCE_LOSSES
    if beta is not None:
        source = "--beta"
    elif preference_run:
        beta, source = config.get("beta", DEFAULT_BETA), "run"
    else:
        beta, source = DEFAULT_BETA, "default"
    return PreferenceLoss(config["objective"] if preference_run else "dpo", beta, details=True), source


def attach_reference(ref: Reference, objective: PreferenceLoss, policy: torch.nn.Module, policy_tok: Any,
                     device: str, kernels: str) -> None:
    """Give `objective` its reference: the policy's adapters switched off, or `ref.model` loaded (its vocabulary
    and tokenizer must be the policy's: the pairs' token ids are read by both)."""
    if ref.kind == "adapters-off":
        objective.bind(policy)  # a LoRA/QLoRA model: its adapters switch off
        return
    from ..peft.load import load_any_model
    from ..tokenizer import encoding_sha256

    model, tok, _ = load_any_model(ref.model, device, kernels)
    what = f"--ref-model {ref.model}" if ref.kind == "--ref-model" else f"the run's starting model {ref.model}"
    mine, theirs = policy.cfg.vocab_size, model.cfg.vocab_size
    if mine != theirs:
        raise InputError(f"{what} has vocab_size {theirs}, the evaluated model {mine}: a reference must read the "
                         f"same token ids; give a reference of the same tokenizer with --ref-model MODEL")
    if tok is not None and policy_tok is not None and encoding_sha256(tok) != encoding_sha256(policy_tok):
        raise InputError(f"{what} has another tokenizer than the evaluated model (the same vocab_size, a different "
                         f"encoding): its log-probs would be of other text; give a reference of the same tokenizer "
                         f"with --ref-model MODEL")
    objective.use_reference(model)


def pair_metrics(ev: dict[str, Any]) -> dict[str, Any]:
    """`evaluate`'s result with a PreferenceLoss(details=True) -> eval's keys (means over the pairs)."""
    out = {"pairs": ev["tokens"], "batches": ev["batches"], "loss": ev["loss"]}
    out.update({ours: ev[theirs] for ours, theirs in {**TRAINER_KEYS, **DETAIL_KEYS}.items() if theirs in ev})
    return out


__all__ = ["DETAIL_KEYS", "KINDS", "TRAINER_KEYS", "Reference", "attach_reference", "objective_for_eval",
           "pair_metrics", "plan_reference", "run_of"]
