#!/usr/bin/env bash
# --cuda-graphs (auto) with checkpoints and a resume through the real CLI on one GPU: 20 steps saving every 10,
# then --resume auto to 30; prints the graph log lines, each step's loss and the exit codes.
set -u
OUT=${1:-/tmp/cgr}
mkdir -p "$OUT"
python - "$OUT" <<'PY'
import sys
from pathlib import Path
from bench.cli_run import arch_dir, write_shards
out = Path(sys.argv[1])
arch_dir(out / "arch", "llama-370m", None, 4)
write_shards(out / "shards", 32000, 40 * 4 * 1024 + 1025)
PY
common=(--model "$OUT/arch" --data "$OUT/shards" --out "$OUT/run" --batch-size 4 --seq-len 1024 --lr 3e-4 --warmup 2
        --save-every 10 --keep 2 --no-preflight)
python -m entrenar pretrain "${common[@]}" --steps 20 2> "$OUT/first.err"; echo "first exit $?"
python -m entrenar pretrain "${common[@]}" --steps 30 --resume auto 2> "$OUT/resume.err"; echo "resume exit $?"
grep -h "cuda graphs\|resum" "$OUT/first.err" "$OUT/resume.err" | head -8
python -c "
import json; rows=[json.loads(l) for l in open('$OUT/run/metrics.jsonl') if l.strip()]
print([(r['step'], round(r['loss'],4)) for r in rows if 'loss' in r and 'step' in r])"
ls "$OUT/run/checkpoints" "$OUT/run/final" | head
