"""The real CLI's GPU path vs transformers + Liger, in one call on one card (issue 15).

    PYTHONPATH=src python bench/cli_throughput.py --qwen-data .gpu/qwen_shards \
        --llama-data .gpu/scratch_370m [--steps 40] [--warmup 5] [--out DIR]

1. Peers, in this process, with bench/train_throughput.py's step loop (same random weights and batch for
   all; batch 8 x 2048, fused AdamW): entrenar with bf16 weights (the benchmark's fast path), entrenar with
   fp32 weights + bf16 autocast, transformers + Liger 0.8.5 with bf16 weights, and with fp32 weights + bf16
   autocast. Step-0 losses on identical weights, including our --dtype bf16-weights step
   (train/precision.BF16Weights over fp32 masters).
2. `entrenar pretrain --model qwen2.5-0.5b --device cuda` (a subprocess per --dtype: bf16 = the GPU
   default, bf16-weights) on token shards packed with the Qwen2.5 tokenizer (151,936 = the preset's vocab:
   the shape is the preset's). tokens/s = median per-step tok_s of RUN/metrics.jsonl after --warmup steps,
   MFU the median of its mfu, peak GiB its largest mem_mb.
3. The same for llama-370m on shards of a 32,000-token tokenizer (the preset's vocab).
4. Profiler split (ms per kernel class) of one step of each benchmark precision.
Prints one markdown table (and writes cli_throughput.md / .json under --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput as tt

from entrenar.config import preset
from entrenar.train.precision import BF16Weights

BATCH, SEQ = 8, 2048


def peers(steps: int, warmup: int, device: torch.device) -> list[dict]:
    cfg = preset("qwen2.5-0.5b")
    input_ids, labels = (t.to(device) for t in tt.make_batch(cfg, BATCH, SEQ))
    hf_labels = torch.cat([input_ids[:, :1], labels], dim=1)[:, :SEQ].clone()
    state = tt.reference_state(cfg)
    rows = []

    def add(label, build, step_of, autocast):
        try:
            model = build()
            r = tt.run_training(label, model, step_of(model), cfg, BATCH, SEQ, steps, warmup, device, autocast)
        except Exception as e:  # noqa: BLE001 -- a failing peer is reported, the others still run
            r = {"name": label, "error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(r)
        print(json.dumps(r), flush=True)
        gc.collect()
        torch.cuda.empty_cache()

    def ours(model):
        def step():
            loss_sum, n = model(input_ids, labels=labels)
            return loss_sum / n
        return step

    def hf(model):
        return lambda: model(input_ids=input_ids, labels=hf_labels, use_cache=False).loss

    add("bench loop: entrenar, bf16 weights", lambda: tt.build_entrenar(cfg, state, "triton", torch.bfloat16, device),
        ours, False)
    add("bench loop: entrenar, fp32 weights + bf16 autocast",
        lambda: tt.build_entrenar(cfg, state, "triton", torch.float32, device), ours, True)
    rows.append(bf16_weights_loss0(cfg, state, input_ids, labels, device))
    tt.apply_liger(cfg)
    add("transformers + Liger, bf16 weights", lambda: tt.build_hf(cfg, state, torch.bfloat16, device), hf, False)
    add("transformers + Liger, fp32 weights + bf16 autocast",
        lambda: tt.build_hf(cfg, state, torch.float32, device), hf, True)
    return rows


def bf16_weights_loss0(cfg, state, input_ids, labels, device) -> dict:
    """Step-0 loss of the CLI's --dtype bf16-weights step (fp32 masters, bf16 copies) on the same weights."""
    model = tt.build_entrenar(cfg, state, "triton", torch.float32, device)
    with BF16Weights(model).compute(), torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        loss_sum, n = model(input_ids, labels=labels)
    r = {"name": "--dtype bf16-weights step (precision.BF16Weights), step-0 loss only",
         "loss0": float(loss_sum / n)}
    del model
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps(r), flush=True)
    return r


def trainer_profile(dtype: str, device: torch.device, steps: int = 3, warm: int = 5,
                    model_name: str = "qwen2.5-0.5b") -> dict:
    """Where the CLI's own step goes: the Trainer (train_step, as `entrenar pretrain` runs it) on
    `model_name`'s shapes, random batches; device time per kernel class over `steps` profiled steps vs
    their wall time (the difference is device idle: host work the device waited for)."""
    import tempfile

    from trainer_syncs import RandomLoader

    from entrenar.model import CausalLM
    from entrenar.train.loop import TrainConfig, build_trainer

    cfg_m = preset(model_name)
    model = CausalLM(cfg_m, kernels="triton")
    model.init_weights(0)
    model = model.to(device)
    cfg = TrainConfig(steps=100, batch_size=BATCH, seq_len=SEQ, lr=3e-4, warmup=5, device="cuda", dtype=dtype)
    with tempfile.TemporaryDirectory() as d:
        trainer = build_trainer(model, RandomLoader(cfg_m.vocab_size, BATCH, SEQ), None, cfg, Path(d), log=lambda _t: None)
        for step in range(1, warm + 1):
            trainer.train_step(step)
        def run_steps():
            for s in range(warm + 1, warm + steps + 1):
                trainer.train_step(s)
        prof = tt.timed_profile(run_steps, steps)
    trainer = model = None  # free the GPU memory before the next profile
    gc.collect()
    torch.cuda.empty_cache()
    return {"model": model_name, "dtype": dtype, **prof}


def cli_run(label: str, model: str, data: str, dtype: str, steps: int, warmup: int, root: Path) -> dict:
    run = root / re.sub(r"[^A-Za-z0-9.-]+", "_", label)
    cmd = [sys.executable, "-m", "entrenar", "pretrain", "--model", model, "--data", data, "--out", str(run),
           "--steps", str(steps), "--batch-size", str(BATCH), "--seq-len", str(SEQ), "--device", "cuda",
           "--dtype", dtype, "--lr", "3e-4", "--warmup", "5", "--eval-batches", "2", "--keep", "1",
           "--no-preflight"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    wall = time.perf_counter() - t0
    log = proc.stderr[-3000:]
    if proc.returncode != 0:
        return {"name": label, "error": f"exit {proc.returncode}: {log[-600:]}"}
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    after = [r for r in recs if r["step"] > warmup]
    done = re.search(r"done: .*?([\d,]+) tok/s", log)
    notes = [ln for ln in log.splitlines() if ln.startswith("note:")]
    return {"name": label, "cmd": " ".join(cmd[1:]), "tok_s": statistics.median(r["tok_s"] for r in after),
            "tok_s_min": min(r["tok_s"] for r in after), "tok_s_max": max(r["tok_s"] for r in after),
            "mfu": statistics.median(r["mfu"] for r in after), "peak_gib": max(r["mem_mb"] for r in recs) / 1024,
            "loss0": recs[0]["loss"], "loss_last": recs[-1]["loss"],
            "summary_tok_s": float(done.group(1).replace(",", "")) if done else None,
            "step_s_sum": sum(BATCH * SEQ / r["tok_s"] for r in recs), "process_wall_s": wall, "notes": notes}


def table(env: dict, rows: list[dict]) -> str:
    liger = next((r for r in rows if r["name"] == "transformers + Liger, bf16 weights" and "tok_s" in r), None)
    out = [(f"card **{env['card']}**, torch {env['torch']}, triton {env['triton']}, transformers "
           f"{env['transformers']}, liger-kernel {env['liger']}, commit `{env['commit']}`; batch {BATCH} x {SEQ}, "
           f"tokens/s = median per-step tok_s after {env['warmup']} warm-up steps ({env['steps']} steps; CLI: "
           f"RUN/metrics.jsonl); MFU = tokens/s x flops_per_token / 989 TFLOP/s"), "",
           "| model | run | tokens/s | vs Liger bf16 | peak GiB | MFU | step-0 loss |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['name']} | failed: {r['error'][:160]} | | | | |")
            continue
        if "tok_s" not in r:
            out.append(f"| {r['model']} | {r['name']} | | | | | {r['loss0']:.4f} |")
            continue
        ratio = f"{r['tok_s'] / liger['tok_s']:.2f}x" if liger and r["model"] == "qwen2.5-0.5b" else "-"
        spread = f" ({r['tok_s_min']:,.0f}-{r['tok_s_max']:,.0f})" if "tok_s_min" in r else ""
        out.append(f"| {r['model']} | {r['name']} | {r['tok_s']:,.0f}{spread} | {ratio} | {r['peak_gib']:.1f} | "
                   f"{100 * r['mfu']:.1f}% | {r['loss0']:.4f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qwen-data", default=".gpu/qwen_shards")
    ap.add_argument("--llama-data", default=".gpu/scratch_370m")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peer-steps", type=int, default=12)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--runs", default="/tmp/entrenar-cli-throughput")
    ap.add_argument("--skip", default="",
                    help="comma-separated parts to skip: peers,qwen,llama,profile,bench-profile")
    ap.add_argument("--profiles", default="qwen2.5-0.5b:bf16,qwen2.5-0.5b:bf16-weights,qwen2.5-0.5b:bf16-pure,"
                    "llama-370m:bf16", help="Trainer steps to profile, MODEL:DTYPE comma-separated")
    args = ap.parse_args()
    out, root, skip = Path(args.out), Path(args.runs), set(filter(None, args.skip.split(",")))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    from importlib.metadata import PackageNotFoundError, version

    import triton

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env = {"card": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "transformers": ver("transformers"), "liger": ver("liger-kernel"), "steps": args.steps,
           "warmup": args.warmup, "commit": os.environ.get("ENTRENAR_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()}
    print(json.dumps(env), flush=True)
    rows: list[dict] = []
    results = {"env": env, "rows": rows, "profile": {}}

    def save():
        (out / "cli_throughput.json").write_text(json.dumps(results, indent=1))

    if "peers" not in skip:
        rows += [{"model": "qwen2.5-0.5b", **r} for r in peers(args.peer_steps, 2, device)]
        save()
    plan = []
    if "qwen" not in skip:
        plan += [("qwen2.5-0.5b", args.qwen_data, d) for d in ("bf16", "bf16-weights", "bf16-pure")]
    if "llama" not in skip:
        plan += [("llama-370m", args.llama_data, d) for d in ("bf16", "bf16-weights", "bf16-pure")]
    for model, data, dtype in plan:
        r = cli_run(f"CLI {model} --dtype {dtype}", model, data, dtype, args.steps, args.warmup, root)
        r = {"model": model, **r}
        rows.append(r)
        print(json.dumps(r), flush=True)
        save()
    if "profile" not in skip:
        for spec in filter(None, args.profiles.split(",")):
            model_name, _, dtype = spec.partition(":")
            key = f"Trainer step, {model_name} --dtype {dtype}"
            try:
                results["profile"][key] = trainer_profile(dtype, device, model_name=model_name)
            except Exception as e:  # noqa: BLE001 -- reported, the table still prints
                results["profile"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps({key: results["profile"][key]}), flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            save()
    if "bench-profile" not in skip:
        cfg = preset("qwen2.5-0.5b")
        ns = SimpleNamespace(batch=BATCH, seq=SEQ)
        for key, dtype, autocast in (("bf16 weights", torch.bfloat16, False),
                                     ("fp32 weights + bf16 autocast", torch.float32, True)):
            try:
                results["profile"][key] = tt.profile_step(cfg, ns, device, dtype, autocast)
            except Exception as e:  # noqa: BLE001 -- reported, the table still prints
                results["profile"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
            gc.collect()
            torch.cuda.empty_cache()
        save()
    md = table(env, rows)
    for key, prof in results["profile"].items():
        if "by_class_ms" in prof:
            total = sum(prof["by_class_ms"].values())
            head = (f"{key}: wall {prof['wall_ms_per_step']:.1f} ms/step, kernels {total:.1f}, device idle "
                    f"{prof['idle_ms_per_step']:.1f}" if "wall_ms_per_step" in prof
                    else f"one bench-loop step, {key}: {total:.1f} ms of kernels")
            md += f"\n\nprofile, {head}: " + ", ".join(f"{c} {ms:.1f}" for c, ms in prof["by_class_ms"].items())
    (out / "cli_throughput.md").write_text(md + "\n")
    save()
    print(md)


if __name__ == "__main__":
    main()
