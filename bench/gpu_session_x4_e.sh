#!/usr/bin/env bash
# Issue 17, next call on 4 GPUs (prepared in session 3, not run yet): what closes llama-370m's 81.6% at 4 GPUs
# under DDP. The 1- and 4-GPU rows once per DDP variant (same machine, same call): default (25 MB buckets, copies
# into buckets), gradients as bucket views, 100 MB buckets, both. ~25 s per row.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session-e}
i=0
for kw in '{}' '{"gradient_as_bucket_view": true}' '{"bucket_cap_mb": 100}' \
          '{"bucket_cap_mb": 100, "gradient_as_bucket_view": true}'; do
  i=$((i + 1)); mkdir -p "$OUT/v$i"; echo "### DDP options $kw"
  OUT=$OUT/v$i $PY bench/distributed_scaling.py --gpus 1,4 --big-gpus 0 --only llama --ddp-kw "$kw" \
    --budget 110 2>&1 | grep -v '^{' | grep "llama"
done
