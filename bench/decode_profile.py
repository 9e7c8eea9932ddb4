"""Where a decode step's and a prefill's time goes in the engine (engine.generate_many), random weights at a real
model's shapes in bf16, for each decode attention (ENTRENAR_DECODE_ATTENTION: the span kernel, SDPA under a mask).

    PYTHONPATH=src:. python bench/decode_profile.py                 # GPU, SmolLM2-135M shapes
    PYTHONPATH=src:. python bench/decode_profile.py --tiny          # CPU dry run (checks the script)

1. The engine's workloads (bench/engine_throughput.py's bfcl840 and humaneval164): seconds, tokens/s and
   generate_many's stats, per attention.
2. One decode step at (slots, attended columns): the eager step's wall time (host launches included), the CUDA
   graph's replay time, and the step's kernels by GPU time (torch.profiler over an eager step).
3. One prefill group: its time and its kernels by GPU time.
One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.engine_throughput import TINY_WORKLOADS, WORKLOADS, shape_config, workload
from bench.generate_throughput import NoStops
from entrenar import engine as eng
from entrenar import static_decode as sd
from entrenar.model import CausalLM


def build(shape: str, tiny: bool, device: str) -> CausalLM:
    cfg = shape_config(shape, tiny)
    with torch.device(device):
        model = CausalLM(cfg, kernels="triton" if device == "cuda" else "torch")
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, cfg.initializer_range, generator=gen)
    return model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def top_kernels(fn, device: str, n: int = 12) -> dict:
    """fn() under torch.profiler: the kernel count and the n kernels taking the most GPU (or CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    key = "device_time_total" if device == "cuda" else "cpu_time_total"
    rows = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    kernels = [e for e in prof.events() if device == "cuda" and str(getattr(e, "device_type", "")).endswith("CUDA")]
    rows.sort(key=lambda e: -getattr(e, key))
    total = sum(getattr(e, "device_time", 0.0) for e in kernels) / 1000 if kernels else None
    return {"gpu_kernels": len(kernels), "gpu_ms": total,
            "top": [(e.key[:70], e.count, round(getattr(e, key) / 1000, 3)) for e in rows[:n]]}


def step_costs(model, vocab: int, slots: int, attend: int, prompt: int, attention: str, device: str) -> dict:
    """One decode step of `slots` slots whose prompts have `prompt` tokens, attending to `attend` columns."""
    settings = eng.GenerationSettings(max_new_tokens=attend - prompt, max_slots=slots, stop_ids=[],
                                      decode_attention=attention)
    with torch.inference_mode():
        e = eng.Engine(model, slots, attend, settings, vocab, torch.device(device))
        g = torch.Generator().manual_seed(1)
        group = max(1, eng.PREFILL_TOKENS // prompt)
        for at in range(0, slots, group):
            rows = list(range(at, min(slots, at + group)))
            e.prefill(rows, [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in rows], [0] * len(rows))
        e.col[:slots] = attend - 1  # every slot at its last column: the step reads all of them
        step = e.step_fn(slots, attend)
        for _ in range(3):
            e.at.zero_()
            step()
        sync(device)
        t0, n = time.perf_counter(), 10
        for _ in range(n):
            e.at.zero_()
            step()
        sync(device)
        eager_ms = (time.perf_counter() - t0) / n * 1000
        out = {"slots": slots, "attend": attend, "attention": attention, "eager_step_ms": round(eager_ms, 3)}
        if device == "cuda":
            graph = sd.GraphStep(step, pool=sd.new_pool())
            for _ in range(3):
                e.at.zero_()
                graph.replay()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                e.at.zero_()
                graph.replay()
            sync(device)
            out["graph_step_ms"] = round((time.perf_counter() - t0) / n * 1000, 3)

        def one() -> None:
            e.at.zero_()
            step()

        out.update(top_kernels(one, device))
    return out


def prefill_costs(model, vocab: int, rows: int, prompt: int, device: str) -> dict:
    settings = eng.GenerationSettings(max_new_tokens=8, max_slots=rows, stop_ids=[])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (prompt - (r % 7) * 9,), generator=g).tolist() for r in range(rows)]
    with torch.inference_mode():
        e = eng.Engine(model, rows, prompt + 8, settings, vocab, torch.device(device))
        e.prefill(list(range(rows)), prompts, [0] * rows)
        sync(device)
        t0 = time.perf_counter()
        e.prefill(list(range(rows)), prompts, [0] * rows)
        ms = (time.perf_counter() - t0) * 1000
        out = {"prefill_rows": rows, "prompt": prompt, "prefill_ms": round(ms, 2)}
        out.update(top_kernels(lambda: e.prefill(list(range(rows)), prompts, [0] * rows), device))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--shape", default="smollm2-135m")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    model = build(args.shape, args.tiny, device)
    vocab = model.cfg.vocab_size
    attentions = ["kernel", "sdpa"]
    for name, spec in (TINY_WORKLOADS if args.tiny else WORKLOADS).items():
        prompts, answers = workload(spec, vocab)
        for attention in attentions:
            settings = eng.GenerationSettings(max_new_tokens=max(answers), stop_ids=[], decode_attention=attention,
                                              max_slots=eng.resolve_slots("auto", model, [len(p) for p in prompts],
                                                                          max(answers))[0] if not args.tiny else 8)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                eng.generate_many(model, NoStops(vocab), prompts[:64], settings, max_new=answers[:64])  # warm-up
                stats: dict = {}
                sync(device)
                t0 = time.perf_counter()
                out = eng.generate_many(model, NoStops(vocab), prompts, settings, max_new=answers, stats=stats)
                sync(device)
            s = time.perf_counter() - t0
            toks = sum(len(r.token_ids) for r in out)
            print(json.dumps({"workload": name, "attention": attention, "seconds": round(s, 3),
                              "tokens_per_s": round(toks / s), "stats": stats}), flush=True)
    grid = [(4, 64, 32)] if args.tiny else [(512, 1024, 600), (512, 512, 300), (128, 256, 150), (8, 1024, 600)]
    for slots, attend, prompt in grid:
        for attention in attentions:
            print(json.dumps(step_costs(model, vocab, slots, attend, prompt, attention, device)), flush=True)
    for rows, prompt in ([(4, 32)] if args.tiny else [(40, 800), (128, 250)]):
        print(json.dumps(prefill_costs(model, vocab, rows, prompt, device)), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
