#!/usr/bin/env bash
# Issue 17, call 2 on 4 GPUs: qwen2.5-coder-7b (FSDP2, fp32 master, bf16 compute, activation checkpointing)
# on 4 GPUs at batch 2 x 2048 per GPU writes its sharded checkpoint of step 3 through the CLI and runs to
# step 6; the same job resumes that checkpoint on 2 GPUs at batch 4 per GPU (same global batch 8).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session-d}
mkdir -p "$OUT/resume" "$OUT/prof"
df -h /tmp | tail -1
OUT=$OUT/resume timeout 580 $PY bench/distributed_scaling.py --gpus 4 --big-gpus 0 --only coder --big-batch 2 \
  --resume-test 4,2 --budget 560 --work /tmp/resume-work 2>&1 | grep -v '^{"name"' | tail -12
ls -la /tmp/resume-work/resume-qwen2.5-coder-7b/checkpoints/* 2>&1 | head -5
rm -rf /tmp/resume-work
