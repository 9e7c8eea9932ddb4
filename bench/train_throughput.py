"""Same-process, same-GPU training throughput: entrenar vs transformers (sdpa) vs transformers + Liger.

    PYTHONPATH=src python -m bench.train_throughput [--out DIR] [--quick] [--compile]

For each model shape (Qwen2.5-0.5B and llama-370m presets, random weights identical for everyone, batch
8 x 2048, full fine-tune with AdamW) it times training steps and reports tokens/s, MFU (cfg.flops_per_token
against 989 TFLOP/s dense bf16), peak memory and the step-0 loss. Then a kernel micro-benchmark (ours vs the
torch reference vs Liger: time and GB/s against the measured copy bandwidth) and a profiler split of one
entrenar step by kernel class. Writes results.json and results.md under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from entrenar.config import ModelConfig, preset
from entrenar.kernels import cross_entropy, rmsnorm, rope, swiglu
from entrenar.model import Attention, CausalLM
from entrenar.tensors import IGNORE_INDEX

ORIGINAL_ATTENTION_FORWARD = Attention.forward

PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, the MFU denominator


# ---- setup helpers -------------------------------------------------------------------------
def make_batch(cfg: ModelConfig, batch: int, seq: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    input_ids = ids[:, :-1].contiguous()
    shifted = ids[:, 1:].contiguous()  # entrenar: labels already shifted
    shifted[:, -1] = IGNORE_INDEX  # HF shifts internally and cannot see the last target: same T-1 targets for all
    return input_ids, shifted


def reference_state(cfg: ModelConfig, seed: int = 1) -> dict:
    model = CausalLM(cfg, kernels="torch")
    model.init_weights(seed=seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build_entrenar(cfg, state, kernels, dtype, device):
    model = CausalLM(cfg, kernels=kernels)
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype)


def build_hf(cfg, state, dtype, device):
    import transformers

    d = cfg.to_hf_dict()
    config_cls = transformers.Qwen2Config if cfg.architecture == "qwen2" else transformers.LlamaConfig
    hf_cfg = config_cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.to(dtype=dtype)


# ---- training-step timing ------------------------------------------------------------------
def run_training(name, model, step_fn, cfg, batch, seq, steps, warmup, device, autocast_bf16, profile_steps=0):
    """Median step time of `steps` steps after `warmup`; with profile_steps, that many more steps under
    torch.profiler, summarized as the CLI's --profile does (entrenar.train.profiling)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []

    def one_step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_bf16):
            loss = step_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = one_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    step_s = sorted(times[warmup:])[len(times[warmup:]) // 2]
    tokens = batch * seq
    tok_s = tokens / step_s
    mfu = tok_s * cfg.flops_per_token(seq) / (PEAK_BF16_TFLOPS * 1e12)
    peak = torch.cuda.max_memory_allocated() / 2**30
    profile = None
    if profile_steps:
        from entrenar.train.profiling import StepProfiler

        prof = StepProfiler((1, profile_steps), Path("."), device, write=False)
        for i in range(1, profile_steps + 1):
            prof.before(i)
            one_step()
            prof.after(i)
        profile = prof.result
    opt.state.clear()  # the AdamW moments go now, not when the caller drops the model
    return {"name": name, "step_s": step_s, "tok_s": tok_s, "mfu": mfu, "peak_gib": peak,
            "loss0": losses[0], "loss_last": losses[-1], "first_step_s": times[0], "profile": profile}


def bench_model(cfg_name, cfg, args, device, results, liger_state):
    batch, seq = args.batch, args.seq
    input_ids, labels = make_batch(cfg, batch, seq)
    input_ids, labels = input_ids.to(device), labels.to(device)
    hf_labels = torch.cat([input_ids[:, :1], labels], dim=1)[:, :seq]  # HF shifts inside: same targets
    hf_labels = hf_labels.clone()
    state = reference_state(cfg)
    rows = []
    default_chunk = cross_entropy._CHUNK_BYTES

    def ours(kernels, dtype, autocast, label, compile_blocks=False, chunk_bytes=None, backend=None,
             fused_qkv=False):
        if chunk_bytes:
            cross_entropy._CHUNK_BYTES = chunk_bytes
        if fused_qkv:
            Attention.forward = fused_qkv_forward
        model = build_entrenar(cfg, state, kernels, dtype, device)
        if compile_blocks:
            for block in model.model.layers:
                block.compile()

        def step():
            if backend is None:
                loss_sum, n = model(input_ids, labels=labels)
            else:
                with sdpa_kernel(backend):
                    loss_sum, n = model(input_ids, labels=labels)
            return loss_sum / n

        try:
            return run_training(label, model, step, cfg, batch, seq, args.steps, args.warmup, device, autocast)
        finally:
            cross_entropy._CHUNK_BYTES = default_chunk
            Attention.forward = ORIGINAL_ATTENTION_FORWARD

    def hf(label, use_liger):
        model = build_hf(cfg, state, torch.bfloat16, device)

        def step():
            return model(input_ids=input_ids, labels=hf_labels, use_cache=False).loss

        return run_training(label, model, step, cfg, batch, seq, args.steps, args.warmup, device, False)

    plan = [
        ("entrenar triton, fp32 master + bf16 autocast", lambda l: ours("triton", torch.float32, True, l)),
        ("entrenar triton, bf16 weights", lambda l: ours("triton", torch.bfloat16, False, l)),
        ("entrenar triton, bf16 weights, CE chunk 128 MiB",
         lambda l: ours("triton", torch.bfloat16, False, l, chunk_bytes=128 << 20)),
        ("entrenar triton, bf16 weights, CE chunk 256 MiB",
         lambda l: ours("triton", torch.bfloat16, False, l, chunk_bytes=256 << 20)),
        ("entrenar triton, bf16 weights, sdpa FLASH backend",
         lambda l: ours("triton", torch.bfloat16, False, l, backend=SDPBackend.FLASH_ATTENTION)),
        ("entrenar triton, bf16 weights, fused QKV (bench prototype)",
         lambda l: ours("triton", torch.bfloat16, False, l, fused_qkv=True)),
        ("entrenar torch kernels, bf16 weights", lambda l: ours("torch", torch.bfloat16, False, l)),
        ("transformers sdpa, bf16 weights", lambda l: hf(l, False)),
    ]
    if liger_state["ok"]:
        plan.append(("transformers + Liger, bf16 weights", lambda l: hf(l, True)))
        # run-to-run spread: the two headline rows again, alternating, in the same process
        plan.append(("entrenar triton, bf16 weights (repeat)", lambda l: ours("triton", torch.bfloat16, False, l)))
        plan.append(("transformers + Liger, bf16 weights (repeat)", lambda l: hf(l, True)))
    if args.compile and cfg_name == args.models.split(",")[0]:
        plan.append(("entrenar triton + compile/block, bf16 weights",
                     lambda l: ours("triton", torch.bfloat16, False, l, compile_blocks=True)))
    for label, fn in plan:
        if "Liger" in label:
            apply_liger(cfg)
        try:
            r = fn(label)
        except Exception as e:  # noqa: BLE001 -- a peer that fails is reported, not hidden; the others still run
            r = {"name": label, "error": f"{type(e).__name__}: {e}"[:400]}
        r["model"] = cfg_name
        rows.append(r)
        print(json.dumps(r), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    results["training"].extend(rows)


def fused_qkv_forward(self, x, cos, sin, mask, ops, cache=None):
    """Bench prototype of Attention.forward with one Q/K/V matmul (weights concatenated per call).

    Saves the two grad-accumulation adds on the norm output and the small K/V matmuls; the training
    path (no cache, no doc mask, no verify records) only.
    """
    assert cache is None and mask is None and self.internals is None
    cfg, B, T = self.cfg, x.shape[0], x.shape[1]
    d = cfg.head_dim
    nq, nk = cfg.num_heads * d, cfg.num_kv_heads * d
    weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
    bias = (torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
            if self.q_proj.bias is not None else None)
    qkv = F.linear(x, weight, bias)
    q = qkv[..., :nq].view(B, T, cfg.num_heads, d)
    k = qkv[..., nq:nq + nk].view(B, T, cfg.num_kv_heads, d)
    v = qkv[..., nq + nk:].view(B, T, cfg.num_kv_heads, d)
    q, k = ops.rope(q, k, cos, sin, cfg.rope_style)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=T > 1,
                                       enable_gqa=cfg.num_heads != cfg.num_kv_heads)
    return self.o_proj(y.transpose(1, 2).reshape(B, T, nq))


def apply_liger(cfg):
    from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen2

    fn = apply_liger_kernel_to_qwen2 if cfg.architecture == "qwen2" else apply_liger_kernel_to_llama
    fn(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)


# ---- profiler split of one step (the CLI's --profile summary: entrenar.train.profiling) ----------------
def timed_profile(run_steps, steps: int) -> dict:
    """Profile `run_steps()` (which runs `steps` steps): device ms per kernel class and step, against the
    wall time per step; idle = wall - compute kernels (host work the device waited for)."""
    from torch.profiler import ProfilerActivity, profile

    from entrenar.train.profiling import summarize

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run_steps()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return summarize(prof.key_averages(), steps, wall, on_cuda=True)


def profile_step(cfg, args, device, dtype, autocast):
    batch, seq = args.batch, args.seq
    input_ids, labels = make_batch(cfg, batch, seq)
    input_ids, labels = input_ids.to(device), labels.to(device)
    model = build_entrenar(cfg, reference_state(cfg), "triton", dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss_sum, n = model(input_ids, labels=labels)
            loss = loss_sum / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    return timed_profile(step, 1)


# ---- micro-benchmark ------------------------------------------------------------------------
def timed(fn, reps=20):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=reps * 5, return_mode="median")


def measured_ceilings(device):
    x = torch.empty(2**30 // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x))
    bw = 2 * x.numel() * 2 / (ms * 1e-3) / 1e9
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms_mm = timed(lambda: a @ b)
    return {"copy_GBps": bw, "bf16_mm_TFLOPs": 2 * 8192**3 / (ms_mm * 1e-3) / 1e12}


def fwd_bwd(fn, inputs, grads):
    def run():
        for t in inputs:
            t.grad = None
        outs = fn()
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, grads[: len(outs)])
    return run


N, C, I, V = 16384, 896, 4864, 151936  # Qwen2.5-0.5B at batch 8 x 2048
B, T, HQ, HK, D = 8, 2048, 14, 2, 64
BF = torch.bfloat16


def _row(kernel, impl, ms, nbytes, flops=None):
    r = {"kernel": kernel, "impl": impl, "ms": ms, "GBps": nbytes / (ms * 1e-3) / 1e9}
    if flops:
        r["TFLOPs"] = flops / (ms * 1e-3) / 1e12
    return r


def micro_rmsnorm(device, liger_ok):
    # fwd reads x, writes y; bwd reads dy, x, writes dx (w and dw are tiny)
    x = torch.randn(N, C, device=device, dtype=BF, requires_grad=True)
    w = (1 + 0.1 * torch.randn(C, device=device, dtype=BF)).requires_grad_()
    dy = torch.randn(N, C, device=device, dtype=BF)
    nbytes = 5 * N * C * 2
    impls = [("entrenar triton", lambda: rmsnorm.rms_norm(x, w, 1e-6)),
             ("torch reference", lambda: rmsnorm.rms_norm_reference(x, w, 1e-6))]
    if liger_ok:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        impls.append(("liger", lambda: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)))
    return [_row("rmsnorm fwd+bwd", name, timed(fwd_bwd(fn, [x, w], [dy])), nbytes) for name, fn in impls]


def micro_rope(device, liger_ok):
    q = torch.randn(B, T, HQ, D, device=device, dtype=BF, requires_grad=True)
    k = torch.randn(B, T, HK, D, device=device, dtype=BF, requires_grad=True)
    ang = torch.arange(T, device=device, dtype=torch.float32)[:, None] * (
        1e6 ** (-torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    cos, sin = ang.cos().expand(B, T, D // 2).contiguous(), ang.sin().expand(B, T, D // 2).contiguous()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    nbytes = 4 * (q.numel() + k.numel()) * 2  # fwd read+write, bwd read+write
    rows = [_row("rope fwd+bwd", "entrenar triton",
                 timed(fwd_bwd(lambda: rope.rope(q, k, cos, sin, "neox"), [q, k], [gq, gk])), nbytes),
            _row("rope fwd+bwd", "torch reference",
                 timed(fwd_bwd(lambda: rope.rope_reference(q, k, cos, sin, "neox"), [q, k], [gq, gk])), nbytes)]
    if liger_ok:
        from liger_kernel.ops.rope import LigerRopeFunction

        cos_full = torch.cat([cos, cos], -1)[:1].contiguous()  # HF layout [1, T, D]
        sin_full = torch.cat([sin, sin], -1)[:1].contiguous()
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # Liger takes [B, H, T, D]
        rows.append(_row("rope fwd+bwd", "liger",
                         timed(fwd_bwd(lambda: LigerRopeFunction.apply(qt, kt, cos_full, sin_full), [q, k],
                                       [gq.transpose(1, 2), gk.transpose(1, 2)])), nbytes))
    return rows


def micro_swiglu(device, liger_ok):
    # fwd reads g, u, writes y; bwd reads dy, g, u, writes dg, du
    g = torch.randn(N, I, device=device, dtype=BF, requires_grad=True)
    u = torch.randn(N, I, device=device, dtype=BF, requires_grad=True)
    dy = torch.randn(N, I, device=device, dtype=BF)
    nbytes = 8 * N * I * 2
    impls = [("entrenar triton", lambda: swiglu.swiglu(g, u)), ("torch reference", lambda: swiglu.swiglu_reference(g, u))]
    if liger_ok:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        impls.append(("liger", lambda: LigerSiLUMulFunction.apply(g, u)))
    return [_row("swiglu fwd+bwd", name, timed(fwd_bwd(fn, [g, u], [dy])), nbytes) for name, fn in impls]


def micro_lce(device, liger_ok):
    # LM head + CE fwd+bwd, summed; FLOPs 6*N*C*V; bytes: one pass over hidden/weight and their grads
    h = torch.randn(N, C, device=device, dtype=BF, requires_grad=True)
    wt = (torch.randn(V, C, device=device, dtype=BF) / 30).requires_grad_()
    lab = torch.randint(0, V, (N,), device=device)
    one = torch.ones((), device=device)
    nbytes = 2 * (h.numel() + wt.numel()) * 2
    impls = [("entrenar triton", lambda: cross_entropy.linear_cross_entropy(h, wt, lab)),
             ("torch reference", lambda: cross_entropy.linear_cross_entropy_reference(h, wt, lab))]
    if liger_ok:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        impls.append(("liger", lambda: LigerFusedLinearCrossEntropyFunction.apply(h, wt, lab, None, None, IGNORE_INDEX, 0.0,
                                                                                   0.0, "sum")[0]))
    rows = []
    for name, fn in impls:
        torch.cuda.reset_peak_memory_stats()
        ms = timed(fwd_bwd(fn, [h, wt], [one]), reps=5)
        rows.append(_row("linear CE fwd+bwd", name, ms, nbytes, 6 * N * C * V))
        rows[-1]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return rows


def micro(device, liger_ok):
    rows = []
    for fn in (micro_rmsnorm, micro_rope, micro_swiglu, micro_lce):
        try:
            rows += fn(device, liger_ok)
        except Exception as e:  # noqa: BLE001 -- reported in the table, the rest still runs
            rows.append({"kernel": fn.__name__, "impl": "error", "ms": float("nan"), "GBps": float("nan"),
                         "error": f"{type(e).__name__}: {e}"[:300]})
        gc.collect()
        torch.cuda.empty_cache()
    return rows


# ---- report ---------------------------------------------------------------------------------
def markdown(results) -> str:
    env = results["env"]
    out = [(f"commit `{env['commit']}`, card **{env['card']}**, torch {env['torch']}, triton {env['triton']}, "
           f"transformers {env.get('transformers')}, liger-kernel {env.get('liger')}; batch {env['batch']} x "
           f"{env['seq']}, {env['steps']} timed steps after {env['warmup']} warm-up (median step). "
           f"MFU = tokens/s x cfg.flops_per_token(seq) / 989 TFLOP/s. Measured on this card: copy "
           f"{env['ceilings']['copy_GBps']:.0f} GB/s, bf16 8192^3 matmul {env['ceilings']['bf16_mm_TFLOPs']:.0f} "
           f"TFLOP/s."), ""]
    out += ["| model | run | tokens/s | MFU | peak GiB | step s | step-0 loss | vs Liger |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r["model"] for r in results["training"]):
        rows = [r for r in results["training"] if r["model"] == model]
        liger = next((r for r in rows if "Liger" in r["name"] and "tok_s" in r), None)
        for r in rows:
            if "error" in r:
                out.append(f"| {model} | {r['name']} | failed: {r['error'][:120]} | | | | | |")
                continue
            ratio = f"{r['tok_s'] / liger['tok_s']:.2f}x" if liger else "-"
            out.append(f"| {model} | {r['name']} | {r['tok_s']:,.0f} | {100 * r['mfu']:.1f}% | "
                       f"{r['peak_gib']:.1f} | {r['step_s']:.3f} | {r['loss0']:.4f} | {ratio} |")
        losses = [r["loss0"] for r in rows if "loss0" in r]
        if losses:
            spread = (max(losses) - min(losses)) / min(losses)
            out.append(f"| {model} | step-0 loss spread (max-min)/min | {spread:.2e} | "
                       f"{'ok' if spread <= 1e-2 else 'FAIL'} (bound 1e-2) | | | | |")
    if results.get("micro"):
        out += ["", "| kernel | impl | ms | GB/s (min bytes) | % of copy BW | TFLOP/s |",
                "|---|---|---:|---:|---:|---:|"]
        bw = env["ceilings"]["copy_GBps"]
        for r in results["micro"]:
            tf = f"{r['TFLOPs']:.0f}" if "TFLOPs" in r else ""
            if "error" in r:
                out.append(f"| {r['kernel']} | failed: {r['error'][:150]} | | | | |")
                continue
            out.append(f"| {r['kernel']} | {r['impl']} | {r['ms']:.3f} | {r['GBps']:.0f} | "
                       f"{100 * r['GBps'] / bw:.0f}% | {tf} |")
    for key, prof in results.get("profile", {}).items():
        out += ["", f"Profiler, one training step, {key} (device time, ms):", "",
                "| class | ms |", "|---|---:|"]
        total = sum(prof["by_class_ms"].values())
        for c, ms in prof["by_class_ms"].items():
            out.append(f"| {c} | {ms:.1f} ({100 * ms / total:.0f}%) |")
        out.append(f"| total | {total:.1f} |")
        out += ["", "| top kernels | ms |", "|---|---:|"]
        out += [f"| `{k}` | {v:.1f} |" for k, v in prof["top_kernels_ms"]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--models", default="qwen2.5-0.5b,llama-370m")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile per block")
    ap.add_argument("--no-micro", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    import triton

    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401

        liger_state = {"ok": True, "version": version("liger-kernel")}
    except ImportError as e:
        liger_state = {"ok": False, "version": f"not importable: {e}"}
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    results = {"env": {"commit": commit or os.environ.get("ENTRENAR_COMMIT", "?"),
                       "card": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "transformers": tf_version, "liger": liger_state["version"],
                       "python": platform.python_version(), "batch": args.batch, "seq": args.seq,
                       "steps": args.steps, "warmup": args.warmup,
                       "ceilings": measured_ceilings(device)},
               "training": [], "micro": [], "profile": {}}
    print(json.dumps(results["env"]), flush=True)
    for name in args.models.split(","):
        bench_model(name, preset(name), args, device, results, liger_state)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    if not args.no_profile:
        cfg = preset(args.models.split(",")[0])
        for key, dtype, autocast in (("entrenar bf16 weights", torch.bfloat16, False),
                                     ("entrenar fp32 master + autocast", torch.float32, True)):
            try:
                results["profile"][key] = profile_step(cfg, args, device, dtype, autocast)
            except Exception as e:  # noqa: BLE001 -- reported, the rest still runs
                print(f"profile {key} failed: {type(e).__name__}: {e}", file=sys.stderr)
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    if not args.no_micro:
        results["micro"] = micro(device, liger_state["ok"])
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out_dir / "results.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
