"""A/B of the NF4 paths on one GPU (issue 36 item 3), one call, every check and timing:

    PYTHONPATH=src python bench/nf4_matmul_ab.py --out DIR            # GPU
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/nf4_matmul_ab.py --tiny   # CPU: the plumbing

1. dequantize: session 17's element-wise kernel (each value reads its byte and its block's scale) against the
   block-wise one of kernels/nf4.py (a byte gives two values, a block's scale computed once), on the
   Qwen2.5-Coder-7B linears in bf16: equal outputs, time, GB/s, and the sum over one QLoRA step (every linear
   of 28 blocks dequantized 3 times: forward, recomputed forward, backward).
2. nf4_linear (kernels/nf4_matmul.py, the weight dequantized inside the matmul) against dequantize + cuBLAS,
   by rows (1 ... 4096) and shape: relL2 against the unfused output, time, and a sweep of tiles.
3. decode: a whole QLoRA Qwen2.5-Coder-7B (28 blocks, random weights, r16 on every linear), greedy
   generate_batch at batch 1 and 16 (the static decoder's CUDA graph), fused (FUSED_MAX_ROWS as shipped)
   against unfused (FUSED_MAX_ROWS = 0): tokens/s and whether the tokens agree.

Timing: CUDA events around each call, median of --reps, a 256 MiB write before each to evict the L2 (a
decoder streams every weight once a token: none of it is in the L2 when its matmul starts). Prints JSON lines
and writes DIR/nf4_ab.json and DIR/nf4_ab.md.
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

from entrenar.kernels import nf4

SHAPES = {"q_proj/o_proj": (3584, 3584), "k_proj/v_proj": (512, 3584), "gate_proj/up_proj": (18944, 3584),
          "down_proj": (3584, 18944)}
PER_BLOCK = {"q_proj/o_proj": 2, "k_proj/v_proj": 2, "gate_proj/up_proj": 2, "down_proj": 1}
ROWS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)
SWEEP_SMALL = [(16, 32, 128, 4, 1), (16, 64, 128, 4, 1), (16, 32, 256, 4, 1), (16, 16, 128, 2, 1),
               (16, 32, 128, 4, 2), (16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 64, 4, 2)]
SWEEP_MID = [(64, 64, 128, 4, 1), (32, 64, 128, 4, 1), (64, 128, 64, 4, 1), (64, 64, 128, 4, 2),
             (32, 32, 128, 4, 2)]
SWEEP_LARGE = [(128, 128, 64, 8, 1), (128, 128, 128, 8, 1), (128, 256, 64, 8, 1), (64, 128, 64, 4, 1)]


def _old_dequant_kernel():
    """Session 17's kernels/nf4.py kernel, kept here as the A/B's 'before'."""
    import triton
    import triton.language as tl

    @triton.jit
    def old_kernel(packed_ptr, qscale_ptr, factor_ptr, mean_ptr, table_ptr, out_ptr, n,
                   BLOCK: tl.constexpr, QBLOCK: tl.constexpr, SBLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        byte = tl.load(packed_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
        shift = (1 - (offs % 2)) * 4
        code = (byte >> shift.to(tl.int32)) & 0xF
        level = tl.load(table_ptr + code, mask=mask, other=0.0)
        block = offs // QBLOCK
        q = tl.load(qscale_ptr + block, mask=mask, other=0).to(tl.float32)
        f = tl.load(factor_ptr + block // SBLOCK, mask=mask, other=1.0)
        scale = q / f + tl.load(mean_ptr)
        tl.store(out_ptr + offs, (level * scale).to(out_ptr.dtype.element_ty), mask=mask)

    def run(w: nf4.NF4Weight, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(w.numel, dtype=dtype, device=w.packed.device)
        old_kernel[(triton.cdiv(w.numel, 1024),)](w.packed, w.qscale, w.factor, w.mean.reshape(1),
                                                  nf4.nf4_table(w.packed.device), out, w.numel, BLOCK=1024,
                                                  QBLOCK=nf4.BLOCK_SIZE, SBLOCK=nf4.SCALE_BLOCK_SIZE)
        return out.view(w.shape)

    return run


class Timer:
    def __init__(self, device: str, reps: int):
        self.device, self.reps = device, reps
        self.flush = torch.empty(64 << 20, dtype=torch.float32, device=device) if device == "cuda" else None

    def ms(self, fn) -> float:
        fn()  # compile / warm
        if self.device != "cuda":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def dequant_ab(shapes: dict, timer: Timer, device: str) -> list[dict]:
    old = _old_dequant_kernel()
    rows = []
    for name, (n, k) in shapes.items():
        w = nf4.quantize(torch.randn(n, k, device=device) * 0.02)
        ref = nf4.dequantize_reference(w, torch.bfloat16)
        new_out, old_out = nf4.dequantize_triton(w, torch.bfloat16), old(w, torch.bfloat16)
        t_old = timer.ms(lambda: old(w, torch.bfloat16))
        t_new = timer.ms(lambda: nf4.dequantize_triton(w, torch.bfloat16))
        moved = w.nbytes() + w.numel * 2
        rows.append({"stage": "dequant", "shape": name, "n": n, "k": k, "old_ms": t_old, "new_ms": t_new,
                     "speedup": t_old / t_new, "new_gb_s": moved / t_new / 1e6, "old_gb_s": moved / t_old / 1e6,
                     "new_equals_reference": bool(torch.equal(new_out, ref)),
                     "old_equals_reference": bool(torch.equal(old_out, ref)),
                     "new_vs_reference_rel_l2": rel_l2(new_out, ref)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def linear_ab(shapes: dict, rows_list, timer: Timer, device: str, dtype: torch.dtype, sweep: bool) -> list[dict]:
    from entrenar.kernels.nf4_matmul import _tiles, nf4_linear

    out = []
    for name, (n, k) in shapes.items():
        w = nf4.quantize(torch.randn(n, k, device=device) * 0.02)
        for m in rows_list:
            x = torch.randn(m, k, device=device, dtype=dtype)

            def unfused():
                return F.linear(x, nf4.dequantize(w, dtype) if device == "cuda" else
                                nf4.dequantize_reference(w, dtype))
            ref = unfused()
            got = nf4_linear(x, w)
            row = {"stage": "linear", "shape": name, "rows": m, "tiles": list(_tiles(m, n, k)),
                   "rel_l2_vs_unfused": rel_l2(got, ref), "unfused_ms": timer.ms(unfused),
                   "fused_ms": timer.ms(lambda: nf4_linear(x, w))}
            row["speedup"] = row["unfused_ms"] / row["fused_ms"]
            if m <= 16:  # the LoRA epilogue against LoRALinear's unfused update (addmm on the base output)
                down = torch.randn(m, 16, device=device, dtype=dtype)
                lora_b = torch.randn(n, 16, device=device) * 0.02
                want = torch.addmm(ref, down, lora_b.t().to(dtype), alpha=2.0)
                row["lora_rel_l2_vs_unfused"] = rel_l2(nf4_linear(x, w, None, (down, lora_b, 2.0)), want)
            row["fused_gb_s"] = (w.nbytes() + x.numel() * x.element_size() + m * n * 2) / row["fused_ms"] / 1e6
            if sweep:
                cands = SWEEP_SMALL if m <= 16 else SWEEP_MID if m <= 64 else SWEEP_LARGE
                best = {}
                for t in cands:
                    if k % (t[2] * t[4]):
                        continue
                    best[str(list(t))] = timer.ms(lambda t=t: nf4_linear(x, w, tiles=t))
                row["sweep_ms"] = best
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def decode_ab(device: str, tiny: bool, batches, new_tokens: int) -> list[dict]:
    """Greedy decode of a whole QLoRA model, fused against unfused NF4 matmuls."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from generate_throughput import NoStops

    from entrenar import peft as ep
    from entrenar.config import preset
    from entrenar.generate import generate_batch
    from entrenar.kernels import nf4_matmul
    from entrenar.model import CausalLM

    cfg = preset("qwen2.5-coder-7b")
    if tiny:
        cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size = 2, 128, 256
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size = 4, 2, 512
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = CausalLM(cfg, kernels="triton" if device == "cuda" else "torch").to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    ep.apply_lora(model, rank=16, alpha=32, quantize_nf4=True)
    with torch.no_grad():  # a trained adapter: B nonzero, so the epilogue's term shows
        for mod in model.modules():
            if isinstance(mod, ep.LoRALinear):
                mod.lora_B.weight.normal_(0.0, 0.02)
    model.eval()
    shipped = nf4_matmul.FUSED_MAX_ROWS
    rows = []
    for batch in batches:
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, cfg.vocab_size, (32,), generator=g).tolist() for _ in range(batch)]
        result = {"stage": "decode", "batch": batch, "new_tokens": new_tokens}
        tokens = {}
        for label, limit in (("unfused", 0), ("fused", shipped), ("unfused_again", 0), ("fused_again", shipped)):
            nf4_matmul.FUSED_MAX_ROWS = limit
            try:
                generate_batch(model, NoStops(cfg.vocab_size), prompts, 4, stop_ids=[])  # capture / warm
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = generate_batch(model, NoStops(cfg.vocab_size), prompts, new_tokens, stop_ids=[])
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
            finally:
                nf4_matmul.FUSED_MAX_ROWS = shipped
            tokens[label] = [r.token_ids for r in out]
            result[f"{label}_tok_s"] = batch * new_tokens / seconds
        result["speedup"] = (result["fused_tok_s"] + result["fused_again_tok_s"]) / (
            result["unfused_tok_s"] + result["unfused_again_tok_s"])
        same = [a == b for a, b in zip(tokens["fused"], tokens["unfused"])]
        result["rows_identical"] = f"{sum(same)}/{len(same)}"
        rows.append(result)
        print(json.dumps(result), flush=True)
    return rows


def table(rows: list[dict], card: str) -> str:
    lines = [f"NF4 A/B on {card}", "", "| dequantize | old ms | new ms | speed-up | new GB/s | equal to reference |",
             "|---|---:|---:|---:|---:|---|"]
    step_old = step_new = 0.0
    for r in rows:
        if r["stage"] == "dequant":
            lines.append(f"| {r['shape']} | {r['old_ms']:.3f} | {r['new_ms']:.3f} | {r['speedup']:.2f}x | "
                         f"{r['new_gb_s']:.0f} | {r['new_equals_reference']} |")
            step_old += 3 * 28 * PER_BLOCK.get(r["shape"], 1) * r["old_ms"]
            step_new += 3 * 28 * PER_BLOCK.get(r["shape"], 1) * r["new_ms"]
    lines += ["", f"One QLoRA 7B step's dequantizations (28 blocks x 7 linears x 3): old {step_old:.1f} ms, "
              f"new {step_new:.1f} ms", "", "| linear | rows | unfused ms | fused ms | speed-up | relL2 | tiles |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["stage"] == "linear":
            lines.append(f"| {r['shape']} | {r['rows']} | {r['unfused_ms']:.3f} | {r['fused_ms']:.3f} | "
                         f"{r['speedup']:.2f}x | {r['rel_l2_vs_unfused']:.1e} | {r['tiles']} |")
    lines += ["", "| decode | batch | unfused tok/s | fused tok/s | speed-up | rows identical |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["stage"] == "decode":
            lines.append(f"| QLoRA 7B | {r['batch']} | {r['unfused_tok_s']:.1f} / {r['unfused_again_tok_s']:.1f} | "
                         f"{r['fused_tok_s']:.1f} / {r['fused_again_tok_s']:.1f} | {r['speedup']:.2f}x | "
                         f"{r['rows_identical']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    ap.add_argument("--stages", default="dequant,linear,decode")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("nf4_matmul_ab needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    shapes = {"tiny_a": (96, 256), "tiny_b": (64, 512)} if args.tiny else SHAPES
    timer = Timer(device, 2 if args.tiny else args.reps)
    stages = args.stages.split(",")
    rows: list[dict] = []
    if "dequant" in stages:
        rows += dequant_ab(shapes, timer, device)
    if "linear" in stages:
        rows += linear_ab(shapes, (1, 16, 64, 130) if args.tiny else ROWS, timer, device,
                          torch.float32 if args.tiny else torch.bfloat16, not args.no_sweep and not args.tiny)
    if "decode" in stages:
        rows += decode_ab(device, args.tiny, (1, 2) if args.tiny else (1, 16), 4 if args.tiny else args.new_tokens)
    card = torch.cuda.get_device_name(0) if device == "cuda" else "CPU (interpreter)"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nf4_ab.json").write_text(json.dumps({"card": card, "torch": torch.__version__, "rows": rows}, indent=1))
    md = table(rows, card)
    (out / "nf4_ab.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
