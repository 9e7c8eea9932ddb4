"""Issue 37 part 5: two "nodes" on one 4-GPU host. Per-GPU tokens/s of the real CLI (`pretrain`, random weights
of a preset's shapes, random-token shards) for:

  hsdp-2x2  two torchrun launchers (CUDA_VISIBLE_DEVICES 0,1 and 2,3; --nnodes 2, c10d rendezvous on
            127.0.0.1) with --parallel hsdp: sharded inside a launcher, replicated across the two
  ddp-2x2   the same two launchers with --parallel ddp (every gradient crosses between them)
  fsdp-1x4  one launcher of 4 GPUs, --parallel fsdp (FSDP2 over a flat mesh)
  ddp-1x4   one launcher of 4 GPUs, --parallel ddp

and, from `--profile` (two steps profiled on rank 0, excluded from the tok/s median), the milliseconds per
step of each NCCL collective kind: under HSDP the AllReduce is the cross-"node" one (the shard of the
gradients between replicas), the ReduceScatter / AllGather stay inside a launcher.

    PYTHONPATH=src python -m bench.multinode --out $OUT                # the GPU run (bench/multinode.sh)
    PYTHONPATH=src python -m bench.multinode --out /tmp/mn --small     # CPU dry run: tiny preset, gloo

Writes OUT/multinode.json (one row per model x layout: its commands, exit codes, tok/s, per-GPU tok/s, the
collectives) and OUT/multinode.md (the table). Every row runs under a timeout and never past --budget-s in
all, so a hang still leaves the rows before it. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cli_run import free_port, stop_job, summarize_metrics, write_shards
from bench.rows import REPO


@dataclass(frozen=True)
class Layout:
    name: str
    nodes: int  # torchrun launchers
    per_node: int  # processes (GPUs) per launcher
    parallel: str


LAYOUTS = (Layout("hsdp-2x2", 2, 2, "hsdp"), Layout("ddp-2x2", 2, 2, "ddp"), Layout("fsdp-1x4", 1, 4, "fsdp"),
           Layout("ddp-1x4", 1, 4, "ddp"))
# NCCL kernel names (ncclDevKernel_AllReduce_Sum_f32_RING_LL, ...; on the CPU, where profile.json lists
# operators, gloo's c10d::allreduce_ / _reduce_scatter_base_ / _allgather_base_) -> the collective's kind
COLLECTIVES = {"all_reduce": "allreduce", "reduce_scatter": "reducescatter", "all_gather": "allgather"}


def launcher_commands(layout: Layout, cli: list[str], port: int, device: str,
                      python: str = sys.executable) -> list[tuple[list[str], dict[str, str]]]:
    """(command, extra environment) of each launcher of `layout` running `cli` (entrenar's arguments): one
    torchrun per node, node i on GPUs [i*per_node, (i+1)*per_node) with a c10d rendezvous on 127.0.0.1:port."""
    run = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(layout.per_node)]
    if layout.nodes == 1:
        return [([*run, "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "entrenar", *cli], {})]
    out = []
    for i in range(layout.nodes):
        gpus = ",".join(str(g) for g in range(i * layout.per_node, (i + 1) * layout.per_node))
        env = {"CUDA_VISIBLE_DEVICES": gpus} if device == "cuda" else {}
        out.append(([*run, "--nnodes", str(layout.nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     f"127.0.0.1:{port}", "--rdzv-id", f"multinode-{port}", "--rdzv-conf", "join_timeout=120",
                     "-m", "entrenar", *cli], env))
    return out


def collectives_ms(profile: dict[str, Any]) -> dict[str, float]:
    """Milliseconds per step of each collective kind, from profile.json's top kernels (rank 0's view; on the
    CPU the c10d operators' own time)."""
    out = dict.fromkeys(COLLECTIVES, 0.0)
    for name, ms in profile.get("top_kernels_ms", []):
        key = name.lower().replace("_", "")
        for kind, needle in COLLECTIVES.items():
            if ("nccl" in key or key.startswith("c10d::")) and needle in key:
                out[kind] += float(ms)
    return {k: round(v, 3) for k, v in out.items()}


def summarize_run(run: Path, warmup: int, tokens_per_step: int, gpus: int) -> dict[str, Any]:
    """The row's numbers from a run directory (what exists of it: a run cut by its timeout still has its steps)."""
    metrics = run / "metrics.jsonl"
    records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()] if metrics.is_file() else []
    row: dict[str, Any] = {"steps_logged": len(records)}
    if records:
        row.update(summarize_metrics(records, warmup, tokens_per_step, gpus))
    if (run / "profile.json").is_file():
        profile = json.loads((run / "profile.json").read_text())
        row["collectives_ms_per_step"] = collectives_ms(profile)
        row["communication_ms_per_step"] = profile.get("communication_ms_per_step")
        row["wall_ms_per_step_profiled"] = profile.get("wall_ms_per_step")
    if (run / "run.json").is_file():
        row["distributed"] = json.loads((run / "run.json").read_text()).get("distributed")
    return row


def nccl_transports(logs: list[Path]) -> dict[str, int]:
    """How NCCL connected the ranks (NCCL_DEBUG=INFO lines "Channel ... via P2P/CUMEM", "via SHM/direct/direct",
    "via NET/Socket"): two launchers on one host see disjoint CUDA_VISIBLE_DEVICES, so their link is not the
    in-launcher one; this says which it was. NCCL writes them to stdout: pass each launcher's .out (and .err)."""
    found: collections.Counter = collections.Counter()
    for log in logs:
        if log.is_file():
            found.update(m.group(1) for m in re.finditer(r"Channel \S+ : .* via (\S+)", log.read_text(errors="replace")))
    return dict(found)


def run_layout(layout: Layout, cli: list[str], device: str, timeout_s: float, logs: Path) -> list[Any]:
    """Start every launcher of `layout` together; their exit codes ("timeout" for one stopped at timeout_s)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1", "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
    procs = []
    for i, (cmd, extra) in enumerate(launcher_commands(layout, cli, free_port(), device)):
        with open(f"{logs}-node{i}.out", "w") as out, open(f"{logs}-node{i}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, env={**env, **extra}))
    deadline = time.monotonic() + timeout_s
    codes: list[Any] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            stop_job(p)
            codes.append("timeout")
    return codes


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | layout | exit | tok/s per GPU | AllReduce ms/step | ReduceScatter ms/step | AllGather ms/step |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.get("collectives_ms_per_step") or {}
        per_gpu = r.get("tokens_per_s_per_gpu")
        lines.append(f"| {r['model']} | {r['layout']} | {r['exit']} | "
                     f"{'' if per_gpu is None else f'{per_gpu:,.0f}'} | {c.get('all_reduce', '')} | "
                     f"{c.get('reduce_scatter', '')} | {c.get('all_gather', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, required=True, help="multinode.json, multinode.md, logs/ (launchers' "
                    "output, each run's profile.json)")
    ap.add_argument("--work", type=Path, default=None, help="scratch: shards, run directories (OUT/work)")
    ap.add_argument("--models", default="qwen2.5-0.5b", help="comma-separated presets (qwen2.5-coder-7b: FSDP/HSDP "
                    "only, DDP's 20 B per parameter do not fit)")
    ap.add_argument("--layouts", default=",".join(x.name for x in LAYOUTS))
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of the tok/s median")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--budget-s", type=float, default=450, help="all rows end by then")
    ap.add_argument("--row-timeout-s", type=float, default=150)
    ap.add_argument("--small", action="store_true", help="CPU dry run: the tiny preset, gloo, seq 64")
    a = ap.parse_args(argv)
    device = "cpu" if a.small else "cuda"
    if a.small:
        a.models, a.batch, a.seq, a.steps, a.warmup = "tiny", 2, 64, 6, 2
    t0 = time.monotonic()
    work, logs = a.work or a.out / "work", a.out / "logs"
    work.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    layouts = [x for x in LAYOUTS if x.name in a.layouts.split(",")]
    rows: list[dict[str, Any]] = []
    from entrenar.config import preset

    for model in a.models.split(","):
        vocab = preset(model).vocab_size
        tokens = int(1.25 * a.steps * a.batch * 4 * a.seq) + a.seq + 1
        data = write_shards(work / f"shards-{vocab}-{tokens}", vocab, tokens)
        for layout in layouts:
            if model.endswith("7b") and layout.parallel == "ddp":
                continue  # 20 B per parameter of a 7B model on one 80-140 GB card: DDP cannot hold it
            left = a.budget_s - (time.monotonic() - t0)
            if left < 30:
                rows.append({"model": model, "layout": layout.name, "exit": "skipped (budget spent)"})
                continue
            run = work / f"run-{model}-{layout.name}"
            cli = ["pretrain", "--model", model, "--data", str(data), "--out", str(run), "--steps", str(a.steps),
                   "--batch-size", str(a.batch), "--seq-len", str(a.seq), "--device", device, "--lr", "3e-4",
                   "--warmup", "2", "--keep", "1", "--no-preflight", "--json", "--parallel", layout.parallel,
                   "--profile", f"{a.steps - 2}:2", *(["--dtype", "bf16"] if device == "cuda" else [])]
            if model.endswith("7b"):
                cli += ["--activation-checkpointing", "--batch-size", "2"]
            started = time.monotonic()
            codes = run_layout(layout, cli, device, min(a.row_timeout_s, left), logs / f"{model}-{layout.name}")
            if (run / "profile.json").is_file():
                (logs / f"{model}-{layout.name}-profile.json").write_text((run / "profile.json").read_text())
            gpus = layout.nodes * layout.per_node
            batch = 2 if model.endswith("7b") else a.batch
            row = {"model": model, "layout": layout.name, "exit": codes, "wall_s": round(time.monotonic() - started, 1),
                   "nccl_transports": nccl_transports(sorted(logs.glob(f"{model}-{layout.name}-node*.*"))),
                   "commands": [shlex.join(c) + (f"  # {e}" if e else "")
                                for c, e in launcher_commands(layout, cli, 0, device)],
                   **summarize_run(run, a.warmup, batch * a.seq * gpus, gpus)}
            rows.append(row)
            print(json.dumps({k: row.get(k) for k in ("model", "layout", "exit", "wall_s", "tokens_per_s_per_gpu",
                                                      "collectives_ms_per_step")}), flush=True)
            (a.out / "multinode.json").write_text(json.dumps(rows, indent=2) + "\n")
    (a.out / "multinode.json").write_text(json.dumps(rows, indent=2) + "\n")
    (a.out / "multinode.md").write_text(table(rows))
    print(table(rows))
    return 0 if rows and all(r["exit"] in ([0], [0, 0]) for r in rows if isinstance(r["exit"], list)) else 1


if __name__ == "__main__":
    sys.exit(main())
