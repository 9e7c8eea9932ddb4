#!/usr/bin/env bash
# From-scratch pretraining on one GPU (issue 13): llama-370m with the 32,000-token byte-level BPE
# that `entrenar tokenizer train` learned on the whole lib/python3.11 tree, on shards of the
# standard library packed with it (the shard directory carries the tokenizer: nothing else needed).
#
#   PYTHONPATH=src bash bench/pretrain_370m.sh [SHARDS_DIR] [STEPS]
#
# SHARDS_DIR defaults to bench/data/scratch_370m/shards (copy /work/scratch_370m/shards there);
# STEPS defaults to 300 at batch 8 x 2048 (16,384 tokens a step). Then `entrenar plot` and
# `entrenar generate --model <final dir>` and `--model <checkpoint dir>`, and a table of the numbers.
# Artifacts (curves.png, metrics/eval JSONL, run.json, preflight.json, samples) go to $RESULTS
# (default: $OUT when the device tool sets it, else bench/results/pretrain_370m).
set -euo pipefail
SHARDS=${1:-bench/data/scratch_370m/shards}
STEPS=${2:-300}
RUN=${RUN:-/tmp/entrenar-pretrain-370m}
RESULTS=${RESULTS:-${OUT:-bench/results/pretrain_370m}}
PY=${PYTHON:-python}
# a CPU smoke test of this script: DEVICE=cpu MODEL=tiny BATCH=2 SEQ=64 DTYPE=fp32 bash bench/pretrain_370m.sh DIR 3
DEVICE=${DEVICE:-cuda}; MODEL=${MODEL:-llama-370m}; BATCH=${BATCH:-8}; SEQ=${SEQ:-2048}; DTYPE=${DTYPE:-bf16}
export PYTHONPATH=${PYTHONPATH:-src}

if [ ! -f "$SHARDS/index.json" ] || [ ! -f "$SHARDS/tokenizer.json" ]; then
  echo "no shards with their tokenizer at $SHARDS (copy /work/scratch_370m/shards there)" >&2
  exit 2
fi
mkdir -p "$RESULTS"
rm -rf "$RUN"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

t0=$(date +%s)
$PY -m entrenar pretrain --model "$MODEL" --data "$SHARDS" --out "$RUN" --steps "$STEPS" \
  --batch-size "$BATCH" --seq-len "$SEQ" --device "$DEVICE" --dtype "$DTYPE" --lr 1e-3 --warmup 30 \
  --eval-every 100 --eval-batches 8 --save-every 0 --keep 1 2>&1 | tee "$RESULTS/pretrain.log"
t1=$(date +%s)

$PY -m entrenar plot "$RUN" --out "$RESULTS/curves.png"
CKPT=$(ls -d "$RUN"/checkpoints/step-* | sort | tail -1)
PROMPT='def fibonacci(n):
    """Return the n-th Fibonacci number."""
'
$PY -m entrenar generate --model "$RUN/final" --prompt "$PROMPT" --max-new-tokens 96 --device "$DEVICE" \
  --json > "$RESULTS/generate_final.json"
$PY -m entrenar generate --model "$CKPT" --prompt "import os" --max-new-tokens 64 --device "$DEVICE" \
  --json > "$RESULTS/generate_checkpoint.json"
cp "$RUN"/metrics.jsonl "$RUN"/eval.jsonl "$RUN"/run.json "$RUN"/preflight.json "$RESULTS"/
ls "$RUN/final" "$CKPT" > "$RESULTS/dirs.txt"

$PY - "$RUN" "$RESULTS" "$((t1 - t0))" "$CKPT" "$MODEL" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

run, results, wall, ckpt, model = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines() if line.strip()]
cfg = json.loads((run / "final" / "config.json").read_text())
steady = rows[5:] or rows  # the first steps include Triton autotuning and allocator warm-up
tok_s = statistics.median(r["tok_s"] for r in steady)
mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
params = json.loads((run / "run.json").read_text())["model"]["parameters"]


def last_json(path: Path) -> dict:
    return json.loads(path.read_text().strip().splitlines()[-1])


gen_final, gen_ckpt = last_json(results / "generate_final.json"), last_json(results / "generate_checkpoint.json")
table = [
    ("model", f"{model}, vocab {cfg['vocab_size']}, {params:,} parameters, eos_token_id {cfg['eos_token_id']}"),
    ("steps, tokens", f"{len(rows)} steps, {rows[-1]['tokens']:,} tokens"),
    ("train loss", f"step 1 {rows[0]['loss']:.4f} -> last-10 mean {statistics.mean(r['loss'] for r in rows[-10:]):.4f}"),
    ("eval loss", " -> ".join(f"{e['step']}: {e['loss']:.4f}" for e in evals)),
    ("tokens/s (median, steps 6+)", f"{tok_s:,.0f}"),
    ("MFU (median)", f"{100 * statistics.median(mfu):.1f}%" if mfu else "n/a"),
    ("peak memory", f"{max(r['mem_mb'] for r in rows) / 1024:.1f} GiB"),
    ("wall (pretrain command)", f"{wall} s"),
    ("generate --model final/", repr(gen_final.get("text", gen_final))[:300]),
    (f"generate --model {Path(ckpt).name}", repr(gen_ckpt.get("text", gen_ckpt))[:300]),
]
width = max(len(k) for k, _ in table)
print("\n| what | value |\n|---|---|")
for k, v in table:
    print(f"| {k:<{width}} | {v} |")
(results / "summary.json").write_text(json.dumps(dict(table), indent=2) + "\n")
EOF
