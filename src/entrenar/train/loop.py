"""The one training loop, behind `entrenar pretrain` and `entrenar finetune` (full, LoRA, QLoRA).

`Trainer` takes a built model (fp32 master parameters; LoRA already applied) and loader objects
with the interface `next_batch()`, `iter_epoch()`, `state_dict()`, `load_state_dict()`, `epoch`.
Batches: {"input_ids" [B,T], "labels" [B,T] (already shifted, -100 ignored), optional
"doc_ids", "position_ids", "sample_ids"}. Its parts, each replaceable in a subclass:

  resume(spec)       restore model, optimizer, schedule, data position, guards and RNG
  step0()            the step-0 record (eval, ln(vocab), sizes); check_start(record): GUARD-INIT-LOSS
  train_step(step)   fetch micro-batches -> count_loss_tokens -> forward/backward -> clip ->
                     guard_step -> optimizer
  evaluate(step)     token-weighted eval + its guards
  save(step)         an atomic checkpoint of weights checked finite
  fit()              the steps, evals, checkpoints, then final/

Loss normalisation: a step's G micro-batches are fetched first, their loss tokens counted
(`count_loss_tokens`, the one place a distributed all-reduce goes: `self.reduce`), and each
micro-batch backpropagates loss_sum / total_tokens. So batch 4 and batch 1 x accumulation 4 give
the same update on samples of unequal length. Train and eval both call
`model(input_ids, labels=..., position_ids=..., doc_ids=...)` -> (summed CE, token count).
The command (train/commands.py), not the loop, writes preflight.json from step0()'s record.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import GuardError, InputError
from ..fileio import atomic_write
from ..tensors import IGNORE_INDEX, JOB_COUNTS, batch_counts
from . import guards
from .checkpoint import (
    complete_checkpoints,
    find_resume,
    load_resume,
    restore_model,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_dir_name,
)
from .config import RESUME_SENSITIVE, TrainConfig
from .metrics import JsonlLog, Progress, peak_flops, peak_memory_mb
from .optim import Schedule, build_optimizer
from .precision import BF16Weights, make_precision, step_weights, to_training_dtype, uses_bf16

__all__ = ["LocalReduce", "TrainConfig", "Trainer", "TrainingInterrupted", "evaluate", "forward_backward",
           "train"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast(device: torch.device, dtype: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=uses_bf16(dtype))


def _to_device(batch: dict, device: torch.device) -> dict:
    # pinned host memory: the copy is truly asynchronous (from pageable memory it may wait for the
    # stream, i.e. for the previous step's optimizer, before the host can queue the forward)
    pin = device.type == "cuda"
    return {k: ((v.pin_memory() if pin and v.device.type == "cpu" else v).to(device, non_blocking=True)
                if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()}


class LocalReduce:
    """The collectives of a single process: identity. A distributed run replaces it with one whose
    all_reduce_sum / all_reduce_max combine a number or tensor over every rank (and return the same
    kind), so token totals, loss sums and guard verdicts are global."""

    rank, world_size = 0, 1

    def all_reduce_sum(self, value: Any) -> Any:
        return value

    def all_reduce_max(self, value: Any) -> Any:
        return value

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        return [obj]


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; carries the last complete checkpoint and how to continue."""

    def __init__(self, step: int, last_checkpoint: Path | None, resume_command: str | None):
        self.step, self.last_checkpoint = step, last_checkpoint
        self.checkpoint = str(last_checkpoint) if last_checkpoint is not None else None
        self.resume_command = resume_command or "the same command with --resume auto"
        if last_checkpoint is None:
            text = (f"during step {step}; no checkpoint was written yet (--save-every N writes them), so "
                    f"a rerun starts from step 0")
        else:
            text = (f"during step {step}; the last complete checkpoint is {last_checkpoint}; continue "
                    f"with: {self.resume_command}")
        super().__init__(text)


# ---- the one loss of train and eval ---------------------------------------------------------------
def loss_sum_of(model: torch.nn.Module, batch: dict, device: torch.device, dtype: str) -> torch.Tensor:
    """Summed cross-entropy of one batch through `forward` (a device scalar: no host sync)."""
    b = _to_device(batch, device)
    with autocast(device, dtype):
        loss_sum, _ = model(b["input_ids"], labels=b["labels"], position_ids=b.get("position_ids"),
                            doc_ids=b.get("doc_ids"))
    return loss_sum


def batch_loss(model: torch.nn.Module, batch: dict, device: torch.device, dtype: str
               ) -> tuple[torch.Tensor, int]:
    """(summed loss, loss-token count) of one batch: the one loss of train and eval."""
    return loss_sum_of(model, batch, device, dtype), loss_token_count(batch)


def loss_token_count(batch: dict) -> int:
    """Loss tokens of one batch, counted on the loader's (CPU) labels: no device sync."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


def _sample_ids(batches: Iterable[dict]) -> list:
    ids: list = []
    for b in batches:
        ids.extend(list(b.get("sample_ids") or []))
    return ids


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict], device: torch.device | str = "cpu",
             dtype: str = "fp32", max_batches: int = 0, reduce: LocalReduce | None = None) -> dict[str, float]:
    """Token-weighted eval: sum of per-token losses / number of loss tokens, and exp of it. The sum
    stays on the device in float64 (the same additions as a Python float sum) and is read once."""
    device, reduce = torch.device(device), reduce or LocalReduce()
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count, n_batches = 0, 0
    try:
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            total += loss_sum_of(model, batch, device, dtype).double()
            count += loss_token_count(batch)
            n_batches += 1
    finally:
        model.train(was_training)
    total, count = float(reduce.all_reduce_sum(total)), int(reduce.all_reduce_sum(count))
    if count == 0:
        raise GuardError("GUARD-ZERO-LOSS-TOKENS",
                         f"the eval set ({n_batches} batches) has no loss tokens, so its loss is undefined.",
                         "check the eval data: responses truncated away by --max-seq-len, or an empty split")
    loss = total / count
    ppl = math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan")
    return {"loss": loss, "ppl": ppl, "tokens": count, "batches": n_batches}


def backward_micro_batches(model: torch.nn.Module, micro_batches: list[dict], device: torch.device, dtype: str,
                           total_tokens: int) -> torch.Tensor:
    """Backpropagate every micro-batch's loss_sum / total_tokens (of the whole step); return the summed
    loss of the step as a float64 device scalar (read back once per step by the caller)."""
    acc = torch.zeros((), dtype=torch.float64, device=device)
    for b in micro_batches:
        s = loss_sum_of(model, b, device, dtype)
        (s / total_tokens).backward()
        acc += s.detach().double()
    return acc


def forward_backward(model: torch.nn.Module, micro_batches: list[dict], device: torch.device, dtype: str,
                     total_tokens: int) -> float:
    """backward_micro_batches, returning the step's mean loss per token."""
    return float(backward_micro_batches(model, micro_batches, device, dtype, total_tokens)) / total_tokens


# ---- resume checks ------------------------------------------------------------------------------------
def _check_resume_config(saved: dict, current: dict, allow: bool, log: Callable[[str], None]) -> None:
    diffs = [(k, saved.get(k), current.get(k)) for k in RESUME_SENSITIVE if saved.get(k) != current.get(k)]
    saved_eff = (saved.get("batch_size") or 0) * (saved.get("grad_accum") or 0)
    cur_eff = current["batch_size"] * current["grad_accum"]
    if saved_eff != cur_eff:
        diffs.append(("effective batch", saved_eff, cur_eff))
    if not diffs:
        return
    text = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, a, b in diffs)
    if not allow:
        raise InputError(f"--resume: the checkpoint was trained with different settings ({text}); "
                         f"resuming would not continue the same run. Use the same settings, or pass "
                         f"--allow-config-change to continue anyway")
    log(f"resume: config changed ({text}); continuing because --allow-config-change was given")


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_settings(saved: dict, current: dict) -> list[str]:
    """'lr changed 0.0003 -> 0.0001' for each setting (other than the resume-sensitive ones, which
    _check_resume_config judges) that differs between the checkpoint and now."""
    a, b = _flat(saved), _flat(current)
    skip = {*RESUME_SENSITIVE, "allow_config_change"}
    return [f"{k} changed {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k not in skip and a.get(k) != b.get(k)]


def _nothing_to_do(path: Path, step: int, steps: int) -> str:
    return (f"--resume: {path} is already at step {step} and --steps is {steps}: nothing to do (final/ and "
            f"the logs are left as they are). Raise --steps to train further")


def check_resume_has_work(run_dir: Path, spec: str, steps: int) -> None:
    """InputError when the checkpoint `--resume spec` would continue from is already at >= `steps`:
    the command calls it before it touches anything in run_dir (Trainer.resume checks it again)."""
    path = find_resume(Path(run_dir), spec, log=lambda _text: None)
    if path is None:
        return
    try:
        step = int(json.loads((path / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return  # unreadable meta.json: Trainer.resume's full load reports it (or falls back) with the cause
    if step >= steps:
        raise InputError(_nothing_to_do(path, step, steps))


def read_later(values: torch.Tensor) -> Callable[[], list[float]]:
    """Start copying `values` to the host; the returned function waits for that copy only (not for
    device work queued after it, e.g. the optimizer update) and returns the numbers."""
    if values.device.type != "cuda":
        return values.tolist
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> list[float]:
        copied.synchronize()
        return host.tolist()
    return wait


# Python's automatic garbage collector starts when allocations pass a threshold, i.e. at an arbitrary
# point of a step, and a full pass over a big heap takes milliseconds to tens of them; in a distributed
# run the rank that pauses holds every other rank at the next all-reduce. While fit() runs it is off and
# generations 0-1 are collected every GC_EVERY steps, on every rank at the same step (torchtitan does
# the same); a full collection runs at the start and every GC_FULL_EVERY steps (garbage that was still
# reachable at a generation-1 pass waits in generation 2). GC_EVERY 0: leave Python's automatic
# collection alone.
GC_EVERY = 50
GC_FULL_EVERY = 1000


@contextlib.contextmanager
def scheduled_gc(every: int, full_every: int) -> Any:
    """Automatic garbage collection off inside (restored on exit, also on an error), after one full
    collection. Yields `before_step(step)`: generations 0-1 every `every` steps, everything every
    `full_every`. every=0: nothing changes (before_step does nothing)."""
    if every <= 0:
        yield lambda step: None
        return

    def before_step(step: int) -> None:
        if step % full_every == 0:
            gc.collect()
        elif step % every == 0:
            gc.collect(1)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield before_step
    finally:
        if was_enabled:
            gc.enable()


def _stderr_log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- the Trainer ------------------------------------------------------------------------------------
class Trainer:
    """One training run of `model` for cfg.steps optimizer steps under run_dir (metrics.jsonl,
    eval.jsonl, checkpoints/, final/ through save_final). See the module docstring for its parts."""

    def __init__(self, model: torch.nn.Module, train_loader: Any, eval_loader: Any, cfg: TrainConfig,
                 run_dir: Path, save_final: Callable[[torch.nn.Module, Path], None] | None = None,
                 log: Callable[[str], None] | None = None, reduce: LocalReduce | None = None,
                 resume_command: str | None = None):
        cfg.validate()
        self.model, self.train_loader, self.eval_loader, self.cfg = model, train_loader, eval_loader, cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(cfg.device)
        self.log = log or _stderr_log
        self.save_final, self.reduce = save_final, reduce or LocalReduce()
        # (model, dir) -> files that make each checkpoint a runnable MODEL (set by the commands)
        self.checkpoint_files: Callable[[torch.nn.Module, Path], None] | None = None
        self.resume_command = resume_command
        self.run_config = cfg.to_dict()
        self.vocab_size = model.cfg.vocab_size
        seed_everything(cfg.seed)
        model.train()
        to_training_dtype(model, cfg.dtype)  # bf16-pure: bf16 weights, so the optimizer's state is bf16 too
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = self.build_optimizer()
        self.schedule = Schedule(cfg.lr, cfg.warmup, cfg.steps, cfg.schedule, cfg.min_lr_ratio)
        self.spikes = guards.SpikeGuard(cfg.on_spike, cfg.spike_window, cfg.spike_sigma)
        self.metrics_log = JsonlLog(self.run_dir / "metrics.jsonl")
        self.eval_log = JsonlLog(self.run_dir / "eval.jsonl")
        self.ckpt_root = self.run_dir / "checkpoints"
        self.counters = {"nonfinite_skipped": 0, "spike_skipped": 0, "zero_loss_samples": 0}
        self.start_step, self.tokens = 0, 0
        self.recent_losses: list[float] = []
        self.eval_history: list[dict] = []
        self.best_eval: float | None = None
        self.eval_losses: dict[int, float] = {}  # step -> eval loss, of the whole run (resumes included)
        self.last_loss = float("nan")
        self.last_saved: Path | None = None
        # largest |w| of the trainable weights at the start: what "exploded" is measured against
        self.weights_ref = self.weights_max_abs()
        self.step_seconds = 0.0
        self.progress: Progress | None = None
        # --dtype bf16-weights: bf16 compute copies of the fp32 masters (train/precision.py), built on
        # the first step (a subclass that steps differently, e.g. under FSDP, never builds them)
        self.precision: BF16Weights | None = None
        # ((step, evals so far, last checkpoint), wall time) of the last step's readback: see step_time
        self._timing: tuple[tuple, float] | None = None
        self.update_queued = False  # this step's update already queued on the device (queue_update)

    def build_optimizer(self) -> torch.optim.Optimizer:
        pure = {"master_dtype": torch.bfloat16} if self.cfg.dtype == "bf16-pure" else {}  # else: fp32 masters
        return build_optimizer(self.model, self.cfg.lr, self.cfg.weight_decay, **pure)

    # ---- resume / step 0 -------------------------------------------------------------------------
    def resume(self, spec: str | None) -> Path | None:
        """Continue from a checkpoint (`auto` or a PATH); None (logs reset) when starting at step 0."""
        share = (self.reduce.rank, self.reduce.world_size, self.reduce.gather)  # ranks hash a share each
        path, ckpt = load_resume(self.run_dir, spec, self.log, share) if spec else (None, None)
        if path is None:
            self.metrics_log.reset()
            self.eval_log.reset()
            return None
        st = ckpt["trainer_state"]
        if int(st["step"]) >= self.cfg.steps:
            raise InputError(_nothing_to_do(path, int(st["step"]), self.cfg.steps))
        self.check_resume_config(ckpt["run_config"])
        for change in changed_settings(ckpt["run_config"], self.run_config):
            self.log(f"resume: {change}")
        self.restore_state(ckpt)
        self.load_trainer_state(st)
        self.metrics_log.truncate_after(self.start_step)
        self.eval_log.truncate_after(self.start_step)
        self.last_saved = path
        digest = ckpt["meta"]["sha256"].get("optimizer.pt")
        self.log(f"resume: step {self.start_step}, {self.tokens} tokens seen"
                 + (f", optimizer sha256 {digest[:16]}.." if digest else ""))
        return path

    def check_resume_config(self, saved: dict[str, Any]) -> None:
        """Refuse (InputError) a checkpoint trained with other batch settings (see RESUME_SENSITIVE)."""
        _check_resume_config(saved, self.run_config, self.cfg.allow_config_change, self.log)

    def restore_state(self, ckpt: dict[str, Any]) -> None:
        """Weights and optimizer state from a loaded checkpoint (the distributed trainer reshards)."""
        restore_model(self.model, ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])

    def weights_max_abs(self) -> float:
        """Largest |w| of the trainable weights (over every rank's shard in a distributed run)."""
        return guards.weights_max_abs(self.params)

    def weights_problem(self) -> str | None:
        """Why the trainable weights are not good to keep (non-finite, exploded), or None."""
        return guards.weights_problem(self.params, self.weights_ref)

    def trainer_state(self, step: int, data_state: dict, rng: dict) -> dict[str, Any]:
        """Everything but weights and optimizer that a bit-exact resume needs (JSON apart from rng)."""
        return {"step": step, "tokens": self.tokens, "schedule": self.schedule.state_dict(), "data": data_state,
                "spike": self.spikes.state_dict(), "counters": dict(self.counters),
                "recent_losses": self.recent_losses[-64:], "rng": rng,
                "epoch": getattr(self.train_loader, "epoch", None), "weights_ref": self.weights_ref,
                "best_eval": self.best_eval,
                "eval_losses": [[s, v] for s, v in sorted(self.eval_losses.items()) if s <= step]}

    def load_trainer_state(self, st: dict[str, Any]) -> None:
        self.schedule.load_state_dict(st["schedule"])
        self.train_loader.load_state_dict(st["data"])
        self.spikes.load_state_dict(st["spike"])
        self.counters.update(st["counters"])
        self.recent_losses = list(st["recent_losses"])
        self.start_step, self.tokens = int(st["step"]), int(st["tokens"])
        self.weights_ref = st.get("weights_ref", self.weights_ref)
        self.best_eval = st.get("best_eval")
        self.eval_losses = {int(s): float(v) for s, v in st.get("eval_losses", [])}
        set_rng_state(st["rng"])

    def step0(self) -> dict[str, Any]:
        """The step-0 record (eval or first-train-batch loss, ln(vocab), sizes); logs the step-0 eval.
        The caller writes it into preflight.json, then calls check_start."""
        record: dict[str, Any] = {"ln_vocab": math.log(self.vocab_size), "vocab_size": self.vocab_size,
                                  "parameters": sum(p.numel() for p in self.model.parameters()),
                                  "trainable_parameters": sum(p.numel() for p in self.params)}
        if self.eval_loader is not None:
            ev = self.run_eval(0)
            record["eval"] = ev
            self.spikes.set_reference(ev["loss"])  # GUARD-SPIKE's early-phase reference (with the first step's)
            self.log(f"step 0: eval loss {ev['loss']:.4f} (ppl {ev['ppl']:.2f}, {ev['tokens']} tokens); "
                     f"ln(vocab) = {record['ln_vocab']:.4f}")
        elif self.cfg.check_init_loss:  # no eval set: judge the start on the first train batch, unconsumed
            state = self.train_loader.state_dict()
            first = [self.train_loader.next_batch() for _ in range(self.cfg.grad_accum)]
            record["first_train_batch"] = evaluate(self.model, first, self.device, self.cfg.dtype,
                                                   reduce=self.reduce)
            self.train_loader.load_state_dict(state)
        return record

    def check_start(self, record: dict[str, Any]) -> None:
        """GUARD-INIT-LOSS on a pretrained start (cfg.check_init_loss)."""
        if not self.cfg.check_init_loss:
            return
        ev0 = record.get("eval") or record.get("first_train_batch")
        extra = getattr(self.cfg, "extra", None) or {}  # the untyped dict that TrainConfig.init/model replace
        source = str(getattr(self.cfg, "init", None) or getattr(self.cfg, "model", None)
                     or extra.get("init") or extra.get("model"))
        guards.check_init_loss(ev0["loss"], self.vocab_size, source)
        self.log(f"GUARD-INIT-LOSS ok: step-0 loss {ev0['loss']:.4f} < ln(vocab) {record['ln_vocab']:.4f}")

    # ---- one step --------------------------------------------------------------------------------
    def fetch_micro_batches(self) -> list[dict]:
        return [self.train_loader.next_batch() for _ in range(self.cfg.grad_accum)]

    def count_step(self, micro: list[dict]) -> tuple[int, int, int]:
        """(loss tokens, samples without loss tokens, tokens) of the whole step over every rank: what
        each micro-batch's loss sum is divided by, GUARD-ZERO-LOSS-TOKENS's count and the tokens of
        tok/s. Every rank of a distributed run draws the job's whole micro-batch (RankSlice), which
        attaches its counts (JOB_COUNTS): then no collective, which would wait for the device (the
        previous step's update) before this step's forward could be queued. Else the one place the
        counts are all-reduced (self.reduce; the identity in one process)."""
        if all(JOB_COUNTS in b for b in micro):
            return tuple(sum(c) for c in zip(*(b[JOB_COUNTS] for b in micro), strict=True))
        local = torch.tensor([sum(c) for c in zip(*(batch_counts(b) for b in micro), strict=True)],
                             dtype=torch.float64)
        return tuple(round(x) for x in self.reduce.all_reduce_sum(local).tolist())

    def count_empty_samples(self, empty: int, step: int) -> None:
        if empty:
            self.counters["zero_loss_samples"] += empty
            self.message(f"GUARD-ZERO-LOSS-TOKENS: step {step} has {empty} sample(s) without loss tokens; "
                         f"they add nothing and are not averaged in (total so far "
                         f"{self.counters['zero_loss_samples']})")

    def forward_backward(self, micro: list[dict], total_tokens: int) -> tuple[float, float]:
        """Backward of every micro-batch, gradient clipping; (mean loss per token, grad norm before
        clipping), read from the device together: the step's one host sync."""
        if self.precision is None and self.cfg.dtype == "bf16-weights":
            self.precision = make_precision(self.model, self.cfg.dtype)
        with step_weights(self.precision):  # forward AND backward on the same (bf16 copy) weights
            loss_sum = self.reduce.all_reduce_sum(
                backward_micro_batches(self.model, micro, self.device, self.cfg.dtype, total_tokens))
        max_norm = self.cfg.clip if self.cfg.clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=True)
        read = read_later(torch.stack([loss_sum, grad_norm.to(loss_sum.device, torch.float64)]))
        self.update_queued = self.queue_update(loss_sum, grad_norm)  # runs on the device after the copy
        loss_sum, grad_norm = read()
        return loss_sum / total_tokens, grad_norm

    def queue_update(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Queue the optimizer update BEFORE the step's readback, so the device does not idle while the
        host reads the loss, runs the guards and launches the update. The fused AdamW skips it on the
        device (and un-counts its step) when the loss or the grad norm is non-finite, which is exactly
        when GUARD-NONFINITE says skip or stop: those then find the weights and optimizer state of
        before the step, as when the update was never launched. Not done (False: train_step updates
        after the guards) where the host alone may veto an update (--on-spike skip|stop), without the fused
        optimizer (CPU). Over several ranks the verdict is the same everywhere (reduced loss and norm)."""
        if self.cfg.on_spike != "warn" or not self.optimizer.defaults.get("fused"):
            return False
        self.optimizer.found_inf = (~torch.isfinite(loss_sum) | ~torch.isfinite(grad_norm)).to(torch.float32)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        return True

    def guard_step(self, loss: float, grad_norm: float, step: int, sample_ids: list,
                   pre_step: tuple[dict, dict]) -> str:
        """'ok' (apply the update) or 'skip'. GUARD-NONFINITE 'stop' keeps the last good state, then raises."""
        verdict = guards.check_nonfinite(loss, grad_norm, self.cfg.on_nonfinite)
        if verdict == "stop":
            kept = self.keep_last_good(step - 1, *pre_step)
            raise guards.nonfinite_error(loss, grad_norm, step, sample_ids, self.kept_text(kept))
        if verdict == "skip":
            self.counters["nonfinite_skipped"] += 1
            self.message(f"GUARD-NONFINITE: step {step} skipped (loss {loss}, grad_norm {grad_norm}, "
                         f"samples {sample_ids}); {self.counters['nonfinite_skipped']} skipped so far")
            return "skip"
        spike, spike_msg = self.spikes.check(loss, grad_norm, step, sample_ids)
        if spike == "ok":
            return "ok"
        self.message(spike_msg + (" -> update skipped" if spike == "skip" else " (warning)"))
        if spike == "skip":
            self.counters["spike_skipped"] += 1
            return "skip"
        return "ok"

    def train_step(self, step: int) -> dict[str, Any]:
        """One optimizer step; returns its metrics record."""
        t0 = time.perf_counter()
        pre_step = (self.train_loader.state_dict(), rng_state())  # what a last-good checkpoint of step-1 needs
        micro = self.fetch_micro_batches()
        sample_ids = _sample_ids(micro)
        total_tokens, empty, step_tokens = self.count_step(micro)
        guards.check_loss_tokens(total_tokens, step, sample_ids)
        self.count_empty_samples(empty, step)
        lr = self.schedule.apply(self.optimizer)
        self.update_queued = False  # forward_backward may queue the update (queue_update)
        loss, grad_norm = self.forward_backward(micro, total_tokens)
        t_read = time.perf_counter()  # the device has finished this step's backward
        skip = self.guard_step(loss, grad_norm, step, sample_ids, pre_step) != "ok"
        if not skip and not self.update_queued:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.advance()
        self.tokens += step_tokens
        dt = self.step_time(step, t0, t_read)
        self.step_seconds += dt
        if not skip:
            self.recent_losses.append(loss)
            self.last_loss = loss
        tok_s = step_tokens / dt
        peak = peak_flops(self.device, self.cfg.dtype)
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens,
                "loss_tokens": total_tokens, "tok_s": tok_s,
                # per device: tok_s counts every rank's tokens, peak is one device's
                "mfu": (self.model.cfg.flops_per_token(self.cfg.seq_len) * tok_s / self.reduce.world_size / peak)
                if peak else None,
                "mem_mb": peak_memory_mb(self.device), "epoch": getattr(self.train_loader, "epoch", None),
                "skipped": skip}

    def step_time(self, step: int, t0: float, t_read: float) -> float:
        """Seconds of step `step` without a device sync of its own where possible. A step that directly
        follows the previous one (no eval, checkpoint or resume in between) runs from the previous
        step's readback to its own: one optimizer update (the previous step's, still on the device
        while the host queued this step), the host's work and this forward/backward, i.e. one period of
        the steady state; nothing is counted twice. Any other step (the first, one after an eval or a
        checkpoint) waits for its own update and runs from its start. So the step times add up to the
        training wall time less evals and checkpoints (and the last update before each of those)."""
        marker = (step, len(self.eval_history), self.last_saved)
        if self._timing is not None and self._timing[0] == (step - 1, *marker[1:]):
            dt, anchor = t_read - self._timing[1], t_read
        else:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            anchor = time.perf_counter()
            dt = anchor - t0
        self._timing = (marker, anchor)
        return dt

    # ---- eval / save -------------------------------------------------------------------------------
    def run_eval(self, step: int) -> dict[str, Any]:
        """Evaluate on the eval set and log it (eval.jsonl); no guards."""
        ev = evaluate(self.model, self.eval_loader.iter_epoch(), self.device, self.cfg.dtype,
                      self.cfg.eval_batches, reduce=self.reduce)
        self.eval_log.write({"step": step, **ev})
        self.eval_history.append({"step": step, **ev})
        if math.isfinite(ev["loss"]):
            self.best_eval = ev["loss"] if self.best_eval is None else min(self.best_eval, ev["loss"])
            self.eval_losses[step] = ev["loss"]
        return ev

    def evaluate(self, step: int) -> dict[str, Any]:
        """A scheduled eval and its guards: non-finite, collapse to ln(vocab), diverged far above the best
        eval, anomaly (leak; after the others: a destroyed model's train loss can be 10x its eval loss).
        Each decides on the eval loss reduced over every rank, so all ranks stop at the same eval."""
        best_before = self.best_eval
        ev = self.run_eval(step)
        self.message(f"step {step}: eval loss {ev['loss']:.4f} ppl {ev['ppl']:.2f}")
        guards.check_eval_finite(ev["loss"], step, self.kept_text(self.last_saved))
        guards.check_eval_collapse(ev["loss"], best_before, self.vocab_size, step)
        guards.check_eval_diverged(ev["loss"], best_before, self.vocab_size, step, self.best_checkpoint)
        window = self.recent_losses[-20:]
        guards.check_eval_anomaly(ev["loss"], sum(window) / len(window) if window else None, step)
        return ev

    def best_checkpoint(self) -> tuple[Path, int, float] | None:
        """(path, step, eval loss) of the complete checkpoint on disk whose step's eval is the lowest of
        the run, or None: a checkpoint without an eval at its step is not known to be good."""
        on_disk = {d.name: d for d in complete_checkpoints(self.ckpt_root)}
        evaluated = [(loss, step) for step, loss in self.eval_losses.items() if step_dir_name(step) in on_disk]
        if not evaluated:
            return None
        loss, step = min(evaluated)
        return on_disk[step_dir_name(step)], step, loss

    def kept_text(self, kept: Path | None) -> str:
        if kept is None:
            return ("no checkpoint was kept (none was written before the weights went bad); restart "
                    "without --resume at a lower --lr")
        return f"the last good checkpoint is {kept}"

    def keep_last_good(self, step: int, data_state: dict, rng: dict) -> Path | None:
        """After a non-finite step: save the state before it (step `step`) if its weights are finite and
        not exploded; otherwise keep the previous checkpoint. Returns the good checkpoint or None."""
        if step <= 0 or (self.last_saved is not None and self.last_saved.name == step_dir_name(step)):
            return self.last_saved
        self.optimizer.zero_grad(set_to_none=True)
        problem = self.weights_problem()
        if problem is not None:
            self.message(f"GUARD-NONFINITE: step {step} is not saved as a good checkpoint: {problem}")
            return self.last_saved
        return self.save(step, data_state, rng)

    def save(self, step: int, data_state: dict | None = None, rng: dict | None = None) -> Path:
        """An atomic checkpoint of step `step`; its weights are checked first (GUARD-NONFINITE if they
        are non-finite or exploded: a checkpoint is only ever a good one)."""
        problem = self.weights_problem()
        if problem is not None:
            raise guards.weights_error(f"checkpoint {step_dir_name(step)}", problem,
                                       self.kept_text(self.last_saved), step)
        state = self.trainer_state(step, data_state if data_state is not None else self.train_loader.state_dict(),
                                   rng if rng is not None else rng_state())
        self.last_saved = self.write_checkpoint(step, state)
        return self.last_saved

    def write_checkpoint(self, step: int, state: dict[str, Any]) -> Path:
        """Write one complete checkpoint directory (the distributed trainer writes DCP shards instead)."""
        return save_checkpoint(self.ckpt_root, step, self.model, self.optimizer, state, self.run_config,
                               self.cfg.keep, extra_files=self.checkpoint_files)

    # ---- the run ---------------------------------------------------------------------------------
    def message(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        else:
            self.log(text)

    def after_step(self, step: int) -> None:
        """The scheduled eval and checkpoint after step `step`."""
        cfg = self.cfg
        if self.eval_loader is not None and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
            self.evaluate(step)
        if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
            self.save(step)

    def finish(self) -> None:
        """final/ through save_final, only from weights checked finite (GUARD-NONFINITE otherwise)."""
        if self.save_final is None:
            return
        problem = self.weights_problem()
        if problem is not None:
            raise guards.weights_error("final/", problem, self.kept_text(self.last_saved), self.cfg.steps)
        self.save_final(self.model, self.run_dir / "final")

    def fit(self) -> dict[str, Any]:
        """Steps start_step+1 .. cfg.steps with their evals and checkpoints, then final/. Returns a summary."""
        cfg = self.cfg
        self.progress = Progress(cfg.steps, self.start_step, sys.stderr, cfg.log_every)
        t_train, tokens_at_start, step = time.perf_counter(), self.tokens, self.start_step
        try:
            with scheduled_gc(GC_EVERY, GC_FULL_EVERY) as before_step:
                for step in range(self.start_step + 1, cfg.steps + 1):
                    before_step(step)
                    record = self.train_step(step)
                    self.metrics_log.write(record)
                    self.progress.update(step, record["loss"], record["tok_s"],
                                         f"lr {record['lr']:.2e} gnorm {record['grad_norm']:.3f}")
                    self.after_step(step)
        except KeyboardInterrupt as e:
            raise TrainingInterrupted(step, self.last_saved, self.resume_command) from e
        finally:
            self.progress.close()
            self.progress = None
        self.finish()
        return {"steps": cfg.steps, "start_step": self.start_step, "tokens": self.tokens,
                "final_train_loss": self.last_loss if math.isfinite(self.last_loss) else None,
                # training throughput: tokens over the time spent in steps (evals and checkpoints excluded)
                "tok_s": (self.tokens - tokens_at_start) / self.step_seconds if self.step_seconds > 0 else None,
                "seconds": time.perf_counter() - t_train, "eval": self.eval_history,
                "counters": {**self.counters, "spikes": self.spikes.count}, "run_dir": str(self.run_dir)}


def write_preflight(run_dir: Path, preflight: dict, step0: dict) -> None:
    """RUN/preflight.json: the command's checks plus the step-0 record."""
    atomic_write(Path(run_dir) / "preflight.json",
                 json.dumps({**preflight, "step0": step0}, indent=2, default=str) + "\n")


def train(model: torch.nn.Module, train_loader: Any, eval_loader: Any, cfg: TrainConfig, run_dir: Path,
          resume: str | None = None, preflight: dict | None = None,
          save_final: Callable[[torch.nn.Module, Path], None] | None = None,
          log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Resume or run step 0 (writing preflight.json when `preflight` is given), then fit: the whole
    run as the commands drive it, for library callers and tests."""
    trainer = Trainer(model, train_loader, eval_loader, cfg, run_dir, save_final=save_final, log=log)
    if trainer.resume(resume) is None:
        record = trainer.step0()
        if preflight is not None:
            write_preflight(run_dir, preflight, record)
        trainer.check_start(record)
    return trainer.fit()

