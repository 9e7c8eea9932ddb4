#!/usr/bin/env bash
# Issue 17 (session 4, third call): llama-370m at 4 GPUs with the CLI's defaults, repeated (the spread between
# runs of one setting was +-4% in call g), against 1 GPU before and after; then torchrun's NUMA binding of each
# worker to the CPUs near its GPU, and fewer NCCL channels (less SM contention with the backward's matmuls).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session-h}
$PY -m torch.distributed.run --help | grep -c numa-binding
nvidia-smi topo -m | head -8
row() {  # name, env, gpus
  mkdir -p "$OUT/$1"; echo "### $1: env [$2] gpus $3"
  env $2 OUT=$OUT/$1 $PY bench/distributed_scaling.py --steps 30 --gpus "$3" --big-gpus 0 --only llama \
    --budget 150 2>&1 | grep -v '^{' | grep -E "^\| (llama|qwen)"
}
row a "X=1" 1,4
row b "X=1" 4
row numa1 "BENCH_TORCHRUN_EXTRA=--numa-binding=node" 4
row c "X=1" 4
row numa2 "BENCH_TORCHRUN_EXTRA=--numa-binding=node" 4
row ch8 "NCCL_MAX_NCHANNELS=8" 4
row numa1gpu "BENCH_TORCHRUN_EXTRA=--numa-binding=node" 1,4
row d "X=1" 1
