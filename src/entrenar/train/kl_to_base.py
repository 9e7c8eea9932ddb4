"""`finetune --kl-to-base BETA`: supervised fine-tuning with a pull towards the base model on chosen rows.

The loss of a step is (cross-entropy summed over the step's label tokens + BETA x the KL summed over the chosen
rows' label tokens) / the step's label tokens, where a token's KL is the forward KL of the base's next-token
distribution to the model's, over the whole vocabulary: KL(p_base || p_model) = sum_v p_base(v) (log p_base(v) -
log p_model(v)) (the distillation direction: the model is pulled to keep every answer the base gave weight to).
The chosen rows are those `--mix` added (`--kl-rows mix`, the default: the replay rows of `data replay`) or every
row (`--kl-rows all`). The base is the model with its adapters switched off (LoRA/QLoRA: no second copy) or a
frozen copy of the starting model (full fine-tuning), as DPO's reference (train/objective.py). At step 0 the model
is the base, so the KL is 0 and the loss is the plain cross-entropy.

The KL needs both models' logits over the vocabulary: this objective computes the model's logits (not the fused
linear cross-entropy) and takes the cross-entropy from them, so it costs [tokens, vocab] activations; it is not
captured in CUDA graphs (an objective other than causal-lm). tests/test_kl_to_base.py checks the loss and its
gradient against a float64 reference.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import InputError
from ..tensors import IGNORE_INDEX
from .objective import CausalLMLoss, model_inputs, to_device

KL_ROWS = ("mix", "all")
KL_TOKENS = "_kl_tokens"  # a metric sum only: the chosen rows' label tokens, for kl_to_base per token


def token_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) per position [...] in fp32 from logits [..., V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ref_logp = torch.log_softmax(ref_logits.float(), dim=-1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(dim=-1)


class SFTWithKL(CausalLMLoss):
    name = "sft-kl"

    def __init__(self, beta: float, reference: str):
        if not (math.isfinite(beta) and beta > 0):
            raise InputError(f"--kl-to-base must be a finite number > 0, got {beta}")
        assert reference in ("adapters-off", "frozen-copy"), reference
        self.beta, self.reference = float(beta), reference
        self.reference_model: torch.nn.Module | None = None

    def bind(self, model: torch.nn.Module) -> None:
        """The base: a frozen copy of the starting model (full), or the adapters switched off (LoRA/QLoRA)."""
        if self.reference == "frozen-copy":
            self.reference_model = copy.deepcopy(model).requires_grad_(False).eval()
            return
        from ..peft import lora_modules

        if not lora_modules(model):
            raise InputError("--kl-to-base with the adapters-off base needs a LoRA/QLoRA model (--mode lora|qlora)")

    def _ref_logits(self, model: torch.nn.Module, b: dict) -> torch.Tensor:
        from ..peft import adapters_disabled

        kwargs = model_inputs(b)
        with torch.no_grad():
            if self.reference_model is not None:
                return self.reference_model(b["input_ids"], **kwargs)
            with adapters_disabled(model):
                return model(b["input_ids"], **kwargs)

    def loss(self, model: torch.nn.Module, batch: dict, device: torch.device
             ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        if "kl_mask" not in batch:  # no chosen row in this batch: the plain (fused) cross-entropy
            loss_sum, n, _ = super().loss(model, batch, device)
            zero = torch.zeros((), device=loss_sum.device)
            return loss_sum, n, {"kl_to_base": zero, KL_TOKENS: zero.clone()}
        b = to_device(batch, device)
        logits = model(b["input_ids"], **model_inputs(b))
        ce = F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
        mask = b["kl_mask"] & (b["labels"] != IGNORE_INDEX)
        kl = (token_kl(logits, self._ref_logits(model, b)) * mask).sum()
        return ce + self.beta * kl, self.count(batch), {"kl_to_base": kl.detach(), KL_TOKENS: mask.sum().float()}

    def step_metrics(self, sums: dict[str, float], loss_tokens: int) -> dict[str, Any]:
        tokens = sums.get(KL_TOKENS, 0.0)
        return {"kl_to_base": sums.get("kl_to_base", 0.0) / tokens if tokens else 0.0}
