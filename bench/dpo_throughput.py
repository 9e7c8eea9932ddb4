"""DPO training throughput: `entrenar finetune --objective dpo` (the real CLI) vs TRL's DPOTrainer, in the same call,
on the same random weights (a preset's real shapes; Qwen2.5-0.5B by default), the same preference rows, batch and
sequence length (issue 27 part 4). One JSON line per row on stdout (and --out FILE.jsonl).

    python bench/dpo_throughput.py                       # GPU: qwen2.5-0.5b shapes, bf16, full and LoRA rows
    python bench/dpo_throughput.py --smoke               # CPU: tiny shapes, 2 steps (tests/test_dpo_bench.py)

Data: a byte-level BPE tokenizer trained here (entrenar's ChatML template) on a closed set of words, each of
which is one token with its leading space, so every prompt (PROMPT_WORDS words) and response (RESPONSE_WORDS
words) has exactly the same token count: no padding on either side, and tokens/s means the same thing for both.
The model's vocabulary is the preset's (151,936 for Qwen2.5): the LM head costs what it costs in a real run.

Rows: `tokens_per_s` = tokens of both sequences of every pair / the median step time after `warmup` steps (ours
from metrics.jsonl; TRL's from a callback timing its steps, tokens = its attention_mask). The rows are TRL's
conversational form, rendered by both with the tokenizer's chat template (TRL's completion also holds the template's
newline after the end-of-turn token); the rows say how many tokens a pair has on each side. Both: full fine-tuning with a frozen
reference copy (or LoRA r16 on every projection with adapters switched off as the reference), bf16 autocast over
fp32 master weights on the GPU (TRL: `bf16=True`), AdamW, no gradient checkpointing, the same beta.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT_WORDS_FRACTION = 0.5  # of --seq less the template's tokens: the rest is the response


def build_tokenizer(work: Path) -> tuple[Path, list[str]]:
    """A ChatML BPE tokenizer and the words that are each one token with a leading space."""
    from entrenar.tokenizer_train import train_tokenizer

    words = [f"w{chr(97 + i % 26)}{chr(97 + (i // 26) % 26)}" for i in range(400)]
    corpus = work / "words.txt"
    corpus.write_text("\n".join(" ".join(words[(i * 7 + k) % len(words)] for k in range(40)) for i in range(400)))
    tok_dir = work / "tokenizer"
    train_tokenizer([str(corpus)], 1024, tok_dir)
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tok_dir))
    single = [w for w in words if len(tok.encode(" " + w)) == 1]
    assert len(single) >= 50, f"only {len(single)} single-token words"
    return tok_dir, single


def template_tokens(tok_dir: Path, words: list[str]) -> int:
    """Tokens the chat template adds to a one-turn conversation (ours renders every row with it)."""
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tok_dir))
    enc = tok.encode_chat([{"role": "user", "content": " ".join(words[:3])},
                           {"role": "assistant", "content": " ".join(words[:5])}])
    return len(enc.ids) - 8


def write_rows(path: Path, words: list[str], n: int, prompt_words: int, response_words: int, seed: int = 0) -> None:
    import random

    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k))

    with open(path, "w") as f:
        for _ in range(n):
            # TRL's conversational preference form, which both sides render with the same chat template
            row = {"prompt": [{"role": "user", "content": text(prompt_words)}],
                   "chosen": [{"role": "assistant", "content": text(response_words)}],
                   "rejected": [{"role": "assistant", "content": text(response_words)}]}
            f.write(json.dumps(row) + "\n")


def build_model(work: Path, preset_name: str, tok_dir: Path) -> Path:
    """Random weights of the preset's shapes, saved as an HF directory with the tokenizer."""
    import dataclasses

    import torch

    from entrenar.config import preset, round_vocab
    from entrenar.formats import save_hf_dir
    from entrenar.model import CausalLM
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tok_dir))
    cfg = preset(preset_name)
    cfg = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, round_vocab(len(tok))), bos_token_id=None,
                              eos_token_id=tok.eos_id)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    model.init_weights(0)
    return save_hf_dir(model, work / "model", tok)


def ours(model: Path, data: Path, out: Path, mode: str, args) -> dict:
    cmd = [sys.executable, "-m", "entrenar", "finetune", "--model", str(model), "--data", str(data), "--out",
           str(out), "--objective", "dpo", "--beta", str(args.beta), "--mode", mode, "--steps", str(args.steps),
           "--batch-size", str(args.batch), "--max-seq-len", str(args.seq), "--val-fraction", "0", "--lr", "1e-6",
           "--warmup", "0", "--device", args.device, "--dtype", args.dtype, "--no-preflight", "--json"]
    if mode == "lora":
        cmd += ["--rank", "16"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO),
                                                         os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "exit_code": proc.returncode}
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((out / "data_report.json").read_text())["train"]
    timed = steps[args.warmup:] or steps
    step_tokens = steps[-1]["tokens"] - (steps[-2]["tokens"] if len(steps) > 1 else 0)  # every step: batch x 2 x T
    return {"tokens_per_s": statistics.median(r["tok_s"] for r in timed),
            "step_s": statistics.median(step_tokens / r["tok_s"] for r in timed),
            "tokens_per_pair": report["tokens_total"] / max(report["kept"], 1), "tokens_per_step": step_tokens,
            "padding_free": report["tokens_total"] / max(report["kept"], 1) * args.batch == step_tokens,
            "peak_mem_mb": max((r.get("mem_mb") or 0) for r in steps) or None,
            "final_loss": steps[-1]["loss"], "wall_s": time.perf_counter() - t0}


def trl_row(model: Path, data: Path, out: Path, mode: str, args) -> dict:
    try:
        import torch
        import trl
        from datasets import load_dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    except ImportError as e:
        return {"skipped": f"{type(e).__name__}: {e}"}
    dtype = torch.float32
    tok = AutoTokenizer.from_pretrained(str(model))
    policy = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, attn_implementation="sdpa")
    ref, peft_config = None, None
    if mode == "full":
        ref = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, attn_implementation="sdpa")
    else:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"])
    rows = load_dataset("json", data_files=str(data), split="train")
    times: list[float] = []
    tokens: list[int] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            tokens.append(trainer._total_train_tokens)

    cfg = trl.DPOConfig(output_dir=str(out), beta=args.beta, loss_type=["sigmoid"], per_device_train_batch_size=args.batch,
                        max_steps=args.steps, learning_rate=1e-6, lr_scheduler_type="constant", report_to=[],
                        logging_steps=10**6, save_strategy="no", max_length=args.seq,
                        bf16=args.dtype == "bf16", use_cpu=args.device == "cpu", gradient_checkpointing=False,
                        dataloader_num_workers=0, seed=0)
    trainer = trl.DPOTrainer(model=policy, ref_model=ref, args=cfg, train_dataset=rows, processing_class=tok,
                             peft_config=peft_config, callbacks=[Timer()])
    t0 = time.perf_counter()
    trainer.train()
    per_step = [b - a for a, b in zip([0, *tokens[:-1]], tokens, strict=True)]
    timed = list(zip(times, per_step, strict=True))[args.warmup:] or list(zip(times, per_step, strict=True))
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return {"tokens_per_s": statistics.median(n / t for t, n in timed), "step_s": statistics.median(t for t, _ in timed),
            "tokens_per_step": per_step[-1], "tokens_per_pair": per_step[-1] / args.batch, "peak_mem_mb": peak,
            "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--batch", type=int, default=4, help="pairs per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (prompt + response)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, 2 steps (checks the plumbing)")
    p.add_argument("--out", type=Path, help="also append the rows to this JSONL file")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 48, 2, 0
        args.device, args.dtype = "cpu", "fp32"
    sys.path[:0] = [str(REPO / "src"), str(REPO)]
    work = Path(tempfile.mkdtemp(prefix="dpo-bench-"))
    tok_dir, words = build_tokenizer(work)
    model = build_model(work, args.preset, tok_dir)
    overhead = template_tokens(tok_dir, words)  # the chat template's own tokens around prompt and response
    response_words = max(2, int((args.seq - overhead) * (1 - PROMPT_WORDS_FRACTION)))
    prompt_words = max(2, args.seq - overhead - response_words)
    data = work / "pairs.jsonl"
    write_rows(data, words, max(64, args.batch * (args.steps + 2)), prompt_words, response_words)
    common = {"preset": args.preset, "batch_pairs": args.batch, "seq": args.seq, "steps": args.steps,
              "beta": args.beta, "device": args.device, "dtype": args.dtype, "smoke": args.smoke}
    rows = []
    for mode in args.modes.split(","):
        for runner, fn in (("entrenar-cli", ours), ("trl-dpotrainer", trl_row)):
            try:
                result = fn(model, data, work / f"{runner}-{mode}", mode, args)
            except (RuntimeError, ValueError, TypeError, OSError, subprocess.TimeoutExpired) as e:  # a row says so
                result = {"error": f"{type(e).__name__}: {e}"}
            row = {"bench": "dpo_throughput", "runner": runner, "mode": mode, **common, **result}
            rows.append(row)
            print(json.dumps(row), flush=True)
    ok = {r["mode"]: r for r in rows if r["runner"] == "entrenar-cli" and "tokens_per_s" in r}
    for r in list(rows):
        if r["runner"] == "trl-dpotrainer" and "tokens_per_s" in r and r["mode"] in ok:
            ratio = {"bench": "dpo_throughput", "ratio": "entrenar/trl", "mode": r["mode"], **common,
                     "tokens_per_s_ratio": ok[r["mode"]]["tokens_per_s"] / r["tokens_per_s"]}
            rows.append(ratio)
            print(json.dumps(ratio), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
