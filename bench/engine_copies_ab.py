"""The engine as the CLI runs it -- fp32 weights under bf16 autocast -- with and without the bf16 copies of the linear
weights (engine.linear_weights_in), and a pass@10-like call whose samples share their prompt's prefill.

    PYTHONPATH=src:. python bench/engine_copies_ab.py            # GPU, SmolLM2-135M shapes, random weights
    PYTHONPATH=src:. python bench/engine_copies_ab.py --tiny     # CPU dry run (no copies there: checks the script)

One JSON line per run: seconds, generated tokens/s, the engine's stats; `same_tokens` compares copies on vs off.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.decode_profile import build, sync
from bench.engine_throughput import TINY_WORKLOADS, WORKLOADS, workload
from bench.generate_throughput import NoStops
from entrenar import engine as eng


def run(model, vocab: int, prompts, answers, device: str, seeds=None, temperature: float = 0.0) -> tuple[list, dict]:
    slots = eng.resolve_slots("auto", model, [len(p) for p in prompts], max(answers),
                              sampling=temperature > 0)[0] if device == "cuda" else 8
    settings = eng.GenerationSettings(max_new_tokens=max(answers), stop_ids=[], max_slots=slots, temperature=temperature,
                                      top_p=0.95)
    stats: dict = {}
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        sync(device)
        t0 = time.perf_counter()
        out = eng.generate_many(model, NoStops(vocab), prompts, settings, seeds=seeds, max_new=answers, stats=stats)
        sync(device)
    seconds = time.perf_counter() - t0
    toks = sum(len(r.token_ids) for r in out)
    return [r.token_ids for r in out], {"seconds": round(seconds, 3), "tokens_per_s": round(toks / seconds),
                                         "stats": stats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    model = build("smollm2-135m", args.tiny, device).float()  # fp32 weights, as `entrenar eval` loads them
    vocab = model.cfg.vocab_size
    specs = TINY_WORKLOADS if args.tiny else WORKLOADS
    prompts, answers = workload(specs["bfcl840"], vocab)
    share = eng.LINEAR_COPY_SHARE
    tokens = {}
    for copies in (True, False, True):
        eng.LINEAR_COPY_SHARE = share if copies else 0.0
        run(model, vocab, prompts[:64], answers[:64], device)  # warm-up: compiles, cuBLAS
        tokens[copies], row = run(model, vocab, prompts, answers, device)
        print(json.dumps({"workload": "bfcl840", "fp32_under_bf16_autocast": True, "linear_copies": copies, **row}),
              flush=True)
    eng.LINEAR_COPY_SHARE = share
    print(json.dumps({"same_tokens": tokens[True] == tokens[False],
                      "rows_equal": sum(a == b for a, b in zip(tokens[True], tokens[False])), "rows": len(prompts)}),
          flush=True)
    he, he_answers = workload(specs["humaneval164"], vocab)
    k = 10
    asked = [p for p in he for _ in range(k)]
    _, row = run(model, vocab, asked, [a for a in he_answers for _ in range(k)], device,
                 seeds=[s for _ in he for s in range(k)], temperature=0.8)
    print(json.dumps({"workload": f"humaneval164 x {k} samples", **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
