#!/usr/bin/env bash
# The retention recipe on the GPU machine in one call, after the model's pieces arrived (../shared/device/README.md):
#   bash bench/retention_gpu.sh NAME SECONDS ARGS   join /tmp/carry/NAME/p* (sha256 checked), install .whl into
#                                                   /tmp/site, run bench.task_proof toolcall ARGS on it within SECONDS,
#                                                   then copy the summary, the per-problem files and logs to $OUT
#                                                   (also when the time ran out: what finished is kept)
set -uo pipefail
name=$1; seconds=$2; shift 2
export PYTHONPATH=src:.:/tmp/site PYTHONUNBUFFERED=1
source bench/gpu_model.sh "$name"
work=/tmp/work-retention
timeout "$seconds" python3 -m bench.task_proof toolcall --model "$model" --work "$work" "$@" 2>&1 | tee /tmp/retention.log \
  | grep -v "^step [0-9]*/" | tail -n 60
cp /tmp/retention.log "$work/log.txt" 2>/dev/null
cp "$work/summary.json" "$OUT/retention-summary.json" 2>/dev/null
tar czf "$OUT/retention-results.tgz" -C "$work" --exclude=rows.jsonl --exclude=checkpoints --exclude='*.safetensors' \
  --exclude='*.bin' --exclude='*.pt' . 2>/dev/null
ls -la "$OUT"
