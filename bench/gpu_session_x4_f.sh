#!/usr/bin/env bash
# Issue 17 (session 4): what closes llama-370m's 81.6% at 4 GPUs under DDP. One call on 4 GPUs: the 1-GPU row
# once, then the 4-GPU row per variant (DDP options, NCCL protocol, Python GC off), then qwen2.5-0.5b at 1 and 4
# GPUs with the default and the candidate settings. ~25-35 s per row.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session-f}
BOTH='{"bucket_cap_mb": 100, "gradient_as_bucket_view": true}'
row() {  # name, env, gpus, only, ddp-kw
  mkdir -p "$OUT/$1"; echo "### $1: env [$2] gpus $3 ddp $5"
  env $2 OUT=$OUT/$1 $PY bench/distributed_scaling.py --gpus "$3" --big-gpus 0 --only "$4" --ddp-kw "$5" \
    --budget 120 2>&1 | grep -v '^{' | grep -E "^\| (llama|qwen)"
}
row llama-default   "X=1"                 1,4 llama '{}'
row llama-view      "X=1"                 4 llama '{"gradient_as_bucket_view": true}'
row llama-b100      "X=1"                 4 llama '{"bucket_cap_mb": 100}'
row llama-both      "X=1"                 4 llama "$BOTH"
row llama-simple    "NCCL_PROTO=Simple"   4 llama '{}'
row llama-simple-both "NCCL_PROTO=Simple" 4 llama "$BOTH"
row llama-gc-off    "BENCH_GC=off"        4 llama '{}'
row llama-static-both "X=1"               4 llama '{"bucket_cap_mb": 100, "gradient_as_bucket_view": true, "static_graph": true}'
row llama-gc-both   "BENCH_GC=off"        4 llama "$BOTH"
row qwen-default    "X=1"                 1,4 qwen2.5-0.5b '{}'
row qwen-both       "X=1"                 4 qwen2.5-0.5b "$BOTH"
row qwen-simple-both "NCCL_PROTO=Simple"  4 qwen2.5-0.5b "$BOTH"
