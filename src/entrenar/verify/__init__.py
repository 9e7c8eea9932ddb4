"""Oracle parity: `entrenar verify`, the training preflight, and `entrenar qa`.

- ``verify_model(model, tokenizer, against="reference"|"hf")``: probe -> logits, CE, per-layer
  hidden states, per-op relL2 in the first block over its bound, gradients; names the first op
  that diverges.
- ``preflight(model, tokenizer, device, dtype, kernels)``: the seconds-long version every
  training run does before step 1; raises GuardError (exit 3) naming the op/layer.
"""

from .bisect import BOUNDS, OP_ORDER, Bounds, bounds_for, format_report, rel_l2, verify_model
from .preflight import preflight

__all__ = ["BOUNDS", "OP_ORDER", "Bounds", "bounds_for", "format_report", "preflight", "rel_l2", "verify_model"]
