#!/usr/bin/env python3
"""Step time with a checkpoint write in flight vs without, and how long each save blocks the step (issue 36 item 5).

Trains a random LLaMA-shaped model on random tokens through build_trainer (the commands' checkpoint files
included), saving every --every steps with --save-mode MODE, and times every train_step and every save call.
A step counts as "during" when it ran entirely inside a background write, "free" when it overlapped none (the first
--skip steps are warm-up). The ratio compares each write's steps with the free steps next to it (as many on each
side), so a slow drift of the machine's load cancels out. Prints one JSON line.

    PYTHONPATH=src:. OMP_NUM_THREADS=1 python tools/ckpt_step_time.py OUT --mode async --steps 96 --every 24
    python tools/ckpt_step_time.py OUT --mode sync ...   # the blocking time of a synchronous save
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from entrenar.config import ModelConfig
from entrenar.model import CausalLM
from entrenar.train import checkpoint as C
from entrenar.train import loop
from entrenar.train.loop import TrainConfig, build_trainer
from entrenar.train.model_files import checkpoint_files


class RandomTokens:
    """Batches of random tokens (the loaders' interface), a different seed per batch."""

    def __init__(self, vocab: int, batch: int, seq: int):
        self.vocab, self.batch, self.seq, self.pos, self.epoch = vocab, batch, seq, 0, 0

    def next_batch(self) -> dict:
        g = torch.Generator().manual_seed(self.pos)
        self.pos += 1
        ids = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--mode", default="async", choices=C.SAVE_MODES)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--every", type=int, default=24)
    ap.add_argument("--skip", type=int, default=6)
    args = ap.parse_args()

    cfg_m = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
                        num_layers=args.layers, num_heads=max(1, args.hidden // 64),
                        num_kv_heads=max(1, args.hidden // 128), tie_word_embeddings=True,
                        max_position_embeddings=args.seq)
    model = CausalLM(cfg_m)
    model.init_weights(0)
    model = model.to(args.device)

    writes: list[tuple[float, float]] = []
    steps: dict[int, tuple[float, float]] = {}
    saves: list[float] = []
    write_snapshot, train_step, save = C.write_snapshot, loop.Trainer.train_step, loop.Trainer.save

    def timed_write(*a, **k):
        t = time.perf_counter()
        try:
            return write_snapshot(*a, **k)
        finally:
            writes.append((t, time.perf_counter()))

    def timed_step(self, step):
        t = time.perf_counter()
        record = train_step(self, step)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        steps[step] = (t, time.perf_counter())
        return record

    def timed_save(self, *a, **k):
        t = time.perf_counter()
        try:
            return save(self, *a, **k)
        finally:
            saves.append(time.perf_counter() - t)

    C.write_snapshot, loop.Trainer.train_step, loop.Trainer.save = timed_write, timed_step, timed_save
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch, seq_len=args.seq, lr=1e-4, warmup=2,
                      save_every=args.every, keep=2, seed=1, save_mode=args.mode, device=args.device)
    trainer = build_trainer(model, RandomTokens(args.vocab, args.batch, args.seq), None, cfg, args.out,
                            log=lambda text: None, checkpoint_files=checkpoint_files)
    trainer.begin(None)
    trainer.fit()

    def overlap(a: float, b: float, inside: bool) -> bool:
        return any((w0 <= a and b <= w1) if inside else (w0 < b and a < w1) for w0, w1 in writes)
    per = {s: (b - a, overlap(a, b, True), overlap(a, b, False)) for s, (a, b) in steps.items() if s > args.skip}
    cycles: list[list[int]] = []
    for s in sorted(s for s, (_, inside, _) in per.items() if inside):
        if cycles and s - cycles[-1][-1] <= 2:
            cycles[-1].append(s)
        else:
            cycles.append([s])
    rows = []
    for c in cycles:
        near = [per[s][0] for s in range(c[0] - len(c) - 1, c[-1] + len(c) + 2) if s in per and not per[s][2]]
        if near:
            during = statistics.median(per[s][0] for s in c)
            rows.append({"steps": [c[0], c[-1]], "median_s_during": round(during, 4),
                         "median_s_free_nearby": round(statistics.median(near), 4),
                         "ratio": round(during / statistics.median(near), 3)})
    during = [dt for dt, inside, _ in per.values() if inside]
    free = [dt for dt, _, touched in per.values() if not touched]
    ckpt = (args.out / "checkpoints" / "latest").resolve()
    print(json.dumps({
        "mode": args.mode, "device": args.device, "torch_threads": torch.get_num_threads(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()),
        "save_call_s": [round(x, 3) for x in saves], "write_s": [round(b - a, 3) for a, b in writes],
        "steps_during_write": len(during), "steps_free": len(free),
        "median_step_s_during": round(statistics.median(during), 4) if during else None,
        "median_step_s_free": round(statistics.median(free), 4) if free else None,
        "writes": rows}))


if __name__ == "__main__":
    main()
