#!/usr/bin/env bash
# One device call on a 4-GPU machine (issues 12, 13, 17): llama-370m from scratch on GPU 3 (issue 13)
# while the 1- and 2-GPU scaling rows run on GPUs 0-1; then the 4-GPU rows and qwen2.5-coder-7b on 4.
#   bash bench/gpu_session_x4.sh        (needs .gpu/scratch_370m: the 32k tokenizer's shards)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/entrenar-gpu-session}
RES=/tmp/entrenar-gpu-results
mkdir -p "$OUT" "$RES/s12" "$RES/s4" "$RES/p370"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
git log -1 --format='commit %H' 2>/dev/null || true
$PYTHON -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
(CUDA_VISIBLE_DEVICES=3 RESULTS=$RES/p370 bash bench/pretrain_370m.sh .gpu/scratch_370m "${STEPS_370M:-300}" \
   > "$RES/p370.log" 2>&1; echo "pretrain_370m rc=$?" >> "$RES/p370.log") &
CUDA_VISIBLE_DEVICES=0,1 OUT=$RES/s12 $PYTHON bench/distributed_scaling.py --gpus 1,2 --big-gpus 0 \
  --budget "${BUDGET12:-250}" > "$RES/s12.log" 2>&1
wait
OUT=$RES/s4 $PYTHON bench/distributed_scaling.py --gpus 4 --big-gpus 4 --budget "${BUDGET4:-150}" \
  > "$RES/s4.log" 2>&1
echo "=== 370m from scratch ==="; tail -40 "$RES/p370.log"
echo "=== scaling 1,2 ==="; tail -20 "$RES/s12.log"
echo "=== scaling 4 + 7B ==="; tail -20 "$RES/s4.log"
cp "$RES/p370/curves.png" "$OUT/" 2>/dev/null
tar czf "$OUT/gpu_session.tgz" -C "$RES" .
