#!/usr/bin/env bash
# Issue 24 part 5: end to end from scratch on one GPU, through the real CLI only, in one call of < 9 minutes.
# The corpus is the .py files of the Python installed on the machine (its stdlib and site-packages: code no
# one here wrote), with whole packages held out for validation (bench/e2e_corpus.py):
#   corpus -> `tokenizer train` -> `data pack` (training packages, 1% of their files as the val split;
#   the held-out packages into a second shard directory) -> a 30-step calibration of llama-370m that sets
#   --steps for TRAIN_S seconds of training -> `pretrain --model llama-370m` -> in parallel: `eval` of
#   final/ on the held-out packages, `generate` (greedy) on 3 code prompts, `export gguf` (f16; 740 MB, stays
#   on the machine: entrenar generates from it in fp32 next to final/), `plot`; and the `tiny` preset trained
#   the same way, exported (f16 and f32, a few MB) and generated from (fp32: final/ and each GGUF), so that
#   bench/e2e_gguf_check.py can run that GGUF in llama.cpp on a CPU and compare the greedy tokens.
#
#   OUT=/path bash bench/e2e_pretrain.sh                 # the GPU run (carry .whl: the gguf wheel, see below)
#   E2E_SMALL=1 OUT=/tmp/e2e_out bash bench/e2e_pretrain.sh   # CPU dry run: tiny models, a tiny corpus
#
# Into $OUT (8 files, flat): e2e.log, summary.json (with llama-370m's metrics.jsonl rows), report.md,
# curves.png, small-f16.gguf, small-f32.gguf, tokenizer.json, small_greedy.json. Every stage runs under `timeout` and never past
# TOTAL_S (less what later stages need), so a hang still leaves the earlier stages' results; each stage
# prints its wall time. The `gguf` package (for `export gguf`) is installed from .whl/gguf-*.whl into
# $WORK/pysite when python3 lacks it (the GPU image does).
# Knobs: TRAIN_S (llama-370m training seconds at most, 240: fewer when the steps would not end by TOTAL_S -
# AFTER_MAIN_S - MAIN_OVERHEAD_S at the calibrated speed), LR (6e-4), TOTAL_S (510), VOCAB (32000),
# SMALL_STEPS (tiny's steps, 2000), WORK (scratch, /tmp/e2e_work), PYTHON (python3); E2E_PAR=1 runs step 4's
# jobs in parallel in the CPU dry run too (as on the GPU).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=true
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/e2e_out}
WORK=${WORK:-/tmp/e2e_work}
case "$WORK" in /|/tmp|"$HOME"|"$PWD") echo "WORK=$WORK would be wiped: name a scratch directory" >&2; exit 2;; esac
T0=$(date +%s)
mkdir -p "$OUT" && rm -rf "$WORK" && mkdir -p "$WORK/logs" || exit 2
exec > >(tee -a "$OUT/e2e.log") 2>&1
TEE_PID=$!

PROMPTS=($'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
         $'import os\nimport sys\n\n\ndef main():\n'
         $'class Stack:\n    def __init__(self):\n')
if [ "${E2E_SMALL:-0}" = 1 ]; then
  MODE="cpu dry run (E2E_SMALL=1)"; DEVICE=cpu; TOTAL_S=${TOTAL_S:-1500}; PAR=${E2E_PAR:-0}
  MAIN_MODEL=tiny; MAIN_BATCH=4; MAIN_SEQ=128; MAIN_LR=${LR:-3e-3}; TRAIN_S=${TRAIN_S:-20}; CAL_STEPS=20
  EVAL_BATCHES=4; ASSUMED_TOK_S=5000; AFTER_MAIN_S=600; MAIN_OVERHEAD_S=120
  SMALL_MODEL=tiny; SMALL_BATCH=4; SMALL_SEQ=128; SMALL_LR=3e-3; SMALL_STEPS=${SMALL_STEPS:-30}; SMALL_SAVE=10
  SMALL_LIMIT=300; VOCAB=${VOCAB:-2048}; TRAIN_MB=3; TOK_MB=2; HELDOUT_MB=0.5
  ONLY=${E2E_ONLY:-stdlib.json,stdlib.email,packaging}; WORKERS=2; GEN_TOKENS=24; VAL_FRACTION=0.1
else
  MODE="gpu"; DEVICE=cuda; TOTAL_S=${TOTAL_S:-510}; PAR=1
  MAIN_MODEL=llama-370m; MAIN_BATCH=8; MAIN_SEQ=2048; MAIN_LR=${LR:-6e-4}; TRAIN_S=${TRAIN_S:-240}; CAL_STEPS=30
  EVAL_BATCHES=16; ASSUMED_TOK_S=140000; AFTER_MAIN_S=130; MAIN_OVERHEAD_S=90
  SMALL_MODEL=tiny; SMALL_BATCH=16; SMALL_SEQ=1024; SMALL_LR=3e-3; SMALL_STEPS=${SMALL_STEPS:-2000}; SMALL_SAVE=250
  SMALL_LIMIT=100; VOCAB=${VOCAB:-32000}; TRAIN_MB=150; TOK_MB=60; HELDOUT_MB=8; ONLY=""; WORKERS=12; GEN_TOKENS=96
  VAL_FRACTION=0.01  # ~90 of ~9,000 files, ~0.4M tokens: 16 eval batches of 8 x 2048
fi
MAIN_TPS=$((MAIN_BATCH * MAIN_SEQ)); SMALL_TPS=$((SMALL_BATCH * SMALL_SEQ))
# steps 1-2 may eat into the training time (the calibration then plans fewer steps), never below a minute of it
EARLY_RESERVE=$((AFTER_MAIN_S + MAIN_OVERHEAD_S + 60))
SMALL_GEN_FLAGS=(--max-new-tokens 64 --device "$DEVICE" --dtype fp32)

elapsed() { echo $(( $(date +%s) - T0 )); }
# stage NAME LIMIT_S RESERVE_S CMD...: CMD under `timeout`, ending by TOTAL_S - RESERVE_S at the latest;
# stdout -> logs/NAME.out (the --json line), stderr -> logs/NAME.err; one line in stages.jsonl.
stage() {
  local name=$1 limit=$2 reserve=$3 s rc dt at cap
  shift 3
  cap=$(( TOTAL_S - reserve - $(elapsed) ))
  (( limit > cap )) && limit=$cap
  if (( limit < 3 )); then
    echo "== $name: SKIPPED (no time left at t+$(elapsed) s)"
    printf '{"stage": "%s", "skipped": true, "rc": null}\n' "$name" >> "$WORK/stages.jsonl"
    return 124
  fi
  s=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" > "$WORK/logs/$name.out" 2> "$WORK/logs/$name.err"
  rc=$?
  dt=$(awk -v a="$s" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b - a}')
  at=$(awk -v a="$s" -v b="$T0" 'BEGIN{printf "%.1f", a - b}')
  printf '{"stage": "%s", "seconds": %s, "rc": %d, "limit_s": %d, "started_at_s": %s}\n' \
    "$name" "$dt" "$rc" "$limit" "$at" >> "$WORK/stages.jsonl"
  { echo "== $name: ${dt} s, exit $rc (limit ${limit} s; started t+${at} s)"
    grep -v '^{' "$WORK/logs/$name.err" | tail -n 4 | cut -c1-300 | sed 's/^/   | /'
    tail -n 1 "$WORK/logs/$name.out" | cut -c1-500 | sed 's/^/   > /'; } | cat  # one write: parallel stages
  return $rc
}
bg() { if [ "$PAR" = 1 ]; then "$@" & else "$@"; fi; }
# the jobs started here by bg (a plain `wait` would also wait for the log's tee, which never ends)
waitjobs() { local pids; pids=$(jobs -p); [ -z "$pids" ] || wait $pids; }
model_of() {  # a run's final/, else its newest complete checkpoint (a run stopped by its timeout), else ""
  if [ -f "$1/final/config.json" ]; then echo "$1/final"
  elif [ -e "$1/checkpoints/latest" ]; then echo "$1/checkpoints/latest"; fi
}

if [ "$DEVICE" = cuda ]; then
  DEVICE_NAME=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
else
  DEVICE_NAME="cpu ($(nproc) cores)"
fi
echo "== e2e ($MODE) on $DEVICE_NAME; commit $(git rev-parse --short HEAD 2>/dev/null); OUT=$OUT WORK=$WORK; budget ${TOTAL_S} s"
if ! $PY -c "import gguf" 2>/dev/null; then
  if compgen -G ".whl/gguf-*.whl" > /dev/null; then
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/pysite" .whl/gguf-*.whl; then
      export PYTHONPATH="$PYTHONPATH:$WORK/pysite"; echo "gguf installed from .whl into $WORK/pysite"
    else  # a pure-Python wheel imports from the zip itself
      export PYTHONPATH="$PYTHONPATH:$(ls "$PWD"/.whl/gguf-*.whl | head -1)"; echo "gguf imported from the wheel file"
    fi
    $PY -c "import gguf" || echo "WARNING: gguf still does not import: export gguf will fail"
  else
    echo "WARNING: no gguf package and no .whl/gguf-*.whl: export gguf will fail"
  fi
fi
$PY - "$WORK/plan.json" "$MODE" "$DEVICE_NAME" "$MAIN_MODEL" "$MAIN_TPS" "$SMALL_MODEL" "$SMALL_TPS" \
  "$TRAIN_S" "$TOTAL_S" "${SMALL_GEN_FLAGS[*]}" "${PROMPTS[@]}" <<'EOF'
import json, sys
path, mode, dev, mm, mt, sm, st, train_s, total_s, flags, *prompts = sys.argv[1:]
json.dump({"mode": mode, "device_name": dev, "prompts": prompts, "train_seconds": float(train_s),
           "total_seconds": int(total_s), "main": {"model": mm, "tokens_per_step": int(mt)},
           "small": {"model": sm, "tokens_per_step": int(st), "generate_flags": flags}}, open(path, "w"), indent=2)
EOF

# ---- 1. corpus, tokenizer, shards --------------------------------------------------------------------------
stage corpus 90 $EARLY_RESERVE $PY bench/e2e_corpus.py --out "$WORK/corpus" --train-mb $TRAIN_MB \
  --tok-mb $TOK_MB --heldout-mb $HELDOUT_MB ${ONLY:+--only "$ONLY"}
stage tokenizer 120 $EARLY_RESERVE $PY -m entrenar tokenizer train --vocab-size "$VOCAB" \
  --out "$WORK/tokenizer" "$WORK/corpus/tok" --json
bg stage pack_train 120 $EARLY_RESERVE $PY -m entrenar data pack --model "$WORK/tokenizer" \
  --out "$WORK/shards" --val-fraction $VAL_FRACTION --workers $WORKERS "$WORK/corpus/train" --json
bg stage pack_heldout 120 $EARLY_RESERVE $PY -m entrenar data pack --model "$WORK/tokenizer" \
  --out "$WORK/shards_heldout" --workers 4 "$WORK/corpus/heldout" --json
waitjobs

# ---- 2. calibration: the real pretrain command for CAL_STEPS steps sets --steps ---------------------------
stage calibrate 150 $EARLY_RESERVE $PY bench/e2e_report.py calibrate --run "$WORK/calib" \
  --measure-steps $CAL_STEPS --train-seconds "$TRAIN_S" --tokens-per-step $MAIN_TPS --evals 10 \
  --deadline $((T0 + TOTAL_S - AFTER_MAIN_S - MAIN_OVERHEAD_S)) --out "$WORK/calib.json" \
  -- $PY -m entrenar pretrain --model $MAIN_MODEL --data "$WORK/shards" --out "$WORK/calib" --steps 100000 \
  --batch-size $MAIN_BATCH --seq-len $MAIN_SEQ --device $DEVICE --lr "$MAIN_LR" --eval-batches 1 --no-preflight \
  --keep 1
if [ -f "$WORK/calib.json" ]; then
  read -r STEPS EVAL_EVERY < <($PY -c "import json; c = json.load(open('$WORK/calib.json')); print(c['steps'], c['eval_every'])")
else  # no measurement: the assumed speed, and say so
  LEFT=$(( TOTAL_S - AFTER_MAIN_S - MAIN_OVERHEAD_S - $(elapsed) )); (( LEFT > TRAIN_S )) && LEFT=$TRAIN_S
  STEPS=$(( LEFT * ASSUMED_TOK_S / MAIN_TPS )); (( STEPS < 10 )) && STEPS=10
  EVAL_EVERY=$(( STEPS / 10 > 0 ? STEPS / 10 : 1 ))
  echo "{\"steps\": $STEPS, \"eval_every\": $EVAL_EVERY, \"assumed_tok_s\": $ASSUMED_TOK_S}" > "$WORK/calib.json"
  echo "calibration failed: --steps $STEPS from an assumed $ASSUMED_TOK_S tok/s"
fi
echo "== plan: $MAIN_MODEL --steps $STEPS (x $MAIN_TPS tokens = $((STEPS * MAIN_TPS)) tokens, ~${TRAIN_S} s), --eval-every $EVAL_EVERY"

# ---- 3. pretrain ----------------------------------------------------------------------------------------
# its limit reaches into the time kept for step 4 (a kill would lose the whole run: no checkpoint before the end)
stage pretrain_main $((TRAIN_S * 3 / 2 + 150)) $((AFTER_MAIN_S / 2)) $PY -m entrenar pretrain --model $MAIN_MODEL \
  --data "$WORK/shards" --out "$WORK/run_main" --steps "$STEPS" --batch-size $MAIN_BATCH --seq-len $MAIN_SEQ \
  --device $DEVICE --lr "$MAIN_LR" --eval-every "$EVAL_EVERY" --eval-batches $EVAL_BATCHES --save-every 0 \
  --keep 1 --json
MAIN=$(model_of "$WORK/run_main")

# ---- 4. the trained model: eval, generate, export (in parallel), and the small model the same way ----------
main_gguf() {
  stage export_main 150 15 $PY -m entrenar export gguf "$MAIN" "$WORK/main-f16.gguf" --type f16 --json || return
  bg stage gen_main_fp32_final 90 15 $PY -m entrenar generate --model "$MAIN" --prompt "${PROMPTS[0]}" \
    --max-new-tokens $GEN_TOKENS --device $DEVICE --dtype fp32 --json
  bg stage gen_main_fp32_gguf 90 15 $PY -m entrenar generate --model "$WORK/main-f16.gguf" --prompt "${PROMPTS[0]}" \
    --max-new-tokens $GEN_TOKENS --device $DEVICE --dtype fp32 --json
  waitjobs
}
main_jobs() {
  [ -n "$MAIN" ] || { echo "== no model from pretrain_main: its eval/generate/export are skipped"; return; }
  bg stage eval_main 120 15 $PY -m entrenar eval --model "$MAIN" --data "$WORK/shards_heldout" --split train \
    --seq-len $MAIN_SEQ --batch-size $MAIN_BATCH --device $DEVICE --json
  for i in 0 1 2; do
    bg stage gen_main_$i 90 15 $PY -m entrenar generate --model "$MAIN" --prompt "${PROMPTS[$i]}" \
      --max-new-tokens $GEN_TOKENS --device $DEVICE --json
  done
  bg main_gguf
  bg stage plot 60 15 $PY -m entrenar plot "$WORK/run_main" --out "$OUT/curves.png" --json
  waitjobs
}
small_jobs() {
  stage pretrain_small $SMALL_LIMIT 45 $PY -m entrenar pretrain --model $SMALL_MODEL --data "$WORK/shards" \
    --out "$WORK/run_small" --steps "$SMALL_STEPS" --batch-size $SMALL_BATCH --seq-len $SMALL_SEQ \
    --device $DEVICE --lr $SMALL_LR --eval-every $((SMALL_STEPS / 5)) --eval-batches $EVAL_BATCHES \
    --save-every $SMALL_SAVE --keep 1 --json
  local small
  small=$(model_of "$WORK/run_small")
  [ -n "$small" ] || { echo "== no model from pretrain_small"; return; }
  # f16: the export users make; f32: the very weights of final/, so llama.cpp vs `generate` of final/ is exact
  for t in f16 f32; do
    bg stage export_small_$t 60 25 $PY -m entrenar export gguf "$small" "$OUT/small-$t.gguf" --type $t --json
  done
  waitjobs
  bg stage eval_small 60 15 $PY -m entrenar eval --model "$small" --data "$WORK/shards_heldout" --split train \
    --seq-len $MAIN_SEQ --batch-size $MAIN_BATCH --device $DEVICE --json
  for i in 0 1 2; do
    bg stage gen_small_final_$i 60 15 $PY -m entrenar generate --model "$small" --prompt "${PROMPTS[$i]}" \
      "${SMALL_GEN_FLAGS[@]}" --json
    for t in f16 f32; do
      [ -f "$OUT/small-$t.gguf" ] && bg stage gen_small_${t}_$i 60 15 $PY -m entrenar generate \
        --model "$OUT/small-$t.gguf" --prompt "${PROMPTS[$i]}" "${SMALL_GEN_FLAGS[@]}" --json
    done
  done
  waitjobs
}
if [ "$PAR" = 1 ]; then  # 16 cores among ~10 processes
  (export OMP_NUM_THREADS=4; main_jobs) & (export OMP_NUM_THREADS=4; small_jobs) & waitjobs
else
  main_jobs; small_jobs
fi

# ---- 5. report ------------------------------------------------------------------------------------------
cp "$WORK/tokenizer/tokenizer.json" "$OUT/tokenizer.json" 2>/dev/null
stage report 60 -30 $PY bench/e2e_report.py report --work "$WORK" --out "$OUT"
cat "$WORK/logs/report.out"
echo "== per-stage stderr (head and tail) ==================================================================="
for f in "$WORK"/logs/*.err; do
  [ -s "$f" ] || continue
  echo "--- $(basename "$f" .err)"
  if [ "$(wc -l < "$f")" -gt 50 ]; then head -n 15 "$f"; echo "   [...]"; tail -n 30 "$f"; else cat "$f"; fi
done | cut -c1-400
echo "== done in $(elapsed) s; OUT:"
ls -la "$OUT"
exec 1>&- 2>&-
wait "$TEE_PID"
