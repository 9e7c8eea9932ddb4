"""Parity of the HumanEval metric: the same harness (prompts, stop rule, code extraction, sandbox) driven by
entrenar's generate_batch and by transformers' generate (greedy), on the same weights (the packaged
Qwen2.5-Coder-0.5B-Instruct GGUF, fp32): per-problem pass/fail must agree.

    PYTHONPATH=src python bench/humaneval_parity.py --out parity.jsonl [--limit N] [--batch-size 8]

Problems go in chunks of --batch-size (in HumanEval order); each chunk is decoded by both, and one JSON
line per problem (ours and transformers' pass/fail, completions, whether the token ids agree) is appended
to --out as soon as the chunk is done, so a run stopped at any point keeps what it finished. The last
stdout line is the summary: pass@1 of each, the problems run, and those whose pass/fail differ.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from entrenar.evaluate.harness import TaskEvalSettings, entrenar_completer, summarize, task_records
from entrenar.evaluate.oracle import transformers_completer
from entrenar.evaluate.tasks import humaneval_problems, prompt_ids
from entrenar.formats import load_model
from entrenar.model_spec import packaged_path
from entrenar.tokenizer import load_tokenizer

MODEL = "qwen2.5-coder-0.5b-instruct"


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSONL, appended per chunk")
    ap.add_argument("--limit", type=int, default=0, help="first N problems (0 = all 164)")
    ap.add_argument("--start", type=int, default=0, help="skip the first N problems (continue a run)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    path = packaged_path(MODEL)
    tok = load_tokenizer(MODEL)
    ours = load_model(path, dtype=torch.float32).eval()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    problems = humaneval_problems()[args.start:]
    if args.limit:
        problems = problems[: args.limit]
    settings = TaskEvalSettings(batch_size=args.batch_size, chat=True)
    ours_ids: dict = {}
    hf_ids: dict = {}
    complete_ours = entrenar_completer(ours, tok, args.max_new_tokens, True, token_ids=ours_ids)
    complete_hf = transformers_completer(hf, tok, args.max_new_tokens, True, token_ids=hf_ids)
    all_ours, all_hf = [], []
    t0 = time.perf_counter()
    for c in range(0, len(problems), args.batch_size):
        chunk = problems[c:c + args.batch_size]
        t = time.perf_counter()
        rec_ours = task_records(chunk, tok, complete_ours, settings)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        rec_hf = task_records(chunk, tok, complete_hf, settings)
        t_hf = time.perf_counter() - t
        with open(args.out, "a") as f:
            for p, a, b in zip(chunk, rec_ours, rec_hf):
                key = tuple(prompt_ids(p, tok, True))
                f.write(json.dumps({"task_id": p.task_id, "ours_passed": a["passed"], "hf_passed": b["passed"],
                                    "same_tokens": ours_ids[key] == hf_ids[key], "ours_tokens": len(ours_ids[key]),
                                    "hf_tokens": len(hf_ids[key]), "ours_error": a["error"][-300:],
                                    "hf_error": b["error"][-300:], "ours_completion": a["completion"],
                                    "hf_completion": b["completion"]}) + "\n")
        all_ours += rec_ours
        all_hf += rec_hf
        agree = sum(a["passed"] == b["passed"] for a, b in zip(all_ours, all_hf))
        print(f"{len(all_ours)}/{len(problems)} problems: ours {sum(r['passed'] for r in all_ours)} pass, "
              f"transformers {sum(r['passed'] for r in all_hf)} pass, agree on {agree}; chunk {t_ours:.0f} s ours, "
              f"{t_hf:.0f} s transformers ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    s_ours, s_hf = summarize(all_ours, settings), summarize(all_hf, settings)
    differ = [a["task_id"] for a, b in zip(all_ours, all_hf) if a["passed"] != b["passed"]]
    print(json.dumps({"problems": s_ours["problems"], "pass@1_entrenar": s_ours["pass@1"],
                      "pass@1_transformers": s_hf["pass@1"], "differ": differ,
                      "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                      "seconds": round(time.perf_counter() - t0, 1), "out": str(Path(args.out))}))
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
