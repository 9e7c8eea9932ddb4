#!/usr/bin/env bash
# Issue 23 on a 4-GPU host, one call: (1) the GPU default through the real CLI on one GPU: no --dtype (auto)
# next to --dtype bf16 and --dtype fp32 (the old default), Qwen2.5-0.5B batch 8 x 2048; (2) the 7B preset's
# full shapes on one GPU with the Triton kernels: the bf16 preflight's two passes clean, and each seeded defect
# named (bench/parity/seeded_7b.py); (3) the 7B preset under torchrun on 4 GPUs without --no-preflight.
# DATA=.gpu holds qwen_shards/ (packed here with the Qwen2.5 tokenizer).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=src NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/i23}
DATA=${DATA:-.gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
summ() {  # median tok_s after step 5, peak GiB, dtype and why
  python3 - "$1" <<'PY'
import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
cfg = json.loads((run / "run.json").read_text())["config"]
tok = statistics.median(r["tok_s"] for r in rows[5:])
print(json.dumps({"run": run.name, "dtype": cfg["dtype"], "why": cfg["dtype_reason"], "steps": len(rows),
                  "tok_s_median": round(tok), "mfu_median": statistics.median(r.get("mfu") or 0 for r in rows[5:]),
                  "peak_gib": round(max(r["mem_mb"] for r in rows) / 1024, 2)}))
PY
}
PART=${PART:-all}
if [ "$PART" != 7b ]; then
for d in auto bf16 fp32; do
  flag=(); [ "$d" = auto ] || flag=(--dtype "$d")
  steps=25; [ "$d" = fp32 ] && steps=12
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m entrenar pretrain --model qwen2.5-0.5b --data "$DATA/qwen_shards" \
    --out "$OUT/q05-$d" --device cuda --seq-len 2048 --batch-size 8 --steps $steps --eval-batches 1 \
    "${flag[@]}" 2>&1 | grep -E "^dtype:|preflight|error|Error" | head -5
  summ "$OUT/q05-$d" | tee -a "$OUT/cli_dtype.jsonl"
done
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 bench/parity/seeded_7b.py --out "$OUT/seeded_7b.json" 2>&1 | cut -c1-400 | tail -12
fi
[ "$PART" = cli ] && exit 0
timeout 420 torchrun --nproc_per_node 4 -m entrenar pretrain --model qwen2.5-coder-7b --data "$DATA/qwen_shards" \
  --out "$OUT/7b" --device cuda --seq-len 2048 --batch-size 2 --steps 8 --eval-batches 1 --json 2>&1 \
  | grep -E "^dtype:|preflight|GUARD|error|step [0-9]+/|^\{" | tail -16
python3 -c "import json;print(json.dumps(json.load(open('$OUT/7b/preflight.json'))['verify'].get('sequences'))[:1500])"
