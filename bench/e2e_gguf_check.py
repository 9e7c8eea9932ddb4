"""Issue 24 part 5, the CPU side: the small model's GGUFs that bench/e2e_pretrain.sh exported on the GPU
machine run in llama.cpp (llama-cpp-python) here with the same greedy tokens as `entrenar generate` there.

    python -m bench.e2e_gguf_check OUT_DIR [--entrenar-cpu] [--json FILE]

OUT_DIR is what the GPU run returned: small-f16.gguf, small-f32.gguf, tokenizer.json, small_greedy.json
(--gguf-f16/--gguf-f32/--tokenizer/--greedy point elsewhere). For each prompt of small_greedy.json:
(1) our tokenizer (tokenizer.json + the tokenizer_config.json carried in small_greedy.json) gives the prompt ids
recorded on the GPU machine, and llama.cpp tokenizes the prompt from the GGUF to the same ids; (2) llama.cpp's
greedy continuation (argmax of its logits, no sampler, f32 K/V cache, stop at the tokenizer's stop ids) of each
GGUF is compared with the GPU's `generate --dtype fp32` of final/ and of each GGUF. Passing: llama.cpp on
small-f32.gguf (final/'s own weights) == `generate` of final/, and llama.cpp on small-f16.gguf == `generate`
of small-f16.gguf (the same f16-rounded weights). llama.cpp on the f16 file against final/ is reported too: f16
rounding moves logits by ~1e-3, which can flip a near tie. Where tokens differ, the first differing position is
named with llama.cpp's margin between its top two logits there. With --entrenar-cpu, `entrenar generate
--device cpu` of each GGUF here is compared as well (the same file and CPU as llama.cpp). Exit 0 when every
passing comparison holds, else 1.
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

from bench.e2e_report import first_difference

# (GGUF type, the GPU `generate` it must equal): final/'s weights exactly, and the f16 file itself
MUST_MATCH = (("f32", "final"), ("f16", "f16"))


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
    """Argmax continuation from llama.cpp's logits, and the logits row each token was chosen from."""
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


def cell(c: dict[str, Any]) -> str:
    if not c.get("compared"):
        return "n/a"
    if c["identical"]:
        return "yes"
    return f"no at {c.get('first_difference')} (margin {c.get('llama_top2_margin', float('nan')):.3g})"


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path, help="the files the GPU run returned")
    ap.add_argument("--gguf-f16", type=Path)
    ap.add_argument("--gguf-f32", type=Path)
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json (or a tokenizer directory)")
    ap.add_argument("--greedy", type=Path, help="small_greedy.json of the GPU run")
    ap.add_argument("--entrenar-cpu", action="store_true", help="also `entrenar generate --device cpu` each GGUF here")
    ap.add_argument("--json", type=Path, help="write the result here too")
    a = ap.parse_args()
    greedy_path = a.greedy or a.out_dir / "small_greedy.json"
    greedy = json.loads(greedy_path.read_text())
    ggufs = {"f16": a.gguf_f16 or a.out_dir / greedy["gguf"]["f16"], "f32": a.gguf_f32 or a.out_dir / greedy["gguf"]["f32"]}

    from entrenar.tokenizer import load_tokenizer

    flags = greedy["generate_flags"].split()
    n_new = int(flags[flags.index("--max-new-tokens") + 1])
    with tempfile.TemporaryDirectory() as tmp:
        tok = load_tokenizer(str(tokenizer_dir(a.tokenizer or a.out_dir / "tokenizer.json",
                                               greedy.get("tokenizer_config"), Path(tmp))))
    stop_ids = set(greedy["stop_ids"]) if greedy.get("stop_ids") is not None else set(tok.stop_ids)
    results: list[dict[str, Any]] = [{"prompt": p["prompt"]} for p in greedy["prompts"]]
    for typ, path in ggufs.items():
        llm = load_llama(path, n_ctx=512)
        for r, p in zip(results, greedy["prompts"]):
            ours_ids = tok.encode(p["prompt"])
            r["prompt_ids_ok"] = (r.get("prompt_ids_ok", True) and p.get("prompt_ids") in (None, ours_ids)
                                  and llm.tokenize(p["prompt"].encode("utf-8"), add_bos=True, special=True) == ours_ids)
            theirs, rows = llama_greedy(llm, ours_ids, n_new, stop_ids)
            r[f"llama_{typ}"] = {"tokens": theirs, "text": tok.decode(theirs),
                                 **{f"vs_gpu_{kind}": compare(theirs, rows, tokens_of(p.get(kind)))
                                    for kind in ("final", "f16", "f32")}}
            if a.entrenar_cpu:
                r[f"llama_{typ}"]["vs_cpu_same_file"] = compare(theirs, rows, entrenar_cpu(path, p["prompt"], n_new))
        del llm
    ok = all(r["prompt_ids_ok"] and r[f"llama_{typ}"][f"vs_gpu_{kind}"].get("identical")
             for r in results for typ, kind in MUST_MATCH)
    summary = {"ok": ok, "passing_requires": [f"llama.cpp({t}.gguf) == GPU generate({k})" for t, k in MUST_MATCH],
               "ggufs": {t: str(p) for t, p in ggufs.items()}, "stop_ids": sorted(stop_ids), "max_new_tokens": n_new,
               "gpu_device": greedy.get("device"), "prompts": results}
    cols = [("f32", "final"), ("f16", "f16"), ("f16", "final"), ("f32", "f32")]
    head = [f"llama.cpp {t} = GPU {k}" for t, k in cols] + (["= CPU, same file (f32, f16)"] if a.entrenar_cpu else [])
    print("| prompt | prompt ids agree | " + " | ".join(head) + " |")
    print("|---|---|" + "---|" * len(head))
    for r in results:
        cells = [cell(r[f"llama_{t}"][f"vs_gpu_{k}"]) for t, k in cols]
        if a.entrenar_cpu:
            cells.append(", ".join(cell(r[f"llama_{t}"]["vs_cpu_same_file"]) for t in ("f32", "f16")))
        print(f"| {r['prompt'][:30]!r} | {r['prompt_ids_ok']} | " + " | ".join(cells) + " |")
    for r in results:
        print(f"llama.cpp f32 text for {r['prompt'][:30]!r}: {r['llama_f32']['text'][:200]!r}")
    print(json.dumps({k: v for k, v in summary.items() if k != "prompts"}))
    if a.json:
        a.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
