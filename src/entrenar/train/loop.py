"""The one training loop, behind `entrenar pretrain` and `entrenar finetune` (full, LoRA, QLoRA), in one
process or under torchrun.

`build_trainer` is the one way to make a `Trainer` (the commands, the tests and `train` call it): from a
built model (fp32 master parameters; LoRA already applied), loader objects with the interface
`next_batch()`, `iter_epoch()`, `state_dict()`, `load_state_dict()`, `epoch`, and the TrainConfig, it
composes the Trainer's parts:

  precision   train/precision.py: what --dtype means (autocast, bf16 copies, the bf16-pure cast); its
              prepare_model runs first, before parallelism
  strategy    train/parallel.py: one process, DDP or FSDP2 applied from outside the model (apply_parallel);
              the loaders split by global sample index (train/distributed.py)
  objective   train/objective.py: batch -> (loss sum, loss-token count, metrics); causal-LM cross-entropy
  checkpointer train/checkpoint.py: local or DCP-sharded checkpoints, written and restored

Batches: {"input_ids" [B,T], "labels" [B,T] (already shifted, -100 ignored), optional "doc_ids",
"position_ids", "sample_ids"}. The Trainer's steps:

  begin(resume)      resume(spec) (model, optimizer, schedule, data position, guards, RNG), or step0()
                     (eval, the objective's uniform loss, sizes; recorded in preflight.json) and
                     check_start (GUARD-INIT-LOSS)
  train_step(step)   fetch micro-batches -> count_step -> forward_backward (the one forward/backward:
                     backward_micro_batches, reduce, clip, queue the update, one readback) -> (step 1 of a
                     fresh run: the objective's check_first_gradient, GUARD-PREF-NO-GRADIENT) -> guard_step
                     -> optimizer
  evaluate(step)     token-weighted eval + its guards
  save(step)         an atomic checkpoint of weights checked finite
  fit()              the steps, evals, checkpoints, then final/ (rank 0 writes files)

Loss normalisation: a step's G micro-batches are fetched first, their loss tokens counted over every
rank (`count_step`), and each micro-batch backpropagates loss_sum / total_tokens; gradients are then
SUM-reduced over ranks. So batch 4 == batch 1 x accumulation 4 == 2 ranks x batch 2 on samples of
unequal length. Train and eval both take the loss from the objective, through the same forward.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
import os
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
from ..tensors import JOB_COUNTS
from . import checkpoint as checkpoints
from . import guards
from .checkpoint import (
    Checkpointer,
    complete_checkpoints,
    find_resume,
    rng_state,
    set_rng_state,
    step_dir_name,
)
from .config import RESUME_SENSITIVE, TrainConfig
from .cuda_graphs import StepGraphs, loss_scale, resolve_cuda_graphs
from .distributed import DistContext, DistReduce, global_batch, shard_loader
from .distributed import current as job_context
from .early_stop import BestEvalWeights, early_stop
from .metrics import JsonlLog, NullLog, Progress, peak_flops, peak_memory_mb
from .objective import CausalLMLoss, Objective
from .optim import Schedule, build_optimizer
from .parallel import Strategy, apply_parallel, job_parallel
from .periodic import TimedSaves
from .precision import Precision, precision_policy
from .profiling import StepProfiler
from .reporting import start_reporting
from .task_tracking import TaskTracker, checkpoint_of_step

__all__ = ["TrainConfig", "Trainer", "TrainingInterrupted", "backward_micro_batches", "build_trainer", "evaluate",
           "train"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


# ---- the one forward of train and eval ------------------------------------------------------------
def as_precision(dtype: str | Precision) -> Precision:
    return dtype if isinstance(dtype, Precision) else precision_policy(dtype)


def _sample_ids(batches: Iterable[dict]) -> list:
    ids: list = []
    for b in batches:
        ids.extend(list(b.get("sample_ids") or []))
    return ids


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict], device: torch.device | str = "cpu",
             dtype: str | Precision = "fp32", max_batches: int = 0, reduce: DistReduce | None = None,
             objective: Objective | None = None) -> dict[str, float]:
    """Token-weighted eval: sum of per-token losses / number of loss tokens, and exp of it, summed over
    every rank with `reduce` (the objective's loss units: pairs for a preference objective, whose metrics,
    e.g. rewards/accuracies, are added as their means over the eval set). The sums stay on the device in
    float64 (the same additions as a Python float sum) and are read once."""
    device, precision, objective = torch.device(device), as_precision(dtype), objective or CausalLMLoss()
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count, n_batches = 0, 0
    sums: dict[str, torch.Tensor] = {}
    try:
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            with precision.autocast(device):
                loss_sum, n, found = objective.loss(model, batch, device)
            total += loss_sum.double()
            for k, v in found.items():
                sums[k] = sums[k] + v.double() if k in sums else v.double()
            count += n
            n_batches += 1
    finally:
        model.train(was_training)
    names = sorted(sums)
    if reduce is not None:
        total, count = reduce.all_reduce_sum(total), reduce.all_reduce_sum(count)
        sums = {k: reduce.all_reduce_sum(sums[k]) for k in names}
    total, count = float(total), int(count)
    extra = objective.step_metrics({k: float(sums[k]) for k in names}, count) if count else {}
    if count == 0:
        raise GuardError("GUARD-ZERO-LOSS-TOKENS",
                         f"the eval set ({n_batches} batches) has no loss tokens, so its loss is undefined.",
                         "check the eval data: responses truncated away by --max-seq-len, or an empty split")
    loss = total / count
    ppl = math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan")
    return {"loss": loss, "ppl": ppl, "tokens": count, "batches": n_batches, **extra}


def backward_micro_batches(model: torch.nn.Module, micro_batches: list[dict], device: torch.device,
                           dtype: str | Precision, total_tokens: int, objective: Objective | None = None,
                           sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
                           metrics: dict[str, torch.Tensor] | None = None,
                           graphs: StepGraphs | None = None) -> torch.Tensor:
    """The one forward/backward of training: every micro-batch backpropagates its loss_sum x (1 / total_tokens)
    (of the whole step, over every rank; loss_scale: a device scalar, as a CUDA graph's replay reads it),
    under the precision's autocast and `sync(last_micro_batch)` (the strategy's: DDP reduces only in the
    last backward); with `graphs` (--cuda-graphs) a micro-batch of a captured shape is one graph replay.
    Returns the step's summed loss as a float64 device scalar (read back once per step by the caller); the
    objective's metrics are summed into `metrics`."""
    precision, objective = as_precision(dtype), objective or CausalLMLoss()
    acc = torch.zeros((), dtype=torch.float64, device=device)
    inv_total = 1.0 / total_tokens
    for j, b in enumerate(micro_batches):
        found: dict[str, torch.Tensor] = {}

        def eager(b: dict = b, last: bool = j == len(micro_batches) - 1, found: dict = found) -> torch.Tensor:
            with sync(last) if sync is not None else contextlib.nullcontext():
                with precision.autocast(device):
                    s, _, got = objective.loss(model, b, device)
                (s * loss_scale(inv_total, s)).backward()
            found.update(got)
            return s.detach()

        s = graphs.micro_batch(b, inv_total, eager) if graphs is not None else None
        if s is None:
            s = eager()
        acc += s.double()
        if metrics is not None:
            for k, v in found.items():
                metrics[k] = metrics[k] + v.detach().double() if k in metrics else v.detach().double()
    return acc


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
# A stop waiting for the checkpoint being written looks this often for a rank of the job gone (settle_write)
SETTLE_POLL_S = 0.5


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
    """One training run of `strategy.module` for cfg.steps optimizer steps under run_dir (metrics.jsonl,
    eval.jsonl, checkpoints/, final/ through save_final), from its parts (see the module docstring).
    Made by `build_trainer`."""

    def __init__(self, strategy: Strategy, train_loader: Any, eval_loader: Any, cfg: TrainConfig, run_dir: Path, *,
                 precision: Precision, objective: Objective, checkpointer: Checkpointer,
                 save_final: Callable[[torch.nn.Module, Path], None] | None = None,
                 log: Callable[[str], None] | None = None, resume_command: str | None = None,
                 task_eval: Any | None = None, samples: Any | None = None):
        cfg.validate()
        self.strategy, self.precision, self.objective, self.checkpointer = strategy, precision, objective, checkpointer
        self.ctx: DistContext = strategy.ctx
        self.reduce = strategy.reduce
        self.model = model = strategy.module
        self.train_loader, self.eval_loader, self.cfg = train_loader, eval_loader, cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.device = torch.device(cfg.device)
        self.log = log or _stderr_log
        self.save_final = save_final
        self.resume_command = resume_command
        self.run_config = cfg.to_dict()
        if self.ctx.active:  # recorded in each checkpoint: resuming elsewhere compares global batches
            self.run_config["world_size"] = self.ctx.world
        self.vocab_size = model.cfg.vocab_size
        self.uniform_loss = objective.uniform_loss(self.vocab_size)  # ln(vocab) for cross-entropy
        seed_everything(cfg.seed)
        model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, master_dtype=precision.master_dtype)
        self.schedule = Schedule(cfg.lr, cfg.warmup, cfg.steps, cfg.schedule, cfg.min_lr_ratio)
        self.spikes = guards.spike_guard(cfg.on_spike, cfg.spike_window, cfg.spike_sigma, objective)
        # only rank 0 writes the logs
        self.metrics_log = JsonlLog(self.run_dir / "metrics.jsonl") if self.ctx.is_main else NullLog()
        self.eval_log = JsonlLog(self.run_dir / "eval.jsonl", kind="eval") if self.ctx.is_main else NullLog()
        self.stopped_early: dict[str, Any] | None = None  # --early-stop: why and where (train/early_stop.py)
        self.best_weights = BestEvalWeights() if cfg.keep_best == "eval" else None  # --keep-best eval
        self.ckpt_root = checkpointer.root
        self.counters = {"nonfinite_skipped": 0, "spike_skipped": 0, "zero_loss_samples": 0}
        self.step_warnings: list[dict[str, Any]] = []  # every guard warning of a step, for the summary's "warnings"
        self.start_step, self.tokens = 0, 0
        self.recent_losses: list[float] = []
        self.eval_history: list[dict] = []
        self.best_eval: float | None = None
        self.eval_losses: dict[int, float] = {}  # step -> eval loss, of the whole run (resumes included)
        self.train_watch = guards.TrainWatch()  # GUARD-TRAIN-DIVERGED / GUARD-END-WORSE without an eval set
        self.best_lm_eval: float | None = None  # GUARD-PREF-CHOSEN-DIVERGED: lowest eval NLL of the chosen responses
        self.last_loss = float("nan")
        self.saves = 0  # checkpoints started (step_time: a step after one is timed from its own start)
        self.step_now = 0  # the step being run (or the last one run): what a Ctrl-C message names
        # largest |w| of the trainable weights at the start: what "exploded" is measured against
        self.weights_ref = self.weights_max_abs()
        self.step_seconds = 0.0
        self.end_save: dict[str, float] = {}  # seconds the end of the run spent saving (finish)
        self.progress: Progress | None = None
        # ((step, evals so far, last checkpoint), wall time) of the last step's readback: see step_time
        self._timing: tuple[tuple, float] | None = None
        self.update_queued = False  # this step's update already queued on the device (queue_update)
        self.final_step: int | None = None  # --keep-best task: the step whose weights final/ holds, if not the last
        self._local_loss = 0.0  # this rank's own loss sum of the last step (names a rank that went non-finite)
        self.graphs: StepGraphs | None = None  # --cuda-graphs: the step's graphs (train/cuda_graphs.py)
        assert cfg.cuda_graphs in ("on", "off"), "build_trainer resolves --cuda-graphs"
        if cfg.cuda_graphs == "on":
            objective.head_at = False  # a captured step's shapes must not vary: the head everywhere, eager steps too
            self.graphs = StepGraphs(functools.partial(objective.loss_sum, strategy.forward_module), precision,
                                     self.device, self.message)
        self.timed_saves = TimedSaves(cfg.save_every_minutes, self.ctx)  # train/periodic.py
        self.task: TaskTracker | None = None  # --eval-task: the task metric of the run (train/task_tracking.py)
        if task_eval is not None:
            if strategy.kind == "fsdp":  # generation under FSDP2 would need every rank in the same forwards
                raise InputError("--eval-task is not supported under FSDP2 yet (its generation would need every "
                                 "rank to decode in lock step): use --parallel ddp where the model fits, or "
                                 "evaluate the checkpoints with `entrenar eval --task`")
            self.task = TaskTracker(task_eval, self.ctx, self.run_dir, cfg.eval_task_every, cfg.steps,
                                    cfg.on_task_regression, cfg.keep_best == "task", self.metrics_log.write,
                                    self.message)
        self.tracking, self.samples = start_reporting(self, samples)  # --report-to, --sample-prompts (last: opens runs)

    # ---- resume / step 0 -------------------------------------------------------------------------
    def begin(self, resume: str | None, preflight: dict | None = None) -> None:
        """Continue from `resume` (auto or a PATH), or start: the step-0 record (written into preflight.json
        with the command's checks in `preflight`, by rank 0, before its guard judges it), then check_start."""
        resumed = self.resume(resume)
        if self.samples is not None:  # a fresh start's step-0 samples, or samples.jsonl cut back to the resumed step
            self.samples.start(self.start_step, self.model)
        if resumed is not None:
            return
        record = self.step0()
        if preflight is not None and self.ctx.is_main:
            write_preflight(self.run_dir, preflight, record)
        self.check_start(record)
        if self.task is not None:  # the base's task metric: what training must not make worse
            self.task_evaluate(0)

    def resume(self, spec: str | None) -> Path | None:
        """Continue from a checkpoint (`auto` or a PATH); None (logs reset) when starting at step 0."""
        path, ckpt = self.checkpointer.load(spec, self.log) if spec else (None, None)
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
        self.checkpointer.restore(ckpt, self.model, self.optimizer)
        self.load_trainer_state(st)
        self.metrics_log.truncate_after(self.start_step)
        self.eval_log.truncate_after(self.start_step)
        self.last_saved = path
        digest = ckpt["meta"]["sha256"].get("optimizer.pt")
        self.log(f"resume: step {self.start_step}, {self.tokens} tokens seen"
                 + (f", optimizer sha256 {digest[:16]}.." if digest else ""))
        return path

    def check_resume_config(self, saved: dict[str, Any]) -> None:
        """Refuse (InputError) a checkpoint trained with other batch settings (see RESUME_SENSITIVE). At
        another world size the global batch (world x batch x accumulation) and the sequence length must
        stay: the loader position is in samples, so the same steps then see the same samples; per-rank
        batch and accumulation may change."""
        was, now = int(saved.get("world_size") or 1), self.ctx.world
        if was != now:
            g_was = global_batch(saved.get("batch_size") or 0, saved.get("grad_accum") or 0, was)
            g_now = global_batch(self.cfg.batch_size, self.cfg.grad_accum, now)
            if (g_was != g_now or saved.get("seq_len") != self.cfg.seq_len) and not self.cfg.allow_config_change:
                raise InputError(
                    f"--resume: the checkpoint was written by {was} process(es) with a global batch of {g_was} "
                    f"(world {was} x batch {saved.get('batch_size')} x accumulation {saved.get('grad_accum')}, "
                    f"seq_len {saved.get('seq_len')}); now {now} x {self.cfg.batch_size} x {self.cfg.grad_accum} = "
                    f"{g_now} (seq_len {self.cfg.seq_len}). Keep world x --batch-size x --grad-accum and "
                    f"--max-seq-len the same to continue the same run (e.g. --batch-size "
                    f"{max(1, g_was // max(1, now * self.cfg.grad_accum))}), or pass --allow-config-change")
            self.log(f"resume: world size {was} -> {now}, global batch {g_was} -> {g_now}; resharding model and "
                     f"optimizer")
            saved = {**saved, "batch_size": self.cfg.batch_size, "grad_accum": self.cfg.grad_accum}
        _check_resume_config(saved, self.run_config, self.cfg.allow_config_change, self.log)

    def weights_max_abs(self) -> float:
        """Largest |w| of the trainable weights (over every rank's shard in a distributed run)."""
        return self.strategy.weights_max_abs(self.params)

    def weights_problem(self) -> str | None:
        """Why the trainable weights are not good to keep (non-finite, exploded), or None."""
        return guards.max_abs_problem(self.weights_max_abs(), self.weights_ref)

    def trainer_state(self, step: int, data_state: dict, rng: dict) -> dict[str, Any]:
        """Everything but weights and optimizer that a bit-exact resume needs (JSON apart from rng)."""
        return {"step": step, "tokens": self.tokens, "schedule": self.schedule.state_dict(), "data": data_state,
                "spike": self.spikes.state_dict(), "counters": dict(self.counters),
                "recent_losses": self.recent_losses[-64:], "rng": rng,
                "epoch": getattr(self.train_loader, "epoch", None), "weights_ref": self.weights_ref,
                "best_eval": self.best_eval, "objective": self.objective.state_dict(),
                "eval_losses": [[s, v] for s, v in sorted(self.eval_losses.items()) if s <= step],
                "train_watch": self.train_watch.state_dict(), "best_lm_eval": self.best_lm_eval,
                "step_warnings": [w for w in self.step_warnings if w["step"] <= step],
                **({"task": self.task.state_dict(step)} if self.task is not None else {})}

    def load_trainer_state(self, st: dict[str, Any]) -> None:
        ranks = st.get("rng_ranks")
        if ranks and len(ranks) == self.ctx.world:  # a sharded checkpoint of this world size: each rank its own RNG
            st = {**st, "rng": ranks[self.ctx.rank]}
        self.schedule.load_state_dict(st["schedule"])
        self.train_loader.load_state_dict(st["data"])
        self.spikes.load_state_dict(st["spike"])
        self.counters.update(st["counters"])
        self.step_warnings = list(st.get("step_warnings", []))
        self.recent_losses = list(st["recent_losses"])
        self.start_step, self.tokens = int(st["step"]), int(st["tokens"])
        self.weights_ref = st.get("weights_ref", self.weights_ref)
        self.best_eval = st.get("best_eval")
        self.eval_losses = {int(s): float(v) for s, v in st.get("eval_losses", [])}
        self.train_watch.load_state_dict(st.get("train_watch") or {})
        self.best_lm_eval = st.get("best_lm_eval")
        self.objective.load_state_dict(st.get("objective") or {})
        if self.task is not None:
            self.task.load_state_dict(st.get("task") or {})
        set_rng_state(st["rng"])

    def step0(self) -> dict[str, Any]:
        """The step-0 record (eval or first-train-batch loss, the objective's uniform loss, sizes); logs the
        step-0 eval. begin() writes it into preflight.json, then calls check_start."""
        record: dict[str, Any] = {"ln_vocab": self.uniform_loss, "vocab_size": self.vocab_size,
                                  "parameters": sum(p.numel() for p in self.model.parameters()),
                                  "trainable_parameters": sum(p.numel() for p in self.params)}
        if self.eval_loader is not None:
            ev = self.run_eval(0)
            record["eval"] = ev
            self.check_lm_eval(ev, 0)  # the reference's NLL of the chosen responses: GUARD-PREF-CHOSEN-DIVERGED's start
            self.spikes.set_reference(ev["loss"])  # GUARD-SPIKE's early-phase reference (with the first step's)
            ppl = f"ppl {ev['ppl']:.2f}, " if self.objective.perplexity else ""
            self.log(f"step 0: eval loss {ev['loss']:.4f} ({ppl}{ev['tokens']} {self.objective.unit}); "
                     f"{self.objective.uniform_name} = {record['ln_vocab']:.4f}")
        elif self.cfg.check_init_loss:  # no eval set: judge the start on the first train batch, unconsumed
            state = self.train_loader.state_dict()
            first = [self.train_loader.next_batch() for _ in range(self.cfg.grad_accum)]
            record["first_train_batch"] = evaluate(self.model, first, self.device, self.precision,
                                                   reduce=self.reduce, objective=self.objective)
            self.train_loader.load_state_dict(state)
        return record

    def check_start(self, record: dict[str, Any]) -> None:
        """GUARD-INIT-LOSS on a pretrained start (cfg.check_init_loss), against the objective's uniform loss."""
        if not self.cfg.check_init_loss:
            return
        ev0 = record.get("eval") or record.get("first_train_batch")
        self.log(self.objective.check_start(ev0["loss"], self.uniform_loss, ev0, str(self.cfg.init or self.cfg.model)))

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
        local = torch.tensor([sum(c) for c in zip(*(self.objective.counts(b) for b in micro), strict=True)],
                             dtype=torch.float64)
        return tuple(round(x) for x in self.reduce.all_reduce_sum(local).tolist())

    def count_empty_samples(self, empty: int, step: int) -> None:
        if empty:
            self.counters["zero_loss_samples"] += empty
            self.message(f"GUARD-ZERO-LOSS-TOKENS: step {step} has {empty} sample(s) without loss tokens; "
                         f"they add nothing and are not averaged in (total so far "
                         f"{self.counters['zero_loss_samples']})")

    def forward_backward(self, micro: list[dict], total_tokens: int) -> tuple[float, float, dict[str, Any]]:
        """The step on the device: every micro-batch's backward (backward_micro_batches, on the weights the
        precision computes with, through the strategy's forward module), the loss sum reduced over the
        ranks, the gradients clipped by their global norm (the strategy's), the update queued; then (mean
        loss per token, grad norm before clipping, the objective's metrics) read from the device together:
        the step's one host sync. Each rank backpropagates its loss sums / the global token total and the
        gradients are SUM-reduced (apply_parallel), so the update is one process's on the global batch."""
        sums: dict[str, torch.Tensor] = {}
        with self.precision.step_weights(self.model):  # forward AND backward on the same (bf16 copy) weights
            local = backward_micro_batches(self.strategy.forward_module, micro, self.device, self.precision,
                                           total_tokens, self.objective, self.strategy.sync_context, sums,
                                           self.graphs)
        self.strategy.after_backward()  # ReplicaStrategy's gradient all-reduce (DDP/FSDP2 reduced inside)
        loss_sum = self.reduce.all_reduce_sum(local)
        max_norm = self.cfg.clip if self.cfg.clip > 0 else float("inf")
        grad_norm = self.strategy.clip_grad_norm(self.params, max_norm)
        names = sorted(sums)
        read = read_later(torch.stack([local, loss_sum, grad_norm.to(local.device, torch.float64),
                                       *(self.reduce.all_reduce_sum(sums[k]) for k in names)]))
        self.update_queued = self.queue_update(loss_sum, grad_norm)  # runs on the device after the copy
        local, loss_sum, grad_norm, *values = read()
        self._local_loss = local
        return loss_sum / total_tokens, grad_norm, self.objective.step_metrics(dict(zip(names, values, strict=True)),
                                                                                total_tokens)

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
        if self.ctx.active and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            # every rank sees the same reduced NaN; say where it came from: the ranks whose own loss
            # was non-finite (all ranks when only the gradient norm was), with their samples
            reports = self.reduce.gather((self.ctx.rank, math.isfinite(self._local_loss), sample_ids))
            bad = [(r, ids) for r, ok, ids in reports if not ok] or [(r, ids) for r, _, ids in reports]
            sample_ids = {f"rank {r}": ids for r, ids in bad}
        verdict = guards.check_nonfinite(loss, grad_norm, self.cfg.on_nonfinite)
        if verdict == "stop":
            kept = self.keep_last_good(step - 1, *pre_step)
            raise guards.nonfinite_error(loss, grad_norm, step, sample_ids, self.kept_text(kept))
        if verdict == "skip":
            self.counters["nonfinite_skipped"] += 1
            self.message(f"GUARD-NONFINITE: step {step} skipped (loss {loss}, grad_norm {grad_norm}, "
                         f"samples {sample_ids}); {self.counters['nonfinite_skipped']} skipped so far")
            self.step_warnings.append({"guard": "GUARD-NONFINITE", "step": step, "message": "step skipped"})
            return "skip"
        spike, spike_msg = self.spikes.check(loss, grad_norm, step, sample_ids)
        if spike == "ok":
            return "ok"
        self.message(spike_msg + (" -> update skipped" if spike == "skip" else " (warning)"))
        self.step_warnings.append({"guard": "GUARD-SPIKE", "step": step, "message": spike_msg})
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
        if self.graphs is not None:
            self.graphs.begin_step()
        loss, grad_norm, objective_metrics = self.forward_backward(micro, total_tokens)
        t_read = time.perf_counter()  # the device has finished this step's backward
        if step == 1 and self.start_step == 0:  # the gradient at the start, before any update is applied or saved
            self.objective.check_first_gradient(grad_norm, sum(p.numel() for p in self.params),
                                                float(self.optimizer.defaults.get("eps") or 0.0))
        skip = self.guard_step(loss, grad_norm, step, sample_ids, pre_step) != "ok"
        if not skip and not self.update_queued:
            self.optimizer.step()
        # a captured backward accumulates into the gradients it was recorded with: zeroed in place from then on
        # and ReplicaStrategy's gradients are views into its flat buffers
        self.optimizer.zero_grad(set_to_none=not (self.strategy.grads_in_place
                                                  or (self.graphs is not None and self.graphs.static_grads)))
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
                "skipped": skip, **objective_metrics}

    def step_time(self, step: int, t0: float, t_read: float) -> float:
        """Seconds of step `step` without a device sync of its own where possible. A step that directly
        follows the previous one (no eval, checkpoint or resume in between) runs from the previous
        step's readback to its own: one optimizer update (the previous step's, still on the device
        while the host queued this step), the host's work and this forward/backward, i.e. one period of
        the steady state; nothing is counted twice. Any other step (the first, one after an eval or a
        checkpoint) waits for its own update and runs from its start. So the step times add up to the
        training wall time less evals and checkpoints (and the last update before each of those)."""
        marker = (step, len(self.eval_history), self.saves, len(self.task.results) if self.task else 0)
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
        ev = evaluate(self.model, self.eval_loader.iter_epoch(), self.device, self.precision,
                      self.cfg.eval_batches, reduce=self.reduce, objective=self.objective)
        self.eval_log.write({"step": step, **ev})
        self.eval_history.append({"step": step, **ev})
        if math.isfinite(ev["loss"]):
            self.best_eval = ev["loss"] if self.best_eval is None else min(self.best_eval, ev["loss"])
            self.eval_losses[step] = ev["loss"]
            if self.best_weights is not None:
                self.best_weights.note(step, ev["loss"], self.params)
        return ev

    def check_lm_eval(self, ev: dict[str, Any], step: int) -> None:
        """GUARD-PREF-CHOSEN-DIVERGED: an objective whose loss is not the language model's NLL (a preference loss)
        has that NLL judged too, at every eval, against its lowest eval of the run (step 0's included)."""
        key = self.objective.lm_key
        value = ev.get(key)
        if key == "loss" or value is None or not math.isfinite(value):
            return
        if step > 0:
            guards.check_chosen_diverged(value, self.best_lm_eval, math.log(self.vocab_size), step,
                                         self.best_checkpoint)
        self.best_lm_eval = value if self.best_lm_eval is None else min(self.best_lm_eval, value)

    def watch_train(self, record: dict[str, Any]) -> None:
        """GUARD-TRAIN-DIVERGED after each step of a run without an eval set (before that step is checkpointed):
        the median of the last steps' language-model loss against its lowest. Every rank holds the same reduced
        values, so all stop at the same step."""
        value = record.get(self.objective.lm_key)
        if record.get("skipped") or value is None or not math.isfinite(value):
            return
        smoothed, best = self.train_watch.update(float(value))
        if self.eval_loader is None:
            guards.check_train_diverged(smoothed, best, math.log(self.vocab_size), record["step"],
                                        self.objective.lm_name, self.last_saved)

    def end_warnings(self) -> list[dict[str, Any]]:
        """GUARD-END-WORSE, said and returned for the summary's "warnings": the last eval above the step-0 eval;
        without evals, the median of the last steps' loss above that of the first steps."""
        if self.eval_losses:
            first, last = min(self.eval_losses), max(self.eval_losses)
            found = guards.end_worse(self.eval_losses[first], self.eval_losses[last], "eval loss",
                                     f"eval at step {first}", f"eval at step {last}") if first == 0 and last > 0 \
                else None
        else:
            name = "train loss" if self.objective.lm_key == "loss" else self.objective.lm_name
            found = guards.end_worse(self.train_watch.start(), self.train_watch.end(),
                                     f"{name} (median of {guards.TRAIN_WINDOW} steps)", "the first steps",
                                     "the last steps")
        if found is None:
            return []
        self.log(found["message"])
        return [found]

    def evaluate(self, step: int) -> dict[str, Any]:
        """A scheduled eval and its guards: non-finite, collapse to the objective's uniform loss, diverged far
        above the best eval, anomaly (leak; after the others: a destroyed model's train loss can be 10x its eval
        loss). Each decides on the eval loss reduced over every rank, so all ranks stop at the same eval."""
        best_before = self.best_eval
        ev = self.run_eval(step)
        self.message(f"step {step}: eval loss {ev['loss']:.4f}"
                     + (f" ppl {ev['ppl']:.2f}" if self.objective.perplexity else "")
                     + (f" accuracy {ev['rewards/accuracies']:.3f}" if "rewards/accuracies" in ev else ""))
        guards.check_eval_finite(ev["loss"], step, self.kept_text(self.last_saved))
        name = self.objective.uniform_name
        guards.check_eval_collapse(ev["loss"], best_before, self.uniform_loss, step, name)
        guards.check_eval_diverged(ev["loss"], best_before, self.uniform_loss, step, self.best_checkpoint, name,
                                   *self.objective.diverged)
        window = self.recent_losses[-20:]
        if self.objective.eval_anomaly:
            guards.check_eval_anomaly(ev["loss"], sum(window) / len(window) if window else None, step)
        self.check_lm_eval(ev, step)
        self.stopped_early = early_stop(self.eval_losses, self.cfg.early_stop) if step < self.cfg.steps else None
        if self.stopped_early is not None:
            self.message(self.stopped_early["reason"])
        return ev

    def task_evaluate(self, step: int) -> dict[str, Any]:
        """The --eval-task metric of the weights after step `step` (0: the base) and GUARD-TASK-REGRESSION."""
        assert self.task is not None
        score = self.task.evaluate(step, self.strategy.module, self.params, self.checkpoint_of)
        for warning in getattr(self.objective, "watch_task", lambda step, task: [])(step, self.task):
            self.message(warning)  # GUARD-REWARD-HACKING (train/grpo.py)
        return score

    def checkpoint_of(self, step: int) -> Path | None:
        """The complete checkpoint of `step` on disk; the one being written in the background is finished
        first (what a message names must exist)."""
        if self.checkpointer.in_flight == step:
            self.settle_write(f"naming checkpoint {step_dir_name(step)}")
        return checkpoint_of_step(self.ckpt_root, step)

    def best_checkpoint(self) -> tuple[Path, int, float] | None:
        """(path, step, eval loss) of the complete checkpoint on disk whose step's eval is the lowest of
        the run, or None: a checkpoint without an eval at its step is not known to be good. Called when a
        guard stops the run; the checkpoint being written is finished first when its eval is the lowest (the
        one to name); any other write in flight is abandoned by the stop, as on every error end."""
        writing = self.checkpointer.in_flight
        if writing in self.eval_losses and self.eval_losses[writing] <= min(self.eval_losses.values()):
            self.settle_write(f"naming checkpoint {step_dir_name(writing)}")
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
        not exploded; otherwise keep the previous checkpoint. Returns the good checkpoint or None. A
        checkpoint being written in the background is finished first (it may be that very state)."""
        self.settle_write("the run stops")
        if step <= 0 or (self.last_saved is not None and self.last_saved.name == step_dir_name(step)):
            return self.last_saved
        self.optimizer.zero_grad(set_to_none=True)
        problem = self.weights_problem()
        if problem is not None:
            self.message(f"GUARD-NONFINITE: step {step} is not saved as a good checkpoint: {problem}")
            return self.last_saved
        self.save(step, data_state, rng, wait=True)
        return self.last_saved

    @property
    def last_saved(self) -> Path | None:
        """The newest checkpoint known COMPLETE (what the messages name); a background write counts once done."""
        return self.checkpointer.last_complete

    @last_saved.setter
    def last_saved(self, path: Path | None) -> None:
        self.checkpointer.last_complete = path

    def save(self, step: int, data_state: dict | None = None, rng: dict | None = None, wait: bool = False) -> Path:
        """An atomic checkpoint of step `step` (the checkpointer's: local, or DCP shards under torchrun); its
        weights are checked first (GUARD-NONFINITE if they are non-finite or exploded: a checkpoint is only
        ever a good one). --save-mode async: a snapshot now, written in the background (`wait`: finished before
        this returns); the path it will have is returned."""
        problem = self.weights_problem()
        if problem is not None:
            raise guards.weights_error(f"checkpoint {step_dir_name(step)}", problem,
                                       self.kept_text(self.last_saved), step)
        state = self.trainer_state(step, data_state if data_state is not None else self.train_loader.state_dict(),
                                   rng if rng is not None else rng_state())
        self.saves += 1
        self.timed_saves.saved()  # --save-every-minutes counts from the newest checkpoint
        path = self.checkpointer.save(step, self.model, self.optimizer, state, self.run_config,
                                      last=step == self.cfg.steps)
        if wait:
            self.checkpointer.wait()
        return path

    def settle_write(self, why: str) -> None:
        """Finish the checkpoint being written in the background, if any, before `why` (a stop): a write error
        is said, not raised (what stops the run is reported instead); a Ctrl-C while waiting abandons the write
        (it is never made COMPLETE), and so does a rank of the job found gone meanwhile (its shards never come:
        torchrun SIGTERMs the survivors of a lost rank, and the write must not hold back their exit 4)."""
        step = self.checkpointer.in_flight
        if step is None:
            return
        self.log(f"{why}: waiting for checkpoint {step_dir_name(step)} being written (Ctrl-C abandons it)")
        try:
            while not self.checkpointer.wait(timeout_s=SETTLE_POLL_S):
                gone = self.ranks_gone()
                if gone:
                    self.checkpointer.abandon()
                    self.log(f"checkpoint {step_dir_name(step)} abandoned: rank {', '.join(map(str, gone))} of the "
                             f"job is gone, so it cannot be completed; it has no COMPLETE marker, --resume ignores it")
                    return
        except KeyboardInterrupt:  # its temporary goes once it stops (ABANDON_WAIT_S; a third signal ends the wait)
            self.checkpointer.abandon(wait_s=checkpoints.ABANDON_WAIT_S)
            self.log(f"checkpoint {step_dir_name(step)} abandoned: it has no COMPLETE marker, --resume ignores it")
        except Exception as e:  # noqa: BLE001 -- said here; the stop is what the command reports
            self.log(f"checkpoint {step_dir_name(step)} was not written: {e}")

    def ranks_gone(self) -> list[int]:
        """Under torchrun, the ranks of the job found gone now (jobwatch.ranks_gone); none in one process."""
        if not self.ctx.active:
            return []
        from .jobwatch import ranks_gone

        return ranks_gone(self.ctx)

    def drop_write(self) -> None:
        """The run ends on an error: a checkpoint still being written in the background by this process is
        abandoned (it never becomes COMPLETE from here on) and given checkpoint.ABANDON_WAIT_S to stop (so the
        process does not exit while its thread writes, or waits in a collective of the writers' group); an error
        of that write is said. What the end then names as the last checkpoint (a lost rank's exit 4) is the newest
        COMPLETE one on disk: under torchrun rank 0 may have committed one this rank had not heard of yet."""
        step = self.checkpointer.in_flight
        error = self.checkpointer.abandon(wait_s=checkpoints.ABANDON_WAIT_S)
        if error is not None:
            self.log(f"checkpoint {step_dir_name(step)} was not written: {error}")
        self.adopt_committed()

    def adopt_committed(self) -> None:
        """The newest COMPLETE checkpoint on disk becomes the last one named: under torchrun rank 0 may have
        committed one that this rank's writer never heard of (the node lost before the outcome's broadcast)."""
        done = complete_checkpoints(self.ckpt_root)
        if done and (self.last_saved is None or done[-1].name > self.last_saved.name):
            self.last_saved = done[-1]

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
        if self.task is not None and self.task.due(step):
            self.task_evaluate(step)
        if self.samples is not None:
            self.samples.maybe(step, self.model, last=self.stopped_early is not None)
        if (step == cfg.steps or self.stopped_early or (cfg.save_every and step % cfg.save_every == 0)
                or self.timed_saves.due()):
            t0 = time.perf_counter()
            self.save(step)
            if step == cfg.steps or self.stopped_early:  # what the last checkpoint held the run for (async: the snapshot)
                self.end_save = {"checkpoint_s": time.perf_counter() - t0}

    def finish(self) -> None:
        """final/ through save_final: one consolidated directory written by rank 0 whatever the world size,
        only from weights checked finite (GUARD-NONFINITE otherwise); meanwhile the end-of-run checkpoint is
        written in the background (--save-mode async), and waited for (also when final/ fails). The seconds
        each part took are logged and kept in `end_save` (the summary's end_save_s is their total)."""
        t0 = time.perf_counter()
        try:
            if self.save_final is not None:
                problem = self.weights_problem()
                if problem is not None:
                    raise guards.weights_error("final/", problem, self.kept_text(self.last_saved), self.cfg.steps)
                self.final_step = self.task.restore_best(self.params) if self.task is not None else None
                if self.best_weights is not None:
                    self.final_step = self.best_weights.restore(self.params, self.step_now, self.eval_losses,
                                                                self.message)
                model = self.strategy.final_model()  # a collective under FSDP: the tensors land on rank 0
                gathered = time.perf_counter()
                self.ctx.run_on_main(lambda: self.save_final(model, self.run_dir / "final"))
        except BaseException:
            self.settle_write("final/ was not written")
            raise
        t1 = time.perf_counter()
        self.checkpointer.wait()
        end = self.end_save
        end.update(final_s=t1 - t0, write_wait_s=time.perf_counter() - t1)
        end["total_s"] = sum(end.values())
        gather = f"gathering the weights {gathered - t0:.1f} s, " if self.save_final is not None else ""
        self.log(f"end of run: checkpoint and final/ held the run {end['total_s']:.1f} s (checkpoint "
                 f"{end.get('checkpoint_s', 0.0):.1f} s, final/ {end['final_s']:.1f} s ({gather}then writing), "
                 f"waiting for the checkpoint's background write {end['write_wait_s']:.1f} s)")

    def fit(self) -> dict[str, Any]:
        """Steps start_step+1 .. cfg.steps with their evals and checkpoints, then final/. Returns a summary."""
        ok = False
        try:
            if self.ctx.is_main:
                result = self._fit()
            else:
                with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):  # one progress bar per job
                    result = self._fit()
            ok = True
            return result
        finally:
            if self.tracking is not None:  # the end's artifacts, the tracker runs closed (failed when not ok)
                self.tracking.close(ok)
            if self.graphs is not None:  # before the command leaves the process group (StepGraphs.release)
                self.graphs.release()
            self.strategy.close()

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        self.progress = Progress(cfg.steps, self.start_step, sys.stderr, cfg.log_every)
        t_train, tokens_at_start = time.perf_counter(), self.tokens
        self.step_now = self.start_step
        profiler = None if cfg.profile is None else StepProfiler(cfg.profile, self.run_dir, self.device,
                                                                   write=self.ctx.is_main)
        if profiler is not None and profiler.stop <= self.start_step:
            self.log(f"note: --profile {profiler.start}:{profiler.count} is before the resumed step "
                     f"{self.start_step}: nothing is profiled")
        try:
            self._steps(profiler)
            self.finish()
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM: a checkpoint being written is finished first
            self.settle_write("stopping")
            self.adopt_committed()
            raise TrainingInterrupted(self.step_now, self.last_saved, self.resume_command) from e
        except BaseException:
            self.drop_write()
            raise
        warnings = self.step_warnings + self.end_warnings()
        return {"warnings": warnings, "steps": cfg.steps, "start_step": self.start_step, "tokens": self.tokens,
                "final_train_loss": self.last_loss if math.isfinite(self.last_loss) else None,
                # training throughput: tokens over the time spent in steps (evals and checkpoints excluded)
                "tok_s": (self.tokens - tokens_at_start) / self.step_seconds if self.step_seconds > 0 else None,
                "seconds": time.perf_counter() - t_train, "eval": self.eval_history,
                "end_save_s": self.end_save.get("total_s"),
                "counters": {**self.counters, "spikes": self.spikes.count}, "run_dir": str(self.run_dir),
                "early_stop": self.stopped_early, "final_step": self.final_step,
                **({"task": self.task.summary(self.final_step)} if self.task is not None else {})}

    def _steps(self, profiler: StepProfiler | None) -> None:
        """Steps start_step+1 .. cfg.steps with their evals and checkpoints (the progress bar closed after)."""
        cfg = self.cfg
        try:
            with scheduled_gc(GC_EVERY, GC_FULL_EVERY) as before_step:
                for step in range(self.start_step + 1, cfg.steps + 1):
                    self.step_now = step
                    before_step(step)
                    if profiler is not None:
                        profiler.before(step)
                    record = self.train_step(step)
                    if profiler is not None and profiler.active(step):
                        record["profiled"] = True
                        profiler.after(step)
                        if profiler.result is not None:
                            r = profiler.result
                            self.log(f"profile of steps {r['steps'][0]}-{r['steps'][1]}: {r['wall_ms_per_step']:.1f}"
                                     f" ms/step, top: " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                                    list(r["by_class_ms"].items())[:4])
                                     + f" -> {self.run_dir / 'profile.json'}")
                    self.metrics_log.write(record)
                    for warning in self.objective.watch(record):  # the objective's step warnings
                        self.message(warning)
                        self.step_warnings.append({"guard": warning.split(" ", 1)[0].rstrip(":"), "step": step,
                                                   "message": warning})
                    self.watch_train(record)
                    fields = getattr(self.objective, "progress_fields", None)  # a library user's may lack it
                    extra = fields(record) if fields is not None else ""
                    self.progress.update(step, record["loss"], record["tok_s"],
                                         f"lr {record['lr']:.2e} gnorm {record['grad_norm']:.3f}"
                                         + (f" {extra}" if extra else ""))
                    self.after_step(step)
                    # a background checkpoint write that ended: COMPLETE, or its error (exit 2) raised here; under
                    # torchrun errors wait for the next save or the end, which every rank reaches at the same step
                    self.checkpointer.poll(raise_errors=not self.ctx.active)
                    if self.stopped_early is not None:
                        break
        finally:
            if profiler is not None:
                profiler.close()
            self.progress.close()
            self.progress = None


def write_preflight(run_dir: Path, preflight: dict, step0: dict) -> None:
    """RUN/preflight.json: the command's checks plus the step-0 record."""
    atomic_write(Path(run_dir) / "preflight.json",
                 json.dumps({**preflight, "step0": step0}, indent=2, default=str) + "\n")


def build_trainer(model: torch.nn.Module, train_loader: Any, eval_loader: Any, cfg: TrainConfig, run_dir: Path, *,
                  objective: Objective | None = None, ctx: DistContext | None = None,
                  checkpoint_files: Callable[[torch.nn.Module], Callable[[Path], None]] | None = None,
                  save_final: Callable[[torch.nn.Module, Path], None] | None = None,
                  log: Callable[[str], None] | None = None, resume_command: str | None = None,
                  task_eval: Any | None = None, samples: Any | None = None) -> Trainer:
    """The one construction of a Trainer (the commands, the tests, `train`): the precision prepares the model
    (bf16-pure's cast; before the optimizer exists, its state follows the weights), the memory options reach
    the blocks, parallelism is applied from outside (apply_parallel: nothing in one process), the loaders are
    split by global sample index, and only rank 0 logs. `checkpoint_files(model)` takes what makes each local
    checkpoint a runnable MODEL and returns its writer (model_files.checkpoint_files)."""
    from ..long_context import apply_memory_options

    ctx = ctx or job_context()
    precision = precision_policy(cfg.dtype)
    assert not (precision.one_process_only and ctx.active), f"--dtype {cfg.dtype} is refused under torchrun (commands)"
    model = precision.prepare_model(model)
    objective = objective or CausalLMLoss()
    objective.bind(model)  # a frozen reference copy (preference objectives, --mode full) of what training starts from
    if getattr(objective, "reference_model", None) is not None:
        precision.prepare_frozen(objective.reference_model)
    # before fully_shard: the blocks are recomputed inside (checkpointing, offload, MLP chunks: long_context.py)
    apply_memory_options(model, cfg)
    adapters = cfg.mode in ("lora", "qlora")
    # a library caller's --cuda-graphs (the commands resolve and log it before run.json): before the parallel
    # strategy, which is replicas without DDP for a captured step
    resolve_cuda_graphs(cfg, torch.device(cfg.device), ctx.world, objective.name, model,
                        parallel=job_parallel(model, ctx, cfg.parallel, adapters))
    strategy = apply_parallel(model, ctx, cfg.parallel, precision, adapters, cfg.grad_accum, cfg.grad_reduce,
                              cfg.ddp_bucket_mb, graphs=cfg.cuda_graphs == "on")
    checkpointer = Checkpointer(run_dir, cfg.keep, ctx, extra_files=checkpoint_files, mode=cfg.save_mode)
    return Trainer(strategy, shard_loader(train_loader, ctx, objective.counts),
                   shard_loader(eval_loader, ctx, objective.counts), cfg, run_dir,
                   precision=precision, objective=objective, checkpointer=checkpointer,
                   save_final=save_final, log=log if ctx.is_main else (lambda text: None),
                   resume_command=resume_command, task_eval=task_eval, samples=samples)


def train(model: torch.nn.Module, train_loader: Any, eval_loader: Any, cfg: TrainConfig, run_dir: Path,
          resume: str | None = None, preflight: dict | None = None,
          save_final: Callable[[torch.nn.Module, Path], None] | None = None,
          log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """build_trainer, begin (resume or step 0; preflight.json written when `preflight` is given), fit: the
    whole run as the commands drive it, for library callers and tests."""
    trainer = build_trainer(model, train_loader, eval_loader, cfg, run_dir, save_final=save_final, log=log)
    trainer.begin(resume, preflight)
    return trainer.fit()
