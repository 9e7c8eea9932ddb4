"""What a training step keeps for the backward, per token and decoder layer: entrenar vs transformers + Liger.

Issue 15, goal 2 asks for a peak at or under Liger's (18.1 GiB at Qwen2.5-0.5B, batch 8 x 2048, bf16 weights
and AdamW state); `--dtype bf16-pure` peaked at 19.0 GiB. With weights, gradients and AdamW state the same on
both sides (8 bytes per parameter), the difference is what the forward saves for the backward. This counts
it exactly, by dtype and shape, without a GPU: one decoder layer at the preset's real widths runs in the
Triton interpreter on the CPU (TRITON_INTERPRET=1, so the same autograd Functions as on the GPU save the same
tensors), every tensor saved for the backward is seen by `torch.autograd.graph.saved_tensors_hooks`, each
storage counted once, parameters left out (they are not activations), each saving attributed to the module
that was running. Attention is counted as a flash kernel saves it on the GPU (q, k, v, out, fp32
log-sum-exp; its output is o_proj's input there) on both sides, whatever the CPU's SDPA kept.

    PYTHONPATH=src python bench/saved_activations.py --model qwen2.5-0.5b

Prints a JSON line per side and the per-module breakdown; `--tokens` and `--batch` scale the total to a
step's size (8 x 2048 as in the issue's table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import defaultdict

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from entrenar.config import preset
from entrenar.kernels import cross_entropy
from entrenar.model import CausalLM

GIB = 1 << 30


class SavedCounter:
    """Counts the bytes of every storage saved for backward while active, by the innermost running module."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.by_module: dict[str, int] = defaultdict(int)
        self.items: list[tuple[str, str, tuple, int]] = []
        self.stack: list[str] = ["(top)"]
        self.in_attention = False  # SDPA's own saves are replaced by flash_saves()
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: self.stack.append(n)))
            self.handles.append(mod.register_forward_hook(lambda m, a, o: self._pop()))

    def _pop(self) -> None:  # a forward hook that returned the popped name would replace the module's output
        self.stack.pop()

    def pack(self, t: torch.Tensor):
        where = self.stack[-1]
        if self.in_attention:
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.params or ptr in self.seen or st.nbytes() == 0:
            return t
        self.seen.add(ptr)
        self.by_module[where] += st.nbytes()
        self.items.append((where, str(t.dtype).replace("torch.", ""), tuple(t.shape), st.nbytes()))
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def sdpa(self, real):
        def wrapped(*a, **kw):
            self.in_attention = True
            try:
                return real(*a, **kw)
            finally:
                self.in_attention = False
        return wrapped

    def close(self):
        for h in self.handles:
            h.remove()


def flash_saves(cfg, tokens: int) -> int:
    """What a flash-attention forward keeps beyond what the o_proj linear keeps anyway: q, k, v in bf16 and the
    fp32 log-sum-exp per head. Its output is saved too, but on the GPU flash/cuDNN return it in [B, T, H, D]
    memory, so the o_proj input (transpose + reshape, a view there) is the same storage, counted at o_proj."""
    d, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    return tokens * (2 * d * (h + kv + kv) + 4 * h)


def count(model, forward, cfg, tokens: int) -> SavedCounter:
    counter = SavedCounter(model)
    real = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = counter.sdpa(real)
    try:
        with counter.hooks():
            loss = forward()
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    loss.backward()  # the saved set must be usable: a backward runs
    counter.close()
    for i in range(cfg.num_layers):
        counter.by_module[f"model.layers.{i}.self_attn (flash: q, k, v, lse)"] += flash_saves(cfg, tokens)
    return counter


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--seq", type=int, default=64, help="tokens in the measured forward (one sequence)")
    ap.add_argument("--batch", type=int, default=8, help="the step to scale to: batch x --tokens")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()

    full = preset(args.model)
    # two layers: the second's saves are one layer's own (tables shared by all layers are counted at the first)
    cfg = dataclasses.replace(full, num_layers=2)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq + 1))
    inp, lab = ids[:, :-1], ids[:, 1:]
    step_tokens = args.batch * args.tokens
    results = {}

    ours = CausalLM(cfg, kernels="triton")
    ours.init_weights(seed=1)
    ours = ours.to(torch.bfloat16)

    def fwd_ours():
        s, n = ours(inp, labels=lab)
        return s / n

    # the whole model's saves minus the layer's are embedding / final norm / head: measured, not scaled by layers
    c = count(ours, fwd_ours, cfg, args.seq)
    results["entrenar (bf16-pure)"] = c

    # transformers + Liger, from Liger 0.8.5's save_for_backward lists (its kernels do not run in the Triton
    # interpreter: a float argument has no .to there): LigerRMSNormFunction keeps X and the fp32 RSTD per row,
    # LigerSiLUMulFunction a and b, the q/k/v, o, gate/up and down linears their inputs, attention as above.
    h, i = cfg.hidden_size, cfg.intermediate_size
    liger_layer = 2 * (2 * h + 4) + 2 * h + flash_saves(cfg, 1) + 2 * h + 2 * h + 3 * 2 * i
    print(json.dumps({"side": "transformers + Liger (from its source)", "model": args.model,
                      "bytes_per_token_per_layer": liger_layer,
                      "saved_gib_per_step_layers": round(step_tokens * liger_layer * full.num_layers / GIB, 3)}))

    for side, c in results.items():
        per_tok_layer = sum(b for m, b in c.by_module.items() if "layers.1." in m) / args.seq
        first = sum(b for m, b in c.by_module.items() if "layers.0." in m) / args.seq
        # outside the layers: [vocab, hidden] saves (the CE's finished grad_weight) do not grow with tokens
        fixed = sum(nb for where, _, shape, nb in c.items if "layers." not in where and cfg.vocab_size in shape)
        per_tok_outside = (sum(b for m, b in c.by_module.items() if "layers." not in m) - fixed) / args.seq
        total = step_tokens * (first + per_tok_layer * (full.num_layers - 1) + per_tok_outside) + fixed
        # at the forward's end (the step's peak): bf16 weights and the two bf16 AdamW moments (gradients are None
        # until the backward makes them while it frees activations), and the CE's one logits chunk in flight
        with torch.device("meta"):
            n_params = sum(p.numel() for p in CausalLM(full).parameters())
        chunk = min(cross_entropy._CHUNK_BYTES, step_tokens * full.vocab_size * 2)
        print(json.dumps({"side": side, "model": args.model, "bytes_per_token_per_layer": round(per_tok_layer, 1),
                          "bytes_per_token_outside_layers": round(per_tok_outside, 1),
                          "fixed_bytes_outside_layers": fixed, "step_tokens": step_tokens,
                          "layers": full.num_layers, "saved_gib_per_step": round(total / GIB, 3),
                          "weights_and_adamw_gib": round(6 * n_params / GIB, 3), "ce_chunk_gib": round(chunk / GIB, 3),
                          "predicted_peak_gib": round((total + 6 * n_params + chunk) / GIB, 2)}))
        for m, b in sorted(c.by_module.items()):
            print(f"    {m:<55} {b / args.seq:9.1f} B/token")
        for where, dt, shape, nb in c.items:
            print(f"      saved: {where:<45} {dt:<9} {shape!s:<24} {nb:12d} B")


if __name__ == "__main__":
    main()
