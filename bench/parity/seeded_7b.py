"""The 7B preset's full shapes (28 blocks, hidden 3584, vocab 152,064) on one GPU with the real Triton kernels:
a clean --dtype bf16 preflight passes the depth-grown bounds, and each seeded defect (RoPE pairing, dropped
Q/K/V bias, eps read as 1e-5, non-causal attention) stops it naming its op (issue 23). One float64 reference
on the host (61 GB), built once and shared (verify.bisect.CachedPath).

    PYTHONPATH=src python bench/parity/seeded_7b.py [--layers 28] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

import entrenar.model as model_mod
from entrenar.config import preset
from entrenar.kernels import TORCH_OPS, get_ops
from entrenar.kernels.rmsnorm import rms_norm_reference
from entrenar.kernels.rope import rope_reference
from entrenar.model import Attention, CausalLM
from entrenar.verify.bisect import CachedPath, OurPath, bounds_for, reference_model, verify_model
from entrenar.verify.probe import ProbeSequence


def seeded(defect: str) -> tuple[object, object]:
    """(ops of the path under test, Attention.forward) with one defect; the oracle keeps TORCH_OPS."""
    triton = get_ops("triton")
    forward = Attention.forward
    if defect == "rope":
        return dataclasses.replace(triton, rope=lambda q, k, cos, sin, style: rope_reference(
            q, k, cos, sin, "gptj" if style == "neox" else "neox")), forward
    if defect == "eps":
        return dataclasses.replace(triton, rms_norm=lambda x, w, eps: rms_norm_reference(x, w, 1e-5)), forward
    if defect == "bias":
        def no_bias(self, x, cos, sin, mask, ops, cache=None):
            if ops is TORCH_OPS:
                return forward(self, x, cos, sin, mask, ops, cache)
            mods = (self.q_proj, self.k_proj, self.v_proj)
            saved = [m.bias for m in mods]
            for m in mods:
                m.bias = None
            try:
                return forward(self, x, cos, sin, mask, ops, cache)
            finally:
                for m, b in zip(mods, saved):
                    m.bias = b
        return triton, no_bias
    if defect == "causal":
        def bidirectional(self, x, cos, sin, mask, ops, cache=None):
            if ops is not TORCH_OPS and mask is None:
                mask = torch.ones(x.shape[0], 1, x.shape[1], x.shape[1], dtype=torch.bool, device=x.device)
            return forward(self, x, cos, sin, mask, ops, cache)
        return triton, bidirectional
    return triton, forward


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (a CPU check of this script)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cfg = dataclasses.replace(preset("qwen2.5-coder-7b"), num_layers=a.layers)
    if a.vocab:
        cfg = dataclasses.replace(cfg, vocab_size=a.vocab)
    t0 = time.time()
    with torch.device(a.device):
        model = CausalLM(cfg, kernels="triton")
    model.init_weights(0)
    with torch.no_grad():
        gen = torch.Generator(device=a.device).manual_seed(1)
        for name, prm in model.named_parameters():
            if name.endswith(".bias"):
                prm.copy_(0.5 * torch.randn(prm.shape, generator=gen, device=a.device))
    model.eval()
    oracle = CachedPath(OurPath(reference_model(model), label="cpu fp64 kernels=torch (reference)"))
    gen = torch.Generator().manual_seed(0)
    probe = [ProbeSequence("short", torch.randint(0, cfg.vocab_size, (1, 9), generator=gen)),
             ProbeSequence("long", torch.randint(0, cfg.vocab_size, (1, a.tokens), generator=gen))]
    print(f"built {cfg.num_layers} blocks + fp64 reference in {time.time() - t0:.0f}s; bf16 bounds "
          f"{bounds_for('bf16', cfg)}", flush=True)
    rows = []
    real_get_ops, real_forward = model_mod.get_ops, Attention.forward
    for defect in ("none", "rope", "bias", "eps", "causal"):
        ops, forward = seeded(defect)
        model_mod.get_ops = lambda kind, ops=ops: TORCH_OPS if kind == "torch" else ops
        Attention.forward = forward
        try:
            for dtype in (torch.float32, torch.bfloat16):  # the preflight's two passes
                t1 = time.time()
                rep = verify_model(model, probe=probe, dtype=dtype, grads=False, oracle=oracle)
                fd = rep["first_divergent"] or {}
                row = {"defect": defect, "dtype": rep["dtype"], "ok": rep["ok"], "first": fd.get("name"),
                       "rel_l2": fd.get("rel_l2"), "bound": fd.get("bound"), "hint": fd.get("hint"),
                       "logits_rel_l2": [s["logits_rel_l2"] for s in rep["sequences"]],
                       "logits_bound": rep["bounds"]["logits"], "seconds": round(time.time() - t1, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            model_mod.get_ops, Attention.forward = real_get_ops, real_forward
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
