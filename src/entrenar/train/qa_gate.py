"""GUARD-QA: `qa`'s gates (verify/qa.py) on the base before a fine-tune and on the final model after it.

A fine-tune that destroys the model (lr 0.01 on a LoRA: "1 plus 4 plus 4 plus 4 ...") can still end with exit 0
and a falling loss. The four golden prompts take seconds; a gate that passed on the base and fails on the final
model (a prompt whose every gate passed on the base and one fails at the end) is GUARD-QA: a warning in the
summary's `warnings` (`--on-qa-fail warn`, the default) or exit 3 after final/ is written (`stop`). A prompt the
base already failed (a tiny or untrained model) is not the fine-tune's doing and is not reported. `off` skips both
runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from ..errors import GuardError, InputError

QA_POLICIES = ("warn", "stop", "off")


def qa_report(model: Any, tokenizer: Any, device: str = "cpu", dtype: str = "fp32",
              log: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """qa's report on `model` (its chat prompts only when the tokenizer has a chat template), under the run's
    autocast (a LoRA's frozen base is stored in bf16 on a GPU); None without a tokenizer, or when the golden prompts
    do not fit the model's context (a tiny test model): GUARD-QA is then not checked, and `log` says why."""
    import torch

    from ..devices import BF16_COMPUTE
    from ..peft.nf4_linear import dequantized_for_inference
    from ..verify.qa import GOLDEN, run_qa

    if tokenizer is None:
        return None
    prompts = GOLDEN if getattr(tokenizer, "chat_template", None) else tuple(g for g in GOLDEN if g.kind == "plain")
    # a QLoRA base on the CPU: its NF4 weights dequantized once for qa's decoding, not at every step
    kept = dequantized_for_inference(model) if torch.device(device).type == "cpu" else contextlib.nullcontext()
    try:
        with kept, torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=dtype in BF16_COMPUTE):
            return run_qa(model, tokenizer, prompts)
    except InputError as e:  # a golden prompt longer than the model's context
        if log is not None:
            log(f"GUARD-QA: not checked ({e})")
        return None


def qa_regressions(base: dict[str, Any], final: dict[str, Any]) -> list[dict[str, Any]]:
    """The golden prompts the base answered passing every gate and the final model fails: [{prompt, gates (the
    failed ones), output, notes}]. A prompt the base already failed (a tiny or untrained model) is not the
    fine-tune's doing."""
    before = {p["name"]: p for p in base["prompts"]}
    out = []
    for p in final["prompts"]:
        b = before.get(p["name"])
        if b is None or not all(b["gates"].values()) or all(p["gates"].values()):
            continue
        out.append({"prompt": p["name"], "gates": [g for g, ok in p["gates"].items() if not ok],
                    "output": p["output"][:200], "notes": p["notes"]})
    return out


def judge(base: dict[str, Any] | None, final: dict[str, Any] | None, policy: str) -> dict[str, Any] | None:
    """GUARD-QA's verdict: None when quiet, the warning (policy warn) or a GuardError (stop: exit 3)."""
    assert policy in QA_POLICIES, policy
    if base is None or final is None or policy == "off":
        return None
    lost = qa_regressions(base, final)
    if not lost:
        return None
    shown = "; ".join(f"{r['prompt']} ({', '.join(r['gates'])}): {r['output']!r}" for r in lost[:4])
    message = (f"GUARD-QA: qa's gates passed on the base and fail on the final model ({len(lost)}: {shown}). The "
               f"fine-tune damaged what the model could do (too high a --lr, too many steps on narrow rows)")
    remedy = ("lower --lr or --steps, mix general rows in (`entrenar data replay`), add --retain-task chat, and check "
              "with `entrenar qa RUN/final`")
    if policy == "stop":
        raise GuardError("GUARD-QA", message + "; final/ was written.", remedy, details={"lost": lost})
    return {"guard": "GUARD-QA", "message": f"{message}. Remedy: {remedy}", "lost": lost}


def ok_of(report: dict[str, Any]) -> bool:
    return all(all(p["gates"].values()) for p in report["prompts"])
