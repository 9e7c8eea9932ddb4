"""A/B in one process: the training step with the fused residual add + RMSNorm block (model.Block) vs the
two-op block (x + attn, then RMSNorm), Qwen2.5-0.5B shapes, batch 8 x 2048, random weights, Triton kernels,
fp32 weights + bf16 autocast and bf16 weights; alternating runs of 10 steps after 2 warm-up steps.

    PYTHONPATH=src python bench/add_rms_norm_ab.py
"""
import time

import torch

from entrenar.config import preset
from entrenar.model import Block, CausalLM

cfg = preset("qwen2.5-0.5b")
torch.manual_seed(0)
with torch.device("cuda"):
    m = CausalLM(cfg, kernels="triton")
opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
ids = torch.randint(0, cfg.vocab_size, (8, 2048), device="cuda")
def step():
    with torch.autocast("cuda", torch.bfloat16):
        loss, n = m(ids, labels=ids)
    (loss / n).backward()
    opt.step(); opt.zero_grad(set_to_none=True)
def bench(k=10):
    for _ in range(2): step()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(k): step()
    torch.cuda.synchronize(); return 16384 * k / (time.perf_counter() - t)
orig = Block.forward
def two_op(self, x, cos, sin, mask, ops, cache=None):
    x = x + self.self_attn(self.input_layernorm(x, ops), cos, sin, mask, ops, cache)
    return x + self.mlp(self.post_attention_layernorm(x, ops), ops)
res = {}
for name in ("fused", "two-op", "fused", "two-op"):
    Block.forward = orig if name == "fused" else two_op
    res.setdefault(name, []).append(round(bench()))
print("fp32 weights + bf16 autocast, qwen2.5-0.5b 8x2048, tok/s:", res)
m.to(torch.bfloat16); opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
res = {}
for name in ("fused", "two-op", "fused", "two-op"):
    Block.forward = orig if name == "fused" else two_op
    res.setdefault(name, []).append(round(bench()))
print("bf16 weights, tok/s:", res)
