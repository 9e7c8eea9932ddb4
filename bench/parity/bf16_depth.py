"""bf16 (or fp32) rounding error of the forward against float64, as a function of depth and width (CPU).

Random init (the preset's own init), real widths, reduced depth and vocabulary: the measurements behind
the depth-scaled bf16 bounds of verify/bisect.py (docs/design.md, "Numerics"). CPU autocast bf16 rounds
every matmul input to bf16 and accumulates in fp32, as the GPU path does.

    PYTHONPATH=src python bench/parity/bf16_depth.py --preset qwen2.5-0.5b --layers 1 2 4 8 --tokens 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import torch

from entrenar.config import preset
from entrenar.model import CausalLM
from entrenar.tensors import rel_l2
from entrenar.verify.trace import FilteredTrace, keep_layers, record_ours


def measure(name: str, layers: int, tokens: int, vocab: int, seed: int = 0, dtype: str = "bf16") -> dict:
    cfg = dataclasses.replace(preset(name), num_layers=layers, vocab_size=vocab)
    torch.manual_seed(seed)
    model = CausalLM(cfg, kernels="torch")
    model.init_weights(seed)
    model.eval()
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))
    out = {}
    test = ("test", torch.float32, torch.bfloat16 if dtype == "bf16" else None)
    for label, param_dtype, ctx in (("ref", torch.float64, None), test):
        m = model.to(param_dtype)
        trace = FilteredTrace(keep_layers)
        with torch.no_grad(), torch.autocast("cpu", dtype=ctx or torch.float32, enabled=ctx is not None), \
                record_ours(m, trace, keep_layers):
            logits = m(ids)
        out[label] = (logits[0].double(), {k: v.double() for k, v in dict(trace).items()})
    (lr, tr), (lb, tb) = out["ref"], out["test"]
    per_layer = {k: rel_l2(tb[k], tr[k]) for k in tr if k in tb}
    return {"dtype": test[2] and "bf16" or "fp32", "preset": name, "layers": layers, "hidden": cfg.hidden_size, "tokens": tokens, "vocab": vocab,
            "logits": rel_l2(lb, lr), "norm": per_layer.get("norm"),
            "worst_layer": max(v for k, v in per_layer.items() if k.startswith("layers.")),
            "last_layer": per_layer.get(f"layers.{layers - 1}")}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--preset", required=True)
    p.add_argument("--layers", type=int, nargs="+", required=True)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    a = p.parse_args()
    for n in a.layers:
        for s in range(a.seeds):
            r = measure(a.preset, n, a.tokens, a.vocab, s, a.dtype)
            u = 2 ** -8 if a.dtype == "bf16" else 2 ** -24
            r["logits_over_u_sqrt_depth"] = r["logits"] / (u * math.sqrt(n + 1))
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
