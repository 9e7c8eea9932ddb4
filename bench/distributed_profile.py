#!/usr/bin/env python3
"""Where a distributed step's time goes: the real CLI under torchrun (as bench/distributed_scaling.py)
with torch.profiler around steps 5-7 on rank 0. Prints key_averages sorted by self CUDA time and by
self CPU time, and the step time of every step.

    PYTHONPATH=src NCCL_NVLS_ENABLE=0 python bench/distributed_profile.py --gpus 1,2 --preset llama-370m
    PYTHONPATH=src python bench/distributed_profile.py --smoke        # CPU, gloo, tiny preset

Extra CLI flags (e.g. --parallel ddp) go through --cli-extra. Tables and a gzipped chrome trace per
run land in $OUT when it is set (the device tool brings it back).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed_scaling import REPO, WRAPPER, free_port, write_shards

PROFILE = """
import gzip, os, shutil, time
import torch
from entrenar.train import loop
_step = loop.Trainer.train_step
_prof = {}
def train_step(self, step):
    rank = int(os.environ.get("RANK", "0"))
    if step == 5 and rank == 0:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        _prof["p"] = torch.profiler.profile(activities=acts)
        _prof["p"].__enter__()
    t = time.perf_counter()
    rec = _step(self, step)
    if rank == 0:
        print(f"PROFILE step {step} wall {1e3 * (time.perf_counter() - t):.1f} ms tok_s {rec['tok_s']:.0f}", flush=True)
    if step == 7 and rank == 0 and "p" in _prof:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        p = _prof.pop("p")
        p.__exit__(None, None, None)
        ka = p.key_averages()
        tag = os.environ.get("PROFILE_TAG", "run")
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        text = (f"== {tag}: by {key} (3 steps)\\n" + ka.table(sort_by=key, row_limit=40, max_name_column_width=70)
                + f"\\n== {tag}: by self_cpu_time_total\\n"
                + ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
                + f"\\n== {tag}: by count\\n" + ka.table(sort_by="count", row_limit=25, max_name_column_width=70))
        print(text, flush=True)
        out = os.environ.get("OUT")
        if out:
            Path = __import__("pathlib").Path
            (Path(out) / f"profile-{tag}.txt").write_text(text)
            trace = Path(out) / f"trace-{tag}.json"
            p.export_chrome_trace(str(trace))
            with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
                shutil.copyfileobj(f, g)
            trace.unlink()
    return rec
loop.Trainer.train_step = train_step
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny preset, short sequences")
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--preset", default="llama-370m")
    ap.add_argument("--cli-extra", default="")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    device, dtype, seq, batch, preset_name = "cuda", "bf16", 2048, 8, args.preset
    if args.smoke:
        device, dtype, seq, batch, preset_name = "cpu", "fp32", 64, 2, "tiny"
    from entrenar.config import preset

    work = Path(tempfile.mkdtemp(prefix="entrenar-dist-prof-"))
    steps = 8
    counts = [int(g) for g in args.gpus.split(",")]
    shards = write_shards(work / "shards", preset(preset_name).vocab_size, 4 * (steps * batch * max(counts) * seq + seq + 1))
    wrapper = work / "wrapper.py"
    # the profiler patch goes in before the CLI runs (the last two lines of WRAPPER)
    head, tail = WRAPPER.rsplit("from entrenar import cli", 1)
    wrapper.write_text(head + PROFILE + "from entrenar import cli" + tail)
    rc = 0
    for gpus in counts:
        tag = f"{args.tag or preset_name}-{gpus}gpu"
        env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "NCCL_NVLS_ENABLE": "0", "PROFILE_TAG": tag, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(wrapper), "pretrain", "--model", preset_name,
               "--data", str(shards), "--out", str(work / tag), "--steps", str(steps), "--batch-size", str(batch),
               "--seq-len", str(seq), "--lr", "1e-4", "--warmup", "2", "--device", device, "--dtype", dtype,
               "--no-preflight", "--json", *args.cli_extra.split()]
        print(f"### {tag}", flush=True)
        rc |= subprocess.run(cmd, env=env, timeout=240, check=False).returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
