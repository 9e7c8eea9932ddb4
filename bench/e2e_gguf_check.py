"""Issue 24 part 5, the CPU side: the GGUF that bench/e2e_pretrain.sh exported on the GPU machine runs in
llama.cpp (llama-cpp-python) here with the same greedy tokens as `entrenar generate`.

    python bench/e2e_gguf_check.py --gguf OUT/small-f16.gguf --tokenizer OUT/tokenizer.json \
        --greedy OUT/small_greedy.json [--entrenar-cpu] [--json FILE]

For each prompt of small_greedy.json: (1) the prompt's ids from our tokenizer (tokenizer.json plus the
tokenizer_config.json carried inside small_greedy.json) equal the ids recorded on the GPU machine and
llama.cpp's own tokenization of the prompt from the GGUF; (2) llama.cpp's greedy continuation (argmax of its
logits, no sampler, f32 KV cache, stop at the tokenizer's stop ids) equals the tokens `entrenar generate`
gave on the GPU machine from final/ and from the GGUF (both fp32); with --entrenar-cpu also `entrenar
generate --device cpu` of the GGUF here (the same file and CPU as llama.cpp). Where tokens differ, the
first differing position is named with llama.cpp's margin between its top two logits there (a near tie that
f16 weights or another matmul order can flip, or a real disagreement). Exit 0 when every prompt's llama.cpp
tokens equal the GPU's `generate` of final/, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from e2e_report import first_difference  # bench/ is on sys.path when this file runs as a script


def tokenizer_dir(tokenizer: Path, config: dict[str, Any] | None, tmp: Path) -> Path:
    """A directory our loader reads: TOKENIZER itself, or tokenizer.json + the carried tokenizer_config.json."""
    if tokenizer.is_dir():
        return tokenizer
    (tmp / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    if config is not None:
        (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


def load_llama(gguf: Path, n_ctx: int):
    """llama.cpp on the file, CPU, every position's logits, K/V in f32 (its f16 default rounds the cache)."""
    from llama_cpp import GGML_TYPE_F32, Llama

    return Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=2, n_threads_batch=2,
                 logits_all=True, flash_attn=False, verbose=False, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)


def llama_greedy(llm, prompt_ids: list[int], n: int, stop_ids: set[int]) -> tuple[list[int], list[np.ndarray]]:
    """Argmax continuation from llama.cpp's logits, and the logits row of each chosen token."""
    llm.reset()
    llm.eval(prompt_ids)
    out: list[int] = []
    rows: list[np.ndarray] = []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        nxt = int(np.argmax(row))
        out.append(nxt)
        rows.append(row)
        if nxt in stop_ids:
            break
        llm.eval([nxt])
    return out, rows


def compare(theirs: list[int], rows: list[np.ndarray], ours: list[int] | None) -> dict[str, Any]:
    """Identical or not; at the first difference: llama.cpp's top-2 margin and the rank of our token."""
    if ours is None:
        return {"compared": False}
    d = first_difference(theirs, ours)
    res: dict[str, Any] = {"compared": True, "identical": d is None, "tokens": len(ours)}
    if d is not None:
        res["first_difference"] = d
        if d < len(rows) and d < len(ours):
            row = rows[d]
            top2 = np.sort(row)[-2:]
            res.update(llama_token=theirs[d], ours_token=ours[d], llama_top2_margin=float(top2[1] - top2[0]),
                       llama_logit_gap_to_ours=float(row.max() - row[ours[d]]),
                       rank_of_ours_in_llama=int((row > row[ours[d]]).sum()))
    return res


def entrenar_cpu(gguf: Path, prompt: str, n: int) -> list[int] | None:
    """`entrenar generate` of the GGUF on this CPU in fp32 (the real CLI, as on the GPU machine)."""
    cmd = [sys.executable, "-m", "entrenar", "generate", "--model", str(gguf), "--prompt", prompt,
           "--max-new-tokens", str(n), "--device", "cpu", "--dtype", "fp32", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "2"})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        print(f"entrenar generate --device cpu failed (exit {p.returncode}): {p.stderr[-800:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])["token_ids"]


def tokens_of(gen: dict[str, Any] | None) -> list[int] | None:
    return gen["token_ids"] if gen and gen.get("ok") else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--tokenizer", required=True, type=Path, help="tokenizer.json (or a tokenizer directory)")
    ap.add_argument("--greedy", required=True, type=Path, help="small_greedy.json of the GPU run")
    ap.add_argument("--entrenar-cpu", action="store_true", help="also `entrenar generate --device cpu` the GGUF here")
    ap.add_argument("--json", type=Path, help="write the result here too")
    a = ap.parse_args()

    from entrenar.tokenizer import load_tokenizer

    greedy = json.loads(a.greedy.read_text())
    flags = greedy["generate_flags"].split()
    n_new = int(flags[flags.index("--max-new-tokens") + 1])
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(str(tokenizer_dir(a.tokenizer, greedy.get("tokenizer_config"), Path(tmp))))
    stop_ids = set(greedy["stop_ids"]) if greedy.get("stop_ids") is not None else set(tok.stop_ids)
    llm = load_llama(a.gguf, n_ctx=512)
    results = []
    for p in greedy["prompts"]:
        ours_ids = tok.encode(p["prompt"])
        llama_ids = llm.tokenize(p["prompt"].encode("utf-8"), add_bos=True, special=True)
        theirs, rows = llama_greedy(llm, ours_ids, n_new, stop_ids)
        r = {"prompt": p["prompt"], "prompt_tokens": len(ours_ids),
             "prompt_ids_match_gpu_record": p.get("prompt_ids") in (None, ours_ids),
             "prompt_ids_match_llama_cpp": llama_ids == ours_ids, "llama_cpp_tokens": theirs,
             "text": tok.decode(theirs),
             "vs_gpu_generate_final": compare(theirs, rows, tokens_of(p.get("final"))),
             "vs_gpu_generate_gguf": compare(theirs, rows, tokens_of(p.get("gguf")))}
        if a.entrenar_cpu:
            r["vs_cpu_generate_gguf"] = compare(theirs, rows, entrenar_cpu(a.gguf, p["prompt"], n_new))
        results.append(r)
    ok = all(r["prompt_ids_match_gpu_record"] and r["prompt_ids_match_llama_cpp"]
             and r["vs_gpu_generate_final"].get("identical") for r in results)
    summary = {"ok": ok, "gguf": str(a.gguf), "stop_ids": sorted(stop_ids), "max_new_tokens": n_new,
               "gpu_device": greedy.get("device"), "prompts": results}
    print("| prompt | prompt ids = GPU's = llama.cpp's | tokens | llama.cpp = GPU final/ | = GPU GGUF |"
          + (" = CPU GGUF |" if a.entrenar_cpu else ""))
    print("|---|---|---:|---|---|" + ("---|" if a.entrenar_cpu else ""))
    for r in results:
        cells = [r["vs_gpu_generate_final"], r["vs_gpu_generate_gguf"]]
        cells += [r["vs_cpu_generate_gguf"]] if a.entrenar_cpu else []
        shown = [("yes" if c.get("identical") else f"no at {c.get('first_difference')} (margin "
                  f"{c.get('llama_top2_margin', float('nan')):.3g})") if c.get("compared") else "n/a" for c in cells]
        print(f"| {r['prompt'][:30]!r} | {r['prompt_ids_match_gpu_record'] and r['prompt_ids_match_llama_cpp']} | "
              f"{len(r['llama_cpp_tokens'])} | " + " | ".join(shown) + " |")
    print(json.dumps({k: v for k, v in summary.items() if k != "prompts"}))
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
