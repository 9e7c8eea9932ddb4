"""Generation speed (issue 24, part 2): generated tokens/s of entrenar's generate_batch vs transformers'
generate(do_sample=False), in the same process on the same weights, at batch 1, 16 and 64.

    PYTHONPATH=src python bench/generate_throughput.py                # GPU: Qwen2.5-0.5B shapes, bf16
    PYTHONPATH=src python bench/generate_throughput.py --tiny         # CPU: a tiny model, checks the script

The model is random (init_weights, seed 0) with the real Qwen2.5-0.5B shapes (`qwen2.5-0.5b` preset: vocab
151936, hidden 896, 24 layers, 14/2 heads, Q/K/V bias, tied head); the same state dict is loaded into
transformers' Qwen2ForCausalLM (our tensor names are HF's). Both hold bf16 weights on the GPU (fp32 on the
CPU). Every row gets a random prompt of --prompt-len tokens (no padding) and decodes exactly --new-tokens
(no stop token: stop_ids=[] / eos_token_id=None with min_new_tokens), greedy. Time: from the call to the
last token on the host (cuda synchronize), the prompt's prefill included, best of --repeats after one
warm-up call per batch size. tokens/s = batch x new tokens / time.

Prints one JSON object per batch size and a markdown table with the ratio ours / transformers (the goal:
>= 1.5x at batch 16 on the GPU), and whether batch 1's greedy tokens agree (bf16 rounding may part them
after a near-tie: reported, not asserted).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from entrenar.config import preset
from entrenar.generate import generate_batch
from entrenar.model import CausalLM


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


def build(tiny: bool, device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = preset("tiny" if tiny else "qwen2.5-0.5b")
    if tiny:  # the tiny preset with Qwen2's features, so the same HF class loads it
        cfg = dataclasses.replace(cfg, architecture="qwen2", attention_bias=True, tie_word_embeddings=True)
    ours = CausalLM(cfg, kernels="triton" if device.startswith("cuda") else "torch")
    ours.init_weights(0)
    hf_cfg = Qwen2Config(**{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    hf = Qwen2ForCausalLM(hf_cfg)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ours = ours.to(device=device, dtype=dtype).eval()
    hf = hf.to(device=device, dtype=dtype).eval()
    hf.tie_weights()
    return cfg, ours, hf


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (1,16,64; --tiny: 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per row (128; --tiny: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generated tokens per row (128; --tiny: 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None, help="cuda if available, else cpu")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    batches = [int(b) for b in (args.batches or ("1,4" if args.tiny else "1,16,64")).split(",")]
    prompt_len = args.prompt_len or (16 if args.tiny else 128)
    new = args.new_tokens or (8 if args.tiny else 128)
    cfg, ours, hf = build(args.tiny, device, dtype)
    tok = NoStops(cfg.vocab_size)
    gen = torch.Generator().manual_seed(1)
    card = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    rows = []
    for b in batches:
        prompts = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=gen)
        ids = prompts.tolist()
        out: dict = {}

        def run_ours(ids=ids, out=out):
            out["ours"] = [r.token_ids for r in generate_batch(ours, tok, ids, new, stop_ids=[])]

        def run_hf(prompts=prompts, out=out):
            with torch.inference_mode():
                seq = hf.generate(prompts.to(device), attention_mask=torch.ones_like(prompts).to(device),
                                  max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)
            out["hf"] = seq[:, prompt_len:].tolist()

        times = {}
        for name, fn in (("entrenar", run_ours), ("transformers", run_hf)):
            timed(fn, device)  # warm-up: kernels compiled, caches allocated
            times[name] = min(timed(fn, device) for _ in range(args.repeats))
        row = {"batch": b, "prompt_len": prompt_len, "new_tokens": new, "device": card, "dtype": str(dtype),
               "entrenar_tok_s": round(b * new / times["entrenar"], 1),
               "transformers_tok_s": round(b * new / times["transformers"], 1),
               "ratio": round(times["transformers"] / times["entrenar"], 3),
               "same_greedy_tokens_rows": sum(a == h for a, h in zip(out["ours"], out["hf"])), "rows": b}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| batch | entrenar tok/s | transformers tok/s | ratio | rows with identical greedy tokens |  ({card}, "
          f"{dtype}, prompt {prompt_len}, {new} new tokens)")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['entrenar_tok_s']} | {r['transformers_tok_s']} | {r['ratio']}x | "
              f"{r['same_greedy_tokens_rows']}/{r['rows']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
