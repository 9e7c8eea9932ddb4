#!/usr/bin/env bash
# Issue 17, call 1 on 4 GPUs: the scaling table at 1, 2, 4 GPUs under --parallel auto (DDP for these small
# models since 79ac186), the 4-GPU rows under --parallel fsdp for comparison, and qwen2.5-coder-7b full
# fine-tuning on 4 GPUs (FSDP2, activation checkpointing) at batch 8 x 2048 per GPU.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session-c}
mkdir -p "$OUT/auto" "$OUT/fsdp"
git log --oneline 2>/dev/null | head -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
OUT=$OUT/auto $PY bench/distributed_scaling.py --gpus 1,2,4 --big-gpus 4 --big-batch 8 --budget 330 \
  --big-reserve 120 2>&1 | grep -v '^{' | tail -14
OUT=$OUT/fsdp $PY bench/distributed_scaling.py --gpus 4 --big-gpus 0 --cli-extra "--parallel fsdp" \
  --budget 90 2>&1 | grep -v '^{' | tail -6
