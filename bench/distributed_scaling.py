#!/usr/bin/env python3
"""Data-parallel scaling of the real CLI under torchrun (issue 12): tokens/s and peak memory per GPU.

    PYTHONPATH=src NCCL_NVLS_ENABLE=0 python bench/distributed_scaling.py            # 2 GPUs, < 9 min
    PYTHONPATH=src python bench/distributed_scaling.py --smoke                        # CPU, tiny, gloo

Runs `python -m torch.distributed.run --nproc-per-node N <cli> pretrain --model PRESET ...` with
random weights of the preset's real shapes on random-token shards written here (the pack format of
data/corpus.py, vocabulary = the preset's, so no shapes change). Rows:

  qwen2.5-0.5b   full training, bf16 compute / fp32 master, batch 8 x 2048 per GPU, 1 and 2 GPUs
  llama-370m     pretraining, same settings, 1 and 2 GPUs
  qwen2.5-coder-7b  full training on 2 GPUs (FSDP2, fp32 master sharded, bf16 compute,
                 --activation-checkpointing), batch 2 x 2048 per GPU (1 x 2048 if that does not fit);
                 with the memory arithmetic whether or not it fits

1 GPU is the plain single-process path (torchrun with one process: no process group, no FSDP);
2 GPUs is FSDP2 (MixedPrecisionPolicy bf16/fp32). tok/s per GPU = the CLI's tok_s (all ranks'
tokens per step time) / GPUs, median over the steps after the first 3; peak memory = the CLI's
mem_mb (torch.cuda.max_memory_allocated on rank 0; FSDP ranks are symmetric). MFU = the CLI's
(6N + attention FLOPs per token, per device, against the card's dense bf16 peak).

What is not the plain CLI (a wrapper patches it before calling entrenar.cli.main): checkpoints and
final/ are switched off (a 7B DCP checkpoint is ~120 GB and would dominate the time), and the random
weights are drawn on the GPU (same distribution as CausalLM.init_weights; the CLI draws them on the
CPU, minutes for 7.6 B parameters). Neither is inside the measured steps. A run that fails with --kernels auto (Triton) is retried with
--kernels torch, and the table says which kernels ran. Prints a markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WRAPPER = """
import math, sys
import torch
from entrenar.model import CausalLM
from entrenar.train import loop, parallel
# bench: no checkpoint / final/ I/O (a 7B sharded checkpoint is ~90 GB); the steps are the CLI's. The
# resume test (BENCH_SAVE_AT=N) writes the one checkpoint of step N, through the CLI's own save
import os
_save, _at = loop.Trainer.save, int(os.environ.get("BENCH_SAVE_AT") or 0)
loop.Trainer.save = lambda self, step, *a, **k: _save(self, step, *a, **k) if step == _at else None
loop.Trainer.finish = lambda self: None
# bench: DDP constructor options under test (BENCH_DDP_KW, JSON, e.g. '{"bucket_cap_mb": 25}'), over what
# train/parallel.apply_ddp passes (parallel.DDP_OPTIONS, static_graph without accumulation)
import json
import torch.nn.parallel as _tnp
_ddp_kw = json.loads(os.environ.get("BENCH_DDP_KW") or "{}")
if _ddp_kw:
    class _TunedDDP(_tnp.DistributedDataParallel):
        def __init__(self, *a, **k):
            super().__init__(*a, **{**k, **_ddp_kw})
    _tnp.DistributedDataParallel = _TunedDDP
# bench: BENCH_GC=auto gives the steps Python's automatic garbage collection back (the CLI's steps run with it
# off, collecting every loop.GC_EVERY steps): the A/B of that choice
if os.environ.get("BENCH_GC") == "auto":
    loop.GC_EVERY = 0
# bench: random weights built on this rank's GPU (the CLI builds them on the CPU: minutes for 7.6 B
# parameters with one thread per rank); same distribution as CausalLM.init_weights
_init = CausalLM.__init__
def __init__(self, *a, **k):
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        _init(self, *a, **k)
def init_weights(self, seed=None):
    dev = next(self.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(seed or 0)
    std = self.cfg.initializer_range
    with torch.no_grad():
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                resid = name.endswith(("o_proj.weight", "down_proj.weight"))
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.num_layers) if resid else std, generator=gen)
CausalLM.__init__ = __init__
CausalLM.init_weights = init_weights
from entrenar import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_job(proc: subprocess.Popen) -> str:
    """A job past its time: SIGTERM to torchrun (it stops its workers), then SIGKILL to whatever is
    left; an orphaned worker would keep its GPU memory and make every later run run out of it."""
    workers = _descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        err = ""
    for pid in [proc.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None or not err:
        err = (err or "") + (proc.communicate()[1] or "")
    return err


def write_shards(out: Path, vocab: int, tokens: int, seed: int = 0) -> Path:
    """Random token ids in [0, vocab) in entrenar's shard format (data/corpus.py): index.json,
    train-00000.bin (little-endian uint32), train.docs.bin (one document)."""
    from entrenar.data.corpus import FORMAT
    from entrenar.fileio import sha256_file

    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype("<u2") if vocab < 65536 else np.dtype("<u4")
    ids = np.random.default_rng(seed).integers(0, vocab, size=tokens).astype(dtype)
    ids.tofile(out / "train-00000.bin")
    np.zeros(1, dtype="<u8").tofile(out / "train.docs.bin")
    index = {"format": FORMAT, "dtype": dtype.str, "vocab_size": vocab,
             "tokenizer": {"model": None, "vocab_size": vocab, "eos_id": None},
             "source_sha256": f"random-{seed}-{vocab}-{tokens}", "tokens": tokens, "documents": 1,
             "splits": {"train": {"documents": 1, "tokens": tokens, "doc_offsets": "train.docs.bin",
                                  "shards": [{"file": "train-00000.bin", "tokens": tokens,
                                              "sha256": sha256_file(out / "train-00000.bin")}]}}}
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def num_parameters(preset_name: str) -> int:
    import torch

    from entrenar.config import preset
    from entrenar.model import CausalLM

    with torch.device("meta"):
        model = CausalLM(preset(preset_name))
    return sum(p.numel() for p in model.parameters())


def run_one(work: Path, name: str, preset_name: str, gpus: int, batch: int, seq: int, steps: int, device: str,
            dtype: str, extra: list[str], timeout: float, out: Path | None = None,
            env_extra: dict[str, str] | None = None) -> dict:
    """One torchrun job; its metrics summarised (or the failure). `out` given: that run directory as it
    is (a resume continues in it), else a fresh one."""
    wrapper = work / "bench_cli.py"
    wrapper.write_text(WRAPPER)
    kernels = "torch" if "--kernels" in extra else "auto"
    if out is None:
        out = work / f"{name.replace(' ', '-')}-{gpus}gpu-b{batch}-{kernels}"  # fresh per attempt (retries too)
        shutil.rmtree(out, ignore_errors=True)
    shards = work / f"shards-{preset_name}"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "NCCL_NVLS_ENABLE": "0", **(env_extra or {})}
    launcher = os.environ.get("BENCH_TORCHRUN_EXTRA", "").split()  # e.g. "--numa-binding node"
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc-per-node", str(gpus), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(wrapper), "pretrain", "--model", preset_name,
           "--data", str(shards), "--out", str(out), "--steps", str(steps), "--batch-size", str(batch),
           "--seq-len", str(seq), "--lr", "1e-4", "--warmup", "2", "--device", device, "--dtype", dtype,
           "--no-preflight", "--json", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        err, code = stop_job(proc), f"timeout after {timeout:.0f} s"
    row: dict = {"name": name, "gpus": gpus, "batch": batch, "seq": seq, "seconds": time.perf_counter() - t0,
                 "kernels": kernels, "ok": code == 0}
    metrics = out / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    row["losses"] = {r["step"]: r["loss"] for r in records}
    first = min(row["losses"], default=0)  # a resumed run's first step is not step 1
    later = [r for r in records if r["step"] > first + 2] or records[1:] or records
    if code != 0:  # the ranks' own error lines, not torchrun's ChildFailedError summary after them
        causes = [ln for ln in err.splitlines() if ("Error" in ln or "error:" in ln or "out of memory" in ln)
                  and "ChildFailedError" not in ln and "elastic" not in ln and not ln.startswith("[W")]
        tail = causes[-3:] or [ln for ln in err.splitlines() if ln.strip()][-4:]
        row["error"] = f"exit {code}: " + " | ".join(tail)[-600:]
    if later:
        row["tok_s_per_gpu"] = statistics.median(r["tok_s"] for r in later) / gpus
        mfu = [r["mfu"] for r in later if r.get("mfu") is not None]
        row["mfu"] = statistics.median(mfu) if mfu else None
        row["peak_mem_gib"] = max(r["mem_mb"] for r in records) / 1024
        row["steps_measured"] = len(later)
    print(json.dumps(row), flush=True)
    return row


def memory_arithmetic(preset_name: str, gpus: int, batch: int, seq: int) -> str:
    from entrenar.config import preset

    cfg = preset(preset_name)
    n = num_parameters(preset_name)
    gib = 2**30
    states = 16 * n / gpus / gib  # fp32 master 4 + fp32 grad 4 + AdamW m, v 8 bytes, sharded
    per_block = (n - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)) / cfg.num_layers
    gathered = 2 * 2 * per_block / gib  # bf16 all-gathered block (+ the prefetched next one)
    head = 2 * cfg.vocab_size * cfg.hidden_size / gib  # the root's bf16 head, gathered for the whole step
    act = cfg.num_layers * batch * seq * cfg.hidden_size * 2 / gib  # checkpointed block inputs (bf16)
    return (f"{preset_name}: {n / 1e9:.2f} B parameters; per GPU at {gpus} GPUs: {states:.1f} GiB sharded fp32 "
            f"master+grad+AdamW (16 B/param / {gpus}) + {gathered:.1f} GiB gathered bf16 blocks + {head:.1f} GiB "
            f"bf16 head + {act:.2f} GiB checkpointed activations (batch {batch} x {seq}) + one block's "
            f"recompute and the loss chunks = {states + gathered + head + act:.1f} GiB before allocator overhead; "
            f"1 GPU would need {16 * n / gib:.0f} GiB for the states alone")


def resume_test(work: Path, preset_name: str, gpus_a: int, gpus_b: int, batch_a: int, seq: int, steps: int,
                save_at: int, device: str, dtype: str, extra: list[str], timeout: float) -> list[dict]:
    """Run A on gpus_a GPUs writes the sharded checkpoint of step `save_at` and runs on to `steps`; run B
    resumes that checkpoint on the first gpus_b GPUs with the same global batch (per-GPU batch
    batch_a * gpus_a / gpus_b) and runs the same steps: its losses against A's after the checkpoint."""
    name = f"{preset_name} resume {gpus_a}->{gpus_b}"
    out = work / f"resume-{preset_name}"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    a = run_one(work, f"{name} (A: writes step {save_at})", preset_name, gpus_a, batch_a, seq, steps, device,
                dtype, [*extra, "--save-every", str(save_at)], timeout, out=out,
                env_extra={"BENCH_SAVE_AT": str(save_at)})
    ckpt = out / "checkpoints" / f"step-{save_at:07d}"
    a["save_and_run_seconds"] = time.perf_counter() - t0
    a["checkpoint_gib"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30 if ckpt.is_dir() else None
    if not a["ok"] or not ckpt.is_dir():
        return [a]
    shutil.copy(out / "metrics.jsonl", work / f"resume-{preset_name}-A-metrics.jsonl")
    visible = ",".join(str(i) for i in range(gpus_b))
    b = run_one(work, f"{name} (B: resumes step {save_at})", preset_name, gpus_b, batch_a * gpus_a // gpus_b, seq,
                steps, device, dtype, [*extra, "--resume", str(ckpt)], timeout, out=out,
                env_extra={"CUDA_VISIBLE_DEVICES": visible} if device == "cuda" else {})
    after = [s for s in sorted(b.get("losses", {})) if s > save_at]
    b["resumed_steps"] = after
    if b["ok"] and after and all(s in a["losses"] for s in after):  # a failed B left A's metrics.jsonl there
        rel = [abs(b["losses"][s] - a["losses"][s]) / abs(a["losses"][s]) for s in after]
        b["max_rel_loss_diff_vs_A"] = max(rel)
    print(json.dumps({"resume": name, "A": a["losses"], "B": b.get("losses"),
                      "max_rel": b.get("max_rel_loss_diff_vs_A")}), flush=True)
    return [a, b]


def fmt(row: dict) -> str:
    def num(key: str, spec: str) -> str:
        v = row.get(key)
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    status = "ok" if row["ok"] else row.get("error", "failed")[:160].replace("|", "/")
    return (f"| {row['name']} | {row['gpus']} | {row['batch']} x {row['seq']} | {num('tok_s_per_gpu', ',.0f')} | "
            f"{num('scaling', '.1%')} | {num('mfu', '.1%')} | {num('peak_mem_gib', '.1f')} | {row['kernels']} | "
            f"{status} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, the tiny preset, 2 steps: checks the plumbing")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds for all runs (default 500; a run past its time is stopped, <= 30 s more)")
    ap.add_argument("--big-reserve", type=float, default=200.0,
                    help="seconds of the budget kept for the 7B run (default 200)")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=10,
                    help="steps of each GPU row (default 10; the median is over the steps after the first 3)")
    ap.add_argument("--only", default="", help="run only the rows whose preset contains this text")
    ap.add_argument("--cli-extra", default="", help="extra CLI flags for every run, e.g. '--parallel ddp'")
    ap.add_argument("--gpus", default="1,2", help="GPU counts of the scaling rows (default 1,2; e.g. 1,2,4)")
    ap.add_argument("--big-gpus", type=int, default=2,
                    help="GPUs of the qwen2.5-coder-7b row (default 2; 0 = no 7B row)")
    ap.add_argument("--ddp-kw", default="", help="JSON of extra DistributedDataParallel options for every run, e.g. "
                    "'{\"bucket_cap_mb\": 100, \"gradient_as_bucket_view\": true}' (bench only)")
    ap.add_argument("--big-batch", type=int, default=2, help="per-GPU batch of the qwen2.5-coder-7b row (default 2)")
    ap.add_argument("--resume-test", default="",
                    help="A,B: qwen2.5-coder-7b on A GPUs writes its sharded checkpoint of step 3 and runs 6 "
                         "steps; B GPUs resume it (same global batch); losses of steps 4-6 compared")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.ddp_kw:
        json.loads(args.ddp_kw)  # fail here, not in every rank
        os.environ["BENCH_DDP_KW"] = args.ddp_kw
    work = Path(args.work or tempfile.mkdtemp(prefix="entrenar-dist-bench-"))
    if args.smoke:
        device, dtype, seq, steps = "cpu", "fp32", 64, 5
        plan = [("tiny pretrain", "tiny", g, 2, [], 120) for g in (1, 2)]
        big = None
    else:
        import torch

        counts = [int(g) for g in args.gpus.split(",") if g.strip()]
        if torch.cuda.device_count() < max(*counts, args.big_gpus):
            print(f"needs {max(*counts, args.big_gpus)} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
        print(f"cards: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}")
        device, dtype, seq, steps = "cuda", "bf16", 2048, args.steps
        plan = [("qwen2.5-0.5b full", "qwen2.5-0.5b", g, 8, [], 120) for g in counts]
        plan += [("llama-370m pretrain", "llama-370m", g, 8, [], 120) for g in counts]
        big = (("qwen2.5-coder-7b full", "qwen2.5-coder-7b", args.big_gpus, args.big_batch,
                ["--activation-checkpointing"], 240) if args.big_gpus else None)
    if args.only:
        plan = [p for p in plan if args.only in p[1]]
    if args.cli_extra:
        plan = [(*p[:4], [*p[4], *args.cli_extra.split()], p[5]) for p in plan]
    from entrenar.config import preset

    resume_preset = "tiny" if args.smoke else "qwen2.5-coder-7b"
    if args.resume_test:
        plan_shards = [("", resume_preset, max(int(x) for x in args.resume_test.split(",")), 2 * args.big_batch, [], 0)]
    else:
        plan_shards = []
    for _, preset_name, gpus, batch, _, _ in plan + ([big] if big else []) + plan_shards:
        need = steps * batch * gpus * seq + seq + 1
        if not (work / f"shards-{preset_name}" / "index.json").is_file():
            write_shards(work / f"shards-{preset_name}", preset(preset_name).vocab_size, max(need, 4 * need))
    rows: list[dict] = []
    phase_end = args.budget - (args.big_reserve if big else 0)  # the scaling rows, then the 7B
    for name, preset_name, gpus, batch, extra, timeout in plan:
        left = phase_end - (time.perf_counter() - t_start)
        if left < 30:
            rows.append({"name": name, "gpus": gpus, "batch": batch, "seq": seq, "kernels": "-", "ok": False,
                         "error": "skipped: time budget spent"})
            continue
        row = run_one(work, name, preset_name, gpus, batch, seq, steps, device, dtype, extra, min(timeout, left))
        if not row["ok"] and "tok_s_per_gpu" not in row and not args.smoke and row["seconds"] < left - 60:
            row = run_one(work, name, preset_name, gpus, batch, seq, steps, device, dtype,
                          [*extra, "--kernels", "torch"], min(timeout, left - row["seconds"]))
            if row["ok"] and gpus > 1 and big:  # Triton failed under FSDP: the 7B run goes to torch directly
                big = (*big[:4], [*big[4], "--kernels", "torch"], big[5])
        rows.append(row)
    for row in rows:  # per-GPU throughput at N GPUs relative to the same model at 1 GPU
        base = next((r for r in rows if r["name"] == row["name"] and r["gpus"] == 1 and r.get("tok_s_per_gpu")), None)
        if base and row.get("tok_s_per_gpu") and row["gpus"] > 1:
            row["scaling"] = row["tok_s_per_gpu"] / base["tok_s_per_gpu"]
    notes = []
    if big:
        name, preset_name, gpus, batch, extra, timeout = big
        notes.append(memory_arithmetic(preset_name, gpus, batch, seq))
        left = args.budget - (time.perf_counter() - t_start)
        for b in sorted({batch, max(1, batch // 2), 1}, reverse=True):  # smaller batches only after an OOM
            if left < 60:
                rows.append({"name": name, "gpus": gpus, "batch": b, "seq": seq, "kernels": "-", "ok": False,
                             "error": f"skipped: {left:.0f} s of the time budget left"})
                break
            row = run_one(work, name, preset_name, gpus, b, seq, steps, device, dtype, extra, min(timeout, left))
            rows.append(row)
            left -= row["seconds"]
            if row["ok"] or "out of memory" not in row.get("error", "").lower():
                break
    if args.resume_test:
        ga, gb = (int(x) for x in args.resume_test.split(","))
        left = args.budget - (time.perf_counter() - t_start)
        rows += resume_test(work, resume_preset, ga, gb, args.big_batch, seq, 6, 3, device, dtype,
                            ["--activation-checkpointing", *(args.cli_extra.split() if args.cli_extra else [])],
                            max(60.0, left / 2))
    lines = ["| run | GPUs | batch/GPU | tok/s per GPU | vs 1 GPU | MFU | peak mem GiB/GPU | kernels | status |",
             "|---|---|---|---|---|---|---|---|---|", *(fmt(row) for row in rows), *(f"\n{n}" for n in notes)]
    print("\n" + "\n".join(lines))
    if os.environ.get("OUT"):  # the device tool brings $OUT back
        Path(os.environ["OUT"], "distributed_scaling.md").write_text("\n".join(lines) + "\n")
        Path(os.environ["OUT"], "distributed_scaling.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; work dir {work}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
