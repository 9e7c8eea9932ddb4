"""Generation speed (issue 24, part 2): generated tokens/s of entrenar's generate_batch vs transformers'
generate(do_sample=False), in the same process on the same weights, at batch 1, 16 and 64, for two real
shapes, and whether the greedy tokens are the same. One GPU call does all of it (estimated 2-4 minutes on an
H100/H200; --timeout-s bounds it):

    PYTHONPATH=src python bench/generate_throughput.py                # GPU: both shapes, bf16 timing
    PYTHONPATH=src python bench/generate_throughput.py --tiny         # CPU: tiny models, checks the script

Shapes (random weights, N(0, 0.02), norms 1): `qwen2.5-0.5b` (the preset: vocab 151936, hidden 896, 24 layers,
14/2 heads, Q/K/V bias, tied head) and `llama-1b` (Llama-3.2-1B's: vocab 128256, hidden 2048, 16 layers,
32/8 heads, llama3 RoPE scaling, tied head). The same state dict is loaded into transformers' Qwen2ForCausalLM /
LlamaForCausalLM (our tensor names are HF's).

1. Token identity, float32 (TF32 off), per shape: 4 prompts of different lengths (left padding), --check-tokens
   greedy tokens each, from ours with the CUDA graph, ours eager (decoder="static", cuda_graphs=False), ours
   dynamic (the growing cache), each prompt alone (graph), and transformers' batched generate. All must be
   equal ("identical_fp32"). Then in bf16 at batch 16: graph vs eager (the same kernels: must be equal), and
   the rows equal to transformers' / to the prompt alone (reported: bf16 rounding differs between
   implementations and between batch sizes, and random weights have near-ties).
2. Speed, bf16 weights for both (fp32 on the CPU): every row gets a random prompt of --prompt-len tokens and
   decodes exactly --new-tokens (stop_ids=[] / eos_token_id=None with min_new_tokens), greedy. Time: from the
   call to the last token on the host (cuda synchronize), the prefill and the graph capture included, best of
   --repeats after one warm-up call per batch size. tokens/s = batch x new tokens / time.

Prints one JSON object per check and per (shape, batch), a markdown table (the goal: ratio >= 1.5 at batch 16),
and, last, one summary JSON object {"ok", "card", "identical_fp32", "graph_eq_eager_bf16", "ratio_batch16",
"rows", "checks", "errors"}; ok = no stage failed and every fp32 identity held. A failing stage is printed with its traceback and the run goes on (ok: false, exit 1); past
--timeout-s the process prints a JSON line {"ok": false, "error": "timeout ..."} and exits 1 (no hang).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import sys
import threading
import time
import traceback

import torch

from entrenar.config import ModelConfig, preset
from entrenar.generate import generate_batch
from entrenar.model import CausalLM

LLAMA_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       max_position_embeddings=131072, architecture="llama",
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def shape_config(name: str, tiny: bool) -> ModelConfig:
    if name == "qwen2.5-0.5b":
        cfg = preset("qwen2.5-0.5b")
        if tiny:  # the tiny preset with Qwen2's features, so the same HF class loads it
            cfg = dataclasses.replace(preset("tiny"), architecture="qwen2", attention_bias=True,
                                      tie_word_embeddings=True)
        return cfg
    if name == "llama-1b":
        if tiny:
            return dataclasses.replace(preset("tiny"), rope_theta=500000.0, rope_scaling=LLAMA_1B.rope_scaling,
                                       num_heads=4, num_kv_heads=1, max_position_embeddings=131072)
        return LLAMA_1B
    raise SystemExit(f"--shapes: unknown shape {name!r}; known: qwen2.5-0.5b, llama-1b")


class NoStops:
    """The few tokenizer attributes generate_batch reads, for random ids: nothing stops a row early."""

    eos_id = None

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.stop_ids: set[int] = set()

    def check_ids(self, ids, vocab_size: int) -> None:
        assert max(ids) < vocab_size

    def decode(self, ids, skip_special: bool = False) -> str:
        return ""


def build(cfg: ModelConfig, device: str):
    """(ours, transformers') in float32 on `device` with the same random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    with torch.device(device):  # built where they run: no CPU init of a billion parameters
        ours = CausalLM(cfg, kernels="triton" if device.startswith("cuda") else "torch")
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, cfg.initializer_range, generator=gen)
    hf_cfg_cls, hf_cls = (Qwen2Config, Qwen2ForCausalLM) if cfg.architecture == "qwen2" else (LlamaConfig,
                                                                                              LlamaForCausalLM)
    hf_cfg = hf_cfg_cls(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    with torch.device(device):
        hf = hf_cls(hf_cfg)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return ours.eval(), hf.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def ours_tokens(model, vocab: int, prompts: list[list[int]], new: int, **kw) -> tuple[list[list[int]], str]:
    """Greedy ids of generate_batch; the static decoder unless `decoder` says otherwise (on CUDA: the graph)."""
    out = generate_batch(model, NoStops(vocab), prompts, new, stop_ids=[], **{"decoder": "static", **kw})
    return [r.token_ids for r in out], out[0].decoder


def hf_tokens(hf, prompts: list[list[int]], new: int, device: str) -> list[list[int]]:
    """transformers' batched greedy generate, left padding with an attention mask, exactly `new` tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        seq = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return seq[:, width:].tolist()


def check_fp32(shape: str, ours, hf, vocab: int, n: int, device: str, gen: torch.Generator) -> dict:
    """Greedy tokens of 4 left-padded prompts, float32, TF32 off: graph == eager == dynamic == alone == HF."""
    lengths = [48, 31, 17, 5]
    prompts = [torch.randint(0, vocab, (t,), generator=gen).tolist() for t in lengths]
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        graph, decoder = ours_tokens(ours, vocab, prompts, n)
        eager, _ = ours_tokens(ours, vocab, prompts, n, decoder="static", cuda_graphs=False)
        dynamic, _ = ours_tokens(ours, vocab, prompts, n, decoder="dynamic")
        alone = [ours_tokens(ours, vocab, [p], n)[0][0] for p in prompts]
        ref = hf_tokens(hf, prompts, n, device)
    finally:
        torch.set_float32_matmul_precision(before)
    res = {"check": "identity_fp32", "shape": shape, "batch": len(prompts), "prompt_lens": lengths, "new_tokens": n,
           "decoder": decoder, "graph_eq_eager": graph == eager, "graph_eq_dynamic": graph == dynamic,
           "graph_eq_alone": graph == alone, "graph_eq_transformers": graph == ref,
           "rows_eq_transformers": sum(a == b for a, b in zip(graph, ref))}
    res["identical"] = all(res[k] for k in ("graph_eq_eager", "graph_eq_dynamic", "graph_eq_alone",
                                            "graph_eq_transformers"))
    return res


def check_bf16(shape: str, ours, hf, vocab: int, batch: int, n: int, prompt_len: int, device: str,
               gen: torch.Generator) -> dict:
    """bf16 at the goal's batch: graph vs eager must agree; rows vs transformers / alone are reported."""
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()
    graph, decoder = ours_tokens(ours, vocab, prompts, n)
    eager, _ = ours_tokens(ours, vocab, prompts, n, decoder="static", cuda_graphs=False)
    alone = [ours_tokens(ours, vocab, [p], n)[0][0] for p in prompts[:4]]
    ref = hf_tokens(hf, prompts, n, device)
    return {"check": "identity_bf16", "shape": shape, "batch": batch, "new_tokens": n, "decoder": decoder,
            "graph_eq_eager": graph == eager, "rows_eq_transformers": sum(a == b for a, b in zip(graph, ref)),
            "rows_eq_alone": sum(a == b for a, b in zip(graph, alone)), "rows_alone_checked": len(alone),
            "mean_tokens_before_parting_from_transformers": round(sum(
                next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n) for a, b in zip(graph, ref)) / batch, 1)}


def speed(shape: str, ours, hf, vocab: int, batch: int, prompt_len: int, new: int, repeats: int, device: str,
          dtype, card: str, gen: torch.Generator, cuda_graphs: bool, time_eager: bool) -> dict:
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()
    out: dict = {}

    def run_ours(graphs: bool = cuda_graphs, key: str = "ours"):
        out[key], out[key + "_decoder"] = ours_tokens(ours, vocab, prompts, new, cuda_graphs=graphs)

    def run_hf():
        out["hf"] = hf_tokens(hf, prompts, new, device)

    runs = [("entrenar", run_ours), ("transformers", run_hf)]
    if time_eager and cuda_graphs:
        runs.append(("entrenar_eager", lambda: run_ours(False, "eager")))
    times = {}
    for name, fn in runs:
        timed(fn, device)  # warm-up: kernels compiled, caches allocated
        times[name] = min(timed(fn, device) for _ in range(repeats))
    row = {"shape": shape, "batch": batch, "prompt_len": prompt_len, "new_tokens": new, "device": card,
           "dtype": str(dtype), "decoder": out["ours_decoder"],
           "entrenar_tok_s": round(batch * new / times["entrenar"], 1),
           "transformers_tok_s": round(batch * new / times["transformers"], 1),
           "ratio": round(times["transformers"] / times["entrenar"], 3),
           "same_greedy_tokens_rows": sum(a == h for a, h in zip(out["ours"], out["hf"])), "rows": batch}
    if "entrenar_eager" in times:
        row["entrenar_eager_tok_s"] = round(batch * new / times["entrenar_eager"], 1)
    return row


def watchdog(seconds: float) -> None:
    """Past `seconds`: a JSON line saying so, exit 1; faulthandler dumps every thread's stack a little later
    and kills the process even if the main thread is stuck inside a CUDA call holding the GIL."""
    def fire():
        print(json.dumps({"ok": False, "error": f"timeout after {seconds:.0f} s (--timeout-s)"}), flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + 30, exit=True)


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU (checks the script)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (1,16,64; --tiny: 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per row (128; --tiny: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens per row (256; --tiny: 8)")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per measurement, best taken (2)")
    ap.add_argument("--device", default=None, help="cuda if available, else cpu")
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama-1b", help="comma-separated: qwen2.5-0.5b, llama-1b")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="time ours without CUDA graphs (static cache, eager)")
    ap.add_argument("--time-eager", action="store_true", help="also time ours without CUDA graphs (slower run)")
    ap.add_argument("--check-tokens", type=int, default=None, help="greedy tokens per identity check (32; --tiny: 6)")
    ap.add_argument("--no-checks", action="store_true", help="skip the token identity checks")
    ap.add_argument("--timeout-s", type=float, default=570.0, help="give up (JSON error line, exit 1) after this")
    args = ap.parse_args()
    watchdog(args.timeout_s)
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device == "cpu" and not args.tiny:
        print(json.dumps({"ok": False, "error": "no CUDA device: the real shapes need a GPU; --tiny checks the "
                                                "script on the CPU"}), flush=True)
        return 2
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    batches = [int(b) for b in (args.batches or ("1,4" if args.tiny else "1,16,64")).split(",")]
    prompt_len = args.prompt_len or (16 if args.tiny else 128)
    new = args.new_tokens or (8 if args.tiny else 256)
    n_check = args.check_tokens or (6 if args.tiny else 32)
    goal_batch = 4 if args.tiny else 16
    card = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(json.dumps({"start": True, "card": card, "torch": torch.__version__, "device": device,
                      "shapes": args.shapes, "batches": batches, "prompt_len": prompt_len, "new_tokens": new}),
          flush=True)
    rows, checks, errors = [], [], []
    t_start = time.perf_counter()
    for shape in args.shapes.split(","):
        cfg = shape_config(shape, args.tiny)
        gen = torch.Generator().manual_seed(1)
        stage = "build"
        try:
            ours, hf = build(cfg, device)
            if not args.no_checks:
                stage = "identity_fp32"
                checks.append(check_fp32(shape, ours, hf, cfg.vocab_size, n_check, device, gen))
                print(json.dumps(checks[-1]), flush=True)
            ours, hf = ours.to(dtype), hf.to(dtype)
            if not args.no_checks and dtype != torch.float32:
                stage = "identity_bf16"
                checks.append(check_bf16(shape, ours, hf, cfg.vocab_size, goal_batch, n_check, prompt_len, device,
                                         gen))
                print(json.dumps(checks[-1]), flush=True)
            for b in batches:
                stage = f"speed batch {b}"
                rows.append(speed(shape, ours, hf, cfg.vocab_size, b, prompt_len, new, args.repeats, device, dtype,
                                  card, gen, not args.no_cuda_graphs, args.time_eager))
                print(json.dumps(rows[-1]), flush=True)
        except Exception as e:  # noqa: BLE001 -- reported (traceback, JSON, exit 1), the other shapes still run
            traceback.print_exc()
            errors.append(f"{shape}: {stage}: {type(e).__name__}: {e}")
            print(json.dumps({"ok": False, "shape": shape, "stage": stage, "error": errors[-1]}), flush=True)
        finally:
            ours = hf = None
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    print(f"\n| shape | batch | entrenar tok/s | transformers tok/s | ratio | decoder | rows with identical greedy "
          f"tokens |  ({card}, {dtype}, prompt {prompt_len}, {new} new tokens)")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['batch']} | {r['entrenar_tok_s']} | {r['transformers_tok_s']} | {r['ratio']}x | "
              f"{r['decoder']} | {r['same_greedy_tokens_rows']}/{r['rows']} |")
    for c in checks:
        print(f"identity {c['check']} {c['shape']}: " + ", ".join(f"{k}={v}" for k, v in c.items()
                                                              if k not in ("check", "shape")))
    fp32 = [c for c in checks if c["check"] == "identity_fp32"]
    bf16 = [c for c in checks if c["check"] == "identity_bf16"]
    summary = {"ok": not errors and all(c["identical"] for c in fp32),
               "card": card, "torch": torch.__version__, "seconds": round(time.perf_counter() - t_start, 1),
               "identical_fp32": all(c["identical"] for c in fp32) if fp32 else None,
               "graph_eq_eager_bf16": all(c["graph_eq_eager"] for c in bf16) if bf16 else None,
               "ratio_batch16": {r["shape"]: r["ratio"] for r in rows if r["batch"] == goal_batch},
               "rows": rows, "checks": checks, "errors": errors}
    print(json.dumps(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
