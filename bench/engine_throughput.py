"""Generation of many prompts: entrenar's engine (engine.generate_many: continuous batching, slots from
--batch-size auto) vs transformers' generate at its best batch, in one process on the same weights, on a
BFCL-840-like and a HumanEval-164-like workload; then, with --cli MODEL, the real command line on a real model.

    PYTHONPATH=src python bench/engine_throughput.py                   # GPU: smollm2-135m and qwen2.5-0.5b shapes
    PYTHONPATH=src python bench/engine_throughput.py --tiny            # CPU dry run: tiny shapes, small workloads
    PYTHONPATH=src python bench/engine_throughput.py --cli MODEL [--chat-template FILE]   # + `entrenar eval`

Workloads (random prompt ids and weights; every request's answer length drawn once from a fixed seed, the same
for both generators):
- bfcl840: 840 prompts of 250..900 tokens (BFCL prompts carry their functions); 55% of the answers run to the
  256-token limit (the base models' long answers), the rest end after 16..120 tokens.
- humaneval164: 164 prompts of 120..450 tokens; 30% of the answers run to the 512 limit, the rest 60..300.
Each request stops at its length: ours through generate_many's per-request max_new, transformers' through a
StoppingCriteria ending each row at its own length (a finished row is padded while its batch goes on, as
transformers does at EOS). Both get the prompts longest first (transformers' batches then pad little).

1. Token identity, float32 (TF32 off), per shape: 8 prompts of different lengths and answer lengths; the engine's
   greedy tokens at 1, 3 and 8 slots (eager, and with CUDA graphs) equal generate() of each prompt alone, and
   transformers' generate of each prompt alone. bf16: the engine with graphs equals the engine eager.
2. Speed, bf16 weights for both: the wall time of one call generating the whole workload (cuda synchronize; the
   prefills and the graph captures included; after one warm-up call on the workload's first 64 prompts);
   tokens/s = generated tokens / time. transformers at each of --hf-batches, the best taken.
3. --cli MODEL: `python -m entrenar eval --task bfcl:simple_python,multiple,irrelevance` and `--task humaneval` on
   MODEL (default --batch-size auto), their generate_seconds and seconds from the --json line.

One JSON line per check and row, a markdown table, and a last summary line {"ok", "card", "identical_fp32",
"graph_eq_eager_bf16", "rows", "cli", "errors"}; exit 1 when a stage failed or an fp32 identity did not hold.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from bench.generate_throughput import NoStops, build, sync, watchdog
from entrenar.config import preset
from entrenar.engine import GenerationSettings, generate_many, resolve_slots
from entrenar.generate import generate

WORKLOADS = {  # name: (prompts, prompt lengths lo..hi, limit, share of answers at the limit, others lo..hi)
    "bfcl840": (840, (250, 900), 256, 0.55, (16, 120)),
    "humaneval164": (164, (120, 450), 512, 0.30, (60, 300)),
}
TINY_WORKLOADS = {"bfcl840": (24, (10, 40), 16, 0.5, (2, 10)), "humaneval164": (12, (8, 30), 24, 0.3, (4, 16))}


def shape_config(name: str, tiny: bool):
    cfg = preset(name)
    if tiny:
        cfg = dataclasses.replace(preset("tiny"), architecture=cfg.architecture, attention_bias=cfg.attention_bias,
                                  tie_word_embeddings=True)
    return cfg


def workload(spec: tuple, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts longest first, each one's answer length)."""
    n, (plo, phi), limit, at_limit, (alo, ahi) = spec
    g = torch.Generator().manual_seed(seed)
    lengths = sorted(torch.randint(plo, phi + 1, (n,), generator=g).tolist(), reverse=True)
    prompts = [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths]
    answers = [limit if float(torch.rand((), generator=g)) < at_limit else
               int(torch.randint(alo, ahi + 1, (), generator=g)) for _ in range(n)]
    return prompts, answers


def ours(model, vocab: int, prompts, answers, slots: int | str, graphs: bool = True) -> tuple[list[list[int]], str, int]:
    """(tokens per prompt, decoder, slots) of generate_many, each request stopping at its answer length."""
    n, _ = resolve_slots(slots, model, [len(p) for p in prompts], max(answers), cuda_graphs=graphs)
    out = generate_many(model, NoStops(vocab), prompts, GenerationSettings(max_new_tokens=max(answers), max_slots=n,
                                                                             stop_ids=[], cuda_graphs=graphs),
                        max_new=answers)
    return [r.token_ids for r in out], out[0].decoder, n


def transformers_tokens(hf, prompts, answers, batch: int, device: str) -> list[list[int]]:
    """transformers' greedy generate in batches of `batch`, each row ending at its own answer length."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class OwnLength(StoppingCriteria):
        def __init__(self, width: int, want: torch.Tensor):
            self.width, self.want = width, want

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - self.width) >= self.want

    out: list[list[int]] = []
    for at in range(0, len(prompts), batch):
        chunk, lens = prompts[at:at + batch], answers[at:at + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        stop = OwnLength(width, torch.tensor(lens, device=device))
        with torch.inference_mode():
            seq = hf.generate(ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False, eos_token_id=None,
                              pad_token_id=0, stopping_criteria=StoppingCriteriaList([stop]))
        out += [row[:k] for row, k in zip(seq[:, width:].tolist(), lens)]
    return out


def check_fp32(shape: str, model, hf, vocab: int, device: str, tiny: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    lengths = [60, 41, 33, 20, 17, 9, 5, 3]
    prompts = [torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths]
    answers = [12, 5, 9, 16, 3, 11, 7, 14]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        alone = [generate(model, NoStops(vocab), p, k, stop_ids=[]).token_ids for p, k in zip(prompts, answers)]
        ref = [transformers_tokens(hf, [p], [k], 1, device)[0] for p, k in zip(prompts, answers)]
        res: dict = {"check": "identity_fp32", "shape": shape, "prompt_lens": lengths, "answers": answers,
                     "alone_eq_transformers": alone == ref}
        for slots in (1, 3, 8):
            for graphs in (False, True):
                got, decoder, _ = ours(model, vocab, prompts, answers, slots, graphs)
                res[f"slots{slots}_{'graph' if graphs else 'eager'}_eq_alone"] = got == alone
                res.setdefault("decoders", []).append(decoder)
    finally:
        torch.set_float32_matmul_precision(before)
    res["identical"] = all(v for k, v in res.items() if k.endswith("_eq_alone"))
    return res


def speed(shape: str, name: str, model, hf, vocab: int, spec: tuple, device: str, hf_batches: list[int],
          card: str) -> dict:
    prompts, answers = workload(spec, vocab)
    tokens = sum(answers)
    got: dict = {}

    def timed(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    timed(lambda: ours(model, vocab, prompts[:64], answers[:64], "auto"))  # warm-up: kernels, allocator
    t_ours = timed(lambda: got.update(ours=ours(model, vocab, prompts, answers, "auto")))
    row = {"shape": shape, "workload": name, "prompts": len(prompts), "generated_tokens": tokens, "device": card,
           "slots": got["ours"][2], "decoder": got["ours"][1], "entrenar_s": round(t_ours, 3),
           "entrenar_tok_s": round(tokens / t_ours, 1), "transformers": {}}
    best = None
    for b in hf_batches:
        transformers_tokens(hf, prompts[:min(b, 64)], [min(a, 8) for a in answers[:min(b, 64)]], b, device)  # warm
        t = timed(lambda b=b: got.update({f"hf{b}": transformers_tokens(hf, prompts, answers, b, device)}))
        row["transformers"][str(b)] = {"s": round(t, 3), "tok_s": round(tokens / t, 1),
                                       "rows_eq_ours": sum(x == y for x, y in zip(got[f"hf{b}"], got["ours"][0]))}
        if best is None or t < best[1]:
            best = (b, t)
    if best is not None:
        row.update(transformers_best_batch=best[0], transformers_s=round(best[1], 3),
                   transformers_tok_s=round(tokens / best[1], 1), ratio=round(best[1] / t_ours, 2))
    return row


def cli_rows(model_dir: str, chat_template: str | None, device: str) -> list[dict]:
    """`entrenar eval --task bfcl:...` and `--task humaneval` on a real model: their JSON's times."""
    out = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in ("src", os.environ.get("PYTHONPATH", "")) if p)}
    for task in ("bfcl:simple_python,multiple,irrelevance", "humaneval"):
        cmd = [sys.executable, "-m", "entrenar", "eval", "--task", task, "--model", model_dir, "--device", device,
               "--json"]
        if chat_template and task.startswith("bfcl"):
            cmd += ["--chat-template", chat_template]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        row = {"task": task, "exit": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
               "command": " ".join(cmd)}
        try:
            js = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update({k: js.get(k) for k in ("generate_seconds", "seconds", "problems", "passed_problems",
                                                "truncated", "accuracy", "pass@1")})
        except (IndexError, json.JSONDecodeError):
            row["stderr"] = proc.stderr[-1500:]
        row["slots_log"] = [ln for ln in proc.stderr.splitlines() if "--batch-size" in ln][:3]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and workloads on the CPU (checks the script)")
    ap.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b", help="comma-separated presets")
    ap.add_argument("--workloads", default="bfcl840,humaneval164", help="comma-separated: bfcl840, humaneval164")
    ap.add_argument("--hf-batches", default=None, help="transformers' batch sizes, best taken (64,256; --tiny: 4)")
    ap.add_argument("--no-checks", action="store_true", help="skip the token identity checks")
    ap.add_argument("--cli", default=None, metavar="MODEL", help="also time `entrenar eval --task bfcl/humaneval` on it")
    ap.add_argument("--chat-template", default=None, help="--cli's bfcl: a template that renders tools")
    ap.add_argument("--timeout-s", type=float, default=570.0, help="give up (JSON error line, exit 1) after this")
    args = ap.parse_args()
    watchdog(args.timeout_s)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and not args.tiny:
        print(json.dumps({"ok": False, "error": "no CUDA device: --tiny checks the script on the CPU"}), flush=True)
        return 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf_batches = [int(b) for b in (args.hf_batches or ("4" if args.tiny else "64,256")).split(",")]
    card = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(json.dumps({"start": True, "card": card, "torch": torch.__version__, "shapes": args.shapes,
                      "workloads": args.workloads, "hf_batches": hf_batches}), flush=True)
    rows, checks, errors = [], [], []
    for shape in args.shapes.split(","):
        cfg = shape_config(shape, args.tiny)
        stage = "build"
        model = hf = None
        try:
            model, hf = build(cfg, device)
            if not args.no_checks:
                stage = "identity_fp32"
                checks.append(check_fp32(shape, model, hf, cfg.vocab_size, device, args.tiny))
                print(json.dumps(checks[-1]), flush=True)
            model, hf = model.to(dtype), hf.to(dtype)
            if not args.no_checks:
                stage = "graph_eq_eager_bf16"
                prompts, answers = workload((TINY_WORKLOADS if args.tiny else WORKLOADS)["bfcl840"], cfg.vocab_size, 5)
                prompts, answers = prompts[:48], [min(a, 32) for a in answers[:48]]
                graph = ours(model, cfg.vocab_size, prompts, answers, 16, True)
                eager = ours(model, cfg.vocab_size, prompts, answers, 16, False)
                checks.append({"check": "graph_eq_eager_bf16", "shape": shape, "decoder": graph[1],
                               "rows_equal": sum(a == b for a, b in zip(graph[0], eager[0])), "rows": len(prompts),
                               "identical": graph[0] == eager[0]})
                print(json.dumps(checks[-1]), flush=True)
            for name in filter(None, args.workloads.split(",")):  # "": the checks only
                stage = f"speed {name}"
                spec = (TINY_WORKLOADS if args.tiny else WORKLOADS)[name]
                rows.append(speed(shape, name, model, hf, cfg.vocab_size, spec, device, hf_batches, card))
                print(json.dumps(rows[-1]), flush=True)
        except Exception as e:  # noqa: BLE001 -- reported (traceback, JSON, exit 1), the other shapes still run
            traceback.print_exc()
            errors.append(f"{shape}: {stage}: {type(e).__name__}: {e}")
            print(json.dumps({"ok": False, "shape": shape, "stage": stage, "error": errors[-1]}), flush=True)
        finally:
            model = hf = None
            if device == "cuda":
                torch.cuda.empty_cache()
    cli = cli_rows(args.cli, args.chat_template, device) if args.cli else []
    print(f"\n| shape | workload | tokens | entrenar s | slots | transformers s (best batch) | ratio |  ({card}, {dtype})")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['workload']} | {r['generated_tokens']:,} | {r['entrenar_s']} | {r['slots']} | "
              f"{r.get('transformers_s')} ({r.get('transformers_best_batch')}) | {r.get('ratio')}x |")
    fp32 = [c for c in checks if c["check"] == "identity_fp32"]
    bf16 = [c for c in checks if c["check"] == "graph_eq_eager_bf16"]
    summary = {"ok": not errors and all(c["identical"] for c in fp32), "card": card, "torch": torch.__version__,
               "identical_fp32": all(c["identical"] for c in fp32) if fp32 else None,
               "graph_eq_eager_bf16": all(c["identical"] for c in bf16) if bf16 else None,
               "rows": rows, "cli": cli, "checks": checks, "errors": errors}
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
