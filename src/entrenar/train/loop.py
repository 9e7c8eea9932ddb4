"""The one training loop, behind `entrenar pretrain` and `entrenar finetune` (full, LoRA, QLoRA).

It takes a built model (fp32 master parameters; LoRA already applied) and loader objects with
the interface `next_batch()`, `iter_epoch()`, `state_dict()`, `load_state_dict()`, `epoch`.
Batches: {"input_ids" [B,T], "labels" [B,T] (already shifted, -100 ignored), optional
"doc_ids", "position_ids", "sample_ids"}.

Loss normalisation: a step's G micro-batches are fetched first, their loss tokens counted, and
each micro-batch backpropagates loss_sum / total_tokens_of_the_step. So batch 4 and batch 1 x
accumulation 4 give the same update on samples of unequal length. Train and eval both use
`model.loss` -> (summed CE, token count) and divide the sums once.
"""

from __future__ import annotations

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
from ..tensors import IGNORE_INDEX
from . import guards
from .checkpoint import (
    find_resume,
    load_checkpoint,
    restore_model,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_dir_name,
)
from .config import RESUME_SENSITIVE, TrainConfig
from .metrics import JsonlLog, Progress, peak_flops, peak_memory_mb
from .optim import Schedule, build_optimizer


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def autocast(device: torch.device, dtype: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()}


def batch_loss(model: torch.nn.Module, batch: dict, device: torch.device, dtype: str
               ) -> tuple[torch.Tensor, int]:
    """(summed loss, loss-token count) of one batch via `model.loss`: the one loss of train and eval."""
    b = _to_device(batch, device)
    with autocast(device, dtype):
        loss_sum, n = model.loss(b["input_ids"], b["labels"], position_ids=b.get("position_ids"),
                                 doc_ids=b.get("doc_ids"))
    return loss_sum, int(n)


def loss_token_count(batch: dict) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


def _sample_ids(batches: Iterable[dict]) -> list:
    ids: list = []
    for b in batches:
        ids.extend(list(b.get("sample_ids") or []))
    return ids


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict], device: torch.device | str = "cpu",
             dtype: str = "fp32", max_batches: int = 0) -> dict[str, float]:
    """Token-weighted eval: sum of per-token losses / number of loss tokens, and exp of it."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    total, count, n_batches = 0.0, 0, 0
    try:
        for i, batch in enumerate(batches):
            if max_batches and i >= max_batches:
                break
            s, n = batch_loss(model, batch, device, dtype)
            total += float(s)
            count += n
            n_batches += 1
    finally:
        model.train(was_training)
    if count == 0:
        raise GuardError("GUARD-ZERO-LOSS-TOKENS",
                         f"the eval set ({n_batches} batches) has no loss tokens, so its loss is undefined.",
                         "check the eval data: responses truncated away by --max-seq-len, or an empty split")
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count, "batches": n_batches}


def forward_backward(model: torch.nn.Module, micro_batches: list[dict], device: torch.device, dtype: str,
                     total_tokens: int) -> float:
    """Backpropagate every micro-batch's loss_sum / total_tokens (of the whole step); return the
    step's mean loss per token."""
    loss_total = 0.0
    for b in micro_batches:
        s, _ = batch_loss(model, b, device, dtype)
        (s / total_tokens).backward()
        loss_total += float(s.detach())
    return loss_total / total_tokens


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


def train(model: torch.nn.Module, train_loader: Any, eval_loader: Any, cfg: TrainConfig, run_dir: Path,
          resume: str | None = None, preflight: dict | None = None,
          save_final: Callable[[torch.nn.Module, Path], None] | None = None,
          log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train `model` for cfg.steps optimizer steps. Writes metrics.jsonl, eval.jsonl, preflight.json,
    checkpoints/ and (through save_final) final/ under run_dir. Returns a summary dict."""
    cfg.validate()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(cfg.device)
    progress_stream = sys.stderr
    log = log or (lambda text: print(text, file=progress_stream, flush=True))
    run_config = cfg.to_dict()
    vocab_size = model.cfg.vocab_size

    seed_everything(cfg.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    schedule = Schedule(cfg.lr, cfg.warmup, cfg.steps, cfg.schedule, cfg.min_lr_ratio)
    spikes = guards.SpikeGuard(cfg.on_spike, cfg.spike_window, cfg.spike_sigma)
    metrics_log, eval_log = JsonlLog(run_dir / "metrics.jsonl"), JsonlLog(run_dir / "eval.jsonl")
    ckpt_root = run_dir / "checkpoints"
    counters = {"nonfinite_skipped": 0, "spike_skipped": 0, "zero_loss_samples": 0}
    start_step, tokens = 0, 0
    recent_losses: list[float] = []
    eval_history: list[dict] = []

    ckpt_path = find_resume(run_dir, resume, log) if resume else None
    if ckpt_path is not None:
        ckpt = load_checkpoint(ckpt_path)
        _check_resume_config(ckpt["run_config"], run_config, cfg.allow_config_change, log)
        restore_model(model, ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        st = ckpt["trainer_state"]
        schedule.load_state_dict(st["schedule"])
        train_loader.load_state_dict(st["data"])
        spikes.load_state_dict(st["spike"])
        counters.update(st["counters"])
        recent_losses = list(st["recent_losses"])
        start_step, tokens = int(st["step"]), int(st["tokens"])
        metrics_log.truncate_after(start_step)
        eval_log.truncate_after(start_step)
        set_rng_state(st["rng"])
        log(f"resume: step {start_step}, {tokens} tokens seen, optimizer sha256 "
            f"{ckpt['meta']['sha256']['optimizer.pt'][:16]}..")
    else:
        step0: dict[str, Any] = {"ln_vocab": math.log(vocab_size), "vocab_size": vocab_size,
                                 "parameters": sum(p.numel() for p in model.parameters()),
                                 "trainable_parameters": sum(p.numel() for p in params)}
        if eval_loader is not None:
            ev = evaluate(model, eval_loader.iter_epoch(), device, cfg.dtype, cfg.eval_batches)
            eval_log.write({"step": 0, **ev})
            eval_history.append({"step": 0, **ev})
            step0["eval"] = ev
            spikes.set_reference(ev["loss"])  # GUARD-SPIKE's early-phase reference (with the first step's)
            log(f"step 0: eval loss {ev['loss']:.4f} (ppl {ev['ppl']:.2f}, {ev['tokens']} tokens); "
                f"ln(vocab) = {step0['ln_vocab']:.4f}")
        elif cfg.check_init_loss:  # no eval set: judge the start on the first train batch, unconsumed
            state = train_loader.state_dict()
            ev = evaluate(model, [train_loader.next_batch() for _ in range(cfg.grad_accum)], device, cfg.dtype)
            train_loader.load_state_dict(state)
            step0["first_train_batch"] = ev
        if preflight is not None:
            import json
            record = {**preflight, "step0": step0}
            (run_dir / "preflight.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        if cfg.check_init_loss:
            ev0 = step0.get("eval") or step0.get("first_train_batch")
            guards.check_init_loss(ev0["loss"], vocab_size, str(cfg.init or cfg.model))
            log(f"GUARD-INIT-LOSS ok: step-0 loss {ev0['loss']:.4f} < ln(vocab) {step0['ln_vocab']:.4f}")

    def trainer_state(step: int, data_state: dict, rng: dict) -> dict[str, Any]:
        return {"step": step, "tokens": tokens, "schedule": schedule.state_dict(), "data": data_state,
                "spike": spikes.state_dict(), "counters": dict(counters), "recent_losses": recent_losses[-64:],
                "rng": rng, "epoch": getattr(train_loader, "epoch", None)}

    last_saved = ckpt_path.name if ckpt_path is not None else None
    peak = peak_flops(device, cfg.dtype)
    flops_per_token = model.cfg.flops_per_token(cfg.seq_len)
    progress = Progress(cfg.steps, start_step, progress_stream, cfg.log_every)
    t_train, tokens_at_start, step_seconds = time.perf_counter(), tokens, 0.0
    last_loss = float("nan")
    try:
        for step in range(start_step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            pre_data, pre_rng = train_loader.state_dict(), rng_state()  # for a last-good checkpoint
            micro = [train_loader.next_batch() for _ in range(cfg.grad_accum)]
            sample_ids = _sample_ids(micro)
            total_tokens = sum(loss_token_count(b) for b in micro)
            guards.check_loss_tokens(total_tokens, step, sample_ids)
            empty = sum(int(((b["labels"] != IGNORE_INDEX).sum(dim=1) == 0).sum()) for b in micro)
            if empty:
                counters["zero_loss_samples"] += empty
                progress.message(f"GUARD-ZERO-LOSS-TOKENS: step {step} has {empty} sample(s) without loss "
                                 f"tokens; they add nothing and are not averaged in (total so far "
                                 f"{counters['zero_loss_samples']})")
            lr = schedule.apply(optimizer)
            loss = forward_backward(model, micro, device, cfg.dtype, total_tokens)
            max_norm = cfg.clip if cfg.clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
            skip = guards.check_nonfinite(loss, grad_norm, step, sample_ids, "skip")
            if skip and cfg.on_nonfinite == "stop":
                if last_saved != step_dir_name(step - 1) and step - 1 > 0:
                    optimizer.zero_grad(set_to_none=True)
                    save_checkpoint(ckpt_root, step - 1, model, optimizer,
                                    trainer_state(step - 1, pre_data, pre_rng), run_config, cfg.keep)
                guards.check_nonfinite(loss, grad_norm, step, sample_ids, "stop")
            verdict, spike_msg = ("ok", "") if skip else spikes.check(loss, grad_norm, step, sample_ids)
            if skip:
                counters["nonfinite_skipped"] += 1
                progress.message(f"GUARD-NONFINITE: step {step} skipped (loss {loss}, grad_norm {grad_norm}, "
                                 f"samples {sample_ids}); {counters['nonfinite_skipped']} skipped so far")
            elif verdict != "ok":
                progress.message(spike_msg + (" -> update skipped" if verdict == "skip" else " (warning)"))
                if verdict == "skip":
                    counters["spike_skipped"] += 1
                    skip = True
            if not skip:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.advance()
            step_tokens = sum(int(b["input_ids"].numel()) for b in micro)
            tokens += step_tokens
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            step_seconds += dt
            tok_s = step_tokens / dt
            if not skip:
                recent_losses.append(loss)
                last_loss = loss
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                      "loss_tokens": total_tokens, "tok_s": tok_s,
                      "mfu": (flops_per_token * tok_s / peak) if peak else None,
                      "mem_mb": peak_memory_mb(device), "epoch": getattr(train_loader, "epoch", None),
                      "skipped": skip}
            metrics_log.write(record)
            progress.update(step, loss, tok_s, f"lr {lr:.2e} gnorm {grad_norm:.3f}")

            if eval_loader is not None and (step == cfg.steps or (cfg.eval_every and step % cfg.eval_every == 0)):
                ev = evaluate(model, eval_loader.iter_epoch(), device, cfg.dtype, cfg.eval_batches)
                eval_log.write({"step": step, **ev})
                eval_history.append({"step": step, **ev})
                progress.message(f"step {step}: eval loss {ev['loss']:.4f} ppl {ev['ppl']:.2f}")
                window = recent_losses[-20:]
                guards.check_eval_anomaly(ev["loss"], sum(window) / len(window) if window else None, step)
            if step == cfg.steps or (cfg.save_every and step % cfg.save_every == 0):
                path = save_checkpoint(ckpt_root, step, model, optimizer,
                                       trainer_state(step, train_loader.state_dict(), rng_state()),
                                       run_config, cfg.keep)
                last_saved = path.name
    finally:
        progress.close()
    elapsed = time.perf_counter() - t_train
    if save_final is not None:
        save_final(model, run_dir / "final")
    return {"steps": cfg.steps, "start_step": start_step, "tokens": tokens, "final_train_loss": last_loss,
            # training throughput: tokens over the time spent in steps (evals and checkpoints excluded)
            "tok_s": (tokens - tokens_at_start) / step_seconds if step_seconds > 0 else None,
            "seconds": elapsed,
            "eval": eval_history, "counters": {**counters, "spikes": spikes.count},
            "run_dir": str(run_dir)}
