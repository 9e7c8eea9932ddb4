#!/usr/bin/env python3
"""Which lines of entrenar make the host wait for the GPU inside a training step (CUDA only).

    PYTHONPATH=src python -m bench.step_syncs [--steps 3]

Runs Trainer steps (the CLI's step: `Trainer.train_step`) under torch.cuda.set_sync_debug_mode("warn"),
which warns at every synchronising CUDA call (blocking copies, .item(), stream/device synchronize, ...),
and counts them by the innermost entrenar source line on the stack. Settings: llama-370m shapes at
--dtype bf16 and bf16-pure, and QLoRA (NF4 base + LoRA r 16) on smollm2-135m shapes, batch 2 x 512, random
tokens. The first step (its own timing sync, lazy allocations) is not counted. A step is meant to have
exactly one host read (loss and grad norm together, Trainer.forward_backward); anything else listed is a
place where the GPU drains and then idles while the host queues the next kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from bench.trainer_syncs import RandomLoader
from entrenar.config import preset
from entrenar.model import CausalLM
from entrenar.train.loop import TrainConfig, build_trainer


def count_syncs(fn) -> collections.Counter:
    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if "/entrenar/" in f.filename]
        where = (f"{ours[-1].filename.split('/entrenar/', 1)[-1]}:{ours[-1].lineno} {ours[-1].line}" if ours
                 else f"{filename}:{lineno}")
        sites[where] += 1

    old = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = old
    return sites


def run(name: str, model_name: str, dtype: str, steps: int, qlora: bool) -> dict:
    cfg_m = preset(model_name)
    model = CausalLM(cfg_m, kernels="triton")
    model.init_weights(0)
    if qlora:
        from entrenar.peft import apply_lora

        model = apply_lora(model.to("cuda"), 16, 32.0, quantize_nf4=True, seed=0)
    model = model.to("cuda")
    cfg = TrainConfig(steps=100, batch_size=2, seq_len=512, lr=1e-4, warmup=2, device="cuda", dtype=dtype)
    with tempfile.TemporaryDirectory() as d:
        trainer = build_trainer(model, RandomLoader(cfg_m.vocab_size, 2, 512), None, cfg, Path(d), log=lambda _t: None)
        trainer.train_step(1)

        def steps_fn():
            for s in range(2, steps + 2):
                trainer.train_step(s)
            torch.cuda.synchronize()
        sites = count_syncs(steps_fn)
    per_step = {k: v / steps for k, v in sites.most_common()}
    return {"name": name, "syncs_per_step": sum(per_step.values()), "sites": per_step}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("step_syncs needs CUDA", file=sys.stderr)
        return 2
    for name, model_name, dtype, qlora in (("llama-370m --dtype bf16", "llama-370m", "bf16", False),
                                           ("llama-370m --dtype bf16-pure", "llama-370m", "bf16-pure", False),
                                           ("QLoRA smollm2-135m --dtype bf16", "smollm2-135m", "bf16", True)):
        try:
            r = run(name, model_name, dtype, args.steps, qlora)
        except Exception as e:  # noqa: BLE001 -- reported, the other settings still run
            r = {"name": name, "error": f"{type(e).__name__}: {e}"[:400]}
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
