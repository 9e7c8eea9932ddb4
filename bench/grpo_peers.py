"""Our GRPO (`finetune --objective grpo --reward bfcl-graded --mode lora`) against TRL's GRPOTrainer + PEFT on the
same model, prompts, G, lengths, batch and steps: optimizer steps per hour, rollout tokens/s, mean reward and peak
memory of each, in one call.

    python -m bench.grpo_peers --model smollm2-135m-instruct --data calls.jsonl --out DIR \
        --steps 10 --batch 4 --num-generations 8 --max-new-tokens 128 --rank 16 --lr 5e-5
    python -m bench.grpo_peers --model smollm2-135m-instruct --make-rows --out DIR   # `data sft-from-bfcl` rows made
    python -m bench.grpo_peers --tiny --out DIR      # the whole thing on the CPU with a tiny model, 2 steps

TRL needs trl and datasets importable; no vLLM (use_vllm=False: transformers' generate).

Rows, each in a child process of its own (separate memory peaks): trl (before), entrenar (the real `entrenar
finetune --objective grpo` CLI), trl-after (the peer's speed did not change while ours ran).

Same work: the prompt rows are read by entrenar's own GRPO loader (load_prompts with our tokenizer and --chat-template,
the rows whose prompt + --max-new-tokens pass --max-seq-len dropped, GRPOLoader's order at seed 0), steps x batch
prompts. TRL gets that sequence in that order (shuffle_dataset=False) and each prompt's token ids exactly as ours
(GRPOTrainer._tokenize_prompts answered from our ids), batch x G completions per optimizer step (generation batch =
train batch: one optimizer pass per rollout batch), the same stop tokens (our EOS and end-of-turn), temperature,
top_p 1, top_k off, beta, epsilon, loss_type and scale_rewards (ours: TRL's names), LoRA rank/alpha/dropout/targets,
lr, warmup and schedule, AdamW betas, clip. Its reward is a plain callable that decodes each completion's ids with our
tokenizer as our engine does (the stop token dropped) and calls entrenar's own `bfcl-graded` reward with its row.

Timing. TRL: the loop from the Trainer's on_train_begin to on_train_end (CUDA synchronised); its rollout tokens/s is
the completion tokens (up to and with the first stop token, TRL's completion mask) over the seconds inside the
model's generate (wrapped, CUDA synchronised). Ours: the step seconds of the run (summary tokens / tok_s) plus the
first rollout (drawn by step 0's check, replayed by step 1, so outside step 1's time); its rollout tokens/s is the
sum of completion tokens over the sum of rollout seconds of metrics.jsonl (rollout_tok_s, completion_length per
step). Peak memory: torch.cuda.max_memory_allocated in the TRL child (reset after the model is loaded); ours: the
largest mem_mb of RUN/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.sft_peers import (
    ADAM_BETAS,
    MIN_LR_RATIO,
    TARGETS,
    Skip,
    _tail,
    child_row,
    load_hf,
    run,
    run_entrenar,
    train_clock,
    warmup_steps,
)

ROWS = ("trl", "entrenar", "trl-after")
SEED = 0  # finetune's default --seed: prompt order, sampling seeds and the adapters' init
REWARD = "bfcl-graded"
DIFFERENCES = [
    ("sampling: ours through entrenar's generation engine (continuous batching, CUDA-graph decode, per-request "
     "seeds); TRL through transformers' generate on the left-padded batch (padding to the longest prompt, no "
     "graphs); the same distribution (temperature, top_p 1, no top_k), different draws, so completions, their "
     "lengths and rewards differ"),
    ("the loss: the same formula and normalisation (TRL's _compute_loss; ours equals it, tests/test_grpo_parity.py); "
     "the log-probs: TRL's through its fused, chunked LM-head log-prob kernel (the prompt positions masked), ours "
     "the head applied at the completion positions only; the body runs over prompt + completion in both"),
    ("the reference: both the adapters switched off (PEFT's disable_adapter, our adapters_disabled), computed once "
     "per rollout batch"),
    ("precision: TRL loads fp32 and trains under bf16 autocast (bf16=True) as transformers' Trainer does; ours fp32 "
     "master weights under its bf16 autocast (--dtype auto on CUDA)"),
    "the optimizer: transformers' default AdamW (fused on CUDA) with our betas, eps 1e-8, weight decay 0",
    ("LoRA init: PEFT's (kaiming-uniform A, zero B) and ours, seeded differently: equal at step 0 (B = 0), "
     "different random A"),
    ("TRL computes entropy, clip ratios and reward statistics each step for its logs (its default), ours its "
     "metrics.jsonl record"),
    ("ours runs step 0's check (a rollout and its loss without an update, GUARD-INIT-LOSS) before step 1, which "
     "trains on that rollout: counted in loop_s as its rollout seconds"),
]


def grpo_defaults() -> dict[str, Any]:
    """finetune --objective grpo's defaults (TrainConfig / LoRAConfig fields): what both sides run unless flagged."""
    import dataclasses

    from entrenar.train.config import LoRAConfig, TrainConfig
    from entrenar.train.grpo import DEFAULT_GRPO_BETA

    train = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    lora = {f.name: f.default for f in dataclasses.fields(LoRAConfig)}
    return {"beta": DEFAULT_GRPO_BETA, "temperature": train["temperature"], "top_p": train["top_p"],
            "epsilon": train["epsilon"], "loss_type": train["loss_type"], "scale_rewards": train["scale_rewards"],
            "clip": train["clip"], "min_lr_ratio": train["min_lr_ratio"], "dropout": lora["dropout"]}


# ---- the prompts both sides roll out ----------------------------------------------------------------------------
def prompt_sequence(model: str, data: str, chat_template: str | None, max_seq_len: int, max_new_tokens: int,
                    steps: int, batch: int) -> tuple[list[Any], Any]:
    """(the PromptExamples `finetune --objective grpo` rolls out, in its order: steps x batch; our tokenizer).
    finetune's path: load_prompts (rows with room for --max-new-tokens), no eval split, GRPOLoader at seed 0."""
    from entrenar.tokenizer import load_tokenizer, use_chat_template_file
    from entrenar.train.grpo import GRPOLoader, load_prompts

    tok = load_tokenizer(model)
    use_chat_template_file(tok, chat_template)
    examples, _ = load_prompts(data, tok, max_seq_len, max_new_tokens)
    loader = GRPOLoader(examples, batch, seed=SEED, max_seq_len=max_seq_len,
                        pad_id=tok.pad_id if tok.pad_id is not None else tok.eos_id)
    out = []
    for _ in range(steps * batch):
        out.append(loader._peek())
        loader._advance()
    return out, tok


def prompt_key(tok: Any, ids: list[int]) -> str:
    """The prompt text TRL carries for a prompt (its dataset's "prompt"): our tokenizer's decode of our ids."""
    return tok.decode(ids)


def entrenar_reward(tok: Any) -> Any:
    """TRL's reward function: each completion's ids decoded as our engine decodes them (a final stop token dropped),
    scored by entrenar's own bfcl-graded reward against its row (the dataset's "row" column, JSON)."""
    from entrenar.train.rewards import bfcl_graded_reward

    stops = tok.stop_ids

    def bfcl_graded(prompts: list[str], completions: list[str], completion_ids: list[list[int]], row: list[str],
                    **_: Any) -> list[float]:
        texts = [tok.decode(ids[:-1] if ids and ids[-1] in stops else ids) for ids in completion_ids]
        return bfcl_graded_reward(prompts, texts, [json.loads(r) for r in row])
    return bfcl_graded


# ---- the TRL child -----------------------------------------------------------------------------------------------
def build_trl_trainer(p: dict[str, Any]) -> Any:
    """GRPOTrainer + PEFT LoRA on our prompt sequence, configured as finetune --objective grpo (see DIFFERENCES)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    d = grpo_defaults()
    seq, tok = prompt_sequence(p["model"], p["data"], p["chat_template"], p["max_seq_len"], p["max_new_tokens"],
                               p["steps"], p["batch"])
    ids_of = {prompt_key(tok, e.input_ids.tolist()): [int(i) for i in e.input_ids] for e in seq}
    dataset = Dataset.from_dict({"prompt": [prompt_key(tok, e.input_ids.tolist()) for e in seq],
                                 "row": [json.dumps(e.row) for e in seq]})
    model, hf_tok = load_hf(p["model"], torch)
    if hf_tok.pad_token_id is None:
        hf_tok.pad_token = hf_tok.eos_token
    model.generation_config.eos_token_id = sorted(tok.stop_ids)  # TRL stops where our engine stops
    cuda = p["device"] == "cuda"
    model.to(p["device"])
    G = p["num_generations"]
    config = GRPOConfig(
        output_dir=str(Path(p["work"]) / "trainer"), max_steps=p["steps"],
        per_device_train_batch_size=p["batch"] * G, generation_batch_size=p["batch"] * G,
        gradient_accumulation_steps=1, num_iterations=1, num_generations=G,
        max_completion_length=p["max_new_tokens"], temperature=d["temperature"], top_p=d["top_p"], top_k=0,
        beta=d["beta"], epsilon=d["epsilon"], loss_type=d["loss_type"], scale_rewards=d["scale_rewards"],
        mask_truncated_completions=False, shuffle_dataset=False, use_vllm=False,
        learning_rate=p["lr"], lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": d["min_lr_ratio"]}, warmup_steps=warmup_steps(p["steps"]),
        weight_decay=0.0, max_grad_norm=d["clip"], adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1],
        adam_epsilon=1e-8, bf16=cuda, fp16=False, use_cpu=not cuda, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, seed=SEED, log_completions=False,
        gradient_checkpointing=False)  # GRPOConfig turns it on by default; ours runs without it
    lora = LoraConfig(r=p["rank"], lora_alpha=2 * p["rank"], lora_dropout=d["dropout"], target_modules=TARGETS,
                      task_type="CAUSAL_LM", bias="none")

    class OurPromptIds(GRPOTrainer):  # each prompt's ids exactly as our loader rendered them
        def _tokenize_prompts(self, prompts: list) -> Any:
            return [list(ids_of[t]) for t in prompts], None, {}

    trainer = OurPromptIds(model=model, reward_funcs=[entrenar_reward(tok)], args=config, train_dataset=dataset,
                           processing_class=hf_tok, peft_config=lora)
    stops = sorted(tok.stop_ids)  # the Trainer may realign the model's eos to the tokenizer's: set after it
    trainer.eos_token_ids = stops
    trainer.generation_config.eos_token_id = stops
    if isinstance(getattr(trainer, "generation_kwargs", None), dict):
        trainer.generation_kwargs["eos_token_id"] = stops
    trainer.entrenar_sequence = seq
    return trainer


def time_generate(trainer: Any, cuda: bool) -> dict[str, float]:
    """Wrap the policy's generate (what GRPOTrainer calls for its rollouts): seconds inside it (CUDA synchronised)
    and the completion tokens it produced (each row up to and with its first stop token: TRL's completion mask)."""
    import torch

    model = trainer.model
    inner = model.generate
    eos = torch.tensor(trainer.eos_token_ids)
    seen: dict[str, Any] = {"seconds": [], "tokens": [], "dtypes": set(), "in": False}  # per call
    # the compute dtype of its rollouts (bf16 under autocast, else the weights'): a first linear's output dtype
    probe = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    probe.register_forward_hook(lambda m, i, o: seen["dtypes"].add(str(o.dtype).replace("torch.", ""))
                                if seen["in"] else None)

    def generate(*args: Any, **kwargs: Any) -> Any:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        seen["in"] = True
        try:
            out = inner(*args, **kwargs)
        finally:
            seen["in"] = False
        if cuda:
            torch.cuda.synchronize()
        seen["seconds"].append(time.perf_counter() - t0)
        completion = out[:, kwargs["input_ids"].shape[1]:]
        is_eos = torch.isin(completion, eos.to(completion.device))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completion.shape[1])
        seen["tokens"].append(float(first.sum()))
        return out

    model.generate = generate
    return seen


def trl_child(p: dict[str, Any]) -> dict[str, Any]:
    import torch

    trainer = build_trl_trainer(p)
    cuda = p["device"] == "cuda"
    times: dict[str, Any] = {}
    trainer.add_callback(train_clock(cuda, times, step_ends=True))
    step_ends = times["step_ends"]
    first = trainer.entrenar_sequence[0]  # the reward's imports (BFCL's checker) paid before the clock, as ours
    trainer.reward_funcs[0]([first.text], [""], [[]], [json.dumps(first.row)])  # pays them in step 0's check
    gen = time_generate(trainer, cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    import peft
    import transformers
    import trl
    return {"loop_s": times["end"] - times["begin"], "optimizer_steps": trainer.state.global_step,
            "loop_s_after_first": step_ends[-1] - step_ends[0] if len(step_ends) > 1 else None,
            **rollout_measures(gen["tokens"], gen["seconds"]),
            "rollout_tok_s_basis": "generate seconds (wrapped)" if gen["tokens"] else "none: generate not seen",
            "generate_calls": len(gen["tokens"]), "generate_dtype": ",".join(sorted(gen["dtypes"])) or None,
            "mean_reward": sum(h["reward"] for h in logs) / len(logs) if logs else None,
            "rewards": [h["reward"] for h in logs],
            "mean_completion_length": (sum(h["completions/mean_length"] for h in logs) / len(logs)
                                       if logs and all("completions/mean_length" in h for h in logs) else None),
            "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "prompts": len(trainer.entrenar_sequence),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__, "torch": torch.__version__}}


def child_main(params: str) -> int:
    p = json.loads(params)
    try:
        row = trl_child(p)
    except Skip as e:
        print(f"SKIP {e}", flush=True)
        return 0
    print("ROW " + json.dumps(row), flush=True)
    return 0


# ---- the parent ----------------------------------------------------------------------------------------------
def trl_row(name: str, p: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    params = {**p, "work": str(out / name / "work")}
    return child_row(name, "trl", [sys.executable, "-m", "bench.grpo_peers", "--child", json.dumps(params)], out,
                     timeout)


def entrenar_command(p: dict[str, Any], run_dir: Path) -> list[str]:
    """`finetune --objective grpo` with the bench's work, no task evals (the peer runs none) and no QA gate."""
    cmd = [sys.executable, "-m", "entrenar", "finetune", "--json", "--model", p["model"], "--data", p["data"],
           "--objective", "grpo", "--reward", REWARD, "--mode", "lora", "--rank", str(p["rank"]),
           "--lr", str(p["lr"]), "--steps", str(p["steps"]), "--batch-size", str(p["batch"]), "--grad-accum", "1",
           "--num-generations", str(p["num_generations"]), "--max-new-tokens", str(p["max_new_tokens"]),
           "--max-seq-len", str(p["max_seq_len"]), "--seed", str(SEED), "--on-qa-fail", "off",
           "--save-every-minutes", "0", "--out", str(run_dir)]
    if p["chat_template"]:
        cmd += ["--chat-template", p["chat_template"]]
    if p["device"] == "cpu":
        cmd += ["--device", "cpu"]
    return cmd + list(p.get("entrenar_flags") or [])


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rollout_measures(tokens: list[float], seconds: list[float]) -> dict[str, Any]:
    """Generated tokens, rollout seconds and tokens/s of a row's rollouts (one entry per rollout), and tokens/s
    without the first rollout (its warm-ups: CUDA graphs, kernels' first calls)."""
    def rate(t: list[float], s: list[float]) -> float | None:
        return sum(t) / sum(s) if t and sum(s) > 0 else None
    return {"generated_tokens": sum(tokens), "rollout_s": sum(seconds) if seconds else None,
            "rollout_tok_s": rate(tokens, seconds), "rollout_tok_s_after_first": rate(tokens[1:], seconds[1:])}


def entrenar_measures(summ: dict[str, Any], records: list[dict[str, Any]], sequences: int) -> dict[str, Any]:
    """Ours from the run's summary and metrics.jsonl: the loop (step seconds + the first rollout, drawn by step 0's
    check), rollout tokens over rollout seconds (per step: completion_length x sequences, / rollout_tok_s), mean
    reward and the largest mem_mb of the steps."""
    steps = [r for r in records if isinstance(r.get("step"), int) and r["step"] >= 1 and "reward" in r]
    rolled = [r for r in steps if r.get("rollout_tok_s")]
    tokens = [r["completion_length"] * sequences for r in rolled]
    seconds = [t / r["rollout_tok_s"] for t, r in zip(tokens, rolled, strict=True)]
    step_s = summ["tokens"] / summ["tok_s"] if summ.get("tok_s") else None
    first_rollout = seconds[0] if seconds else 0.0
    # each step's seconds: its tokens / its tok_s (the loop's step time; step 1's excludes its rollout, step 0's)
    dts = [(r["tokens"] - prev["tokens"]) / r["tok_s"] for prev, r in itertools.pairwise(steps)
           if r.get("tok_s")]
    mems = [r["mem_mb"] for r in records if r.get("mem_mb") is not None]
    return {"loop_s": step_s + first_rollout if step_s is not None else None, "step_s_sum": step_s,
            "first_rollout_s": first_rollout, "optimizer_steps": len(steps),
            "loop_s_after_first": sum(dts) if len(dts) == len(steps) - 1 and dts else None,
            **rollout_measures(tokens, seconds), "rollout_tok_s_basis": "rollout seconds (metrics.jsonl)",
            "mean_reward": sum(r["reward"] for r in steps) / len(steps) if steps else None,
            "rewards": [r["reward"] for r in steps],
            "mean_completion_length": sum(r["completion_length"] for r in steps) / len(steps) if steps else None,
            "peak_mem_mb": max(mems) if mems else None, "train_seconds": summ.get("seconds")}


def entrenar_row(p: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    run_dir = out / "entrenar"
    row, summ = run_entrenar(entrenar_command(p, run_dir), out, timeout)
    if summ is None:
        return row
    row.update(entrenar_measures(summ, read_metrics(run_dir / "metrics.jsonl"), p["batch"] * p["num_generations"]),
               status="ok", run=str(run_dir))
    return row


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def write_summary(out: Path, p: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """DIR/summary.json, rewritten after every row (a run cut short keeps what it measured)."""
    by = {r["row"]: r for r in rows if r["status"] == "ok"}
    ours = by.get("entrenar", {})
    summary: dict[str, Any] = {"params": p, "rows": rows, "defaults": grpo_defaults(), "reward": REWARD,
                               "differences": DIFFERENCES, "warmup_steps": warmup_steps(p["steps"]),
                               "min_lr_ratio": MIN_LR_RATIO}
    for peer in ("trl", "trl-after"):
        theirs = by.get(peer, {})
        tail = "" if peer == "trl" else "_after"
        summary[f"ours_vs_trl{tail}_steps_per_hour"] = _ratio(ours.get("steps_per_hour"),
                                                              theirs.get("steps_per_hour"))
        summary[f"ours_vs_trl{tail}_rollout_tok_s"] = _ratio(ours.get("rollout_tok_s"), theirs.get("rollout_tok_s"))
        for key in ("steps_per_hour_after_first", "rollout_tok_s_after_first"):
            summary[f"ours_vs_trl{tail}_{key}"] = _ratio(ours.get(key), theirs.get(key))
        summary[f"ours_vs_trl{tail}_mem"] = _ratio(ours.get("peak_mem_mb"), theirs.get("peak_mem_mb"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def table(rows: list[dict[str, Any]], p: dict[str, Any]) -> str:
    lines = [(f"{p['steps']} steps x {p['batch']} prompts x G {p['num_generations']}, up to "
              f"{p['max_new_tokens']} new tokens, reward {REWARD}"), "",
             ("| row | status | loop s | steps/hour | (after 1st) | rollout tok/s | (after 1st) | generated tokens "
              "| mean reward | peak MiB |"),
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['row']} | {r['status']}: {r.get('reason', '')[:80]} | | | | | | | | |")
            continue
        lines.append(f"| {r['row']} | ok | {f(r.get('loop_s'), '.1f')} | {f(r.get('steps_per_hour'), ',.0f')} | "
                     f"{f(r.get('steps_per_hour_after_first'), ',.0f')} | {f(r.get('rollout_tok_s'), ',.0f')} | "
                     f"{f(r.get('rollout_tok_s_after_first'), ',.0f')} | {f(r.get('generated_tokens'), ',.0f')} | "
                     f"{f(r.get('mean_reward'), '.4f')} | {f(r.get('peak_mem_mb'), ',.0f')} |")
    return "\n".join(lines)


def make_rows(out: Path, timeout: float) -> str:
    """The tool-call recipe's BFCL rows (recipes/smollm2_tool_calls.yaml, its replay mix left out: GRPO needs ground
    truth): `data sft-from-bfcl --irrelevance --swapped-no-call 650 --swapped-matched`."""
    calls = out / "rows" / "calls.jsonl"
    calls.parent.mkdir(parents=True, exist_ok=True)
    if not calls.is_file():  # made by an earlier call into the same --out: the same rows
        cmd = [sys.executable, "-m", "entrenar", "data", "sft-from-bfcl", "--out", str(calls), "--irrelevance",
               "--swapped-no-call", "650", "--swapped-matched"]
        code, _, err = run(cmd, timeout, out / "rows-calls.log")
        if code != 0:
            raise SystemExit(f"--make-rows: {shlex.join(cmd)} failed (exit {code}): {_tail(err)}")
    return str(calls)


TINY_CALLS = [("get_weather", "city", ["Paris", "Lima", "Oslo", "Cairo"]),
              ("get_time", "zone", ["UTC", "CET", "PST", "JST"])]


def make_tiny(out: Path) -> dict[str, Any]:
    """A tiny llama with SmolLM2's tokenizer (sft_peers.make_tiny's) and a few tool-call rows in `data
    sft-from-bfcl`'s fields (id, tools, messages with the answer's tool_calls: the ground truth)."""
    from bench.sft_peers import make_tiny as tiny_model

    model = tiny_model(out)["model"]
    tools = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} of a {arg}",
                                                "parameters": {"type": "object", "required": [arg], "properties": {
                                                    arg: {"type": "string", "description": f"the {arg}"}}}}}
             for name, arg, _ in TINY_CALLS]
    rows = []
    for name, arg, values in TINY_CALLS:
        for v in values:
            rows.append({"id": f"tiny_{len(rows)}", "tools": tools, "messages": [
                {"role": "user", "content": f"What is the {name.split('_')[1]} for {v}?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": {arg: v}}}]}]})
    data = out / "tiny-grpo-rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": model, "data": str(data)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", help="MODEL: a .gguf, an HF dir or a packaged name (smollm2-135m-instruct)")
    ap.add_argument("--data", help="prompt rows with ground truth (JSONL), e.g. `data sft-from-bfcl`'s")
    ap.add_argument("--make-rows", action="store_true",
                    help="make the recipe's `data sft-from-bfcl` rows into OUT/rows/ instead of --data")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="prompts per optimizer step (ours: --batch-size)")
    ap.add_argument("--num-generations", type=int, default=8, help="G: completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--chat-template", default="chatml_tools")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which rows, in order ({','.join(ROWS)})")
    ap.add_argument("--entrenar-flag", action="append", default=[],
                    help="an extra finetune flag for our row (repeatable; e.g. --entrenar-flag=--beta=0)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per child process")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: a tiny model, tiny rows, 2 steps, G 2")
    ap.add_argument("--out", required=True)
    return ap


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The run's parameters: the flags, --tiny's model and rows, or --make-rows's rows."""
    import torch

    p: dict[str, Any] = {"model": args.model, "data": args.data, "steps": args.steps, "batch": args.batch,
                         "num_generations": args.num_generations, "max_new_tokens": args.max_new_tokens,
                         "rank": args.rank, "lr": args.lr, "max_seq_len": args.max_seq_len,
                         "chat_template": args.chat_template, "entrenar_flags": args.entrenar_flag,
                         "device": "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"}
    if args.tiny:
        p.update(make_tiny(out), steps=2, batch=2, num_generations=2, max_new_tokens=16, rank=4, max_seq_len=1024)
    elif args.make_rows:
        p["data"] = make_rows(out, args.timeout_s)
    if not p["model"] or not p["data"]:
        ap.error("--model and --data (or --make-rows) are required, or --tiny")
    if p["num_generations"] < 2:
        ap.error(f"--num-generations {p['num_generations']}: a group of one has no spread; give 2 or more")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1])
    ap = build_parser()
    args = ap.parse_args(argv)
    names = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"--rows: unknown row(s) {', '.join(unknown)}; rows: {', '.join(ROWS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    p = prepare(ap, args, out)
    rows: list[dict[str, Any]] = []
    for name in names:
        row = entrenar_row(p, out, args.timeout_s) if name == "entrenar" else trl_row(name, p, out, args.timeout_s)
        if row["status"] == "ok" and row.get("loop_s"):
            row["steps_per_hour"] = row["optimizer_steps"] * 3600.0 / row["loop_s"]
        if row["status"] == "ok" and row.get("loop_s_after_first"):  # steps 2..N: the first step's warm-ups out
            row["steps_per_hour_after_first"] = (row["optimizer_steps"] - 1) * 3600.0 / row["loop_s_after_first"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rewards"}), flush=True)
        write_summary(out, p, rows)
    summary = write_summary(out, p, rows)
    print(table(rows, p))
    print(json.dumps({k: v for k, v in summary.items() if k.startswith("ours_vs_")}))
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
