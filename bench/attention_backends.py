"""Causal GQA attention kernels at long context (issue 25 goal 6): which SDPA backend, and what
--save-attention buys, on one GPU.

    PYTHONPATH=src python -m bench.attention_backends --out DIR [--lengths 32768,131072] [--layers 4]

1. Kernels: Qwen2.5-0.5B's attention (14 query heads, 2 kv heads, head_dim 64, bf16, batch 1) through
   torch's SDPA with one backend at a time: flash (GQA in the kernel), cuDNN (GQA in the kernel, else the
   kv heads repeated), memory-efficient (kv repeated). Correctness at 4,096 tokens against float64 math
   (output and the three input gradients, relL2); forward and forward + backward ms and TFLOP/s at each
   length (causal FLOPs: 2 x 2 x S^2 x heads x head_dim / 2 forward, 2.5x that backward).
2. Model: entrenar's CausalLM with Qwen2.5-0.5B widths and --layers blocks, checkpointing + offload + MLP
   chunks (the long-context flags), with and without --save-attention, each under the default SDPA
   choice and under cuDNN first: forward + backward seconds and peak GiB, loss equal.
Writes DIR/attention_backends.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, KV, D = 14, 2, 64
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def attend(q, k, v, backend: str, gqa_in_kernel: bool):
    if not gqa_in_kernel:
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    with sdpa_kernel([BACKENDS[backend]]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa_in_kernel)


def inputs(seq: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, h, seq, D, device="cuda", dtype=dtype, generator=g).requires_grad_()
    return mk(H), mk(KV), mk(KV)


def variant_ok(backend: str, gqa: bool) -> str | None:
    q, k, v = inputs(256)
    try:
        attend(q, k, v, backend, gqa).sum().backward()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - a backend that cannot take this shape is a row, not a crash
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def correctness(backend: str, gqa: bool, seq: int = 4096) -> dict:
    q, k, v = inputs(seq)
    out = attend(q, k, v, backend, gqa)
    go = torch.randn_like(out)
    out.backward(go)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = k64.repeat_interleave(H // KV, dim=1), v64.repeat_interleave(H // KV, dim=1)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q64, kk, vv, is_causal=True)
    ref.backward(go.double())
    return {"out": rel_l2(out, ref), "dq": rel_l2(q.grad, q64.grad), "dk": rel_l2(k.grad, k64.grad),
            "dv": rel_l2(v.grad, v64.grad)}


def cuda_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timing(backend: str, gqa: bool, seq: int) -> dict:
    q, k, v = inputs(seq)
    go = torch.randn(1, H, seq, D, device="cuda", dtype=torch.bfloat16)
    reps = 5 if seq <= 65536 else 3

    def fwd():
        with torch.no_grad():
            attend(q, k, v, backend, gqa)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        attend(q, k, v, backend, gqa).backward(go)

    fwd(), fwd_bwd()  # warm-up
    f, fb = cuda_ms(fwd, reps), cuda_ms(fwd_bwd, reps)
    flops_f = 2 * 2 * seq * seq * H * D / 2
    return {"fwd_ms": round(f, 2), "fwd_bwd_ms": round(fb, 2), "fwd_tflops": round(flops_f / f / 1e9, 1),
            "fwd_bwd_tflops": round(3.5 * flops_f / fb / 1e9, 1)}


def train_step(model, ids: torch.Tensor, order) -> float:
    ctx = sdpa_kernel(order, set_priority=True) if order else torch.enable_grad()
    with ctx:
        loss_sum, n = model(ids, labels=ids)
        (loss_sum / n).backward()
    model.zero_grad(set_to_none=True)
    return float(loss_sum / n)


def model_rows(seq: int, layers: int) -> list[dict]:
    from types import SimpleNamespace

    from bench.long_context_memory import random_init_
    from entrenar.config import preset
    from entrenar.long_context import apply_memory_options
    from entrenar.model import CausalLM

    rows = []
    cfg = preset("qwen2.5-0.5b")
    cfg.num_layers, cfg.max_position_embeddings = layers, max(seq, cfg.max_position_embeddings)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g).cuda()
    for save in (False, True):
        for prefer in ("default", "cudnn"):
            torch.cuda.empty_cache()
            with torch.device("cuda"):
                model = CausalLM(cfg, kernels="triton")
            random_init_(model)
            model = model.to(torch.bfloat16).train()
            apply_memory_options(model, SimpleNamespace(activation_checkpointing=True, offload_activations=True,
                                                        mlp_chunk=16384, save_attention=save))
            order = ([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH] if prefer == "cudnn" else None)

            row = {"seq": seq, "layers": layers, "save_attention": save, "sdpa": prefer}
            try:
                train_step(model, ids, order)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                loss = train_step(model, ids, order)
                torch.cuda.synchronize()
                row.update(seconds=round(time.perf_counter() - t0, 3), loss=loss,
                           peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            except Exception as e:  # noqa: BLE001 - recorded as the row's error
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--model-seq", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "cudnn": torch.backends.cudnn.version(), "kernels": [], "model": []}
    for backend in BACKENDS:
        for gqa in (True, False):
            row = {"backend": backend, "gqa_in_kernel": gqa}
            err = variant_ok(backend, gqa)
            if err:
                row["error"] = err
            else:
                row["relL2_vs_fp64_4096"] = correctness(backend, gqa)
                for seq in (int(x) for x in a.lengths.split(",")):
                    row[str(seq)] = timing(backend, gqa, seq)
            res["kernels"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if a.layers > 0:
        res["model"] = model_rows(a.model_seq, a.layers)
    (a.out / "attention_backends.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
