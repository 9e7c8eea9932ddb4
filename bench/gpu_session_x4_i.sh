#!/usr/bin/env bash
# Issue 17 (session 4, last call): the scaling rows at the session's final code (DDP options, scheduled GC, RoPE
# frequencies built once: no stream sync in the forward), llama-370m 4-GPU row twice. 30 steps a row.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session-i}
row() {  # name, gpus, only
  mkdir -p "$OUT/$1"; echo "### $1: gpus $2"
  OUT=$OUT/$1 $PY bench/distributed_scaling.py --steps 30 --gpus "$2" --big-gpus 0 --only "$3" --budget 110 2>&1 \
    | grep -v '^{' | grep -E "^\| (llama|qwen)"
}
row llama 1,4 llama
row llama-again 4 llama
row qwen 1,4 qwen2.5-0.5b
