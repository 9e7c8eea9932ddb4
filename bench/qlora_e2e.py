"""Issue 24 part 4: QLoRA of the packaged Qwen2.5-Coder-0.5B-Instruct end to end on the CPU, the seeds' setup.

    PYTHONPATH=src nice -n 5 python bench/qlora_e2e.py --out /work/runs/qlora [--steps 24] [--limit 16]

Every SFT sample carries the ~1,550-token system prompt of bench/qlora_system_prompt.txt (the setup an earlier
trainer's 512-token loss window silently trained nothing on) and is trained at --max-seq-len 2048. Stages, each
through the real CLI with --json, each skipped when its result file already exists (so a stopped run continues):

  data      `data sft-from-code` over the standard library's sources (SFT_FLAGS: fenced, self-contained) with the system
            prompt, then `data check` at --max-seq-len 2048 (kept samples, loss tokens, end of turn trained)
  eval-base `eval --task humaneval --limit N --max-new-tokens M` (greedy) of the base model, with the template's
            default system prompt and with --system-prompt-file (the training's: the pass@1 criterion)
  r16/r256  `finetune --mode qlora --rank R --lr auto --batch-size 1 --steps S --max-seq-len 2048`
            then the same HumanEval eval of the run
  export    `export gguf RUN RUN.gguf --type f32` of each run (the adapter merged onto the NF4 weights it was
            trained on), then `entrenar generate --chat` of the run vs llama.cpp's greedy tokens from the
            GGUF (llama-cpp-python) on a few prompts

OUT/summary.json gathers the numbers; OUT/logs/ has every command's stdout/stderr. Exit 0 when every stage ran
and every check held (loss fell without NaN at both ranks, pass@1 within the accepted drop, llama.cpp == generate).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
MODEL = "qwen2.5-coder-0.5b-instruct"
SYSTEM_PROMPT = BENCH / "qlora_system_prompt.txt"
# pass@1 may fall at most this much from the base on the subset (see RESULTS.md for why this number)
ACCEPTED_DROP = 0.125
# Session 9's data (session 8's runs used packaging's functions, plain answers, every documented function:
# both ranks lost HumanEval problems - rank 16 stopped closing its answers, rank 256 wrote terse calls to
# helpers it was never shown). Now: answers in a ```python block as the model already answers, only
# self-contained functions (no module helpers or constants) with at least 3 body lines, from the stdlib.
SFT_FLAGS = ("--answer", "fenced", "--self-contained", "--min-body-lines", "3",
             *[x for d in ("test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "config-*")
               for x in ("--exclude", f"{d}/*")])
COMPARE_PROMPTS = (
    "Write a Python function is_palindrome(s) that ignores case and non-alphanumeric characters.",
    "Explain in two sentences what a Python generator is.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
)


def run_cli(name: str, args: list[str], out: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run `entrenar ARGS --json`, keep its logs, return its JSON line (+ seconds, exit code)."""
    result_file = out / f"stage-{name}.json"
    if result_file.is_file():
        print(f"[{name}] done before: {result_file}", flush=True)
        return json.loads(result_file.read_text())
    cmd = [sys.executable, "-m", "entrenar", *args, "--json"]
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(logs / f"{name}.out", "w") as so, open(logs / f"{name}.err", "w") as se:
        p = subprocess.run(cmd, stdout=so, stderr=se, env=env, check=False)
    seconds = time.time() - t0
    lines = [ln for ln in (logs / f"{name}.out").read_text().splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"ok": False, "error": "no JSON line"}
    res.update(_command=shlex.join(["entrenar", *args, "--json"]), _seconds=round(seconds, 1), _exit=p.returncode)
    print(f"[{name}] exit {p.returncode} in {seconds:.0f} s", flush=True)
    if p.returncode == 0:
        result_file.write_text(json.dumps(res, indent=1) + "\n")
    return res


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def loss_summary(run: Path) -> dict[str, Any]:
    """First/last step losses, NaN check, median tokens/s and the evals of a run directory."""
    m = read_jsonl(run / "metrics.jsonl")
    losses = [r.get("loss") for r in m]
    finite = all(isinstance(x, (int, float)) and np.isfinite(x) for x in losses)
    k = max(1, len(losses) // 4)  # first and last quarter: one sample's loss is noisy at batch 1
    first_q, last_q = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    evals = read_jsonl(run / "eval.jsonl") if (run / "eval.jsonl").is_file() else []
    cfg = json.loads((run / "run.json").read_text())
    return {"steps": len(m), "loss_first": losses[0], "loss_last": losses[-1],
            "loss_first_quarter_mean": first_q, "loss_last_quarter_mean": last_q, "all_finite": finite,
            "fell": finite and last_q < first_q and (not evals or evals[-1]["loss"] < evals[0]["loss"]),
            "tok_s_median": float(np.median([r["tok_s"] for r in m[1:] or m])),
            # metrics' "tokens" counts the run so far, "loss_tokens" the step's
            "tokens": int(m[-1]["tokens"]), "loss_tokens": int(sum(r["loss_tokens"] for r in m)),
            "peak_mem_mb": max(r.get("mem_mb") or 0 for r in m),
            "evals": [{"step": e["step"], "loss": e["loss"]} for e in evals],
            "lr": cfg.get("config", cfg).get("lr") if isinstance(cfg.get("config", cfg), dict) else None,
            "losses": losses}


def llama_greedy(gguf: Path, prompt_ids: list[int], n: int, stop_ids: set[int]) -> list[int]:
    """llama.cpp's argmax continuation (no sampler), f32 K/V cache, stopping at the tokenizer's stop ids."""
    sys.path.insert(0, str(BENCH.parent))  # the checkout's root: bench is a package (python bench/qlora_e2e.py)
    from bench.e2e_gguf_check import llama_greedy as greedy_from
    from bench.e2e_gguf_check import load_llama

    llm = load_llama(gguf, n_ctx=len(prompt_ids) + n + 8)
    try:
        return greedy_from(llm, prompt_ids, n, stop_ids)[0]
    finally:
        llm.close()


def compare_gguf(name: str, run: Path, gguf: Path, out: Path, env: dict[str, str], n_new: int) -> dict[str, Any]:
    """`entrenar generate --chat` of RUN vs llama.cpp on RUN's exported GGUF: the same greedy tokens?"""
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(str(run))
    rows = []
    for i, prompt in enumerate(COMPARE_PROMPTS):
        gen = run_cli(f"generate-{name}-{i}", ["generate", "--model", str(run), "--prompt", prompt, "--chat",
                                                "--max-new-tokens", str(n_new)], out, env)
        ids = tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True).ids
        theirs = llama_greedy(gguf, ids, n_new, set(tok.stop_ids))
        ours = gen.get("token_ids") or []
        # both keep the stop token that ended generation (GenerationResult.token_ids includes it)
        rows.append({"prompt": prompt, "prompt_tokens": len(ids), "generate_tokens": len(ours),
                     "identical": ours == theirs, "generate_text": gen.get("text"),
                     "llama_text": tok.decode([t for t in theirs if t not in tok.stop_ids]),
                     "stop_reason": gen.get("stop_reason")})
        print(f"[compare {name} {i}] identical={rows[-1]['identical']} ({len(ours)} tokens)", flush=True)
    return {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "max_new_tokens": n_new, "prompts": rows,
            "all_identical": all(r["identical"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--source", default=None,
                    help="Python source directory for sft-from-code (this interpreter's standard library)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ranks", default="16,256")
    ap.add_argument("--limit", type=int, default=16, help="HumanEval problems (the first N)")
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--no-base", dest="base", action="store_false",
                    help="skip the base model's HumanEval (another invocation on the same --out runs it)")
    ap.add_argument("--compare-tokens", type=int, default=48)
    # without it rank 256 peaked at 10 GB (2048 tokens of activations + 141M adapter parameters with AdamW) and
    # was OOM-killed on the shared 23 GB machine
    ap.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                    help="train without --activation-checkpointing")
    # OMP threads of each command: 1 on a shared, loaded machine (2 threads on 2 busy cores wait on each other)
    ap.add_argument("--threads", default=os.environ.get("OMP_NUM_THREADS", "1"))
    a = ap.parse_args()
    out: Path = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": a.threads}
    if a.source is None:  # the standard library of this interpreter (site-packages is never descended into)
        import sysconfig

        a.source = sysconfig.get_paths()["stdlib"]
    summary: dict[str, Any] = {"model": MODEL, "system_prompt": str(SYSTEM_PROMPT.relative_to(BENCH.parent)),
                               "source": a.source, "steps": a.steps, "limit": a.limit,
                               "max_new_tokens": a.max_new_tokens, "accepted_pass1_drop": ACCEPTED_DROP}
    t_all = time.time()

    data = out / "sft.jsonl"
    summary["data_build"] = run_cli("data", ["data", "sft-from-code", "--out", str(data), "--system-prompt-file",
                                             str(SYSTEM_PROMPT), *SFT_FLAGS, "--overwrite", a.source], out, env)
    check = run_cli("data-check", ["data", "check", "--model", MODEL, "--data", str(data), "--max-seq-len", "2048"],
                    out, env)
    rep = check.get("report", {})
    summary["data_check"] = {k: rep.get(k) for k in ("rows_read", "kept", "skipped", "skip_fraction", "eot_trained",
                                                     "loss_tokens", "tokens_total", "longest_sample_tokens")}

    def humaneval(name: str, model: str) -> dict[str, Any]:
        """pass@1 without a system prompt (the template's default) and under the training's system prompt."""
        found = {}
        for tag, extra in (("", []), ("-system", ["--system-prompt-file", str(SYSTEM_PROMPT)])):
            res = run_cli(f"humaneval-{name}{tag}", ["eval", "--model", model, "--task", "humaneval", "--limit",
                                                     str(a.limit), "--max-new-tokens", str(a.max_new_tokens), "--out",
                                                     str(out / f"humaneval-{name}{tag}.jsonl"), "--overwrite", *extra],
                          out, env)
            found[tag.strip("-") or "default_system"] = {
                k: res.get(k) for k in ("ok", "problems", "pass@1", "passed_problems", "format", "seconds",
                                        "generate_seconds", "_seconds", "_command")}
        return found

    ranks = [int(x) for x in a.ranks.split(",")]
    summary["runs"], summary["gguf"], summary["humaneval"] = {}, {}, {}

    def save() -> None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    # per rank (largest first): train, export, llama.cpp vs generate, HumanEval; the base's HumanEval last (its
    # greedy completions do not depend on this run), so on a loaded 2-core machine one rank is complete first
    for r in sorted(ranks, reverse=True):
        run = out / f"r{r}"
        ft = run_cli(f"finetune-r{r}", ["finetune", "--model", MODEL, "--mode", "qlora", "--rank", str(r),
                                        "--lr", "auto", "--data", str(data), "--max-seq-len", "2048",
                                        "--batch-size", "1", "--steps", str(a.steps),
                                        "--eval-batches", str(a.eval_batches), "--seed", "0", "--out", str(run),
                                        *(["--activation-checkpointing"] if a.checkpointing else [])],
                     out, env)
        info: dict[str, Any] = {"command": ft.get("_command"), "seconds": ft.get("_seconds"), "exit": ft.get("_exit"),
                                "ok": ft.get("ok")}
        if (run / "metrics.jsonl").is_file():
            info.update(loss_summary(run))
        summary["runs"][f"r{r}"] = info
        save()
        if not ft.get("ok"):
            continue
        gguf = out / f"r{r}-f32.gguf"
        ex = run_cli(f"export-r{r}", ["export", "gguf", str(run), str(gguf), "--type", "f32"], out, env)
        if ex.get("ok"):
            summary["gguf"][f"r{r}"] = {"export_seconds": ex.get("_seconds"), "export_command": ex.get("_command"),
                                        "adapters_merged": ex.get("adapters_merged"),
                                        **compare_gguf(f"r{r}", run, gguf, out, env, a.compare_tokens)}
        else:
            summary["gguf"][f"r{r}"] = {"export": ex}
        save()
        summary["humaneval"][f"r{r}"] = humaneval(f"r{r}", str(run))
        save()
    if a.base:
        summary["humaneval"]["base"] = humaneval("base", MODEL)
        save()

    def pass1(name: str, prompt: str) -> float | None:
        return summary["humaneval"].get(name, {}).get(prompt, {}).get("pass@1")

    checks = {}
    for r in [int(x) for x in a.ranks.split(",")]:
        info = summary["runs"].get(f"r{r}", {})
        checks[f"r{r}_loss_fell_finite"] = bool(info.get("fell"))
        # the criterion: under the system prompt the model was trained with (as it is deployed); the default
        # system prompt's numbers are reported beside it (session 9: the adapters do not carry over to it)
        base, he = pass1("base", "system"), pass1(f"r{r}", "system")
        checks[f"r{r}_pass1_within_drop"] = base is not None and he is not None and he >= base - ACCEPTED_DROP
        checks[f"r{r}_llama_cpp_equals_generate"] = bool(summary["gguf"].get(f"r{r}", {}).get("all_identical"))
    summary["checks"] = checks
    summary["ok"] = all(checks.values())
    summary["seconds_this_invocation"] = round(time.time() - t_all, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({"ok": summary["ok"], "checks": checks}))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
