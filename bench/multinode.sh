#!/usr/bin/env bash
# Issue 37 part 5, the GPU measurement in one device call on a 4-GPU host (H100/H200): two torchrun launchers
# of 2 GPUs each (CUDA_VISIBLE_DEVICES 0,1 and 2,3, --nnodes 2, c10d rendezvous on 127.0.0.1) with
# --parallel hsdp (and ddp) against one launcher of 4 GPUs (FSDP2, DDP), qwen2.5-0.5b shapes, bf16, batch 8 x
# 2048 per GPU; per-GPU tokens/s from each run's metrics.jsonl and the NCCL collectives' ms/step from
# --profile (bench/multinode.py says what each row is).
#
#   OUT=/path bash bench/multinode.sh                    # the four qwen2.5-0.5b rows (~5 min, BUDGET_S=450 at most)
#   WITH_7B=1 OUT=/path bash bench/multinode.sh          # + qwen2.5-coder-7b hsdp-2x2 and fsdp-1x4 (not in 8 min)
#   SMALL=1 OUT=/tmp/mn bash bench/multinode.sh          # CPU dry run (tiny preset, gloo)
#
# Into $OUT: multinode.json (rows: commands, exit codes, tok/s, per-GPU tok/s, collectives), multinode.md (the
# table), multinode.log (this script's output), gpus.csv, logs/ (every launcher's stdout/stderr and each run's
# profile.json). Scratch (shards, run directories) in $WORK, not $OUT. Needs nothing but this checkout (src on
# PYTHONPATH) and the image's torch; NCCL's NVLink multicast stays off.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/multinode_out}
WORK=${WORK:-/tmp/multinode_work}
mkdir -p "$OUT" || exit 2
ARGS=(--out "$OUT" --work "$WORK")
if [ "${WITH_7B:-0}" = 1 ]; then
  ARGS+=(--models qwen2.5-0.5b,qwen2.5-coder-7b --budget-s "${BUDGET_S:-1100}" --row-timeout-s 300)
else
  ARGS+=(--budget-s "${BUDGET_S:-450}")
fi
[ "${SMALL:-0}" = 1 ] && ARGS+=(--small)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$OUT/gpus.csv"
"$PY" -m bench.multinode "${ARGS[@]}" 2>&1 | tee "$OUT/multinode.log"
exit "${PIPESTATUS[0]}"
