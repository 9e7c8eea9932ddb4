#!/usr/bin/env bash
# Issue 35 on the GPU machine, one device call per step (see ../shared/device/README.md for the pieces):
#   bash bench/issue35_gpu.sh piece NAME          copy .carry/NAME/p* (and NAME.sha256 where carried) that travelled
#                                                 with this call to /tmp/carry
#   bash bench/issue35_gpu.sh toolcall NAME ARGS  join NAME's pieces, then bench.task_proof toolcall ARGS on it
#   bash bench/issue35_gpu.sh humaneval NAME ARGS likewise, bench.task_proof humaneval
#   bash bench/issue35_gpu.sh bg TAG WHAT NAME ARGS  the step WHAT detached, from a copy of this tree in /tmp (it outlives
#                                                 the call while the machine stays warm); its results go to /tmp/out-TAG
#   bash bench/issue35_gpu.sh collect             copy every /tmp/out-*/ (the detached steps' results) to $OUT
#   bash bench/issue35_gpu.sh wait SECONDS        wait until every detached step has ended or SECONDS have passed,
#                                                 then collect (the call keeps the machine warm meanwhile)
# Seen in session 12: steps detached in short calls outlived them, but the two still running when a 505-s `wait`
# call ended were gone at the next call (their logs simply stop). Give `wait` enough seconds for every step.
# Results go to $OUT as TAG-summary.json, TAG-results.tgz (per-problem files, logs) and TAG-adapter.tgz (TAG: env, default
# the step's name), so several steps fit in one call.
set -euo pipefail
what=$1; name=$2; shift 2
export PYTHONPATH=src:. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ "$what" = piece ]; then
  mkdir -p /tmp/carry/$name && cp .carry/$name/p* /tmp/carry/$name/ && ls -la /tmp/carry/$name
  [ -f .carry/$name.sha256 ] && cp .carry/$name.sha256 /tmp/carry/  # for steps launched from later calls
  exit 0
fi
if [ "$what" = collect ]; then
  for d in /tmp/out-*/; do [ -d "$d" ] && cp "$d"* "$OUT/" 2>/dev/null; done; ls -la "$OUT"; tail -n 3 /tmp/bg-*.log; exit 0
fi
if [ "$what" = wait ]; then  # NAME here is the most seconds to wait
  end=$((SECONDS + name))
  while [ $SECONDS -lt $end ]; do
    alive=0; for f in /tmp/bg-*.pid; do [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 5
  done
  for f in /tmp/bg-*.pid; do t=${f#/tmp/bg-}; kill -0 "$(cat "$f")" 2>/dev/null && echo "${t%.pid}: running" || echo "${t%.pid}: ended"; done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  exec bash "$0" collect -
fi
if [ "$what" = bg ]; then  # NAME here is the tag; the step and its model follow
  tag=$name; rm -rf /tmp/repo-$tag && mkdir -p /tmp/repo-$tag /tmp/out-$tag && cp -r . /tmp/repo-$tag/
  cd /tmp/repo-$tag && OUT=/tmp/out-$tag TAG=$tag setsid nohup bash bench/issue35_gpu.sh "$@" >/tmp/bg-$tag.log 2>&1 </dev/null &
  echo $! > /tmp/bg-$tag.pid; sleep 2; cat /tmp/bg-$tag.log; exit 0
fi
source bench/gpu_model.sh "$name"
export PYTHONPATH=$PYTHONPATH:/tmp/site
tag=${TAG:-$what}
work=/tmp/work-$tag-$name
python3 -m bench.task_proof "$what" --model "$model" --work "$work" "$@" 2>&1 | tee "$work.log" | grep -v "^step [0-9]*/" || true
cp "$work.log" "$work/log.txt" 2>/dev/null || true
cp "$work/summary.json" "$OUT/$tag-summary.json" 2>/dev/null || true
# the per-problem files, logs and the run's small files (no weights); the adapter on its own: 3 files per step
tar czf "$OUT/$tag-results.tgz" -C "$work" --exclude=rows.jsonl --exclude='code_*.jsonl' --exclude=checkpoints \
  --exclude='*.safetensors' --exclude='*.bin' . || true
if [ -f "$work/run/final/adapter_model.safetensors" ]; then  # files come back in pieces of at most 16 MiB
  tar czf "$work/adapter.tgz" -C "$work/run" final && split -b 15000000 -d "$work/adapter.tgz" "$OUT/$tag-adapter.tgz."
fi
ls -la "$OUT"
