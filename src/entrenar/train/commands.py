"""`entrenar pretrain | finetune` (their options: cli/train.py): build model, tokenizer and loaders, then the one loop.

Everything the user gave is validated (model resolves, data loads, numbers in range, --resume
checkpoint COMPLETE, --out usable) before the run directory is created, so bad input exits 2
with nothing half-written.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import stops
from ..config import PRESETS, preset
from ..data.tabular import SOURCES_HELP, is_row_source, parse_columns
from ..errors import GuardError, InputError
from ..fileio import atomic_write, clear_path, describe_path, write_manifest
from ..outpaths import check_creatable
from ..peft.load import tokenizer_or_none
from . import qa_gate
from .checkpoint import complete_checkpoints, find_resume, resume_problem, run_record_problem, write_errors
from .config import DataConfig, LoRAConfig, default_of, from_args
from .distributed import current, env_world, other_rank
from .jobwatch import join_job, judge_failure
from .loop import TrainConfig, build_trainer, check_resume_has_work
from .precision import precision_policy, verify_dtype
from .runlock import LOCK_FILE, check_free, holding


def _log(text: str) -> None:
    if not other_rank():  # under torchrun rank 0 speaks for the job
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
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n")  # never through a link (fileio)


# What a run writes before its first optimizer step: a directory holding only these (and no metrics
# line, no checkpoint) never trained, so a retry may reuse it (issue 18: an OOM-killed first step left
# a run.json that blocked every retry with "directory exists").
_PRE_STEP_FILES = {"run.json", "data_report.json", "preflight.json", "metrics.jsonl", "eval.jsonl", "checkpoints",
                   # --sample-prompts' step-0 samples and the --report-to trackers' files (train/reporting.py)
                   "samples.jsonl", "tb", "mlflow.db", "mlartifacts", "wandb"}


def _never_trained(out: Path) -> bool:
    entries = {p.name for p in out.iterdir()} - {LOCK_FILE}  # the lock's file stays (runlock.py)
    if not entries <= _PRE_STEP_FILES:
        return False
    metrics, ckpts = out / "metrics.jsonl", out / "checkpoints"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return False
    return not (ckpts.is_dir() and any(ckpts.iterdir())) and not (ckpts.exists() and not ckpts.is_dir())


def _clear_never_trained(out: Path) -> None:
    """Remove what a run that never reached step 1 left (only the files a run writes)."""
    for name in sorted(_PRE_STEP_FILES):
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _check_out(out: Path, resume: str | None) -> None:
    """--out must be new/empty, a run that never reached step 1 (reused), or (with --resume) an
    existing run directory; and it must be creatable."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a directory")
    check_creatable(out, "--out")
    # another run writing it: say so before anything else about the directory (rank 0 probes for the job)
    current().run_on_main(lambda: check_free(out) if out.is_dir() else None)
    if resume is None and out.is_dir() and any(out.iterdir()):
        if not _never_trained(out):
            raise InputError(f"--out {out}: directory exists and is not empty; {_continue_advice(out)}")
        _log(f"note: --out {out} holds a run that never reached step 1 (no metrics, no checkpoint); "
             f"starting it again there")
    if resume is not None:  # --resume writes only into a run of ours (or an empty --out): exit 2, nothing touched
        problem = resume_problem(out, resume, ignore=(LOCK_FILE,))
        if problem is not None:
            raise InputError(problem)
    if resume is not None and resume != "auto":
        find_resume(out, resume, _log)  # raises InputError unless the checkpoint is COMPLETE


def _continue_advice(out: Path) -> str:
    """What to do about a non-empty --out: `--resume auto` only where it would continue this run (issue 38)."""
    if run_record_problem(out) is not None:
        return ("it is not a run directory of entrenar, so nothing will be written there: choose a new (or empty) "
                "--out")
    if complete_checkpoints(out / "checkpoints"):
        return "continue it with --resume auto or choose a new --out"
    if (out / "final").exists():
        return "it holds a finished run with no checkpoint to continue from: choose a new --out"
    return ("it holds a run stopped before its first checkpoint: --resume auto starts it again from step 0 "
            "(replacing its logs), or choose a new --out")


def _configs(args: Any, command: str) -> tuple[TrainConfig, LoRAConfig, DataConfig]:
    """The run's three configs from the parsed flags, validated in the order the user reads the
    flags: data, adapter, then the loop (so --alpha -16 is not reported as a bad --lr)."""
    data = from_args(DataConfig, args, command)
    data.validate()
    lora = from_args(LoRAConfig, args, command)
    if command == "finetune":
        lora.validate()
    lr = args.lr
    if lr == "auto":
        if command != "finetune":
            raise InputError(f"--lr auto picks a fine-tuning rate by mode and adapter shape; give {command} a "
                             f"number, e.g. --lr {default_of(TrainConfig, 'lr', 'pretrain'):g}")
        from ..peft import auto_lr

        lr, why = auto_lr(args.mode, lora.rank, lora.rslora, lora.alpha)
        _log(f"--lr auto: {lr:g} ({why})")
    # --device auto was resolved (and logged) by the CLI: keep why, for run.json
    overrides: dict[str, Any] = {"command": command, "lr": lr,
                                 "device_reason": getattr(args, "device_reason", "")}
    if command == "finetune":  # a window is the longest sample; the start is pretrained
        overrides.update(seq_len=data.max_seq_len, check_init_loss=True)
    cfg = from_args(TrainConfig, args, command, **overrides)
    cfg.validate()
    if precision_policy(cfg.dtype).one_process_only and env_world()[1] > 1:
        # the bf16 compute copies exist in the one-process step only; under DDP/FSDP2 the run would be a
        # --dtype bf16 run recorded as bf16-weights (issue 23: same peak memory, same tokens/s)
        raise InputError("--dtype bf16-weights runs on bf16 copies of the weights that only a one-process run "
                         "builds; under torchrun use --dtype bf16 (autocast; FSDP2 all-gathers bf16 copies of the "
                         "fp32 masters) or --dtype bf16-pure (bf16 weights and AdamW state, --mode full)")
    _log(f"dtype: {cfg.dtype} ({cfg.dtype_reason})")
    if cfg.eval_batches_reason:
        _log(cfg.eval_batches_reason)
    return cfg, lora, data


def _check_batch(batch_size: int, n: int, what: str) -> None:
    """A micro-batch larger than the data would repeat samples inside one batch (and --batch-size
    100000 on 11 rows was OOM-killed with no message): refuse before anything is allocated."""
    if batch_size > n:
        raise InputError(f"--batch-size {batch_size} is more than the {n} {what}: every batch would repeat "
                         f"samples. Use --batch-size {max(n, 1)} or less (and --grad-accum N for a larger "
                         f"effective batch), or add data")


def _run_preflight(args: Any, model: torch.nn.Module, tokenizer: Any, seq_len: int,
                   dtype: str) -> dict:
    if args.no_preflight:
        _log("preflight: SKIPPED (--no-preflight)")
        return {"verify": {"skipped": "--no-preflight"}}
    if tokenizer is None:
        _log("preflight: skipped (no tokenizer known for this model to build the probe)")
        return {"verify": {"skipped": "no tokenizer"}}
    try:
        from ..verify import preflight
    except ImportError as e:  # never a silent skip: a broken verify would turn the parity check off unnoticed
        raise GuardError("GUARD-PARITY", f"the preflight cannot run: entrenar.verify does not import "
                         f"({type(e).__name__}: {e}).",
                         remedy="repair the installation (`pip install -e .` in the entrenar checkout) or the "
                                "module named above; --no-preflight skips the check (logged), at your own risk.") from e
    t0 = time.perf_counter()
    # bf16-weights is checked on the kernels' bf16 path
    convert = None
    if dtype == "fp8":  # the float8 swap happens here, checked last against the same float64 reference
        from .fp8 import to_float8

        convert = to_float8
    result = preflight(model, tokenizer, args.device, verify_dtype(dtype), getattr(model, "kernels", "torch"),
                       seq_len=min(64, seq_len), convert=convert)
    worst = max((s["logits_rel_l2"] for s in result.get("sequences", []) if s.get("logits_rel_l2") is not None),
                default=None)
    _log(f"preflight: parity vs float64 reference ok ({len(result.get('sequences', []))} probe sequences, "
         f"worst logits relL2 {worst if worst is None else f'{worst:.2e}'}, {time.perf_counter() - t0:.1f}s)")
    return {"verify": result}


def _run_json(args: Any, command: str, cfg: TrainConfig, model: torch.nn.Module,
              tokenizer: Any) -> dict:
    """run.json: asdict of the three configs plus provenance (what ran, on what, when, from which code)."""
    lora = from_args(LoRAConfig, args, command) if cfg.mode in ("lora", "qlora") else None
    return {"command": command, "argv": sys.argv, "config": cfg.to_dict(), "seed": cfg.seed,
            "lora": None if lora is None else asdict(lora), "data": asdict(from_args(DataConfig, args, command)),
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
    if resume is None and out.is_dir() and any(out.iterdir()):
        _clear_never_trained(out)  # _check_out let it through: it never reached step 1
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
            "end_save_s": result.get("end_save_s"),
            "eval_loss_start": ev[0]["loss"] if ev and ev[0]["step"] == 0 else None,
            "eval_loss_final": ev[-1]["loss"] if ev else None, "tok_s": result["tok_s"],
            "counters": result["counters"], "final": str(out / "final"),
            "early_stop": result.get("early_stop"),  # --early-stop: why the run ended before --steps, and where
            "final_holds_step": result.get("final_step"),  # --keep-best: the step of final/'s weights if not the last
            # GUARD-END-WORSE's and GUARD-TASK-REGRESSION's warnings: a worse end is never a silent ok
            "warnings": result.get("warnings", []) + (result["task"]["warnings"] if "task" in result else []),
            **({"task": result["task"]} if "task" in result else {})}


def _print_summary(s: dict) -> None:
    parts = [f"done: {s['steps']} steps, {s['tokens']} tokens, {s['tok_s']:,.0f} tok/s" if s["tok_s"] else
             f"done: {s['steps']} steps"]
    if s["eval_loss_start"] is not None:
        parts.append(f"eval loss {s['eval_loss_start']:.4f} -> {s['eval_loss_final']:.4f}")
    elif s["eval_loss_final"] is not None:
        parts.append(f"final eval loss {s['eval_loss_final']:.4f}")
    if s.get("early_stop"):
        parts.append(f"stopped early after step {s['early_stop']['step']} (--early-stop)")
    if s.get("final_holds_step") is not None and not s.get("task"):
        parts.append(f"final/ holds step {s['final_holds_step']} (--keep-best eval)")
    _log("; ".join(parts) + f"; model in {s['final']}")
    task = s.get("task") or {}
    for entry in task.get("units", {}).values():  # one line per task / BFCL category: nothing pooled
        if entry.get("line"):
            _log(f"{entry['role']} {entry['line']}")
            for name, ids in (("lost", entry["change"]["lost"]), ("gained", entry["change"]["gained"])):
                if ids:
                    _log(f"  {name}: {', '.join(ids[:20])}" + (f" and {len(ids) - 20} more" if len(ids) > 20 else ""))
    if task.get("units") and "best" in task:
        best, keep = task["best"], task["keep_best"]
        _log(f"best: step {best['step']} (targets {best['targets_passed']}/{best['targets_problems']})"
             + (f"; final/ holds step {task['final_holds_step']}" if task["final_holds_step"] != task["end_step"]
                else "") + ("" if keep["eligible"] else f"; {keep['reason']}"))


def _task_evaluator(cfg: TrainConfig, tokenizer: Any, system: str | None = None) -> Any:
    """The task panel (evaluate/panel.py): the --eval-task targets and --retain-task retained tasks, each built
    before training (evaluate/in_loop.py) so a bad task is exit 2 now; None without either flag."""
    if not cfg.eval_task and not cfg.retain_task:
        return None
    if tokenizer is None:
        raise InputError("--eval-task generates text: it needs the model's tokenizer, and this run has none")
    from ..evaluate.in_loop import make_evaluator
    from ..evaluate.panel import PanelMember, TaskPanel

    if system is not None:
        _log(f"--eval-task: prompts carry the training rows' system prompt ({len(system)} characters)")
    members = [PanelMember(make_evaluator(spec, tokenizer, limit=cfg.eval_task_limit, system=system,
                                          device=cfg.device, max_new_tokens=cfg.eval_task_max_new_tokens,
                                          dtype=cfg.dtype, batch_size="auto",  # slots from free memory (CPU: 8)
                                          flag="--eval-task" if role == "target" else "--retain-task"), role)
               for role, specs in (("target", cfg.eval_task), ("retain", cfg.retain_task)) for spec in specs]
    return TaskPanel(members)


def _sample_generator(cfg: TrainConfig, tokenizer: Any) -> Any:
    """--sample-prompts' generator (train/samples.py), its prompts encoded now: a bad file is exit 2 before the run."""
    if cfg.sample_prompts is None:
        return None
    from .samples import SampleGenerator

    return SampleGenerator(cfg.sample_prompts, tokenizer, chat=cfg.command == "finetune", every=cfg.sample_every,
                           steps=cfg.steps, max_new_tokens=cfg.sample_max_new_tokens, device=cfg.device,
                           dtype=cfg.dtype)


def _rows_system_prompt(path: str, columns: Any = None) -> str | None:
    """The system message every chat row of `path` starts with, when they all share one (the prompt the run
    trains under, which its task eval must use too); else None. `columns`: --columns (data/tabular.py)."""
    from ..data.tabular import ColumnError, iter_rows

    systems = set()
    for _, _, row in iter_rows(path, on_error=lambda lineno, e: None):
        try:
            row = columns.apply(row) if columns is not None else row
        except ColumnError:
            return None
        messages = row.get("messages") if isinstance(row, dict) else None
        first = messages[0] if isinstance(messages, list) and messages and isinstance(messages[0], dict) else {}
        if first.get("role") != "system" or not isinstance(first.get("content"), str):
            return None
        systems.add(first["content"])
        if len(systems) > 1:
            return None
    return systems.pop() if systems else None


def _is_preset(spec: str) -> bool:
    return spec in PRESETS


def _model_config_of(spec: str):
    from ..formats import load_state

    cfg, _, _ = load_state(spec)
    return cfg


# ---- pretrain -------------------------------------------------------------------------------------
def cmd_pretrain(args: Any) -> dict[str, Any]:
    from ..data.corpus import PretrainLoader, read_index
    from ..formats import load_model, resolve_model
    from ..model import CausalLM

    out = Path(args.out)
    cfg, _, _ = _configs(args, "pretrain")
    join_job(cfg.device)  # under torchrun: the process group and this rank's GPU, before anything is built
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
    _check_batch(cfg.batch_size, len(train_loader), f"training windows of --max-seq-len {cfg.seq_len} in {args.data}")
    if eval_loader is None:
        _log(f"note: {args.data} has no val split of more than --max-seq-len {cfg.seq_len} tokens; no eval "
             f"(pack with --val-fraction for one)")

    from ..data.corpus import check_same_tokenizer, check_shards_fit, shard_tokenizer

    shards_tok = shard_tokenizer(args.data, index)  # the tokenizer packed with the shards (issue 13)
    if args.init:
        model = load_model(args.init, dtype=torch.float32, kernels=args.kernels)
        if _is_preset(args.model) and model.cfg.to_hf_dict() != preset(args.model).to_hf_dict():
            _log(f"note: --init {args.init} defines the architecture; preset {args.model} is ignored")
        cfg.check_init_loss = True
        tok_spec, flag = args.init, "--init"
    else:
        if _is_preset(args.model):
            from ..config import preset_for_tokenizer

            tok = shards_tok
            mcfg, note = preset_for_tokenizer(args.model, index["vocab_size"], getattr(tok, "bos_id", None),
                                              index["tokenizer"].get("eos_id"), getattr(tok, "pad_id", None))
            if note:
                _log(f"note: {note}")
        else:
            mcfg = _model_config_of(args.model)
        model = CausalLM.from_scratch(mcfg, cfg.seed, kernels=args.kernels)
        tok_spec, flag = (None, None) if _is_preset(args.model) else (args.model, "--model")
    own_tok = tokenizer_or_none(tok_spec, _log)
    check_same_tokenizer(args.data, shards_tok, own_tok, tok_spec, flag)
    check_shards_fit(args.data, index, model.cfg.vocab_size)
    if cfg.seq_len > model.cfg.max_position_embeddings:  # trained silently, then generate refused (issue 28 item 8)
        raise InputError(f"--max-seq-len {cfg.seq_len} is more than the model's max_position_embeddings "
                         f"{model.cfg.max_position_embeddings} ({args.init or args.model}): windows would train "
                         f"positions the model does not have, and `generate` refuses a longer context. Use "
                         f"--max-seq-len {model.cfg.max_position_embeddings} or less")
    tokenizer = shards_tok or own_tok or tokenizer_or_none((index.get("tokenizer") or {}).get("model"), _log)
    model = model.to(cfg.device).train()
    data_report = {"kind": "pretrain", "shards": str(args.data), "index": {k: v for k, v in index.items()
                                                                          if k != "inputs"},
                   "train_windows": len(train_loader), "val_windows": len(eval_loader) if eval_loader else 0,
                   "seq_len": cfg.seq_len, "loss_tokens_per_window": cfg.seq_len}
    return _run(args, "pretrain", cfg, model, tokenizer, train_loader, eval_loader, data_report, out,
                save_final=_hf_saver(tokenizer), task_eval=_task_evaluator(cfg, tokenizer),
                samples=_sample_generator(cfg, tokenizer))


def _final_saver(write: Callable[[torch.nn.Module, Path], None]) -> Callable[[torch.nn.Module, Path], None]:
    """final/ written by `write(model, tmp)` into a hidden sibling, its manifest last (read-only commands verify
    final/ against it), then swapped in. A failed write (a full disk) is exit 2 naming the path (write_errors) and
    leaves no half final.tmp behind; an earlier final/ stays."""
    def save(model: torch.nn.Module, final: Path) -> None:
        tmp = final.with_name(final.name + ".tmp")
        with write_errors(final, final.parent / "checkpoints"):
            try:
                clear_path(tmp)  # a link planted as final.tmp or final is removed, never written through
                write(model, tmp)
                write_manifest(tmp)
                clear_path(final)
                os.replace(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return save


def _hf_saver(tokenizer: Any) -> Callable[[torch.nn.Module, Path], None]:
    def write(model: torch.nn.Module, tmp: Path) -> None:
        from ..formats import save_hf_dir

        save_hf_dir(model, tmp, tokenizer)
    return _final_saver(write)


def _adapter_saver(tokenizer: Any, base_spec: str) -> Callable[[torch.nn.Module, Path], None]:
    def write(model: torch.nn.Module, tmp: Path) -> None:
        from .model_files import write_checkpoint_files

        write_checkpoint_files(model, tmp, tokenizer, base_spec)  # adapter + generation_config + tokenizer
    return _final_saver(write)


def _resume_command() -> str | None:
    """This command line with `--resume auto` (for the Ctrl-C message), when it is an entrenar one; under
    torchrun the launcher's command (a single process would have another global batch: refused)."""
    argv = sys.argv
    if current().active:
        from .jobwatch import launcher_words

        launch = launcher_words()
    elif argv and Path(argv[0]).name in ("entrenar", "__main__.py"):
        launch = ["entrenar"]
    else:
        return None  # called as a library (tests, notebooks): there is no command line to repeat
    rest, i = [], 1
    while i < len(argv):
        if argv[i] == "--resume":
            i += 2
            continue
        if not argv[i].startswith("--resume="):
            rest.append(argv[i])
        i += 1
    return shlex.join([*launch, *rest, "--resume", "auto"])


def _run(args, command, cfg, model, tokenizer, train_loader, eval_loader, data_report, out, save_final,
         objective=None, task_eval=None, samples=None) -> dict:
    """Everything validated: create the run directory, preflight, train, summarise. Under torchrun
    rank 0 writes the run directory's files and runs the preflight once (its verdict reaches every
    rank); the trainer applies FSDP/DDP and splits the data (train/parallel.py)."""
    ctx = current()
    if cfg.keep_best == "eval" and eval_loader is None:  # before the run directory is made
        raise InputError("--keep-best eval keeps the weights of the lowest eval loss, and this run has no eval set: "
                         "give finetune --val FILE or --val-fraction F > 0 (pretrain: shards packed with a val split), "
                         "or drop --keep-best eval")
    trainers: list = []  # the trainer, once built: its last checkpoint, should a rank of the job die
    try:
        ctx.barrier()  # every rank has checked --out before rank 0 creates it
        if args.resume:  # a resume with nothing left to do is refused before run.json is touched
            check_resume_has_work(out, args.resume, cfg.steps)
        with holding(out, ctx.run_on_main, ctx):  # one writer per run directory (runlock.py), from here to the end
            return _run_locked(args, command, cfg, model, tokenizer, train_loader, eval_loader, data_report, out,
                               save_final, trainers, objective, task_eval, samples)
    except BaseException as e:  # under torchrun a dead peer is named (exit 4), not "Connection reset by peer"
        if current().active:  # from here a stop signal (the launcher's SIGTERM to survivors) is only recorded
            stops.reporting()
        judged = judge_failure(e, getattr(e, "last_checkpoint", trainers[0].last_saved if trainers else None),
                               _resume_command())
        if judged is e:
            raise
        raise judged from e


def _run_locked(args, command, cfg, model, tokenizer, train_loader, eval_loader, data_report, out, save_final,
                trainers: list, objective=None, task_eval=None, samples=None) -> dict:
    ctx = current()
    from .cuda_graphs import resolve_cuda_graphs, varying_shapes
    from .parallel import job_parallel

    kind = job_parallel(model, ctx, cfg.parallel, cfg.mode in ("lora", "qlora"))
    padding_free = bool(getattr(args, "padding_free", False))
    varying = varying_shapes(command, getattr(args, "pad_buckets", 0), padding_free, ctx.world, cfg.dtype)
    if resolve_cuda_graphs(cfg, torch.device(cfg.device), ctx.world, objective.name if objective else "causal-lm",
                           model, varying, kind):  # before run.json
        _log(f"cuda graphs: {cfg.cuda_graphs} ({cfg.cuda_graphs_reason})")
    if padding_free and cfg.cuda_graphs == "on" and hasattr(train_loader, "pad_rows_for_graphs"):
        train_loader.pad_rows_for_graphs()  # a few row lengths, each captured once (the same samples and counts)
        from ..data.sft import GRAPH_ROW_STEPS

        _log(f"--padding-free rows padded to {GRAPH_ROW_STEPS} lengths per doubling of their tokens for the graphs "
             f"(a span of padding of its own, not counted)")
    if ctx.is_main:
        run_json = _run_json(args, command, cfg, model, tokenizer)
        if ctx.active:  # the job's shape (resuming on another world size keeps the global batch)
            run_json["distributed"] = {
                "world_size": ctx.world, "parallel": kind,
                "global_batch": ctx.world * cfg.batch_size * cfg.grad_accum}
            if ctx.nodes > 1:  # torchrun --nnodes: the job's shape across launchers (and HSDP's mesh)
                run_json["distributed"]["nodes"] = ctx.nodes
                if kind == "hsdp":
                    run_json["distributed"]["mesh"] = {"dp_replicate": ctx.nodes, "dp_shard": ctx.local_world}
        _start_run_dir(out, run_json, data_report, args.resume)
    pre = {"verify": {"skipped": "resumed run"}} if args.resume and (out / "preflight.json").exists() else \
        ctx.run_on_main(lambda: _run_preflight(args, model, tokenizer, cfg.seq_len, cfg.dtype))
    from .model_files import checkpoint_files  # every checkpoint is a runnable MODEL (issue 13)

    trainer = build_trainer(model, train_loader, eval_loader, cfg, out, save_final=save_final, log=_log,
                            resume_command=_resume_command(), objective=objective, task_eval=task_eval, samples=samples,
                            checkpoint_files=functools.partial(checkpoint_files, tokenizer=tokenizer,
                                                               base_spec=args.model))
    trainers.append(trainer)
    trainer.begin(args.resume, pre)  # a fresh start: step 0, recorded before its guard judges it
    qa_policy = getattr(cfg, "on_qa_fail", "off") if command == "finetune" and not ctx.active else "off"
    base_qa = qa_gate.qa_report(model, tokenizer, cfg.device, cfg.dtype, _log) \
        if qa_policy != "off" and not args.resume else None
    result = trainer.fit()
    summary = _summary(result, out)
    final_qa = qa_gate.qa_report(model, tokenizer, cfg.device, cfg.dtype, _log) if base_qa is not None else None
    if base_qa is not None and final_qa is not None:  # GUARD-QA: qa on the base and on final/'s weights (qa_gate.py)
        summary["qa"] = {"base_ok": qa_gate.ok_of(base_qa), "final_ok": qa_gate.ok_of(final_qa)}
        found = qa_gate.judge(base_qa, final_qa, qa_policy)
        if found is not None:
            _log(found["message"])
            summary["warnings"].append(found)
    if ctx.is_main:
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


def _rows_kind(objective: str, pack: bool) -> tuple[Any, Any, str]:
    """(load function, loader class, kind) of --objective's rows: SFT rows, or preference pairs."""
    from ..data.preference import PreferenceLoader, load_preference
    from ..data.sft import SFTLoader, load_sft

    if objective == "sft":
        return load_sft, SFTLoader, "sft"
    if objective == "grpo":  # prompt rows; each micro-batch a rollout (train/grpo.py)
        from .grpo import GRPOLoader

        return None, GRPOLoader, "grpo-prompts"
    if pack:
        raise InputError(f"--pack packs SFT samples; --objective {objective} batches pairs (one pair per row, "
                         f"chosen and rejected in one forward): drop --pack")
    return load_preference, PreferenceLoader, "preference"


def resolve_pad_buckets(requested: int | None, max_seq_len: int, kind: str = "sft") -> tuple[int, ...]:
    """The one place finetune's batch length buckets are decided (--pad-buckets; SFTLoader's ``buckets``).

    requested: --pad-buckets as given (None: not given, the default: pad to the longest row). () pads each
    batch to its longest row; else the bucket_lengths of max_seq_len. Preference pairs have no buckets."""
    from ..data.sft import bucket_lengths

    n = 0 if requested is None else requested
    if kind != "sft":
        if n:
            raise InputError(f"--pad-buckets pads SFT batches; preference pairs (--objective dpo|ipo|dpo-norm) are "
                             f"padded to their longest pair: drop --pad-buckets {n}")
        return ()
    try:
        return bucket_lengths(max_seq_len, n)
    except ValueError as e:
        raise InputError(f"--pad-buckets: {e}") from None


def check_padding_free(data: DataConfig, objective: str) -> None:
    """The one place --padding-free is refused (exit 2): it lays an SFT batch's samples end to end in one row."""
    if not data.padding_free:
        return
    if objective != "sft":
        raise InputError(f"--padding-free lays SFT samples end to end; --objective {objective} batches its own rows "
                         f"(pairs or rollouts): drop --padding-free")
    if data.pack:
        raise InputError("--padding-free and --pack both put several samples in a row: --pack fills rows of "
                         "--max-seq-len tokens, --padding-free makes one row of exactly a batch's samples; choose one")
    if data.pad_buckets:
        raise InputError(f"--padding-free batches have no padding to bucket: drop --pad-buckets {data.pad_buckets} "
                         f"(or --padding-free)")


def cmd_finetune(args: Any) -> dict[str, Any]:
    from ..formats import load_model, resolve_model
    from ..tokenizer import load_tokenizer, use_chat_template_file
    from .grpo import build_grpo, check_grpo_run
    from .objective import objective_for

    out = Path(args.out)
    cfg, lora, data = _configs(args, "finetune")
    check_padding_free(data, cfg.objective)  # before the data is read
    load_rows, Loader, kind = _rows_kind(cfg.objective, args.pack)
    if kind == "grpo-prompts":
        load_rows = check_grpo_run(args, cfg)  # prompt rows with room for the completions; no eval split
    buckets = resolve_pad_buckets(data.pad_buckets, data.max_seq_len, kind)
    join_job(cfg.device)  # under torchrun: the process group and this rank's GPU, before anything is built
    _check_out(out, args.resume)
    expected = (f"finetune reads SFT rows (messages, prompt/completion or instruction/output; --columns maps other "
                f"names), or preference rows with --objective dpo|ipo|dpo-norm, from {SOURCES_HELP}")
    columns = parse_columns(data.columns)
    for flag, path in (("--data", args.data), ("--val", args.val)):
        if path and not is_row_source(path):  # say what is there: a directory is not "no such file"
            raise InputError(f"{flag} {path}: {describe_path(path)}; {expected}")
    resolve_model(args.model)
    tokenizer = load_tokenizer(args.model)
    tokenizer.name = args.model  # the data header names the model as given, not its resolved GGUF path
    use_chat_template_file(tokenizer, args.chat_template)  # saved with the model: generate renders chats as trained
    examples, report = load_rows(args.data, tokenizer, args.max_seq_len, truncation=args.truncation,
                                 skip_invalid=args.skip_invalid, columns=columns,
                                 max_skip_fraction=data.max_skip_fraction)
    for line in report.summary_lines():
        _log(line)
    data_report: dict[str, Any] = {"kind": kind, "train": report.to_dict()}
    if args.val:
        val_examples, val_report = load_rows(args.val, tokenizer, args.max_seq_len, truncation=args.truncation,
                                             skip_invalid=args.skip_invalid, max_skip_fraction=data.max_skip_fraction,
                                             columns=columns)
        data_report["val"] = val_report.to_dict()
    else:
        examples, val_examples = _split_val(examples, args.val_fraction, cfg.seed)
        data_report["val"] = {"from": "--val-fraction", "fraction": args.val_fraction,
                              "examples": len(val_examples)}
    if data.mix or cfg.kl_to_base:
        examples, data_report["mix"] = _mixed(examples, data, cfg, kind, lambda path: load_rows(
            path, tokenizer, args.max_seq_len, truncation=args.truncation, skip_invalid=args.skip_invalid,
            max_skip_fraction=data.max_skip_fraction)[0])
    data_report["train_examples"], data_report["val_examples"] = len(examples), len(val_examples)
    _check_batch(cfg.batch_size, len(examples), f"training samples left in {args.data}")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    # how SFT rows become batches (preference loaders take neither: resolve_pad_buckets, check_padding_free)
    batching = {"buckets": buckets} if buckets else {"padding_free": True} if data.padding_free else {}
    if buckets:
        _log(f"--pad-buckets {len(buckets)}: batches padded to one of {', '.join(map(str, buckets))} tokens")
    train_loader = Loader(examples, cfg.batch_size, seed=cfg.seed, pack=args.pack, max_seq_len=args.max_seq_len,
                          pad_id=pad_id, **batching)
    eval_loader = Loader(val_examples, cfg.batch_size, seed=cfg.seed, pack=False, max_seq_len=args.max_seq_len,
                         pad_id=pad_id, **batching) if val_examples else None

    model = load_model(args.model, dtype=torch.float32, kernels=args.kernels)
    if args.mode in ("lora", "qlora"):  # the adapter wraps the model before the optimizer is built
        from ..peft import apply_lora, describe_parameters

        _check_lora_fits(model, lora)
        model = apply_lora(model, args.rank, lora.effective_alpha,
                           dropout=args.dropout, rslora=args.rslora, targets=args.targets,
                           quantize_nf4=args.mode == "qlora", seed=cfg.seed)  # --seed covers the adapter init
        _log(describe_parameters(model))
        save_final = _adapter_saver(tokenizer, args.model)
    else:
        save_final = _hf_saver(tokenizer)
    model = model.to(cfg.device).train()
    objective = objective_for(cfg.objective, cfg.beta, args.mode) if kind != "grpo-prompts" else \
        build_grpo(cfg, tokenizer, train_loader, args.mode, _log)  # preference, grpo: the reference in build_trainer
    if cfg.kl_to_base:  # SFT with a pull to the base on the chosen rows (train/kl_to_base.py)
        from .kl_to_base import SFTWithKL

        objective = SFTWithKL(cfg.kl_to_base, "frozen-copy" if args.mode == "full" else "adapters-off")
    task_eval = _task_evaluator(cfg, tokenizer,
                                _rows_system_prompt(args.data, columns) if cfg.eval_task or cfg.retain_task else None)
    return _run(args, "finetune", cfg, model, tokenizer, train_loader, eval_loader, data_report, out, save_final,
                objective, task_eval, _sample_generator(cfg, tokenizer))


def _mixed(examples: list, data: DataConfig, cfg: TrainConfig, kind: str, load: Any) -> tuple[list, list]:
    """--mix's rows added to the training rows (data/mixing.py), marked for --kl-to-base per --kl-rows."""
    from dataclasses import replace

    from ..data.mixing import mix_examples

    if kind not in ("sft", "grpo-prompts"):  # grpo with --kl-to-base is refused earlier (its --beta is that pull)
        raise InputError("--mix and --kl-to-base apply to SFT rows (--objective sft); --mix also to GRPO's prompts")
    if cfg.kl_to_base and cfg.kl_rows == "mix" and not data.mix:
        raise InputError("--kl-to-base with --kl-rows mix pulls the rows --mix adds: give --mix FILE:FRACTION "
                         "(e.g. `entrenar data replay`'s rows), or --kl-rows all")
    if cfg.kl_to_base and cfg.kl_rows == "all":
        examples = [replace(e, kl=True) for e in examples]
    mixed, report = mix_examples(examples, data.mix, load, cfg.seed, mark_kl=bool(cfg.kl_to_base))
    for r in report:
        _log(f"--mix {r['file']}: {r['rows_added']} rows added ({r['fraction']:g} of the training rows; "
             f"{r['rows_in_file']} in the file)")
    return mixed, report


def _check_lora_fits(model: torch.nn.Module, lora: LoRAConfig) -> None:
    """Refuse a rank above every target layer's smaller dimension (it adds parameters, not capacity;
    --rank 100000 was OOM-killed with no message); warn, naming them, when it exceeds only some layers'
    (Qwen2.5-0.5B's k/v_proj are 896 -> 128, its other targets 896+ wide: --rank 256 is a real recipe there,
    those two adapters simply reach rank 128); warn when the adapters outgrow the model."""
    from ..peft import parse_targets

    wanted = set(parse_targets(lora.targets))
    linears = [(p, m) for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and ".layers." in f".{p}" and p.rsplit(".", 1)[-1] in wanted]
    if not linears:
        return  # unknown targets: apply_lora names the model's linears
    path, widest = max(linears, key=lambda pm: min(pm[1].in_features, pm[1].out_features))
    width = min(widest.in_features, widest.out_features)
    if lora.rank > width:
        raise InputError(f"--rank {lora.rank} is larger than every target layer's smaller dimension (the widest, "
                         f"{path}: in {widest.in_features}, out {widest.out_features}): a rank above min(in, out) "
                         f"adds parameters but no capacity. Use --rank {width} or less")
    capped = sorted({(p.rsplit(".", 1)[-1], min(m.in_features, m.out_features)) for p, m in linears
                     if lora.rank > min(m.in_features, m.out_features)})
    if capped:
        _log(f"warning: --rank {lora.rank} is above the smaller dimension of "
             + ", ".join(f"{name} ({w})" for name, w in capped)
             + ": those adapters train at most that rank (the extra columns add parameters, not capacity)")
    added = sum(lora.rank * (m.in_features + m.out_features) for _, m in linears)
    total = sum(p.numel() for p in model.parameters())
    if added > total:
        _log(f"warning: --rank {lora.rank} trains {added:,} adapter parameters, more than the model's {total:,}; "
             f"full fine-tuning (--mode full) trains fewer")


__all__ = ["cmd_finetune", "cmd_pretrain", "resolve_pad_buckets"]
