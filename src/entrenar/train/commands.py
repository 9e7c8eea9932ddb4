"""`entrenar pretrain | finetune | eval | plot`: build model, tokenizer and loaders, then the one loop.

Everything the user gave is validated (model resolves, data loads, numbers in range, --resume
checkpoint COMPLETE, --out usable) before the run directory is created, so bad input exits 2
with nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..cli_registry import add_command, add_device_option
from ..config import PRESETS, preset
from ..errors import InputError
from .checkpoint import find_resume
from .loop import TrainConfig, evaluate, train

MODES = ("full", "lora", "qlora")


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- helpers ------------------------------------------------------------------------------------
def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                           capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("entrenar", "torch", "numpy", "tokenizers", "safetensors", "transformers", "triton"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    out["cuda"] = torch.version.cuda
    return out


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _check_out(out: Path, resume: str | None) -> None:
    """--out must be new/empty, or (with --resume) an existing run directory."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a directory")
    if resume is None and out.is_dir() and any(out.iterdir()):
        raise InputError(f"--out {out}: directory exists and is not empty; continue it with --resume auto "
                         f"or choose a new --out")
    if resume is not None and resume != "auto":
        find_resume(out, resume, _log)  # raises InputError unless the checkpoint is COMPLETE


def _train_config(args: argparse.Namespace, seq_len: int, lr: float, extra: dict) -> TrainConfig:
    warmup = args.warmup if args.warmup is not None else min(100, args.steps // 10)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, grad_accum=args.grad_accum, seq_len=seq_len,
                      lr=lr, warmup=warmup, schedule=args.schedule, weight_decay=args.weight_decay,
                      clip=args.clip, device=args.device, dtype=args.dtype, eval_every=args.eval_every,
                      eval_batches=args.eval_batches, save_every=args.save_every, keep=args.keep,
                      seed=args.seed, on_nonfinite=args.on_nonfinite, on_spike=args.on_spike,
                      allow_config_change=args.allow_config_change, extra=extra)
    cfg.validate()
    return cfg


def _run_preflight(args: argparse.Namespace, model: torch.nn.Module, tokenizer: Any, seq_len: int) -> dict:
    if args.no_preflight:
        _log("preflight: SKIPPED (--no-preflight)")
        return {"verify": {"skipped": "--no-preflight"}}
    if tokenizer is None:
        _log("preflight: skipped (no tokenizer known for this model to build the probe)")
        return {"verify": {"skipped": "no tokenizer"}}
    try:
        from ..verify import preflight
    except ImportError as e:
        return {"verify": {"skipped": f"entrenar.verify unavailable: {e}"}}
    t0 = time.perf_counter()
    result = preflight(model, tokenizer, args.device, args.dtype, getattr(model, "kernels", "torch"),
                       seq_len=min(64, seq_len))
    worst = max((s["logits_rel_l2"] for s in result.get("sequences", []) if s.get("logits_rel_l2") is not None),
                default=None)
    _log(f"preflight: parity vs float64 reference ok ({len(result.get('sequences', []))} probe sequences, "
         f"worst logits relL2 {worst if worst is None else f'{worst:.2e}'}, {time.perf_counter() - t0:.1f}s)")
    return {"verify": result}


def _run_json(args: argparse.Namespace, command: str, cfg: TrainConfig, model: torch.nn.Module,
              tokenizer: Any) -> dict:
    return {"command": command, "argv": sys.argv, "config": cfg.to_dict(), "seed": cfg.seed,
            "model": {"spec": getattr(args, "model", None), "init": getattr(args, "init", None),
                      "config": model.cfg.to_hf_dict(),
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                      "source": {k: v for k, v in (getattr(model, "source", None) or {}).items()
                                 if isinstance(v, (str, int, float, bool, type(None)))}},
            "tokenizer": None if tokenizer is None else {"vocab_size": len(tokenizer),
                                                         "eos_id": tokenizer.eos_id,
                                                         "eot_id": getattr(tokenizer, "eot_id", None)},
            "versions": _versions(), "git_commit": _git_commit(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                     "torch_threads": torch.get_num_threads(),
                     "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}}


def _start_run_dir(out: Path, run_json: dict, data_report: dict, resume: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if resume is not None and (out / "run.json").exists():
        prev = json.loads((out / "run.json").read_text())
        run_json = {**prev, "resumed": [*prev.get("resumed", []), run_json]}
    _write_json(out / "run.json", run_json)
    _write_json(out / "data_report.json", data_report)


def _summary(result: dict, out: Path) -> dict:
    ev = result["eval"]
    return {"run_dir": str(out), "steps": result["steps"], "start_step": result["start_step"],
            "tokens": result["tokens"], "final_train_loss": result["final_train_loss"], "seconds": result["seconds"],
            "eval_loss_start": ev[0]["loss"] if ev and ev[0]["step"] == 0 else None,
            "eval_loss_final": ev[-1]["loss"] if ev else None, "tok_s": result["tok_s"],
            "counters": result["counters"], "final": str(out / "final")}


def _print_summary(s: dict) -> None:
    parts = [f"done: {s['steps']} steps, {s['tokens']} tokens, {s['tok_s']:,.0f} tok/s" if s["tok_s"] else
             f"done: {s['steps']} steps"]
    if s["eval_loss_start"] is not None:
        parts.append(f"eval loss {s['eval_loss_start']:.4f} -> {s['eval_loss_final']:.4f}")
    elif s["eval_loss_final"] is not None:
        parts.append(f"final eval loss {s['eval_loss_final']:.4f}")
    _log("; ".join(parts) + f"; model in {s['final']}")


def _is_preset(spec: str) -> bool:
    return spec in PRESETS


def _model_config_of(spec: str):
    from ..formats import load_state

    cfg, _, _ = load_state(spec)
    return cfg


def _tokenizer_or_none(spec: str | None) -> Any:
    if not spec:
        return None
    from ..tokenizer import load_tokenizer

    try:
        return load_tokenizer(spec)
    except InputError as e:
        _log(f"note: no tokenizer from {spec}: {e}")
        return None


# ---- pretrain -------------------------------------------------------------------------------------
def cmd_pretrain(args: argparse.Namespace) -> dict[str, Any]:
    from ..data.corpus import PretrainLoader, read_index
    from ..formats import load_model, resolve_model
    from ..model import CausalLM

    out = Path(args.out)
    lr = 3e-4 if args.lr is None else float(args.lr)
    extra = {"command": "pretrain", "model": args.model, "init": args.init, "data": args.data,
             "kernels": args.kernels, "no_preflight": args.no_preflight}
    cfg = _train_config(args, args.seq_len, lr, extra)
    _check_out(out, args.resume)
    if not _is_preset(args.model):
        resolve_model(args.model)  # InputError for a non-existent model
    if args.init:
        resolve_model(args.init)
    index = read_index(args.data)
    train_loader = PretrainLoader(args.data, "train", cfg.seq_len, cfg.batch_size, seed=cfg.seed)
    val_info = index["splits"].get("val") or {}
    eval_loader = (PretrainLoader(args.data, "val", cfg.seq_len, cfg.batch_size, seed=cfg.seed)
                   if val_info.get("tokens", 0) > cfg.seq_len else None)
    if eval_loader is None:
        _log(f"note: {args.data} has no val split of more than --seq-len {cfg.seq_len} tokens; no eval "
             f"(pack with --val-fraction for one)")

    if args.init:
        model = load_model(args.init, dtype=torch.float32, kernels=args.kernels)
        if _is_preset(args.model) and model.cfg.to_hf_dict() != preset(args.model).to_hf_dict():
            _log(f"note: --init {args.init} defines the architecture; preset {args.model} is ignored")
        cfg.check_init_loss = True
        tok_spec = args.init
    else:
        mcfg = preset(args.model) if _is_preset(args.model) else _model_config_of(args.model)
        model = CausalLM(mcfg, kernels=args.kernels)
        model.init_weights(cfg.seed)
        tok_spec = None if _is_preset(args.model) else args.model
    tok_spec = tok_spec or (index.get("tokenizer") or {}).get("model")
    if index["vocab_size"] > model.cfg.vocab_size:
        raise InputError(f"{args.data}: shards were packed with a tokenizer of {index['vocab_size']} tokens, "
                         f"more than the model's vocab_size {model.cfg.vocab_size}; pack with the model's "
                         f"tokenizer or choose a matching --model")
    tokenizer = _tokenizer_or_none(tok_spec)
    model = model.to(cfg.device).train()
    data_report = {"kind": "pretrain", "shards": str(args.data), "index": {k: v for k, v in index.items()
                                                                          if k != "inputs"},
                   "train_windows": len(train_loader), "val_windows": len(eval_loader) if eval_loader else 0,
                   "seq_len": cfg.seq_len, "loss_tokens_per_window": cfg.seq_len}
    return _run(args, "pretrain", cfg, model, tokenizer, train_loader, eval_loader, data_report, out,
                save_final=_hf_saver(tokenizer))


def _hf_saver(tokenizer: Any):
    def save(model: torch.nn.Module, final: Path) -> None:
        from ..formats import save_hf_dir

        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf_dir(model, tmp, tokenizer)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    return save


def _adapter_saver(tokenizer: Any, base_spec: str):
    def save(model: torch.nn.Module, final: Path) -> None:
        from ..peft import save_adapter

        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter(model, tmp, base_spec)
        if tokenizer is not None:
            tokenizer.save_hf(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    return save


def _run(args, command, cfg, model, tokenizer, train_loader, eval_loader, data_report, out, save_final) -> dict:
    """Everything validated: create the run directory, preflight, train, summarise."""
    _start_run_dir(out, _run_json(args, command, cfg, model, tokenizer), data_report, args.resume)
    pre = {"verify": {"skipped": "resumed run"}} if args.resume and (out / "preflight.json").exists() else \
        _run_preflight(args, model, tokenizer, cfg.seq_len)
    result = train(model, train_loader, eval_loader, cfg, out, resume=args.resume,
                   preflight=pre, save_final=save_final, log=_log)
    summary = _summary(result, out)
    _print_summary(summary)
    return summary


# ---- finetune --------------------------------------------------------------------------------------
def _split_val(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    if not 0.0 <= fraction < 1.0:
        raise InputError(f"--val-fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0 or len(examples) < 2:
        return examples, []
    n_val = min(len(examples) - 1, max(1, round(fraction * len(examples))))
    order = np.random.default_rng([seed, 7919]).permutation(len(examples))
    val_idx = set(order[:n_val].tolist())
    return ([e for i, e in enumerate(examples) if i not in val_idx],
            [e for i, e in enumerate(examples) if i in val_idx])


def cmd_finetune(args: argparse.Namespace) -> dict[str, Any]:
    from ..data.sft import SFTLoader, load_sft
    from ..formats import load_model, resolve_model
    from ..tokenizer import load_tokenizer

    out = Path(args.out)
    if args.mode not in MODES:
        raise InputError(f"--mode {args.mode!r} not in {MODES}")
    if args.lr in (None, "auto"):
        from ..peft import auto_lr

        lr, why = auto_lr(args.mode, args.rank, args.rslora, args.alpha)
        _log(f"--lr auto: {lr:g} ({why})")
    else:
        try:
            lr = float(args.lr)
        except ValueError as e:
            raise InputError(f"--lr must be a number or 'auto', got {args.lr!r}") from e
    extra = {"command": "finetune", "mode": args.mode, "model": args.model, "data": args.data, "val": args.val,
             "val_fraction": args.val_fraction, "kernels": args.kernels, "no_preflight": args.no_preflight,
             "truncation": args.truncation,
             "pack": args.pack, "lora": {"rank": args.rank, "alpha": args.alpha, "dropout": args.dropout,
                                         "rslora": args.rslora, "targets": args.targets}}
    cfg = _train_config(args, args.max_seq_len, lr, extra)
    cfg.check_init_loss = True
    _check_out(out, args.resume)
    if not Path(args.data).is_file():
        raise InputError(f"--data {args.data}: no such file (SFT data is a JSONL file)")
    if args.val and not Path(args.val).is_file():
        raise InputError(f"--val {args.val}: no such file")
    resolve_model(args.model)
    tokenizer = load_tokenizer(args.model)
    examples, report = load_sft(args.data, tokenizer, args.max_seq_len, truncation=args.truncation,
                                skip_invalid=args.skip_invalid)
    for line in report.summary_lines():
        _log(line)
    data_report: dict[str, Any] = {"kind": "sft", "train": report.to_dict()}
    if args.val:
        val_examples, val_report = load_sft(args.val, tokenizer, args.max_seq_len, truncation=args.truncation,
                                            skip_invalid=args.skip_invalid)
        data_report["val"] = val_report.to_dict()
    else:
        examples, val_examples = _split_val(examples, args.val_fraction, cfg.seed)
        data_report["val"] = {"from": "--val-fraction", "fraction": args.val_fraction,
                              "examples": len(val_examples)}
    data_report["train_examples"], data_report["val_examples"] = len(examples), len(val_examples)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    train_loader = SFTLoader(examples, cfg.batch_size, seed=cfg.seed, pack=args.pack,
                             max_seq_len=args.max_seq_len, pad_id=pad_id)
    eval_loader = SFTLoader(val_examples, cfg.batch_size, seed=cfg.seed, pack=False,
                            max_seq_len=args.max_seq_len, pad_id=pad_id) if val_examples else None

    model = load_model(args.model, dtype=torch.float32, kernels=args.kernels)
    if args.mode in ("lora", "qlora"):  # the adapter wraps the model before the optimizer is built
        from ..peft import apply_lora, describe_parameters

        model = apply_lora(model, args.rank, args.alpha if args.alpha is not None else 2 * args.rank,
                           dropout=args.dropout, rslora=args.rslora, targets=args.targets,
                           quantize_nf4=args.mode == "qlora")
        _log(describe_parameters(model))
        save_final = _adapter_saver(tokenizer, args.model)
    else:
        save_final = _hf_saver(tokenizer)
    model = model.to(cfg.device).train()
    return _run(args, "finetune", cfg, model, tokenizer, train_loader, eval_loader, data_report, out, save_final)


# ---- eval ------------------------------------------------------------------------------------------
def load_any_model(spec: str, device: str = "cpu", kernels: str = "torch",
                   adapter: str | None = None) -> tuple[torch.nn.Module, Any, Path]:
    """A full model (plus `adapter`, unmerged) or a LoRA adapter directory (loaded onto its recorded
    base). Returns (model, tokenizer or None, resolved path)."""
    from ..formats import load_model_with_adapter, resolve_model
    from ..peft import read_adapter_config

    path = resolve_model(spec)
    model = load_model_with_adapter(spec, adapter, dtype=torch.float32, device=device, kernels=kernels)
    if path.is_dir() and not (path / "config.json").is_file():  # an adapter: its tokenizer, else the base's
        base = read_adapter_config(path)[0]["base_model_name_or_path"]
        tok = _tokenizer_or_none(str(path) if (path / "tokenizer.json").is_file() else base)
    else:
        tok = _tokenizer_or_none(str(path) if path.is_dir() else spec)
    return model, tok, path


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be a positive integer, got {args.batch_size}")
    data = Path(args.data)
    if not data.exists():
        raise InputError(f"--data {data}: no such file or directory (token shards or an SFT .jsonl)")
    model, tok, path = load_any_model(args.model, args.device, args.kernels, args.adapter)
    if data.is_dir():
        from ..data.corpus import PretrainLoader, read_index

        index = read_index(data)
        split = args.split or ("val" if (index["splits"].get("val") or {}).get("tokens", 0) > args.seq_len
                               else "train")
        loader = PretrainLoader(data, split, args.seq_len, args.batch_size)
        what = f"{data} split {split}, seq_len {args.seq_len}"
    else:
        from ..data.sft import SFTLoader, load_sft

        if tok is None:
            raise InputError(f"{args.model}: no tokenizer found, needed to encode {data}")
        examples, report = load_sft(data, tok, args.max_seq_len, truncation=args.truncation)
        pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id
        loader = SFTLoader(examples, args.batch_size, pad_id=pad_id, max_seq_len=args.max_seq_len)
        what = f"{data} ({report.kept} samples, max_seq_len {args.max_seq_len})"
    t0 = time.perf_counter()
    ev = evaluate(model, loader.iter_epoch(), args.device, args.dtype, args.max_batches)
    dt = time.perf_counter() - t0
    ln_v = math.log(model.cfg.vocab_size)
    if not args.json:
        print(f"eval {path} on {what}: loss {ev['loss']:.4f}, perplexity {ev['ppl']:.3f} over {ev['tokens']} "
              f"loss tokens ({ev['batches']} batches, {dt:.1f}s); ln(vocab) = {ln_v:.4f}")
    return {"model": str(path), "data": str(data), **ev, "ln_vocab": ln_v, "seconds": dt}


# ---- plot ------------------------------------------------------------------------------------------
def cmd_plot(args: argparse.Namespace) -> dict[str, Any]:
    from ..plot import plot_run

    return plot_run(Path(args.run), Path(args.out) if args.out else None)


# ---- registration ------------------------------------------------------------------------------------
def _training_options(p: argparse.ArgumentParser, default_lr: str | None, default_wd: float) -> None:
    p.add_argument("--out", required=True, help="run directory (created; or continued with --resume)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (1000)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch (8)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (1)")
    p.add_argument("--lr", default=default_lr, help=f"peak learning rate ({default_lr or 'auto by mode'})")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (min(100, steps/10))")
    p.add_argument("--schedule", choices=("cosine", "linear", "constant"), default="cosine",
                   help="decay after warmup, to 10%% of the peak (cosine)")
    p.add_argument("--weight-decay", type=float, default=default_wd,
                   help=f"AdamW weight decay on >=2-D weights ({default_wd})")
    p.add_argument("--clip", type=float, default=1.0, help="clip the global L2 grad norm; 0 = off (1.0)")
    add_device_option(p)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="compute dtype; bf16 = autocast, master weights stay fp32 (fp32)")
    p.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto",
                   help="op implementations: auto = triton on cuda, torch elsewhere (auto)")
    p.add_argument("--eval-every", type=int, default=0, help="eval period in steps; 0 = at start and end (0)")
    p.add_argument("--eval-batches", type=int, default=20, help="batches per eval; 0 = all (20)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint period; 0 = at the end only (0)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (3)")
    p.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="continue from the newest COMPLETE checkpoint of --out, or from PATH")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even if batch size, accumulation or sequence length changed")
    p.add_argument("--seed", type=int, default=0, help="seed for init, data order and RNG (0)")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="GUARD-NONFINITE policy: stop (exit 3) or skip the step and count it (stop)")
    p.add_argument("--on-spike", choices=("warn", "skip", "stop"), default="warn",
                   help="GUARD-SPIKE policy for loss/grad-norm spikes > 6 sigma over 128 steps (warn)")
    p.add_argument("--no-preflight", action="store_true", help="skip the step-0 parity check (logged)")


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "pretrain", cmd_pretrain, "pretrain (or continue pretraining) on token shards")
    p.add_argument("--model", required=True, help=f"PRESET ({', '.join(PRESETS)}) or MODEL (its architecture)")
    p.add_argument("--init", help="MODEL whose weights to start from (else random init)")
    p.add_argument("--data", required=True, help="token shards directory (`entrenar data pack`)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per training window (512)")
    _training_options(p, "3e-4", 0.1)

    p = add_command(sub, "finetune", cmd_finetune, "supervised fine-tuning on chat JSONL (full | lora | qlora)")
    p.add_argument("--model", required=True, help="MODEL to fine-tune")
    p.add_argument("--data", required=True, help="training JSONL")
    p.add_argument("--val", help="validation JSONL (else --val-fraction of --data)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out fraction when no --val (0.05)")
    p.add_argument("--mode", choices=MODES, default="full", help="full | lora | qlora (full)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="longest sample in tokens (2048)")
    p.add_argument("--truncation", choices=("skip", "keep"), default="skip",
                   help="a response cut by --max-seq-len: skip the sample or train it cut (skip)")
    p.add_argument("--skip-invalid", action="store_true", help="skip and count invalid rows instead of exit 2")
    p.add_argument("--pack", action="store_true", help="pack several samples per row (attention kept apart)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (16)")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha (2 x rank)")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (0)")
    p.add_argument("--rslora", action="store_true", help="rank-stabilised scaling alpha/sqrt(r)")
    p.add_argument("--targets", default=None, help="LoRA target linears, comma-separated (all)")
    _training_options(p, None, 0.0)

    p = add_command(sub, "eval", cmd_eval, "token-weighted loss and perplexity of MODEL|RUN on data")
    p.add_argument("--model", required=True, help="MODEL or RUN directory (its final model or adapter)")
    p.add_argument("--adapter", default=None, help="LoRA/QLoRA adapter directory applied on --model unmerged")
    p.add_argument("--data", required=True, help="token shards directory or SFT .jsonl")
    p.add_argument("--split", choices=("train", "val"), default=None, help="shards split (val if present)")
    p.add_argument("--seq-len", type=int, default=512, help="window length for shards (512)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="longest SFT sample (2048)")
    p.add_argument("--truncation", choices=("skip", "keep"), default="skip", help="SFT truncation (skip)")
    p.add_argument("--batch-size", type=int, default=8, help="batch size (8)")
    p.add_argument("--max-batches", type=int, default=0, help="stop after this many batches; 0 = all (0)")
    add_device_option(p)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (fp32)")
    p.add_argument("--kernels", choices=("auto", "torch", "triton"), default="auto",
                   help="op implementations: auto = triton on cuda, torch elsewhere (auto)")

    p = add_command(sub, "plot", cmd_plot, "RUN/curves.png: loss, eval loss, lr and grad-norm vs step")
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--out", default=None, help="output image (RUN/curves.png)")


__all__ = ["cmd_eval", "cmd_finetune", "cmd_plot", "cmd_pretrain", "load_any_model", "register"]
