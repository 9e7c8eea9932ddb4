"""QLoRA training throughput, same GPU, same process family: entrenar vs bitsandbytes NF4 + PEFT.

    PYTHONPATH=src python -m bench.qlora_throughput [--steps 10] [--warmup 3] [--batch 2] [--seq 2048]
                                                     [--rank 16] [--preset qwen2.5-coder-7b] [--out DIR]

Qwen2.5-Coder-7B shapes with random weights (N(0, 0.02)), every decoder linear NF4 with double-quantized
scales, LoRA rank 16 / alpha 32 on q,k,v,o,gate,up,down, batch 2 x 2048, activation checkpointing,
bf16 autocast, fp32 adapters, fused AdamW. Each side runs in its own subprocess (``--only``) so peak
memory (torch.cuda.max_memory_allocated, weights included) is not polluted by the other. Needs CUDA,
bitsandbytes (its wheel) and peft. Writes results.json / results.md under --out (default bench/out).

Differences kept on purpose (each side as users run it): the peer computes full logits and HF's
cross-entropy; entrenar uses its fused linear cross-entropy. Neither side calls
prepare_model_for_kbit_training (it would upcast embeddings / norms to fp32 and add memory).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_batch(vocab: int, batch: int, seq: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    input_ids = ids[:, :-1].contiguous()
    shifted = ids[:, 1:].contiguous()  # entrenar: labels already shifted
    return input_ids.to(device), shifted.to(device)


@torch.no_grad()
def init_normal_(model: torch.nn.Module, std: float = 0.02) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std)


def run_entrenar(args) -> dict:
    from entrenar import peft as ep
    from entrenar.config import preset
    from entrenar.model import CausalLM

    cfg = preset(args.preset)
    torch.manual_seed(0)
    # --base fp32/bf16: plain LoRA on an fp32 model (the CLI's --dtype bf16: fp32 masters), its frozen linears
    # kept fp32 (before session 18) or stored bf16 (precision.frozen_linears_in_bf16, the bf16 policy now)
    torch.set_default_dtype(torch.bfloat16 if args.base == "nf4" else torch.float32)
    with torch.device("cuda"):
        model = CausalLM(cfg, kernels="triton")
    torch.set_default_dtype(torch.float32)
    init_normal_(model)
    if args.lora_unfused:  # A/B: the adapter update as separate ops (a mul and an add over the whole output)
        def unfused(self, x):
            y = self.base_layer(x)
            return y + (self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling).to(y.dtype)
        ep.LoRALinear.forward = unfused
    ep.apply_lora(model, rank=args.rank, alpha=2 * args.rank, targets=TARGETS, quantize_nf4=args.base == "nf4")
    if args.base == "bf16":
        from entrenar.train.precision import frozen_linears_in_bf16

        frozen_linears_in_bf16(model)
    model.activation_checkpointing = args.checkpointing == "full"
    model.train()
    gc.collect()
    torch.cuda.empty_cache()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    counts = ep.count_parameters(model)
    input_ids, labels = make_batch(cfg.vocab_size, args.batch, args.seq, "cuda")

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_sum, n = model(input_ids, labels=labels)
            loss = loss_sum / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    if args.only == "entrenar-graphs":  # the trainer's step: backward_micro_batches with CUDA graphs
        from entrenar.train.cuda_graphs import StepGraphs
        from entrenar.train.loop import backward_micro_batches
        from entrenar.train.objective import CausalLMLoss
        from entrenar.train.precision import precision_policy

        precision, dev = precision_policy("bf16"), torch.device("cuda")
        graphs = StepGraphs(lambda b: CausalLMLoss.loss_sum(model, b), precision, dev, print)
        batch = {"input_ids": input_ids, "labels": labels}

        def step() -> float:  # the graphed variant of the step above
            graphs.begin_step()
            total = labels.numel()
            loss = backward_micro_batches(model, [batch], dev, precision, total, graphs=graphs) / total
            opt.step()
            opt.zero_grad(set_to_none=not graphs.static_grads)
            return float(loss)

    result = _time(step, args, {"trainable": counts["trainable"], "total": counts["total"]})
    if args.only == "entrenar-graphs":
        result["graphs"] = graphs.state()
    if args.profile:
        result["profile"] = _profile(step)
    if args.memory:
        result["memory"] = memory_report()
    return result


def memory_report() -> dict:
    """The caching allocator's segments by pool (0: the default pool; others: CUDA graphs' private pools):
    reserved, in tensors, and the largest free blocks, in MiB. Where a graph's pool exceeds the step's transient
    peak, this says whether it is fragmentation (free blocks) or memory the replay holds (active)."""
    pools: dict[str, dict] = {}
    for seg in torch.cuda.memory._snapshot()["segments"]:
        pool = pools.setdefault(str(tuple(seg.get("segment_pool_id", (0, 0)))),
                                {"segments": 0, "reserved_mib": 0.0, "active_mib": 0.0, "free_blocks_mib": []})
        pool["segments"] += 1
        pool["reserved_mib"] += seg["total_size"] / 2**20
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                pool["active_mib"] += block["size"] / 2**20
            elif block["state"] == "inactive":
                pool["free_blocks_mib"].append(round(block["size"] / 2**20, 1))
    for pool in pools.values():
        free = sorted(pool.pop("free_blocks_mib"), reverse=True)
        pool.update(free_mib=round(sum(free), 1), largest_free_mib=free[:12], free_blocks=len(free),
                    reserved_mib=round(pool["reserved_mib"], 1), active_mib=round(pool["active_mib"], 1))
    return pools


def _profile(step, steps: int = 2) -> dict:
    """Device time per kernel class over `steps` steps against their wall time (the rest: device idle)."""
    from bench.train_throughput import timed_profile

    return timed_profile(lambda: [step() for _ in range(steps)], steps)


def _quantize_linears_bnb(model: torch.nn.Module) -> int:
    import bitsandbytes as bnb

    n = 0
    for path, mod in list(model.named_modules()):
        if not (isinstance(mod, torch.nn.Linear) and ".layers." in f".{path}"):
            continue
        new = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                                compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                device="meta")
        new.weight = bnb.nn.Params4bit(mod.weight.data, requires_grad=False,
                                       compress_statistics=True, quant_type="nf4")
        if mod.bias is not None:
            new.bias = torch.nn.Parameter(mod.bias.data.clone(), requires_grad=False)
        new = new.to("cuda")  # Params4bit quantizes on the move to CUDA
        parent_path, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent_path), leaf, new)
        del mod
        n += 1
    return n


def run_peer(args) -> dict:
    import bitsandbytes as bnb
    import peft
    import transformers

    from entrenar.config import preset

    cfg = preset(args.preset)
    d = cfg.to_hf_dict()
    hf_cfg = transformers.Qwen2Config(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    torch.set_default_dtype(torch.float32)
    init_normal_(model)
    n_quant = _quantize_linears_bnb(model)
    gc.collect()
    torch.cuda.empty_cache()
    if args.checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lcfg = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, lora_dropout=0.0,
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lcfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    input_ids, _ = make_batch(cfg.vocab_size, args.batch, args.seq, "cuda")

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss)

    trainable = sum(p.numel() for p in params)
    return _time(step, args, {"trainable": trainable, "bnb_linears": n_quant,
                              "bitsandbytes": bnb.__version__, "peft": peft.__version__,
                              "transformers": transformers.__version__})


def _time(step, args, extra: dict) -> dict:
    losses = [step() for _ in range(args.warmup)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        losses.append(step())
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = args.batch * args.seq * args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30
    # a CUDA graph's memory pool is allocated once, at its capture (in the warm-up): the peak of the measured
    # steps does not see it. What stays reserved once the cache is emptied does: weights, optimizer state,
    # gradients and any graph's pool. The footprint is the larger of the two.
    gc.collect()
    torch.cuda.empty_cache()
    resident = torch.cuda.memory_reserved() / 2**30
    return {"tok_s": tokens / dt, "step_s": dt / args.steps,
            "peak_mem_gib": max(peak, resident), "peak_allocated_measured_gib": peak, "resident_after_gib": resident,
            "first_loss": losses[0], "last_loss": losses[-1], **extra}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-coder-7b")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--checkpointing", choices=("full", "none"), default="full",
                    help="activation checkpointing of every block (full, the peer's setting) or none")
    ap.add_argument("--sides", default="entrenar,peer", help="which sides to run (comma-separated)")
    ap.add_argument("--profile", action="store_true", help="entrenar: kernel classes of 2 more steps")
    ap.add_argument("--memory", action="store_true",
                    help="entrenar: the allocator's pools after the run (reserved, active, free blocks)")
    ap.add_argument("--base", choices=("nf4", "fp32", "bf16"), default="nf4",
                    help="entrenar: the frozen base (nf4: QLoRA; fp32 / bf16: LoRA on an fp32 model, its frozen "
                         "linears kept fp32 or stored bf16)")
    ap.add_argument("--lora-unfused", action="store_true",
                    help="entrenar: the LoRA update as a separate mul + add (before e9a5d8b), for an A/B")
    ap.add_argument("--tag", default="", help="suffix of the result files (several settings in one --out)")
    ap.add_argument("--only", choices=("entrenar", "entrenar-graphs", "peer"),
                    help="run one side in this process (internal); entrenar-graphs: the trainer's step with CUDA graphs")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("qlora_throughput needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.only:
        result = run_peer(args) if args.only == "peer" else run_entrenar(args)
        print(json.dumps(result))
        return 0

    results = {}
    for side in args.sides.split(","):
        cmd = [sys.executable, "-m", "bench.qlora_throughput", "--only", side] + [
            f"--{k}={getattr(args, k)}" for k in ("preset", "batch", "seq", "rank", "steps", "warmup",
                                                   "checkpointing")] + (["--profile"] if args.profile else []) \
            + (["--memory"] if args.memory else []) + [f"--base={args.base}"] \
            + (["--lora-unfused"] if args.lora_unfused else [])
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        if proc.returncode != 0:
            results[side] = {"error": proc.stderr[-3000:]}
        else:
            results[side] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(side, json.dumps(results[side])[:2000], flush=True)
    card = torch.cuda.get_device_name(0)
    meta = {"gpu": card, "torch": torch.__version__, "python": platform.python_version(),
            "shape": args.preset, "batch": args.batch, "seq": args.seq, "rank": args.rank,
            "steps": args.steps, "warmup": args.warmup, "checkpointing": args.checkpointing}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    (out / f"qlora_results{tag}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    lines = [(f"QLoRA {args.preset} shapes, r={args.rank}, batch {args.batch} x {args.seq}, activation "
             f"checkpointing {args.checkpointing}, bf16, {card}"), "",
             "| side | tokens/s | peak GiB | step s | first loss | last loss |", "|---|---|---|---|---|---|"]
    for side, r in results.items():
        if "error" in r:
            lines.append(f"| {side} | error | | | | |")
        else:
            lines.append(f"| {side} | {r['tok_s']:.0f} | {r['peak_mem_gib']:.2f} | {r['step_s']:.3f} | "
                         f"{r['first_loss']:.3f} | {r['last_loss']:.3f} |")
    if {"entrenar", "peer"} <= set(results) and all("tok_s" in r for r in results.values()):
        lines.append("")
        lines.append(f"speed-up {results['entrenar']['tok_s'] / results['peer']['tok_s']:.2f}x, memory "
                     f"{results['entrenar']['peak_mem_gib'] / results['peer']['peak_mem_gib']:.2f}x")
    for side, r in results.items():
        prof = r.get("profile")
        if prof:
            lines.append(f"\nprofile ({side}): wall {prof['wall_ms_per_step']:.1f} ms/step, kernels "
                         f"{prof['kernel_ms_per_step']:.1f}, idle {prof['idle_ms_per_step']:.1f}: "
                         + ", ".join(f"{c} {ms:.1f}" for c, ms in prof["by_class_ms"].items()))
    (out / f"qlora_results{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
