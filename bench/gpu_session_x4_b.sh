#!/usr/bin/env bash
# Second 4-GPU call: NCCL bandwidth (is the interconnect the 2-GPU limit?), 370m at 2 GPUs under DDP
# vs FSDP, the 4-GPU rows, and qwen2.5-coder-7b on 2 of the GPUs (issue 12's sharding case).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session-b}
mkdir -p "$OUT/ddp" "$OUT/s4" "$OUT/b2"
nvidia-smi topo -m 2>&1 | head -8
# (NCCL bandwidth measured in the first run of this script: 2 GPUs 324 GB/s all-reduce bus, 4 GPUs 354)
CUDA_VISIBLE_DEVICES=0,1 OUT=$OUT/ddp $PY bench/distributed_scaling.py --gpus 2 --big-gpus 0 --only llama \
  --cli-extra "--parallel ddp" --budget 120 2>&1 | tail -12
OUT=$OUT/s4 $PY bench/distributed_scaling.py --gpus 4 --big-gpus 0 --budget 200 2>&1 | tail -12
CUDA_VISIBLE_DEVICES=0,1 OUT=$OUT/b2 $PY bench/distributed_scaling.py --gpus 2 --big-gpus 2 --only coder \
  --budget 230 2>&1 | tail -12
