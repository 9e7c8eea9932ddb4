"""--cuda-graphs on vs off through the real CLI on one GPU: the loss trajectories, the final weights and the
tokens/s of each. Not bit for bit on a GPU: the eager step itself is not (attention's backward accumulates in a
nondeterministic order; two eager bf16-pure runs already differ at step 2), and AdamW turns a 1e-3 gradient
difference into a different update of the elements whose gradient is near zero. A pair passes when every step's
loss is within 1e-4 relative (measured <= 1e-5 on an H200, session 13); bench/cuda_graph_grads.py compares one
step's gradients against the eager step's own spread.

    PYTHONPATH=src python bench/cuda_graph_check.py --out /tmp/cg [--layers 4] [--steps 10]

One JSON line per case (graphs on/off pair) and a summary line; exit 1 when a pair is apart or a run failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.cli_run import arch_dir, child_env, write_shards

CASES = {  # name -> extra CLI flags (the pair runs them with --cuda-graphs off and on)
    "bf16": [],
    "bf16-pure": ["--dtype", "bf16-pure"],
    "bf16-ckpt-accum2": ["--activation-checkpointing", "--grad-accum", "2"],
    "fp32": ["--dtype", "fp32"],
}


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted((run / "final").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def one_run(model: str, data: Path, run: Path, steps: int, batch: int, seq: int, flags: list[str]) -> dict:
    cmd = [sys.executable, "-m", "entrenar", "pretrain", "--model", model, "--data", str(data), "--out", str(run),
           "--steps", str(steps), "--batch-size", str(batch), "--seq-len", str(seq), "--lr", "3e-4", "--warmup", "2",
           "--keep", "1", "--no-preflight", "--seed", "1", *flags]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env=child_env(), timeout=600)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run / "metrics.jsonl").is_file() else []
    rows = [r for r in rows if "loss" in r and "step" in r]
    graph_lines = [ln for ln in p.stderr.splitlines() if "cuda graphs" in ln]
    return {"code": p.returncode, "wall_s": round(time.perf_counter() - t0, 1), "rows": rows,
            "graph_log": graph_lines[:4], "err_tail": p.stderr.strip().splitlines()[-3:] if p.returncode else []}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    from entrenar.config import preset

    a.out.mkdir(parents=True, exist_ok=True)
    model = str(arch_dir(a.out / f"arch-{a.preset}-{a.layers}", a.preset, None, a.layers))
    tokens = 3 * a.steps * a.batch * a.seq + a.seq + 1
    data = write_shards(a.out / "shards", preset(a.preset).vocab_size, tokens)
    bad = 0
    for name in a.cases.split(","):
        res = {}
        for graphs in ("off", "on"):
            res[graphs] = one_run(model, data, a.out / f"{name}-{graphs}", a.steps, a.batch, a.seq,
                                  [*CASES[name], "--cuda-graphs", graphs])
        off, on = res["off"], res["on"]
        row = {"case": name, "codes": [off["code"], on["code"]], "graph_log": on["graph_log"],
               "err": off["err_tail"] + on["err_tail"]}
        if off["code"] == 0 and on["code"] == 0:
            lo = [(r["loss"], r["grad_norm"]) for r in off["rows"]]
            ln = [(r["loss"], r["grad_norm"]) for r in on["rows"]]
            wo, wn = final_weights(a.out / f"{name}-off"), final_weights(a.out / f"{name}-on")
            diff = max((float((wo[k].float() - wn[k].float()).abs().max()) for k in wo), default=float("nan"))
            rel = max((float((wo[k].double() - wn[k].double()).norm() / wo[k].double().norm().clamp_min(1e-30))
                       for k in wo), default=float("nan"))
            first_diff = next((i + 1 for i, (x, y) in enumerate(zip(lo, ln)) if x != y), None)
            tok = {g: statistics.median([r["tok_s"] for r in res[g]["rows"][3:]] or [0]) for g in res}
            row.update(steps=len(lo), identical_steps=lo == ln, first_differing_step=first_diff,
                       weights_max_abs_diff=diff, weights_max_rel_l2=rel, same_tensors=sorted(wo) == sorted(wn),
                       tok_s_off=round(tok["off"]), tok_s_on=round(tok["on"]),
                       speedup=round(tok["on"] / tok["off"], 3) if tok["off"] else None,
                       loss_off=lo[-1][0] if lo else None, loss_on=ln[-1][0] if ln else None,
                       mem_mb_off=max(r.get("mem_mb") or 0 for r in off["rows"]),
                       mem_mb_on=max(r.get("mem_mb") or 0 for r in on["rows"]))
            row["max_step_loss_rel_diff"] = max((abs(x[0] - y[0]) / abs(x[0]) for x, y in zip(lo, ln)), default=None)
            bad += not (len(lo) == len(ln) == a.steps and row["max_step_loss_rel_diff"] <= 1e-4)
        else:
            bad += 1
        print(json.dumps(row), flush=True)
    print(json.dumps({"summary": True, "pairs_differing_or_failed": bad, "device": torch.cuda.get_device_name()
                      if torch.cuda.is_available() else "cpu"}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
