"""Long-context training memory (issue 15, goal 5): peak GPU memory and step time of one full
fine-tuning step of Qwen2.5-0.5B (random weights, real shapes), batch 1, at 8k ... 512k tokens.

    PYTHONPATH=src python -m bench.long_context_memory --out DIR            # GPU, 8k..512k in a ~6 min budget
    PYTHONPATH=src python -m bench.long_context_memory --out DIR --lengths 524288 --runs long,peer --budget-s 520
    PYTHONPATH=src python -m bench.long_context_memory --out DIR --quick    # CPU: tiny model, checks the script

(one 512k step is minutes of attention: the default budget usually skips 512k, the second line measures it)

Runs (each in its own subprocess, lengths ascending, each length in its own try: an OOM is recorded
and that run's longer lengths are skipped):
  long   entrenar, bf16 weights + bf16 AdamW state, activation checkpointing, --offload-activations and
         --mlp-chunk (entrenar.long_context.apply_memory_options, the CLI's switch)
  ckpt   entrenar, the same without offload and chunks (checkpointing only): what the features save
  liger  transformers + Liger 0.8.5 (bf16 weights, gradient checkpointing, Liger's RoPE/RMSNorm/SwiGLU and
         fused linear cross-entropy applied as bench/train_throughput.py does); transformers alone where
         liger_kernel cannot run (CPU --quick), labelled so.
Peak = torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), over whole steps (forward,
backward, AdamW step, zero_grad) with the AdamW state already allocated. Step time: the median measured
step; one warm-up step per length (two measured up to 32k, one up to 128k); above 128k one step and no
warm-up (an attention step there takes tens of seconds; the kernels were compiled at the shorter lengths,
but the offload's first pinned host buffers of that size are allocated inside it), marked in the JSON.
Every run is measured up to 131072 tokens first (never skipped for time); then the longer lengths share what is left of --budget-s,
each skipped (and recorded so) when its estimate (last step time x length ratio squared) does not fit.
Writes DIR/long_context_memory.json and prints a markdown table with each run's ratio to Liger and the
goal-5 verdict at 131072 tokens (entrenar long <= 2/3 of Liger's peak).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

GIB = 2**30
GOAL_TOKENS = 131072
GOAL_RATIO = 2 / 3
ISSUE_LIGER_GIB = {131072: 12.7, 524288: 46.9}  # issue 15's H200 numbers, used only where Liger was not measured
RUN_LABELS = {"long": "entrenar, offload + MLP chunks", "ckpt": "entrenar, checkpointing only",
              "liger": "transformers + Liger", "hf": "transformers (no Liger)"}


# ---- models -------------------------------------------------------------------------------------------
def model_config(quick: bool):
    from entrenar.config import ModelConfig, preset

    if quick:  # Qwen2-shaped and tiny: every code path of the real run, in seconds on a CPU
        return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                           num_kv_heads=2, architecture="qwen2", attention_bias=True, tie_word_embeddings=True,
                           rms_norm_eps=1e-6, max_position_embeddings=1 << 20)
    return preset("qwen2.5-0.5b")


def random_init_(model: torch.nn.Module, seed: int = 0) -> None:
    """N(0, 0.02) weights, unit norms, zero biases (qlora_throughput.init_normal_), drawn on the model's
    device (a CPU draw of 494M values would cost seconds per run)."""
    from bench.qlora_throughput import init_normal_

    torch.manual_seed(seed)
    init_normal_(model)


def build_entrenar(cfg, device: torch.device, run: str, mlp_chunk: int):
    from entrenar.long_context import apply_memory_options
    from entrenar.model import CausalLM

    with torch.device(device):
        model = CausalLM(cfg, kernels="triton" if device.type == "cuda" else "torch")
    random_init_(model)
    model = model.to(torch.bfloat16).train()
    flags = SimpleNamespace(activation_checkpointing=True, offload_activations=run == "long",
                            mlp_chunk=mlp_chunk if run == "long" else 0)
    apply_memory_options(model, flags)  # what `--activation-checkpointing --offload-activations --mlp-chunk` do

    def step_loss(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss_sum, n = model(ids, labels=labels)
        return loss_sum / n

    return model, step_loss


def build_hf(cfg, device: torch.device, use_liger: bool):
    import transformers

    if use_liger:  # patches transformers' Qwen2 classes: before the model is built (bench/train_throughput.py)
        from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen2

        fn = apply_liger_kernel_to_qwen2 if cfg.architecture == "qwen2" else apply_liger_kernel_to_llama
        fn(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    d = cfg.to_hf_dict()
    config_cls = transformers.Qwen2Config if cfg.architecture == "qwen2" else transformers.LlamaConfig
    hf_cfg = config_cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    hf_cfg.use_cache = False
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    random_init_(model)
    model = model.to(torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def step_loss(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss  # HF shifts the labels inside

    return model, step_loss


# ---- one run (a worker subprocess) ----------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def steps_for(tokens: int, quick: bool) -> tuple[int, int]:
    """(warm-up, measured) steps at this length: long steps take seconds, and memory needs one."""
    if quick or tokens <= 32768:
        return 1, 2
    return (1, 1) if tokens <= GOAL_TOKENS else (0, 1)


def measure(step, device: torch.device, tokens: int, vocab: int, warmup: int, measured: int,
            oom_above: int | None) -> dict[str, Any]:
    """Peak memory and median time of `measured` full steps after `warmup` ones."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, vocab, (1, tokens + 1), generator=gen).to(device)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if oom_above is not None and tokens > oom_above:  # --oom-above: exercise the OOM path on a CPU
        raise torch.OutOfMemoryError(f"simulated by --oom-above {oom_above}")
    times, losses = [], []
    for i in range(warmup + measured):
        if i == warmup:
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        losses.append(step(inputs, labels))
        _sync(device)
        times.append(time.perf_counter() - t0)
    row: dict[str, Any] = {"tokens": tokens, "status": "ok", "warmup_steps": warmup, "measured_steps": measured,
                           "step_s": statistics.median(times[warmup:]), "loss": losses[-1]}
    row["tokens_per_s"] = tokens / row["step_s"]
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
    else:
        row["peak_gib"] = None  # no device allocator to read on a CPU (--quick checks the script only)
    return row


def worker(args: argparse.Namespace) -> None:
    """One run over its lengths; one JSON line per length on stdout ("ROW {...}")."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    cfg = model_config(args.quick)
    if args.run in ("long", "ckpt"):
        model, step_loss = build_entrenar(cfg, device, args.run, args.mlp_chunk)
    else:
        model, step_loss = build_hf(cfg, device, use_liger=args.run == "liger")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=device.type == "cuda")
    for p in model.parameters():  # AdamW state allocated up front: every measured step holds it, as a real one
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    static_gib = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    emit({"event": "start", "run": args.run, "static_gib": static_gib,
          "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "parameters": sum(p.numel() for p in model.parameters())})

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> float:
        loss = step_loss(inputs, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    run_lengths(step, device, cfg.vocab_size, args)


def run_lengths(step, device: torch.device, vocab: int, args: argparse.Namespace) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    stop_reason, last = None, None
    if args.prior:  # "TOKENS:SECONDS" of this run's last length in an earlier worker
        t, s = args.prior.split(":")
        last = {"tokens": int(t), "step_s": float(s)}
    for tokens in lengths:
        row: dict[str, Any] = {"event": "row", "run": args.run, "tokens": tokens}
        warmup, measured = steps_for(tokens, args.quick)
        if last is not None and tokens > GOAL_TOKENS:  # quadratic: attention dominates at long lengths
            estimate = last["step_s"] * (tokens / last["tokens"]) ** 2 * (warmup + measured)
            if time.time() + estimate > args.deadline:
                stop_reason = stop_reason or f"time budget (estimated {estimate:.0f} s for this length)"
        if stop_reason:
            emit({**row, "status": "skipped", "reason": stop_reason})
            continue
        try:
            result = measure(step, device, tokens, vocab, warmup, measured, args.oom_above)
            last = result
            emit({**row, **result})
        except torch.OutOfMemoryError as e:
            # recorded, not hidden; longer lengths of this run cannot fit either
            emit({**row, "status": "OOM", "reason": str(e).splitlines()[0][:300]})
            stop_reason = f"OOM at {tokens} tokens"
        _free(device)


def emit(obj: dict[str, Any]) -> None:
    print("ROW " + json.dumps(obj), flush=True)


# ---- the driver: runs in subprocesses, table --------------------------------------------------------------
def liger_usable(quick: bool) -> tuple[bool, str]:
    if quick or not torch.cuda.is_available():
        return False, "needs CUDA (Triton GPU kernels)"
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401
    except ImportError as e:
        return False, f"liger_kernel not importable: {e}"
    return True, version("liger-kernel")


def launch(run: str, lengths: list[int], deadline: float, args: argparse.Namespace,
           prior: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One worker subprocess (fresh CUDA allocator, no fragmentation carried between runs); returns its rows.
    Killed at the deadline (+60 s grace for a step already under way); the rows it printed are kept."""
    cmd = [sys.executable, "-m", "bench.long_context_memory", "--worker", run, "--lengths", ",".join(map(str, lengths)),
           "--deadline", str(deadline), "--mlp-chunk", str(args.mlp_chunk)]
    if args.quick:
        cmd.append("--quick")
    if args.oom_above is not None:
        cmd += ["--oom-above", str(args.oom_above)]
    if prior is not None:  # the step time of this run's last length, for the first length's estimate
        cmd += ["--prior", f"{prior['tokens']}:{prior['step_s']}"]
    print(f"[{run}] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[1],
                              timeout=max(30.0, deadline - time.time() + 60))
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, code = "killed at the deadline", "timeout"
    rows = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    for r in rows:
        print(json.dumps(r), file=sys.stderr, flush=True)
    done = {r["tokens"] for r in rows if r.get("event") == "row"}
    for tokens in lengths:  # a worker that died mid-run: its missing lengths say why
        if tokens not in done:
            rows.append({"event": "row", "run": run, "tokens": tokens, "status": "failed",
                         "reason": f"worker exit {code}: {err.strip()[-600:]}"})
    return rows


def plan(args: argparse.Namespace, hf_run: str) -> list[tuple[str, list[int], float]]:
    """(run, lengths, weight of its share of the time left after the head): every run up to the goal's
    length first, never skipped for time (the verdict must not wait on the longest steps: one 512k step is
    minutes of attention); then the long tail, entrenar's first, each length only if its estimate fits. Only the runs of --runs ("peer" is Liger, or transformers where Liger cannot run)."""
    lengths = [int(x) for x in args.lengths.split(",")]
    head = [t for t in lengths if t <= GOAL_TOKENS]
    tail = [t for t in lengths if t > GOAL_TOKENS]
    ckpt = [t for t in lengths if t <= args.ckpt_max]
    out = [("long", head, 0.0), ("peer", head, 0.0), ("ckpt", [t for t in ckpt if t in head], 0.0),
           ("long", tail, 0.5), ("peer", tail, 0.35), ("ckpt", [t for t in ckpt if t in tail], 0.15)]
    wanted = set(args.runs.split(","))
    return [(hf_run if r == "peer" else r, ls, s) for r, ls, s in out if ls and r in wanted]


def drive(args: argparse.Namespace) -> dict[str, Any]:
    ok, liger_info = liger_usable(args.quick)
    hf_run = "liger" if ok else "hf"
    start = time.time()
    rows: list[dict[str, Any]] = []
    steps = plan(args, hf_run)
    end = start + args.budget_s
    weights_left = sum(s for _, _, s in steps)
    for run, lengths, share in steps:
        if share == 0.0:  # the head: always measured; the budget end only bounds a hung worker
            deadline = end
        else:  # a tail run gets its weight's part of what is left (and what earlier tail runs did not use)
            deadline = time.time() + max(0.0, end - time.time()) * share / weights_left
            weights_left -= share
        done = [r for r in rows if r.get("run") == run and r.get("status") == "ok"]
        if any(r.get("run") == run and r.get("status") == "OOM" for r in rows):
            rows += [{"event": "row", "run": run, "tokens": t, "status": "skipped",
                      "reason": "OOM at a shorter length"} for t in lengths]
            continue
        rows += launch(run, lengths, deadline, args, prior=done[-1] if done else None)
    # the card's name comes from a worker: a CUDA context in this process would take device memory
    cards = {r["card"] for r in rows if r.get("event") == "start"}
    env = {"card": ", ".join(sorted(cards)) or "?",
           "torch": torch.__version__, "liger": liger_info, "quick": args.quick, "mlp_chunk": args.mlp_chunk,
           "budget_s": args.budget_s, "wall_s": time.time() - start,
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=False).stdout.strip() or os.environ.get("ENTRENAR_COMMIT", "?"),
           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    return {"env": env, "rows": rows, "peer": hf_run}


def _cell(row: dict[str, Any] | None) -> tuple[str, str]:
    if row is None:
        return "-", "-"
    if row["status"] != "ok":
        return row["status"], ""
    peak = "n/a (CPU)" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
    return peak, f"{row['step_s']:.2f}"


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """Goal 5: entrenar long's peak at 131072 tokens <= 2/3 of the peer's, measured in this call (else
    against the issue's H200 number for Liger, said so)."""
    rows = {(r["run"], r["tokens"]): r for r in results["rows"] if r.get("event") == "row"}
    ours, peer = rows.get(("long", GOAL_TOKENS)), rows.get((results["peer"], GOAL_TOKENS))
    if ours is None or ours["status"] != "ok" or ours.get("peak_gib") is None:
        return {"met": None, "text": f"not measured: entrenar long at {GOAL_TOKENS} tokens "
                                     f"{ours['status'] if ours else 'not run'}"}
    if results["peer"] == "liger" and peer is not None and peer["status"] == "ok":
        ref, source = peer["peak_gib"], "Liger in this call"
    else:
        ref, source = ISSUE_LIGER_GIB[GOAL_TOKENS], "the issue's H200 Liger number (Liger not measured here)"
    ratio = ours["peak_gib"] / ref
    met = ratio <= GOAL_RATIO
    # the issue's own figure too: its method (e.g. whether AdamW state existed at the peak) is not recorded
    issue = ours["peak_gib"] / ISSUE_LIGER_GIB[GOAL_TOKENS]
    return {"met": met, "ratio": ratio, "ours_gib": ours["peak_gib"], "ref_gib": ref, "source": source,
            "ratio_to_issue_figure": issue,
            "text": f"goal 5 {'MET' if met else 'NOT MET'}: {ours['peak_gib']:.2f} GiB vs {ref:.2f} GiB "
                    f"({source}) = {ratio:.3f} of it (bound {GOAL_RATIO:.3f}); vs the issue's "
                    f"{ISSUE_LIGER_GIB[GOAL_TOKENS]} GiB: {issue:.3f}"}


def markdown(results: dict[str, Any]) -> str:
    env, peer = results["env"], results["peer"]
    rows = {(r["run"], r["tokens"]): r for r in results["rows"] if r.get("event") == "row"}
    starts = {r["run"]: r for r in results["rows"] if r.get("event") == "start"}
    lengths = sorted({t for _, t in rows})
    out = [(f"commit `{env['commit']}`, card **{env['card']}**, torch {env['torch']}, liger {env['liger']}; "
            f"{'a tiny Qwen2-shaped model (--quick)' if env['quick'] else 'Qwen2.5-0.5B shapes'} (random weights), "
            f"batch 1, bf16 weights + bf16 AdamW state, activation "
            f"checkpointing; --mlp-chunk {env['mlp_chunk']}; peak = max_memory_allocated over whole steps "
            f"(AdamW state allocated); wall {env['wall_s']:.0f} s."), ""]
    static = ", ".join(f"{RUN_LABELS[r]} {s['static_gib']:.2f} GiB" for r, s in starts.items()
                       if s.get("static_gib") is not None)
    if static:
        out += [f"Weights + AdamW state before a step: {static}.", ""]
    runs = ["long", "ckpt", peer]
    head = " | ".join(f"{RUN_LABELS[r]} GiB | s/step" for r in runs)
    out += [f"| tokens | {head} | long / {peer} | ckpt / {peer} |", "|---:" * (2 + 2 * len(runs) + 1) + "|"]
    for t in lengths:
        cells = [c for r in runs for c in _cell(rows.get((r, t)))]
        ratios = []
        for r in ("long", "ckpt"):
            a, b = rows.get((r, t)), rows.get((peer, t))
            ok = a and b and a["status"] == b["status"] == "ok" and a["peak_gib"] and b["peak_gib"]
            ratios.append(f"{a['peak_gib'] / b['peak_gib']:.2f}" if ok else "-")
        out.append(f"| {t:,} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    notes = [f"- {RUN_LABELS[r['run']]} at {r['tokens']:,}: {r['status']}: {r.get('reason', '')}"
             for r in results["rows"] if r.get("event") == "row" and r["status"] not in ("ok",)]
    out += ["", *notes, "", results["verdict"]["text"]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    ap.add_argument("--lengths", default=None, help="comma-separated token counts (default 8k..512k; --quick: "
                                                    "256..2048)")
    ap.add_argument("--mlp-chunk", type=int, default=16384, help="entrenar long's --mlp-chunk (quick: 128)")
    ap.add_argument("--runs", default="long,peer,ckpt", help="which runs (peer: Liger, or transformers "
                                                             "where Liger cannot run)")
    ap.add_argument("--ckpt-max", type=int, default=GOAL_TOKENS, help="longest length of the ckpt reference run")
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget of all runs (seconds)")
    ap.add_argument("--quick", action="store_true", help="CPU, tiny Qwen2-shaped model, short lengths")
    ap.add_argument("--oom-above", type=int, default=None, help="raise OOM above this length (tests the path)")
    ap.add_argument("--worker", choices=tuple(RUN_LABELS), help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prior", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lengths is None:
        args.lengths = "256,512,1024,2048" if args.quick else ",".join(str(1 << k) for k in range(13, 20))
    if args.quick and args.mlp_chunk == 16384:
        args.mlp_chunk = 128
    if args.worker:
        args.run = args.worker
        worker(args)
        return
    results = drive(args)
    results["verdict"] = verdict(results)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(results)
    (out_dir / "long_context_memory.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "long_context_memory.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
