"""A/B of the NF4 paths on one GPU (issue 36 item 3), one call, every check and timing:

    PYTHONPATH=src python bench/nf4_matmul_ab.py --out DIR            # GPU
    TRITON_INTERPRET=1 PYTHONPATH=src python bench/nf4_matmul_ab.py --tiny   # CPU: the plumbing

1. dequantize: session 17's element-wise kernel (each value reads its byte and its block's scale; kept below
   as the 'before') against the block-wise one of kernels/nf4.py (a byte gives two values, a block's scale
   computed once), on the Qwen2.5-Coder-7B linears in bf16: equal outputs, time, GB/s, and the sum over one
   QLoRA step (every linear of 28 blocks dequantized 3 times: forward, recomputed forward, backward).
2. the fused candidate below (the weight dequantized inside the matmul, a LoRA epilogue) against dequantize +
   cuBLAS, by rows (1 ... 4096) and shape: relL2 against the unfused output, time, and a sweep of tiles.
   Session 18 measured it slower at every row count, so entrenar does not ship it; at commit 8edb80a it was
   wired into NF4Linear for up to 64 rows, and a third stage timed greedy decoding of a whole QLoRA 7B with it
   (0.22x at batch 1, 0.24x at batch 16: bench/RESULTS.md).

Timing: the linear rows, CUDA events around each call, median of --reps, a 256 MiB write before each to evict
the L2 (a decoder streams every weight once a token: none of it is in the L2 when its matmul starts); the
dequantize rows, --reps calls captured in one CUDA graph, as the QLoRA step runs them (a kernel of 3-90 us timed
alone, or back to back, measured the host's launches in session 18's calls 5 and 6, whose files still have
those columns). Prints JSON lines and writes DIR/nf4_ab.json and DIR/nf4_ab.md.
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
import triton
import triton.language as tl

from entrenar.kernels import _common, nf4
from entrenar.kernels.nf4 import BLOCK_SIZE, SCALE_BLOCK_SIZE, NF4Weight, nf4_table
from entrenar.tensors import rel_l2

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


# ---- the candidate: the weight dequantized inside the matmul (tried in session 18, measured slower: not
# shipped). Few rows read 0.5 byte a weight instead of dequantize's 2.5 + the matmul's 2; in registers each tile
# is unpacked, scaled, rounded to x's dtype (the values nf4.dequantize gives) and fed to tl.dot. An optional
# LoRA epilogue adds scale * down @ B^T in fp32 before the one rounding of the output.
@triton.jit
def _nf4_linear_kernel(x_ptr, packed_ptr, qscale_ptr, factor_ptr, mean_ptr, table_ptr, out_ptr, bias_ptr,
                       down_ptr, lora_b_ptr, lora_scale, M, N, K, rank, stride_xm, stride_om, stride_dm,
                       HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, R: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QBLOCK: tl.constexpr,
                       SBLOCK: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    rows = rn.to(tl.int64)
    mean = tl.load(mean_ptr)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_len = K // SPLIT_K  # K % (BK * SPLIT_K) == 0 (the wrapper's choice): no mask along K
    for k0 in range(split * k_len, (split + 1) * k_len, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
        # W[n, k] is flat element n*K + k: byte (n*K + k) // 2, high nibble first; block (n*K + k) // 64
        rb = k0 // 2 + tl.arange(0, BK // 2)
        byte = tl.load(packed_ptr + rows[:, None] * (K // 2) + rb[None, :], mask=n_ok[:, None], other=0)
        byte = byte.to(tl.int32)
        hi = tl.load(table_ptr + (byte >> 4))
        lo = tl.load(table_ptr + (byte & 0xF))
        blk = rows[:, None] * (K // QBLOCK) + k0 // QBLOCK + tl.arange(0, BK // QBLOCK)[None, :]
        q = tl.load(qscale_ptr + blk, mask=n_ok[:, None], other=0).to(tl.float32)
        f = tl.load(factor_ptr + blk // SBLOCK, mask=n_ok[:, None], other=1.0)
        scale = q / f + mean  # [BN, BK // 64]
        w = tl.reshape(tl.join(hi, lo), (BN, BK // QBLOCK, QBLOCK)) * scale[:, :, None]
        w = tl.reshape(w, (BN, BK)).to(x.dtype)
        if DOT_FP32:  # the exact products of the rounded values, accumulated in fp32 (no tf32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_LORA and split == 0:  # + scale * down @ B^T, in fp32 (the adapters' dtype)
        rr = tl.arange(0, R)
        r_ok = rr < rank
        down = tl.load(down_ptr + rm[:, None].to(tl.int64) * stride_dm + rr[None, :],
                       mask=m_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(lora_b_ptr + rows[:, None] * rank + rr[None, :], mask=n_ok[:, None] & r_ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(down, tl.trans(b), input_precision="ieee") * lora_scale
    if HAS_BIAS and split == 0:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:  # partial sums into a zeroed fp32 buffer, rounded to the output dtype after the kernel
        tl.atomic_add(out, acc, mask=m_ok[:, None] & n_ok[None, :])


def supported(w: NF4Weight) -> bool:
    """The kernel's layout: a 2-D weight whose rows are whole blocks of 64 (every linear of the families)."""
    return len(w.shape) == 2 and w.shape[1] % BLOCK_SIZE == 0


def _tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, split-K). Few rows are bound by reading the weight: narrow column tiles, and K
    split over more programs where the columns alone give fewer programs than an H200 has SMs (132)."""
    bk = 128 if k % 128 == 0 else 64
    if m > 64:
        return 128, 128, bk, 8, 1
    bm, bn = (16, 32) if m <= 16 else (64, 64)
    split = 1
    while triton.cdiv(n, bn) * split < 264 and k % (bk * split * 2) == 0 and k // (split * 2) >= 512:
        split *= 2
    return bm, bn, bk, 4, split


def nf4_linear(x: torch.Tensor, w: NF4Weight, bias: torch.Tensor | None = None,
               lora: tuple[torch.Tensor, torch.Tensor, float] | None = None, *,
               tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x @ dequantize(w, x.dtype)^T + bias``, plus ``scale * down @ B^T`` for ``lora = (down, B, scale)``
    (``down = dropout(x) @ A^T`` [..., r], ``B`` [out, r]). x [..., in] 16-bit or fp32; output x's dtype.
    ``tiles`` overrides ``_tiles`` (BM, BN, BK, warps, split-K): the sweep."""
    _common.check_device(x, w.packed)
    if not supported(w):
        raise ValueError(f"nf4_linear needs a 2-D weight with rows of whole {BLOCK_SIZE}-blocks, got {w.shape}")
    n, k = w.shape
    assert x.shape[-1] == k, f"x {tuple(x.shape)} vs weight {w.shape}"
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    bm, bn, bk, warps, split = tiles or _tiles(m, n, k)
    assert k % (bk * split) == 0, f"in_features {k} is not a multiple of BK {bk} x split-K {split}"
    out = _common.empty((m, n), x.dtype, x.device) if split == 1 else torch.zeros((m, n), dtype=torch.float32,
                                                                                    device=x.device)
    if lora is not None:
        down, lora_b, lora_scale = lora
        down = down.reshape(m, -1)
        lora_b = lora_b.contiguous()
        if down.stride(-1) != 1:
            down = down.contiguous()
        rank = lora_b.shape[1]
        assert down.shape[1] == rank and lora_b.shape[0] == n, "LoRA down [rows, r] and B [out, r]"
    else:
        down, lora_b, lora_scale, rank = x2, x2, 0.0, 1
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    if m:
        _nf4_linear_kernel[grid](
            x2, w.packed, w.qscale, w.factor, w.mean.reshape(1), nf4_table(x.device), out,
            bias if bias is not None else out, down, lora_b, float(lora_scale), m, n, k, rank,
            x2.stride(0), out.stride(0), down.stride(0),
            HAS_BIAS=bias is not None, HAS_LORA=lora is not None, R=max(16, _common.next_pow2(rank)),
            BM=bm, BN=bn, BK=bk, QBLOCK=BLOCK_SIZE, SBLOCK=SCALE_BLOCK_SIZE,
            # fp32 inputs: full fp32 as F.linear; the CPU interpreter's 16-bit tl.dot is wrong (triton 3.9)
            DOT_FP32=x.dtype == torch.float32 or not x.is_cuda, SPLIT_K=split, num_warps=warps)
    return out.to(x.dtype).view(*x.shape[:-1], n)


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

    def graph_ms(self, fn) -> float:
        """Per call of ``reps`` calls captured in one CUDA graph and replayed: the kernels' own time, no
        launches (the QLoRA step runs its dequantizations inside a graph)."""
        fn()
        if self.device != "cuda":
            return self.ms(fn)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.reps):
                fn()
        graph.replay()
        self.flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / self.reps


def dequant_ab(shapes: dict, timer: Timer, device: str) -> list[dict]:
    old = _old_dequant_kernel()

    def approx(w: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
        return nf4.dequantize_triton(w, dtype, exact_division=False)
    rows = []
    for name, (n, k) in shapes.items():
        w = nf4.quantize(torch.randn(n, k, device=device) * 0.02)
        ref = nf4.dequantize_reference(w, torch.bfloat16)
        new_out, old_out = nf4.dequantize_triton(w, torch.bfloat16), old(w, torch.bfloat16)
        ms = {label: timer.graph_ms(lambda w=w, f=f: f(w, torch.bfloat16)) for label, f in
              (("old", old), ("new", nf4.dequantize_triton), ("new_approx_div", approx))}
        moved = w.nbytes() + w.numel * 2
        rows.append({"stage": "dequant", "shape": name, "n": n, "k": k, "graph_ms": ms,
                     "speedup": ms["old"] / ms["new"], "new_gb_s": moved / ms["new"] / 1e6,
                     "new_equals_reference": bool(torch.equal(new_out, ref)),
                     "old_equals_reference": bool(torch.equal(old_out, ref)),
                     "approx_equals_reference": bool(torch.equal(approx(w, torch.bfloat16), ref)),
                     "new_vs_reference_rel_l2": rel_l2(new_out, ref)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def linear_ab(shapes: dict, rows_list, timer: Timer, device: str, dtype: torch.dtype, sweep: bool) -> list[dict]:
    out = []
    for name, (n, k) in shapes.items():
        w = nf4.quantize(torch.randn(n, k, device=device) * 0.02)
        for m in rows_list:
            x = torch.randn(m, k, device=device, dtype=dtype)

            def unfused(x=x, w=w):
                return F.linear(x, nf4.dequantize(w, dtype) if device == "cuda" else
                                nf4.dequantize_reference(w, dtype))
            ref = unfused()
            got = nf4_linear(x, w)
            row = {"stage": "linear", "shape": name, "rows": m, "tiles": list(_tiles(m, n, k)),
                   "rel_l2_vs_unfused": rel_l2(got, ref), "unfused_ms": timer.ms(unfused),
                   "fused_ms": timer.ms(lambda x=x, w=w: nf4_linear(x, w))}
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
                    best[str(list(t))] = timer.ms(lambda t=t, x=x, w=w: nf4_linear(x, w, tiles=t))
                row["sweep_ms"] = best
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def table(rows: list[dict], card: str) -> str:
    head = ("| dequantize (ms in a CUDA graph) | old | new | new, approximate division | speed-up | new GB/s | "
            "new equal to reference |")
    lines = [f"NF4 A/B on {card}", "", head, "|---|---:|---:|---:|---:|---:|---|"]
    step_old = step_new = 0.0
    for r in rows:
        if r["stage"] == "dequant":
            g = r["graph_ms"]
            lines.append(f"| {r['shape']} | {g['old']:.4f} | {g['new']:.4f} | {g['new_approx_div']:.4f} | "
                         f"{r['speedup']:.2f}x | {r['new_gb_s']:.0f} | {r['new_equals_reference']} |")
            step_old += 3 * 28 * PER_BLOCK.get(r["shape"], 1) * g["old"]
            step_new += 3 * 28 * PER_BLOCK.get(r["shape"], 1) * g["new"]
    lines += ["", (f"One QLoRA 7B step's dequantizations (28 blocks x 7 linears x 3): old {step_old:.1f} ms, "
                   f"new {step_new:.1f} ms"), "", "| linear | rows | unfused ms | fused ms | speed-up | relL2 | tiles |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["stage"] == "linear":
            lines.append(f"| {r['shape']} | {r['rows']} | {r['unfused_ms']:.3f} | {r['fused_ms']:.3f} | "
                         f"{r['speedup']:.2f}x | {r['rel_l2_vs_unfused']:.1e} | {r['tiles']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    ap.add_argument("--stages", default="dequant,linear")
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
