#!/usr/bin/env bash
# The fine-tune against its peers on the GPU machine (one H200), as detached steps that outlive the calls carrying
# the next model's pieces (../shared/device/README.md; bench/issue35_gpu.sh piece NAME, wait SECONDS, collect):
#   bash bench/peers_gpu.sh setup                  install .whl into /tmp/site and .whl-u (Unsloth and its pins:
#                                                  (.carry/*.sha256 kept in /tmp/carry for the detached steps)
#                                                  trl <= 1.15, datasets < 5) into /tmp/site_u; print the versions
#   bash bench/peers_gpu.sh step SECONDS           the standing step goals' control rows: transformers + Liger,
#                                                  the CLI default and --dtype bf16-pure on Qwen2.5-0.5B shapes
#                                                  (python -m bench run), Liger again after
#   bash bench/peers_gpu.sh sft NAME SECONDS       bench/sft_peers.py on NAME (ROWS=a,b: those rows) (the README recipe's rows made by
#                                                  --make-rows): TRL, TRL + Liger, Unsloth, entrenar (with its
#                                                  in-loop eval of 200 BFCL questions, timed), TRL after; then the
#                                                  BFCL + HumanEval evals of each result
#   bash bench/peers_gpu.sh grpo NAME SECONDS      bench/grpo_peers.py on NAME: TRL's GRPOTrainer, ours, TRL after
#   bash bench/peers_gpu.sh speed NAME SECONDS     the engine through the CLI on NAME (bench/panel_gpu.sh speed
#                                                  with the model's own chat template, the kernel only)
#   bash bench/peers_gpu.sh profile NAME SECONDS   the README recipe's step (the sft stage's rows) profiled, padded
#                                                  and --padding-free: 40 steps each, --profile 30:3
#   bash bench/peers_gpu.sh padfree-graphs NAME SECONDS  the recipe's calls (no replay), --padding-free with the
#                                                  step in CUDA graphs (auto) and eager (off): STEPS (250) each
#   bash bench/peers_gpu.sh panel STAGE NAME SECONDS  bench/panel_gpu.sh STAGE on NAME in /tmp/panel-NAME (its env:
#                                                  ONLY, TEMPLATE, SFT_STEPS, GRPO_*)
#   bash bench/peers_gpu.sh bg TAG STAGE ARGS      STAGE detached from a copy of this tree, after the detached steps
#                                                  already running have ended (one GPU job at a time; AFTER="TAG ...":
#                                                  after those only, so two chains share the GPU); its results go
#                                                  to /tmp/out-TAG (bench/issue35_gpu.sh collect brings them to $OUT)
# DRY=1: sft and grpo on the CPU with --tiny (checks the script, not the numbers).
set -uo pipefail
stage=$1; shift
export PYTHONPATH=src:.:/tmp/site PYTHONUNBUFFERED=1
root=${WORK:-/tmp/peers}
mkdir -p "$root" "$OUT"

install() {  # install DIR TARGET: the wheels of DIR into TARGET once
  [ -d "$1" ] && [ ! -d "$2" ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2.tmp" "$1"/*.whl \
    && mv "$2.tmp" "$2"
}

case $stage in
setup)
  install .whl /tmp/site; install .whl-u /tmp/site_u
  mkdir -p /tmp/carry && cp .carry/*.sha256 /tmp/carry/ 2>/dev/null  # bench/gpu_model.sh finds them there later
  python3 -m pip show torch transformers peft pyarrow fsspec huggingface_hub accelerate 2>/dev/null | grep -E '^(Name|Version)'
  python3 -c "import trl, datasets, liger_kernel; print('trl', trl.__version__, 'datasets', datasets.__version__)"
  PYTHONPATH=/tmp/site_u:$PYTHONPATH python3 -c "import unsloth; print('unsloth', unsloth.__version__)" 2>&1 | tail -3
  ;;
step)
  python3 -m bench run q05-liger-bf16 q05-cli-default q05-cli-bf16-pure --budget-s $(($1 - 20)) --out "$root/step" \
    2>&1 | tail -n 25
  tar czf "$OUT/step-results.tgz" -C "$root" step
  ;;
sft)
  name=$1; seconds=$2
  if [ "${DRY:-0}" = 1 ]; then
    args=(--tiny); rows=trl,unsloth,entrenar,trl-after
  else
    source bench/gpu_model.sh "$name"
    args=(--model "$model" --make-rows --humaneval); rows=${ROWS:-trl,trl-liger,unsloth,entrenar,trl-after}
  fi
  in_loop=(--entrenar-flag=--eval-task=bfcl:simple_python,multiple --entrenar-flag=--eval-task-limit=100)
  for f in ${SFT_FLAGS:-}; do in_loop+=("--entrenar-flag=$f"); done  # SFT_FLAGS="--padding-free": ours with them
  t0=$SECONDS  # two thirds of SECONDS for the training rows, the rest for the evals
  timeout $((seconds * 2 / 3)) python3 -m bench.sft_peers "${args[@]}" --rows "$rows" --no-eval \
    --unsloth-site /tmp/site_u "${in_loop[@]}" --out "$root/sft" 2>&1 | tail -n 30
  timeout $((seconds - (SECONDS - t0) - 15)) python3 -m bench.sft_peers "${args[@]}" --eval-only --out "$root/sft" 2>&1 \
    | tail -n 12
  grep -h '"seconds"' "$root/sft/entrenar/metrics.jsonl" | head -6
  tar czf "$OUT/sft-results.tgz" -C "$root" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude=checkpoints --exclude=hf-model --exclude=trainer sft
  ;;
grpo)
  name=$1; seconds=$2
  if [ "${DRY:-0}" = 1 ]; then
    args=(--tiny)
  else
    source bench/gpu_model.sh "$name"
    [ -f "$root/sft/rows/calls.jsonl" ] || { echo "no rows: run the sft stage first"; exit 1; }
    args=(--model "$model" --data "$root/sft/rows/calls.jsonl")
  fi
  timeout $((seconds - 10)) python3 -m bench.grpo_peers "${args[@]}" ${GRPO_ARGS:-} --out "$root/grpo" 2>&1 | tail -n 25
  tar czf "$OUT/grpo-results.tgz" -C "$root" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude=checkpoints --exclude=trainer grpo
  ;;
profile)  # the README recipe's step profiled, padded and padding-free, on the rows the sft stage made
  name=$1; seconds=$2; rows=$root/sft/rows
  source bench/gpu_model.sh "$name"
  [ -f "$rows/calls.jsonl" ] || { echo "no rows: run the sft stage first"; exit 1; }
  for v in padded padding-free; do
    extra=(); [ "$v" = padding-free ] && extra=(--padding-free)
    rm -rf "$root/profile-$v"
    timeout $((seconds / 2 - 5)) python3 -m entrenar finetune --model "$model" --data "$rows/calls.jsonl" \
      --mix "$rows/replay.jsonl:0.3" --chat-template chatml_tools --mode lora --rank 16 --lr 3e-4 --steps 40 \
      --batch-size 16 --max-seq-len 4096 --profile 30:3 --device cuda --out "$root/profile-$v" \
      "${extra[@]}" > "$root/profile-$v.log" 2>&1
    echo "== $v: exit $?"; grep -E "^done:" "$root/profile-$v.log"
    python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(json.dumps(d, indent=None)[:3000])" \
      "$root/profile-$v/profile.json"
  done 2>&1 | tee "$OUT/profile-summary.txt"
  tar czf "$OUT/profile-results.tgz" -C "$root" --exclude='*.safetensors' --exclude=checkpoints --exclude=final \
    profile-padded profile-padding-free profile-padded.log profile-padding-free.log
  ;;
padfree-graphs)  # --padding-free with the step in CUDA graphs (auto: rows padded to a few lengths) against eager
  name=$1; seconds=$2; rows=$root/pf-calls.jsonl
  source bench/gpu_model.sh "$name"
  python3 -m entrenar data sft-from-bfcl --irrelevance --swapped-no-call 650 --swapped-matched --out "$rows" \
    --overwrite 2>&1 | tail -n 1 | cut -c1-200
  for g in ${GRAPHS:-auto off}; do
    rm -rf "$root/pf-$g"
    timeout $((seconds / 2 - 10)) python3 -m entrenar finetune --model "$model" --data "$rows" --chat-template \
      chatml_tools --mode lora --rank 16 --lr 3e-4 --steps "${STEPS:-250}" --batch-size 16 --max-seq-len 4096 \
      --padding-free --cuda-graphs "$g" --no-preflight --on-qa-fail off --device cuda --out "$root/pf-$g" \
      > "$root/pf-$g.log" 2>&1
    echo "== --cuda-graphs $g: exit $?"; grep -E "^done:|cuda graphs|padded to|eval loss" "$root/pf-$g.log" | head -8
  done 2>&1 | tee "$OUT/padfree-graphs-summary.txt"
  tar czf "$OUT/padfree-graphs-results.tgz" -C "$root" --exclude=final --exclude=checkpoints pf-auto pf-off \
    pf-auto.log pf-off.log 2>/dev/null
  ;;
panel)
  what=$1; name=$2; seconds=$3
  WORK=/tmp/panel-$name bash bench/panel_gpu.sh "$what" "$name" "$seconds"
  ;;
speed)
  name=$1; seconds=$2
  TEMPLATE=own ATTNS="kernel kernel" ENGINE_ROWS=0 WORK=$root/panel-$name bash bench/panel_gpu.sh speed "$name" "$seconds"
  ;;
bg)
  tag=$1; shift
  rm -rf "/tmp/repo-$tag" && mkdir -p "/tmp/repo-$tag" "/tmp/out-$tag" && cp -r . "/tmp/repo-$tag/"
  if [ -n "${AFTER:-}" ]; then
    waits=$(for t in $AFTER; do cat "/tmp/bg-$t.pid"; done | tr '\n' ' ')
  else
    waits=$(cat /tmp/bg-*.pid 2>/dev/null | tr '\n' ' ')
  fi
  # the pid is written from inside: setsid forks when its caller leads a process group (a shell with job control),
  # so $! would be a process that has already exited
  cd "/tmp/repo-$tag" && OUT=/tmp/out-$tag setsid nohup bash -c \
    "echo \$\$ > /tmp/bg-$tag.pid; for p in $waits; do while kill -0 \$p 2>/dev/null; do sleep 2; done; done;
     bash bench/peers_gpu.sh $*; cp /tmp/bg-$tag.log /tmp/out-$tag/$tag.log" > "/tmp/bg-$tag.log" 2>&1 < /dev/null &
  sleep 2; echo "$tag: pid $(cat "/tmp/bg-$tag.pid"), after: $waits"; cat "/tmp/bg-$tag.log"
  ;;
*)
  echo "unknown stage $stage (setup | step | sft | grpo | profile | padfree-graphs | panel | speed | bg)"; exit 2
  ;;
esac
