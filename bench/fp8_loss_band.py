"""Issue 25.2's loss band: `pretrain --dtype fp8` against `--dtype bf16-pure` on the same data, seed and steps,
through the real CLI (the preflight on: its fp8 pass is part of what is measured), one GPU.

    PYTHONPATH=src python bench/fp8_loss_band.py --data SHARDS --model qwen2.5-0.5b --steps 300 --out DIR

Writes DIR/{bf16-pure,fp8}/ (run directories) and prints one JSON line: per dtype the median tokens/s after
step 5, the preflight's logits relL2, the mean train loss of the first and last 50 steps; the band is the
largest |loss_fp8 - loss_bf16| / loss_bf16 over windows of 25 steps after the first 50 (the claim: <= 3%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

BAND = 0.03  # the stated band: fp8's windowed train loss within 3% of bf16-pure's after the first 50 steps
WINDOW = 25


def run(dtype: str, args: argparse.Namespace) -> dict:
    out = Path(args.out) / dtype
    cmd = [sys.executable, "-m", "entrenar", "pretrain", "--model", args.model, "--data", args.data,
           "--out", str(out), "--steps", str(args.steps), "--batch-size", str(args.batch), "--seq-len",
           str(args.seq), "--device", "cuda", "--dtype", dtype, "--lr", "6e-4", "--warmup", "30", "--seed", "0",
           "--eval-every", "0", "--save-every", "0", "--keep", "1", "--json"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0:
        return {"dtype": dtype, "ok": False, "exit": proc.returncode, "last": last[-800:], "stderr": proc.stderr[-1500:]}
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [m for m in metrics if "loss" in m and "step" in m]
    pre = json.loads((out / "preflight.json").read_text()).get("verify", {})
    return {"dtype": dtype, "ok": True, "losses": [m["loss"] for m in steps],
            "tokens_per_s": statistics.median(m["tok_s"] for m in steps[5:] if m.get("tok_s")),
            "peak_gib": max((m.get("mem_mb") or 0) for m in steps) / 1024,
            "preflight_dtype": pre.get("dtype"),
            "preflight_logits_rel_l2": max((s["logits_rel_l2"] for s in pre.get("sequences", [])), default=None),
            "command": " ".join(cmd)}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = {d: run(d, args) for d in ("bf16-pure", "fp8")}
    summary: dict = {"model": args.model, "steps": args.steps, "batch": args.batch, "seq": args.seq}
    if all(r["ok"] for r in rows.values()):
        a, b = rows["bf16-pure"]["losses"], rows["fp8"]["losses"]
        n = min(len(a), len(b))
        gaps = [abs(statistics.mean(b[i:i + WINDOW]) - statistics.mean(a[i:i + WINDOW])) / statistics.mean(a[i:i + WINDOW])
                for i in range(50, n - WINDOW + 1, WINDOW)]
        summary.update(band=max(gaps) if gaps else None, band_claim=BAND,
                       within_band=bool(gaps) and max(gaps) <= BAND,
                       speedup=rows["fp8"]["tokens_per_s"] / rows["bf16-pure"]["tokens_per_s"])
        for r in rows.values():
            ls = r.pop("losses")
            r.update(loss_first50=statistics.mean(ls[:50]), loss_last50=statistics.mean(ls[-50:]),
                     loss_every25=[round(statistics.mean(ls[i:i + WINDOW]), 4) for i in range(0, len(ls), WINDOW)])
    summary["rows"] = rows
    print(json.dumps(summary))
    return 0 if summary.get("within_band") else 1


if __name__ == "__main__":
    raise SystemExit(main())
