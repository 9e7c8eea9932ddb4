#!/usr/bin/env bash
# Issue 17 (session 4, second call): the CLI's new DDP defaults (parallel.DDP_OPTIONS: 100 MB buckets, gradients as
# bucket views, static graph without accumulation) and scheduled garbage collection (loop.GC_EVERY) against the
# old ones, interleaved and repeated on one machine, 30 steps a row (median of 27). Then the 1/2/4-GPU table.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session-g}
OLD_KW='{"bucket_cap_mb": 25, "gradient_as_bucket_view": false, "static_graph": false}'
row() {  # name, env, gpus, only, ddp-kw
  mkdir -p "$OUT/$1"; echo "### $1: env [$2] gpus $3 ddp $5"
  env $2 OUT=$OUT/$1 $PY bench/distributed_scaling.py --steps 30 --gpus "$3" --big-gpus 0 --only "$4" \
    --ddp-kw "$5" --budget 150 2>&1 | grep -v '^{' | grep -E "^\| (llama|qwen)"
}
row llama-new       "X=1"          1,2,4 llama ''
row llama-old       "BENCH_GC=auto" 4 llama "$OLD_KW"
row llama-new2      "X=1"          4 llama ''
row llama-old2      "BENCH_GC=auto" 4 llama "$OLD_KW"
row llama-nostatic  "X=1"          4 llama '{"static_graph": false}'
row llama-gcauto    "BENCH_GC=auto" 4 llama ''
row llama-new3      "X=1"          1,4 llama ''
row qwen-new        "X=1"          1,2,4 qwen2.5-0.5b ''
row qwen-old        "BENCH_GC=auto" 4 qwen2.5-0.5b "$OLD_KW"
