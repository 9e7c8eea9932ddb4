"""A tool-call fine-tune exported to GGUF writes in llama.cpp the calls `entrenar generate` writes (issue 35 part 3).

    python -m bench.toolcall_gguf_check --base MODEL --adapter RUN/final --work DIR [--questions 20]

Exports BASE + ADAPTER with `entrenar export gguf --type f32`, then for the first N BFCL simple_python questions
renders the prompt with the run's template and tools (the adapter's saved tokenizer), decodes greedily with
`entrenar generate --chat --tools` (CPU, fp32) and with llama.cpp (llama-cpp-python, f32 K/V) on the exported
file, and compares the token ids and the calls read back (evaluate/bfcl.py's reader and scorer). Writes
DIR/gguf_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.e2e_gguf_check import llama_greedy, load_llama
from entrenar.data.bfcl_data import load_bfcl, openai_tools
from entrenar.evaluate.bfcl import parse_calls, score
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
    tok = load_tokenizer(a.adapter)
    rows = []
    for q in load_bfcl(["simple_python"], a.questions):
        user = [m for m in q.messages if m["role"] == "user"][-1]["content"]
        tools = openai_tools(q.functions)
        tools_file = work / "tools.json"
        tools_file.write_text(json.dumps(tools))
        gen = entrenar_json("generate", "--model", a.base, "--adapter", a.adapter, "--prompt", user, "--chat",
                            "--tools", str(tools_file), "--max-new-tokens", str(a.max_new_tokens), "--device", "cpu",
                            "--dtype", "fp32")
        ids = tok.encode_chat([{"role": "user", "content": user}], add_generation_prompt=True, tools=tools).ids
        llm = load_llama(gguf, n_ctx=len(ids) + a.max_new_tokens + 8)
        try:
            theirs, _ = llama_greedy(llm, ids, a.max_new_tokens, set(tok.stop_ids))
        finally:
            llm.close()
        ours = gen["token_ids"]
        text_theirs = tok.decode([t for t in theirs if t not in tok.stop_ids])
        calls_ours, _ = parse_calls(gen["text"])
        calls_theirs, _ = parse_calls(text_theirs)
        rows.append({"task_id": q.task_id, "identical_tokens": ours == theirs, "same_calls": calls_ours == calls_theirs,
                     "calls": calls_ours, "llama_calls": calls_theirs,
                     "passed": score(q, calls_ours)[0], "llama_passed": score(q, calls_theirs)[0]})
        print(f"{q.task_id}: tokens identical {rows[-1]['identical_tokens']}, same calls {rows[-1]['same_calls']}, "
              f"passed {rows[-1]['passed']}", flush=True)
    result = {"gguf": str(gguf), "questions": len(rows), "identical_tokens": sum(r["identical_tokens"] for r in rows),
              "same_calls": sum(r["same_calls"] for r in rows), "rows": rows}
    (work / "gguf_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0 if result["same_calls"] == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
