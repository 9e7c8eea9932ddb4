"""Host syncs and step time of Trainer.train_step on one GPU (issue 15 direction, issue 11 item 1).

The Trainer sums the micro-batch losses on the device (float64) and reads loss and grad norm back
together once per step; the loop it replaced called float() on every micro-batch's loss and on the
grad norm (grad_accum + 1 reads per step). This counts the synchronizing CUDA calls inside
train_step with torch.cuda.set_sync_debug_mode("warn") and times steps, for the Trainer as it is and
for a subclass that reads back per micro-batch as before (same math, same losses).

    PYTHONPATH=src python -m bench.trainer_syncs            # prints a table; needs CUDA
    PYTHONPATH=src python -m bench.trainer_syncs --smoke    # the same code on the CPU (no sync counts)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from entrenar.config import ModelConfig
from entrenar.model import CausalLM
from entrenar.train.loop import TrainConfig, Trainer, backward_micro_batches, build_trainer


class RandomLoader:
    """Fixed-length random token batches with the loader interface the Trainer expects."""

    def __init__(self, vocab: int, batch: int, seq: int, seed: int = 0):
        self.vocab, self.batch, self.seq, self.epoch, self.pos = vocab, batch, seq, 0, 0
        self.g = torch.Generator().manual_seed(seed)

    def next_batch(self) -> dict:
        ids = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.g)
        self.pos += 1
        return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                "sample_ids": list(range(self.batch))}

    def iter_epoch(self):
        return iter([])

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class PerMicroBatchReads(Trainer):
    """The replaced loop's read-back pattern: float() per micro-batch loss, then the grad norm."""

    def forward_backward(self, micro, total_tokens):
        loss_total = 0.0
        for b in micro:
            loss_total += float(backward_micro_batches(self.model, [b], self.device, self.cfg.dtype, total_tokens))
        max_norm = self.cfg.clip if self.cfg.clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True))
        return loss_total / total_tokens, grad_norm, {}


def measure(cls: type[Trainer], grad_accum: int, steps: int = 12, device: str = "cuda"
            ) -> tuple[float, float, list[float]]:
    small = device == "cpu"  # --smoke: the same code path on a CPU-sized model, no sync counting
    cfg_m = ModelConfig(vocab_size=512 if small else 32000, hidden_size=64 if small else 512,
                        intermediate_size=128 if small else 1408, num_layers=2 if small else 8, num_heads=8,
                        num_kv_heads=4, tie_word_embeddings=True, max_position_embeddings=1024)
    seq = 32 if small else 512
    model = CausalLM(cfg_m)
    model.init_weights(0)
    model = model.to(device)
    cfg = TrainConfig(steps=steps, batch_size=4, grad_accum=grad_accum, seq_len=seq, lr=1e-4, warmup=0,
                      device=device, dtype="fp32" if small else "bf16", save_every=0)
    with tempfile.TemporaryDirectory() as d:
        trainer = build_trainer(model, RandomLoader(cfg_m.vocab_size, 4, seq), None, cfg, Path(d), log=lambda _t: None)
        trainer.__class__ = cls  # the same parts, the compared step
        trainer.save = lambda *a, **k: None  # time steps only
        syncs, times, losses = [], [], []
        for step in range(1, steps + 1):
            if not small:
                torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if not small:
                    torch.cuda.set_sync_debug_mode("warn")
                t0 = time.perf_counter()
                record = trainer.train_step(step)
                if not small:
                    torch.cuda.set_sync_debug_mode("default")
            times.append(time.perf_counter() - t0)
            syncs.append(sum("synchronizing" in str(w.message) for w in caught))
            losses.append(record["loss"])
    warm = slice(2, None)  # first steps include allocator / autotune warm-up
    return statistics.mean(syncs[warm]), statistics.median(times[warm]), losses


def main() -> None:
    device = "cpu" if "--smoke" in sys.argv else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --smoke for a CPU run of the same code, no sync counts)")
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke)"
    print(f"device: {name}, torch {torch.__version__}")
    print(f"{'grad_accum':>10}  {'pattern':<26}  {'syncs/step':>10}  {'median step ms':>14}  same losses")
    for ga in (1, 4, 16):
        s_new, t_new, l_new = measure(Trainer, ga, device=device)
        s_old, t_old, l_old = measure(PerMicroBatchReads, ga, device=device)
        same = l_new == l_old
        print(f"{ga:>10}  {'Trainer (one read)':<26}  {s_new:>10.1f}  {t_new * 1e3:>14.2f}  {same}")
        print(f"{ga:>10}  {'per-micro-batch float()':<26}  {s_old:>10.1f}  {t_old * 1e3:>14.2f}")


if __name__ == "__main__":
    main()
