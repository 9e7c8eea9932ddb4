#!/usr/bin/env bash
# The retention A/B, the engine's speed and GRPO from an SFT adapter on the GPU machine, one device call per stage,
# through the real CLI (`python -m entrenar`, as `entrenar`), after the model's pieces arrived
# (../shared/device/README.md; bench/issue35_gpu.sh piece NAME copies them to /tmp/carry/NAME):
#   bash bench/panel_gpu.sh speed NAME SECONDS    join /tmp/carry/NAME/p* (sha256 checked), install .whl into /tmp/site;
#                                                 the engine through the CLI on the base, each decode attention
#                                                 (ENTRENAR_DECODE_ATTENTION), the first run of a process cold: BFCL
#                                                 840, HumanEval 164, pass@10; then bench/engine_throughput.py's
#                                                 speed rows against transformers (random weights, SmolLM2 shape)
#   bash bench/panel_gpu.sh ab NAME SECONDS       the base's evals (skipped when $WORK/base has them), then each
#                                                 variant of VARIANTS (ONLY="a b": those) one after another (four at
#                                                 once took 25-86 GB each and ran out of an H200's memory):
#                                                 bench.task_proof toolcall, --base-from those evals
#   bash bench/panel_gpu.sh grpo NAME SECONDS     GRPO (LoRA, --reward bfcl-graded) on the best variant's SFT model
#                                                 (merged), and its evals paired against that SFT model's
#                                                 (GRPO_FROM=VARIANT: that one's; GRPO_FROM=base: the base model,
#                                                 paired against the base's evals; GRPO_ROWS="FLAGS": the prompts made
#                                                 by `data sft-from-bfcl FLAGS` instead of the SFT rows; GRPO_ARGS:
#                                                 more finetune flags; GRPO_REWARD="SPEC ...": the rewards,
#                                                 bfcl-graded by default; PEFT_CHECK=N: the GRPO adapter's first N
#                                                 questions a category in transformers + peft, bench/peft_check.py)
#   bash bench/panel_gpu.sh passk NAME SECONDS    pass@1 and pass@K (PASSK, 8) of BFCL simple_python and multiple, K
#                                                 samples at PASSK_TEMP (1.0), of each model of PASSK_OF ("base": the
#                                                 base; a variant: its SFT run; "grpo": the GRPO run): how far a
#                                                 sampled answer reaches, the ceiling GRPO sharpens towards
#   bash bench/panel_gpu.sh code NAME SECONDS     GRPO (LoRA, --reward tests) from the base on `data tasks-from-code
#                                                 stdlib` prompts (CODE_SOURCES: more source trees), HumanEval in
#                                                 the loop; HumanEval, BFCL and chat after, paired with the base's
# SFT_STEPS: the A/B's steps (250); the variant's flags come after the recipe's, so a variant may override them (qwen);
# SFT_EXTRA: flags after the variant's (DRY=1 with a random model: "--replay 0", its answers pass no chat gate).
# Everything a stage wrote goes to $OUT as one STAGE-results.tgz (per-problem files, logs, summaries; no weights) and
# STAGE-summary.txt. DRY=1: the same steps on the CPU with tiny settings (checks the script, not the numbers).
set -uo pipefail
stage=$1; name=$2; seconds=$3
export PYTHONPATH=src:.:/tmp/site PYTHONUNBUFFERED=1

end=$((SECONDS + seconds - 30))  # the last 30 s for collecting what finished
left() { local n=$((end - SECONDS)); echo $((n > 1 ? n : 1)); }
if [ "${DRY:-0}" = 1 ]; then
  dev=cpu; limit=(--limit 2); task_limit=2; steps=4; every=2; batch=2; grpo_steps=2; gens=2; seq=2048; sft_batch=2
  new=24
else
  dev=cuda; limit=(); task_limit=100; steps=${SFT_STEPS:-250}; every=125; batch=16; grpo_steps=${GRPO_STEPS:-80}; gens=8; seq=4096
  sft_batch=16; new=128
fi
if [ "${DRY:-0}" = 1 ]; then
  model=$name
else
  source bench/gpu_model.sh "$name"
fi
root=${WORK:-/tmp/panel}
base=$root/base
mkdir -p "$base"
tpl=(--chat-template "${TEMPLATE:-chatml_tools}")  # TEMPLATE=own: the model's own chat template
[ "${TEMPLATE:-}" = own ] && tpl=()
tpl_file=()  # bench/peft_check.py takes the template's file
[ "${TEMPLATE:-chatml_tools}" = own ] || tpl_file=(--chat-template "src/entrenar/templates/${TEMPLATE:-chatml_tools}.jinja")
cats=simple_python,multiple,irrelevance

collect() {  # $1: the stage; what it wrote, no weights, to $OUT
  tar czf "$OUT/$1-results.tgz" -C "$root" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
    --exclude=rows.jsonl --exclude=checkpoints --exclude=merged --exclude='*.gguf' . 2>/dev/null
  ls -la "$OUT"
}

timed() {  # timed LOG CMD...: CMD's --json line to LOG.json, its stderr to LOG.log, the wall seconds said
  local log=$1; shift
  local t0=$SECONDS
  timeout "$(left)" "$@" --json > "$log.json" 2> "$log.log"
  local rc=$?
  echo "$(basename "$log"): exit $rc in $((SECONDS - t0)) s; $(grep -h '^generation:' "$log.log" | head -3 | tr '\n' ' ')"
  return $rc
}

# the recipes of the A/B: the README recipe's rows and steps; each adds one way to keep what the model could do
common=(--model "$model" --device "$dev" "${tpl[@]}" --mode lora --rank 16 --lr 3e-4 --steps "$steps"
        --batch-size "$sft_batch" --max-seq-len "$seq" --irrelevance-rows 880 --in-loop-task bfcl:simple_python,multiple
        --retain bfcl:irrelevance --retain chat --in-loop-limit "$task_limit" --in-loop-every "$every" --keep-best task
        "${limit[@]}")
declare -A VARIANTS=(  # ONLY="a b": just those
  [replay]="--swapped-no-call 0 --replay 0.3"
  [matched]="--swapped-no-call 650 --swapped-matched --replay 0.3"
  [nearest]="--swapped-no-call 650 --swapped-nearest --replay 0.3"
  [nearest-kl]="--swapped-no-call 650 --swapped-nearest --replay 0.3 --kl-to-base 0.1"
  [swapped-kl]="--swapped-no-call 1000 --replay 0.3 --kl-to-base 0.1"
  # Qwen2.5-Coder-0.5B-Instruct's recipe (TEMPLATE=qwen2_tools_json SFT_STEPS=300): r16 at lr 1e-4, 8 x 2 a step,
  # 300 live_irrelevance and 300 matched no-call rows, replay, HumanEval in the panel (the r64 recipe lost 28 problems)
  [qwen]="--lr 1e-4 --batch-size 8 --grad-accum 2 --irrelevance-rows 300 --swapped-no-call 300 --swapped-matched
          --replay 0.3 --retain humaneval"
)

if [ "$stage" = speed ]; then
  sp=$root/speed
  mkdir -p "$sp"
  {
    for attn in ${ATTNS:-kernel kernel sdpa}; do  # the first run is the machine's cold start (Triton compiles)
      export ENTRENAR_DECODE_ATTENTION=$attn
      n=$(ls "$sp" | grep -c "^bfcl_$attn.*json$" || true)
      timed "$sp/bfcl_$attn$n" python3 -m entrenar eval --task "bfcl:$cats" --model "$model" "${tpl[@]}" "${limit[@]}" \
        --device "$dev" --out "$sp/bfcl_$attn$n.jsonl" --overwrite
      timed "$sp/he_$attn$n" python3 -m entrenar eval --task humaneval --model "$model" "${tpl[@]}" "${limit[@]}" \
        --device "$dev" --out "$sp/he_$attn$n.jsonl" --overwrite
    done
    unset ENTRENAR_DECODE_ATTENTION
    for f in "$sp"/bfcl_*.json "$sp"/he_*.json; do echo "$(basename "$f"): $(grep -o '"generate_seconds": [0-9.]*' "$f")"; done
    timed "$sp/he10" python3 -m entrenar eval --task humaneval --model "$model" "${tpl[@]}" "${limit[@]}" --device "$dev" \
      --samples 10 --temperature 0.8 --out "$sp/he10.jsonl" --overwrite
    if [ "$dev" = cuda ] && [ "${ENGINE_ROWS:-1}" = 1 ]; then
      echo "== engine vs transformers (random weights, SmolLM2 shape)"
      timeout "$(left)" python3 bench/engine_throughput.py --shapes smollm2-135m --no-checks --hf-batches 128,256 \
        > "$sp/engine.jsonl" 2> "$sp/engine.log"; echo "exit $?"; tail -n 12 "$sp/engine.jsonl"
    fi
  } 2>&1 | tee "$OUT/speed-summary.txt"
  collect speed
  exit 0
fi

base_evals() {  # the base model's BFCL, HumanEval and chat, once per $WORK
  [ -f "$base/base_bfcl.jsonl" ] || timed "$base/base_bfcl" python3 -m entrenar eval --task "bfcl:$cats" --model "$model" "${tpl[@]}" "${limit[@]}" --device "$dev" \
    --out "$base/base_bfcl.jsonl" --overwrite
  [ -f "$base/base_he.jsonl" ] || timed "$base/base_he" python3 -m entrenar eval --task humaneval --model "$model" "${tpl[@]}" "${limit[@]}" --device "$dev" \
    --out "$base/base_he.jsonl" --overwrite
  [ -f "$base/base_chat.jsonl" ] || timed "$base/base_chat" python3 -m entrenar eval --task chat --model "$model" "${tpl[@]}" "${limit[@]}" --device "$dev" \
    --out "$base/base_chat.jsonl" --overwrite
}

after_evals() {  # after_evals DIR RUN BEFORE: RUN's BFCL, chat and HumanEval, each paired with BEFORE{bfcl,chat,he}.jsonl
  local d=$1 run=$2 before=$3
  timed "$d/after_bfcl" python3 -m entrenar eval --task "bfcl:$cats" --model "$run" "${limit[@]}" --device "$dev" \
    --out "$d/after_bfcl.jsonl" --overwrite --compare "${before}bfcl.jsonl"
  grep -E "^bfcl " "$d/after_bfcl.log"
  timed "$d/after_chat" python3 -m entrenar eval --task chat --model "$run" "${limit[@]}" --device "$dev" \
    --out "$d/after_chat.jsonl" --overwrite --compare "${before}chat.jsonl"
  grep -E "^chat" "$d/after_chat.log"
  timed "$d/after_he" python3 -m entrenar eval --task humaneval --model "$run" "${limit[@]}" --device "$dev" \
    --out "$d/after_he.jsonl" --overwrite --compare "${before}he.jsonl"
  grep -E "^humaneval" "$d/after_he.log"
}

rewards=()  # GRPO_REWARD="SPEC ...": one --reward each (tests for the code stage, bfcl-graded for grpo)
default_reward=bfcl-graded
[ "$stage" = code ] && default_reward=tests
for r in ${GRPO_REWARD:-$default_reward}; do rewards+=(--reward "$r"); done

if [ "$stage" = ab ]; then
  {
    base_evals
    for v in ${ONLY:-${!VARIANTS[@]}}; do
      rm -rf "$root/$v/run"  # a variant run again starts afresh (finetune refuses a stopped run's --out)
      # shellcheck disable=SC2086
      timeout "$(left)" python3 -m bench.task_proof toolcall "${common[@]}" --work "$root/$v" --base-from "$base" \
        ${VARIANTS[$v]} ${SFT_EXTRA:-} > "$root/$v.out" 2>&1
    done
    for v in ${ONLY:-${!VARIANTS[@]}}; do
      echo "== $v: ${VARIANTS[$v]}"; grep -E "^(bfcl|chat|humaneval) |exit [1-9]|Error" "$root/$v.out" | head -12
    done
  } 2>&1 | tee "$OUT/ab-summary.txt"
  collect ab
  exit 0
fi

if [ "$stage" = grpo ]; then
  g=$root/grpo
  mkdir -p "$g"
  {
    # the SFT model to start from: the variant whose irrelevance held best, then the most simple_python
    pick=${GRPO_FROM:-$(python3 -m bench.panel_pick "$root" ${ONLY:-nearest-kl nearest matched replay})}
    echo "== GRPO from the SFT adapter of: $pick"
    if [ "$pick" = base ]; then
      start=$model; before=$base/base_; rows=$g/prompts.jsonl
    else
      timed "$g/merge" python3 -m entrenar merge --base "$model" --adapter "$root/$pick/run" --out "$g/merged"
      start=$g/merged; before=$root/$pick/after_; rows=$root/$pick/rows.jsonl
    fi
    [ "$pick" = base ] && GRPO_ROWS=${GRPO_ROWS:---irrelevance}
    if [ -n "${GRPO_ROWS:-}" ]; then
      rows=$g/prompts.jsonl
      # shellcheck disable=SC2086
      python3 -m entrenar data sft-from-bfcl --out "$rows" --overwrite $GRPO_ROWS | tail -n 3
    fi
    # shellcheck disable=SC2086
    timed "$g/finetune" python3 -m entrenar finetune --model "$start" "${tpl[@]}" --objective grpo --data "$rows" \
      "${rewards[@]}" --mode lora --rank 16 --lr "${GRPO_LR:-5e-5}" --num-generations "$gens" \
      --batch-size "${GRPO_BATCH:-$batch}" --grad-accum "${GRPO_ACCUM:-1}" --max-new-tokens "$new" --steps "$grpo_steps" --max-seq-len "$seq" --device "$dev" \
      --eval-task bfcl:simple_python,multiple --eval-task-limit "$task_limit" --eval-task-every $((grpo_steps / 2)) \
      --retain-task bfcl:irrelevance --retain-task chat --keep-best task --seed 0 --out "$g/run" ${GRPO_ARGS:-}
    grep -E "^step [0-9]+/" "$g/finetune.log" | awk 'NR % 10 == 1' | head -20
    after_evals "$g" "$g/run" "$before"
    if [ "${PEFT_CHECK:-0}" -gt 0 ]; then  # the adapter against its own base (the merged SFT model or the GGUF)
      timeout "$(left)" python3 -m bench.peft_check --base "$start" --adapter "$g/run/final" "${tpl_file[@]}" \
        --limit "$PEFT_CHECK" --ours "$g/after_bfcl.jsonl" --out "$g/peft_bfcl.jsonl" > "$g/peft_check.log" 2>&1
      echo "peft_check: exit $?"; tail -n 4 "$g/peft_check.log"
    fi
  } 2>&1 | tee "$OUT/grpo-summary.txt"
  collect grpo
  exit 0
fi

if [ "$stage" = passk ]; then
  k=$root/passk
  mkdir -p "$k"
  {
    for m in ${PASSK_OF:-base}; do
      src=$root/$m/run; own=()  # a run carries its chat template; the base is given the stage's
      [ "$m" = base ] && { src=$model; own=("${tpl[@]}"); }
      timed "$k/$m" python3 -m entrenar eval --task bfcl:simple_python,multiple --model "$src" "${own[@]}" "${limit[@]}" \
        --device "$dev" --samples "${PASSK:-8}" --temperature "${PASSK_TEMP:-1.0}" --out "$k/$m.jsonl" --overwrite
      python3 -c "import json, sys; r = json.load(open(sys.argv[1]))
for n, c in r.get('categories', {}).items(): print(sys.argv[2], n, {k: v for k, v in c.items() if k != 'truncated'})" \
        "$k/$m.json" "$m"
    done
  } 2>&1 | tee "$OUT/passk-summary.txt"
  collect passk
  exit 0
fi

if [ "$stage" = code ]; then
  c=$root/code
  mkdir -p "$c"
  {
    base_evals
    # shellcheck disable=SC2086
    python3 -m entrenar data tasks-from-code --out "$c/tasks.jsonl" --overwrite stdlib ${CODE_SOURCES:-} | tail -n 2
    # shellcheck disable=SC2086
    timed "$c/finetune" python3 -m entrenar finetune --model "$model" "${tpl[@]}" --objective grpo --data "$c/tasks.jsonl" \
      "${rewards[@]}" --mode lora --rank 16 --lr "${GRPO_LR:-1e-4}" --num-generations "$gens" \
      --batch-size "${GRPO_BATCH:-$batch}" --grad-accum "${GRPO_ACCUM:-1}" --max-new-tokens "${CODE_NEW:-$((new * 4))}" \
      --steps "$grpo_steps" --max-seq-len "$seq" --device "$dev" --eval-task humaneval --eval-task-limit "$task_limit" \
      --eval-task-every $((grpo_steps / 2)) --retain-task bfcl:simple_python,irrelevance --retain-task chat --keep-best task \
      --seed 0 --out "$c/run" ${GRPO_ARGS:-}
    grep -E "^step [0-9]+/" "$c/finetune.log" | awk 'NR % 5 == 1' | head -20
    after_evals "$c" "$c/run" "$base/base_"
  } 2>&1 | tee "$OUT/code-summary.txt"
  collect code
  exit 0
fi
echo "unknown stage $stage (speed | ab | grpo | passk | code)"; exit 2
