#!/usr/bin/env bash
# Issue 15 on one GPU, one call: the fused add + RMSNorm parity/timing (gpu_checks), long-context peak memory
# at 8k/32k/128k vs transformers + Liger (goal 5), and the real CLI's tok/s vs Liger (goals 1-3).
# Run from a checkout: DATA=dir holding qwen_shards/ and scratch_370m/; liger-kernel installed or on PYTHONPATH.
set -u
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-issue15}
DATA=${DATA:-.gpu}
mkdir -p "$OUT/norm" "$OUT/long" "$OUT/cli"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 100 $PY bench/gpu_checks.py --add-rms-norm-only --out "$OUT/norm" 2>&1 | tail -14
timeout 210 $PY bench/long_context_memory.py --out "$OUT/long" --lengths 8192,32768,131072 --budget-s 190 2>&1 \
  | tail -16
timeout 280 $PY bench/cli_throughput.py --qwen-data "$DATA/qwen_shards" --llama-data "$DATA/scratch_370m" \
  --steps 25 --warmup 5 --peer-steps 10 --skip profile --out "$OUT/cli" 2>&1 | grep -v '^{' | tail -16
