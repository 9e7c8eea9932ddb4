"""Probe (issue 25, goals 2 and 3): what float8 linears (torchao) and torch.compile of the blocks buy on
top of our bf16-pure step, before they go into the CLI. Random weights with the real shapes, one process,
each variant timed the same way: `steps` optimizer steps, median seconds of the steps after `warmup`.

    PYTHONPATH=src python bench/fp8_compile_probe.py --model llama-370m --batch 8 --seq 2048 \
        --variants bf16,fp8,bf16+compile,fp8+compile --out probe.jsonl

Each variant: the model in bf16 (bf16-pure: weights, grads and AdamW state), our kernels (--kernels),
then optionally every nn.Linear inside the blocks swapped for torchao's Float8Linear (tensorwise dynamic
scaling; the LM head stays bf16 in the fused linear cross-entropy), then optionally each block
compiled (`Block.compile()`, torchtitan's per-block compile). Numerics: the first batch's loss of every
variant, and logits relL2 of the variant against the plain bf16 model on the same weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from entrenar.config import PRESETS
from entrenar.model import CausalLM
from entrenar.tensors import rel_l2


def fp8_swap(model: CausalLM, recipe: str) -> int:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    n = 0

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        nonlocal n
        ok = isinstance(mod, torch.nn.Linear) and ".layers." in f".{fqn}" and \
            mod.in_features % 16 == 0 and mod.out_features % 16 == 0
        n += ok
        return ok

    convert_to_float8_training(model.model, module_filter_fn=keep, config=config)
    return n


def build(cfg, kernels: str, variant: str, seed: int) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(cfg, kernels="torch" if "torchk" in variant else kernels)  # torchk: inductor fuses
    model.init_weights(seed)
    model = model.cuda().to(torch.bfloat16)
    if "fp8" in variant:
        recipe = "rowwise" if "rowwise" in variant else "tensorwise"
        fp8_swap(model, recipe)
    if "compile" in variant:
        for block in model.model.layers:
            block.compile()
    return model


def run_variant(cfg, args, variant: str, batches, ref_logits) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(cfg, args.kernels, variant, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x0 = batches[0][0][:1, :512]
    with torch.no_grad():
        logits = model(x0).float()
    rel = float(rel_l2(logits, ref_logits)) if ref_logits is not None else 0.0
    times, losses = [], []
    t_first = time.perf_counter()
    for i in range(args.steps):
        x, y = batches[i % len(batches)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss_sum, n = model(x, labels=y)
        loss = loss_sum / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))  # syncs: the step is done
        times.append(time.perf_counter() - t0)
        if i == 0:
            first_step_s = time.perf_counter() - t_first
    med = statistics.median(times[args.warmup:])
    tokens = args.batch * args.seq
    flops_per_token = cfg.flops_per_token(args.seq)  # the formula the CLI's MFU uses
    peak_tflops = args.peak_tflops
    row = {"variant": variant, "model": args.model, "layers": cfg.num_layers, "kernels": args.kernels, "batch": args.batch, "seq": args.seq,
           "tokens_per_s": round(tokens / med), "step_s": round(med, 4), "first_step_s": round(first_step_s, 2),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "mfu_bf16_peak": round(flops_per_token * tokens / med / (peak_tflops * 1e12), 4),
           "loss_first": losses[0], "loss_last": losses[-1], "logits_rel_l2_vs_bf16": rel,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    del model, opt
    return row


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-370m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--kernels", default="triton")
    ap.add_argument("--layers", type=int, default=0, help="keep the widths, use this many blocks (0 = the preset's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="bf16,fp8,bf16+compile,fp8+compile")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the card (H100/H200 SXM)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = PRESETS[args.model]
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).cuda()
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    ref = build(cfg, args.kernels, "bf16", args.seed)
    with torch.no_grad():
        ref_logits = ref(batches[0][0][:1, :512]).float()
    del ref
    for variant in args.variants.split(","):
        try:
            row = run_variant(cfg, args, variant, batches, ref_logits)
        except Exception as e:  # noqa: BLE001 -- a variant that cannot run is a row saying why; the others run
            row = {"variant": variant, "model": args.model, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
