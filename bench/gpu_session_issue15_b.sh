#!/usr/bin/env bash
# Issue 15 (session 4), one call on one GPU: the whole table. QLoRA 7B shapes vs bitsandbytes + PEFT at the peer's
# settings (batch 2 x 2048, full checkpointing) with our kernel-class profile, the same with the LoRA update as
# separate ops (the A/B of e9a5d8b, same call), and ours at batch 1 without
# checkpointing; then the real CLI (qwen2.5-0.5b and llama-370m at --dtype bf16 / bf16-weights / bf16-pure) vs
# transformers + Liger in both precisions, and Trainer-step profiles (ms per kernel class, device idle).
# Run from a checkout: DATA=dir holding qwen_shards/ and scratch_370m/; liger-kernel, bitsandbytes, peft importable.
set -u
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-issue15-b}
DATA=${DATA:-.gpu}
BENCH=$(dirname "$0")
mkdir -p "$OUT/qlora" "$OUT/cli"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 220 $PY "$BENCH/qlora_throughput.py" --steps 6 --warmup 2 --profile --out "$OUT/qlora" --tag b2-full 2>&1 \
  | grep -v '^{' | tail -12
timeout 80 $PY "$BENCH/qlora_throughput.py" --sides entrenar --lora-unfused --steps 6 --warmup 2 --profile \
  --out "$OUT/qlora" --tag b2-full-unfused 2>&1 | grep -v '^{' | tail -5
timeout 90 $PY "$BENCH/qlora_throughput.py" --sides entrenar --batch 1 --checkpointing none --steps 6 --warmup 2 \
  --out "$OUT/qlora" --tag b1-none 2>&1 | grep -v '^{' | tail -6
timeout 330 $PY "$BENCH/cli_throughput.py" --qwen-data "$DATA/qwen_shards" --llama-data "$DATA/scratch_370m" \
  --steps 20 --warmup 5 --peer-steps 8 --skip bench-profile --out "$OUT/cli" 2>&1 | grep -v '^{' | tail -24
