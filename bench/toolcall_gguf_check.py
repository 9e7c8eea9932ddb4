"""A tool-call fine-tune exported to GGUF writes in llama.cpp the calls `entrenar` writes (issue 35 part 3).

    python -m bench.toolcall_gguf_check --base MODEL --adapter RUN/final --work DIR [--questions 20]

Exports BASE + ADAPTER with `entrenar export gguf --type f32`; answers the first N BFCL simple_python questions
with `entrenar eval --task bfcl:simple_python --adapter ... --out` (one process, CPU, fp32, greedy: its rows hold
each completion) and with llama.cpp (llama-cpp-python, f32 K/V, loaded once) on the exported file, from the same
prompt tokens (evaluate/bfcl.py's bfcl_prompt_ids with the adapter's saved tokenizer and template), and compares
the completions and the calls read back (evaluate/bfcl.py's reader and scorer). Writes DIR/gguf_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.e2e_gguf_check import llama_greedy, load_llama
from entrenar.data.bfcl_data import load_bfcl
from entrenar.evaluate.bfcl import bfcl_prompt_ids, parse_calls, score
from entrenar.fileio import read_jsonl
from entrenar.tokenizer import load_tokenizer


def entrenar_json(*argv: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "entrenar", *argv, "--json"], capture_output=True, text=True,
                       check=False, env={**os.environ, "OMP_NUM_THREADS": "2"})
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"entrenar {' '.join(argv[:2])} failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    gguf = work / "finetune.f32.gguf"
    if not gguf.exists():
        entrenar_json("export", "gguf", a.base, str(gguf), "--adapter", a.adapter, "--type", "f32")
    rows_file = work / "entrenar_rows.jsonl"
    if not rows_file.exists():
        entrenar_json("eval", "--task", "bfcl:simple_python", "--model", a.base, "--adapter", a.adapter, "--limit",
                      str(a.questions), "--max-new-tokens", str(a.max_new_tokens), "--device", "cpu", "--dtype",
                      "fp32", "--batch-size", "4", "--out", str(rows_file))
    ours = {r["task_id"]: r for _, r in read_jsonl(rows_file)}
    tok = load_tokenizer(a.adapter)
    questions = load_bfcl(["simple_python"], a.questions)
    prompts = [bfcl_prompt_ids(q, tok) for q in questions]
    llm = load_llama(gguf, n_ctx=max(map(len, prompts)) + a.max_new_tokens + 8)
    rows = []
    try:
        for q, ids in zip(questions, prompts):
            theirs, _ = llama_greedy(llm, ids, a.max_new_tokens, set(tok.stop_ids))
            text = tok.decode([t for t in theirs if t not in tok.stop_ids])
            mine = ours[q.task_id]
            calls_theirs, _ = parse_calls(text)
            rows.append({"task_id": q.task_id, "same_text": text.strip() == mine["completion"].strip(),
                         "same_calls": calls_theirs == mine["calls"], "calls": mine["calls"],
                         "llama_calls": calls_theirs, "passed": mine["passed"],
                         "llama_passed": score(q, calls_theirs)[0], "llama_text": text})
            print(f"{q.task_id}: same text {rows[-1]['same_text']}, same calls {rows[-1]['same_calls']}, "
                  f"passed {rows[-1]['passed']}", flush=True)
    finally:
        llm.close()
    result = {"gguf": str(gguf), "questions": len(rows), "same_text": sum(r["same_text"] for r in rows),
              "same_calls": sum(r["same_calls"] for r in rows), "passed": sum(r["passed"] for r in rows),
              "llama_passed": sum(r["llama_passed"] for r in rows), "rows": rows}
    (work / "gguf_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0 if result["same_calls"] == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
