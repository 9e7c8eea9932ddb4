"""entrenar's rows: the real CLI (`python -m entrenar pretrain ... --json`, under torchrun for several GPUs) on
random weights of a preset's shapes and random-token shards of its vocabulary; tokens/s, MFU and peak memory
read from the run directory's metrics.jsonl (median of the steps after the scenario's warm-up).

Nothing of the CLI is patched: what it does in a real run (random init on the CPU, the final/ save) is in
the wall time, outside the measured steps. `--no-preflight` skips the step-0 parity check (minutes at 7B;
the preflight's own cost is not what these rows measure).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.rows import REPO

GIB_MB = 1024


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


def stop_job(proc: subprocess.Popen, grace_s: float = 30.0) -> str:
    """A job past its time: SIGTERM (the CLI and torchrun stop cleanly on it), then SIGKILL to whatever is
    left after `grace_s` (0: SIGKILL at once); an orphaned worker would keep its GPU memory and make every
    later row run out of it."""
    workers = _descendants(proc.pid)
    err = ""
    if grace_s > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            err = ""
    for pid in [proc.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone: what we wanted
    _, rest = proc.communicate()  # what the job wrote until it died (all of stderr when there was no grace)
    return err or rest or ""


STOPPED = "stopped once measured"  # run_command's code when `done` said the job had given what was wanted


def run_command(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None,
                done: Callable[[], bool] | None = None, poll_s: float = 1.0) -> tuple[Any, str, str]:
    """(exit code -- or "timeout after N s", or STOPPED --, stdout, stderr) of `cmd`, stopped with its workers at
    the timeout, or killed at once when `done()` (asked every `poll_s`) turns true: a 7B speed row need not wait
    minutes for the end-of-run checkpoint it does not measure."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=env or child_env())
    deadline = time.monotonic() + timeout_s
    while True:
        wait = deadline - time.monotonic() if done is None else min(poll_s, deadline - time.monotonic())
        try:
            out, err = proc.communicate(timeout=max(wait, 0.01))  # a retry after TimeoutExpired loses no output
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                return f"timeout after {timeout_s:.0f} s", "", stop_job(proc)
            if done is not None and done():
                return STOPPED, "", stop_job(proc, grace_s=0)


def child_env(**extra: str) -> dict[str, str]:
    """This checkout's src first on the path; NVLink multicast off (NCCL NVLS fails on the lent hosts)."""
    return {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1", **extra}


def write_shards(out: Path, vocab: int, tokens: int, seed: int = 0) -> Path:
    """Random token ids in [0, vocab) in entrenar's shard format (data/corpus.py): index.json,
    train-00000.bin, train.docs.bin (one document); no val split, so the CLI runs no eval."""
    from entrenar.data.corpus import FORMAT
    from entrenar.fileio import sha256_file

    if (out / "index.json").is_file() and json.loads((out / "index.json").read_text())["tokens"] >= tokens:
        return out
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


def arch_dir(out: Path, preset_name: str, max_position_embeddings: int | None = None,
             num_layers: int | None = None) -> Path:
    """An HF directory of `preset_name`'s architecture with a longer max_position_embeddings (the preset's
    32k would make `pretrain --seq-len 131072` exit 2) and/or fewer blocks (the 7B widths on one GPU):
    `pretrain --model DIR` takes its architecture and draws random weights as for the preset; the stored
    weights (zeros, bf16) are never trained."""
    import dataclasses

    import torch

    from entrenar.config import preset
    from entrenar.formats.hf import expected_shapes, save_hf

    if (out / "config.json").is_file():
        return out
    cfg = preset(preset_name)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max_position_embeddings or cfg.max_position_embeddings,
                              num_layers=num_layers or cfg.num_layers)
    state = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in expected_shapes(cfg).items()}
    save_hf(cfg, state, out)
    return out


def cli_command(sc: Any, data: Path, run: Path, device: str, model: str) -> list[str]:
    """The exact command of a CLI row (torchrun's launcher in front for several GPUs)."""
    cli = ["-m", "entrenar", "pretrain", "--model", model, "--data", str(data), "--out", str(run),
           "--steps", str(sc.steps), "--batch-size", str(sc.batch), "--seq-len", str(sc.seq), "--device", device,
           "--lr", "3e-4", "--warmup", "2", "--keep", "1", "--no-preflight", "--json",
           *([] if sc.dtype == "auto" else ["--dtype", sc.dtype]), *sc.flags]
    if sc.gpus == 1:
        return [sys.executable, *cli]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(sc.gpus), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *cli]


def summarize_metrics(records: list[dict[str, Any]], warmup: int, tokens_per_step: int, gpus: int) -> dict[str, Any]:
    """The row's numbers from metrics.jsonl: median tok_s of the steps after `warmup` (all steps when the
    run had no more), MFU's median where the CLI reports it, peak = the largest mem_mb."""
    records = [r for r in records if not r.get("profiled")] or records  # --profile's steps run slower
    later = [r for r in records if r["step"] > warmup] or records
    tok = [r["tok_s"] for r in later if r.get("tok_s")]
    mfu = [r["mfu"] for r in later if r.get("mfu") is not None]
    mem = [r["mem_mb"] for r in records if r.get("mem_mb")]
    median = statistics.median(tok) if tok else None
    return {"tokens_per_s": median, "tokens_per_s_per_gpu": median / gpus if median else None,
            "seconds_per_step": tokens_per_step / median if median else None,
            "mfu": statistics.median(mfu) if mfu else None, "peak_gib": max(mem) / GIB_MB if mem else None,
            "extra": {"steps_measured": len(later), "tok_s_min": min(tok, default=None),
                      "tok_s_max": max(tok, default=None), "loss_first": records[0]["loss"] if records else None,
                      "loss_last": records[-1]["loss"] if records else None}}


def _summary_line(out: str) -> dict[str, Any]:
    """The CLI's --json summary (its last JSON line on stdout), {} when there is none."""
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}


def failure_reason(code: Any, out: str, err: str) -> str:
    """The CLI's own error (its --json line) where it printed one, else the ranks' error lines."""
    obj = _summary_line(out)
    if obj.get("ok") is False:
        return f"exit {code}: {obj.get('error', obj)}"
    causes = [ln for ln in err.splitlines() if ("Error" in ln or "error:" in ln or "out of memory" in ln)
              and "ChildFailedError" not in ln and "elastic" not in ln and not ln.startswith("[W")]
    tail = causes[-3:] or [ln for ln in err.splitlines() if ln.strip()][-4:]
    return f"exit {code}: " + " | ".join(tail)[-800:]


def _measured(metrics: Path, run: Path, sc: Any) -> Callable[[], bool]:
    """True once metrics.jsonl holds step sc.steps (and --profile's profile.json is written, if asked)."""
    def done() -> bool:
        if "--profile" in sc.flags and not (run / "profile.json").is_file():
            return False
        try:
            lines = metrics.read_text().splitlines()
            return any(json.loads(ln).get("step") == sc.steps for ln in lines if ln.strip())
        except (OSError, json.JSONDecodeError):
            return False  # not there yet, or a line being written
    return done


def run_cli(sc: Any, ctx: Any) -> list[dict[str, Any]]:
    """One CLI row of scenario `sc` (ctx: suite.Context)."""
    from entrenar.config import preset

    if not ctx.smoke and ctx.device == "cpu":  # real shapes on a CPU would only run into the timeout
        return [ctx.row(sc, status="skipped", reason="no CUDA GPU here (--smoke runs tiny shapes on the CPU)")]
    if sc.gpus > max(ctx.gpus, 1) and not ctx.smoke:
        return [ctx.row(sc, status="skipped", reason=f"needs {sc.gpus} GPUs, this machine has {ctx.gpus}")]
    vocab = preset(sc.model).vocab_size
    tokens = int(1.25 * (sc.steps * sc.batch * sc.gpus * sc.seq)) + sc.seq + 1
    data = write_shards(ctx.work / f"shards-{vocab}-{tokens}", vocab, tokens)
    model = sc.model
    if "max_position_embeddings" in sc.params or "num_layers" in sc.params:
        mpe, layers = sc.params.get("max_position_embeddings"), sc.params.get("num_layers")
        model = str(arch_dir(ctx.work / f"arch-{sc.model}-{mpe}-{layers}", sc.model, mpe, layers))
    run = ctx.work / f"run-{sc.name}"
    shutil.rmtree(run, ignore_errors=True)  # an earlier round's (--repeat): the CLI starts a run in a new folder
    cmd = cli_command(sc, data, run, ctx.device, model)
    t0 = time.perf_counter()
    metrics = run / "metrics.jsonl"
    code, out, err = run_command(cmd, sc.timeout_s,
                                 done=_measured(metrics, run, sc) if sc.params.get("stop_after_steps") else None)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.is_file() else []
    values: dict[str, Any] = {"command": shlex.join(cmd), "wall_s": wall, "steps": sc.steps, "warmup": sc.warmup}
    if records:
        values.update(summarize_metrics(records, sc.warmup, sc.batch * sc.seq * sc.gpus, sc.gpus))
    run_json = run / "run.json"
    if run_json.is_file():
        config = json.loads(run_json.read_text()).get("config", {})
        values.setdefault("extra", {}).update({"dtype_run": config.get("dtype"),
                                               "dtype_reason": config.get("dtype_reason"),
                                               "cuda_graphs": config.get("cuda_graphs"),
                                               "cuda_graphs_reason": config.get("cuda_graphs_reason")})
    graph_lines = [ln.strip() for ln in err.splitlines() if "cuda graphs:" in ln]
    if graph_lines:  # what the step's capture did (captured shapes, a failed capture)
        values.setdefault("extra", {})["cuda_graphs_log"] = graph_lines[:8]
    end_lines = [ln.strip() for ln in err.splitlines() if "end of run:" in ln]
    if end_lines:  # where the end-of-run seconds went (checkpoint snapshot, final/, the background write)
        values.setdefault("extra", {})["end_log"] = end_lines[-1]
    summary = _summary_line(out)
    if summary.get("end_save_s") is not None:  # the end-of-run checkpoint + final/ (after the measured steps)
        values.setdefault("extra", {})["end_save_s"] = summary["end_save_s"]
    if (run / "profile.json").is_file():  # --profile in the scenario's flags: where the step goes
        values.setdefault("extra", {})["profile"] = json.loads((run / "profile.json").read_text())
    if not os.environ.get("BENCH_KEEP_WORK"):  # a 7B row leaves ~100 GB of checkpoint and final/ behind
        for written in ("checkpoints", "final"):
            shutil.rmtree(run / written, ignore_errors=True)
    if code == STOPPED:
        values.setdefault("extra", {})["stopped"] = (f"killed once its {sc.steps} steps were logged: the end-of-run "
                                                     f"checkpoint and final/ were not written or timed")
    if (code == 0 or code == STOPPED) and records:
        values["status"] = "ok"
    else:
        values["status"], values["reason"] = "failed", failure_reason(code, out, err) if code != 0 else \
            "exit 0 but no metrics.jsonl rows"
        if records and records[-1]["step"] >= sc.steps:  # the numbers stand; what came after the steps did not end
            values["reason"] = f"all {sc.steps} steps logged, then: {values['reason']}"
    return [ctx.row(sc, **values)]
