"""The README's tool-call fine-tune (recipes/smollm2_tool_calls.yaml) against TRL's SFTTrainer + PEFT on the same
rows, tokens, rank, steps and batch: time, tokens/s, peak memory and BFCL of each result, in one call.

    python -m bench.sft_peers --model smollm2-135m-instruct --data calls.jsonl --mix replay.jsonl:0.3 \
        --steps 250 --batch 16 --rank 16 --lr 3e-4 --max-seq-len 4096 --chat-template chatml_tools --out DIR
    python -m bench.sft_peers --model smollm2-135m-instruct --make-rows --humaneval --out DIR   # the rows made too
    python -m bench.sft_peers --tiny --out DIR      # the whole thing on the CPU with a tiny model, a few steps

TRL needs trl and datasets (with dill, multiprocess) importable; --no-eval then --eval-only (same DIR) splits the
training rows and the evals into two calls.

Rows, each in a child process of its own (separate memory peaks; Liger's and Unsloth's patches never reach another
row): trl (before), trl-liger (use_liger_kernel=True; skipped where liger_kernel does not import), unsloth (its
FastLanguageModel, bf16 weights, its LoRA, in the same SFTTrainer on the same batches; --unsloth-site DIR goes first
on that child's PYTHONPATH, since Unsloth pins trl <= 1.15 and datasets < 5; skipped where unsloth does not import),
entrenar (the real `entrenar finetune` CLI), trl-after and trl-liger-after (that peer again: its speed did not change
while ours ran; not evaluated, the same recipe again).

Same work for every row: the training rows are read, split and mixed by entrenar's own functions (load_sft,
_split_val, mix_examples: what `finetune` does) with our tokenizer and chat template, and drawn in the order our
SFTLoader draws them (seed 0), steps x batch samples. TRL gets exactly that sequence pre-tokenized (input_ids +
assistant_masks: loss on the assistant tokens only, the tokens our labels train) through a sequential sampler, so
both train on the same token sequences in the same batches, padded to each batch's longest row.

Differences left (stated in summary.json "differences"): TRL logs entropy and token accuracy each step (its
default); transformers' AdamW is its default implementation (fused on CUDA); TRL's cosine_with_min_lr schedule is
ours in form (linear warmup, cosine to 0.1 of the peak).

Timing: the training loop only. TRL: from the Trainer's on_train_begin to on_train_end callbacks (CUDA
synchronised), model load and dataset preparation excluded. Ours: the step seconds of the run (summary tokens /
tok_s: the time inside steps, evals and checkpoints excluded). tokens/s: the non-padding tokens of the step batches
(the same count for every row) over those seconds. Peak memory: torch.cuda.max_memory_allocated in the TRL child
(reset after the model is loaded); ours: the largest mem_mb of RUN/metrics.jsonl.

Quality: `entrenar eval --task bfcl:CATEGORIES` (and humaneval with --humaneval) on each result (ours: the run; TRL's: --model BASE --adapter DIR,
its PEFT adapter), each peer `--compare`d with ours per category (exact McNemar).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS = ("trl", "trl-liger", "unsloth", "entrenar", "trl-after", "trl-liger-after")
SEED = 0  # finetune's default --seed: data order and the adapters' init
MIN_LR_RATIO = 0.1  # finetune's default --min-lr-ratio
ADAM_BETAS = (0.9, 0.95)  # entrenar's AdamW (train/optim.py)
DIFFERENCES = [
    "TRL computes entropy and mean token accuracy of every step for its logs (its default; not turned off)",
    ("the optimizer: transformers' default AdamW implementation (adamw_torch_fused on CUDA) with our betas "
     "(0.9, 0.95), eps 1e-8, weight decay 0; ours: torch AdamW through entrenar's optimizer"),
    ("LoRA init: PEFT's (kaiming-uniform A, zero B) and ours, seeded differently: equal at step 0 (B = 0), "
     "different random A"),
    "entrenar's loss eval at start and end runs outside the timed steps (its QA gate is off); TRL runs no eval",
    "both log every step (TRL logging_steps=1: its loss read back each step, as ours reads its loss once a step)",
    ("unsloth: its own loading (bf16 weights, no fp32 master copy; TRL and ours keep fp32 weights under bf16 "
     "autocast), its LoRA and its patched kernels; the model read from an HF dir written from the same GGUF"),
]


def warmup_steps(steps: int) -> int:
    """finetune's default --warmup: min(100, steps/10)."""
    return min(100, steps // 10)


# ---- the sequence both sides train on -------------------------------------------------------------------
def training_sequence(model: str, data: str, mix: list[str], max_seq_len: int, chat_template: str | None,
                      steps: int, batch: int, val_fraction: float = 0.05) -> list[Any]:
    """The SFTExamples `entrenar finetune` trains on, in its order: steps x batch samples (finetune's data path:
    load_sft, the --val-fraction split, --mix, SFTLoader at seed 0)."""
    from entrenar.data.mixing import mix_examples
    from entrenar.data.sft import SFTLoader, load_sft
    from entrenar.tokenizer import load_tokenizer, use_chat_template_file
    from entrenar.train.commands import _split_val

    tok = load_tokenizer(model)
    use_chat_template_file(tok, chat_template)
    examples, _ = load_sft(data, tok, max_seq_len)
    examples, _ = _split_val(examples, val_fraction, SEED)
    if mix:
        examples, _ = mix_examples(examples, mix, lambda path: load_sft(path, tok, max_seq_len)[0], SEED)
    loader = SFTLoader(examples, batch, seed=SEED, max_seq_len=max_seq_len)
    out = []
    for _ in range(steps):
        for _ in range(batch):
            out.append(loader._peek())
            loader._advance()
    return out


def trl_columns(example: Any) -> dict[str, list[int]]:
    """One SFTExample as TRL's pre-tokenized row: input_ids and assistant_masks (1 = a token the loss trains).
    Ours holds shifted labels (labels[t] = ids[t+1] where token t+1 is trained); TRL's labels are unshifted (the
    model shifts), so token t is trained iff labels[t-1] is not -100."""
    ids = [int(i) for i in example.input_ids]
    mask = [0] + [int(x != -100) for x in example.labels[:-1]]
    return {"input_ids": ids, "assistant_masks": mask}


def sequence_stats(seq: list[Any], batch: int) -> dict[str, Any]:
    h = hashlib.sha256()
    for ex in seq:
        h.update(ex.input_ids.tobytes())
        h.update(ex.labels.tobytes())
    padded = sum(max(len(e) for e in seq[i:i + batch]) * len(seq[i:i + batch]) for i in range(0, len(seq), batch))
    return {"samples": len(seq), "tokens": int(sum(len(e) for e in seq)), "padded_tokens": int(padded),
            "loss_tokens": int(sum(e.loss_tokens for e in seq)), "sha256": h.hexdigest()[:16]}


# ---- the TRL child -----------------------------------------------------------------------------------------
def hf_dir_of(model: str) -> str:
    """MODEL as an HF directory: itself if it is one; else (a GGUF, a packaged name) written once by entrenar's own
    converter from the weights `finetune` loads (dequantized, fp32) into the temp dir. Why: transformers marks a
    model it dequantized from a GGUF as quantized (QuantizationMethod.GGUF) and refuses to train or save it."""
    import tempfile

    import torch

    from entrenar.formats import load_model, resolve_model, save_hf_dir
    from entrenar.tokenizer import load_tokenizer

    if Path(model, "config.json").is_file():
        return model
    path = Path(resolve_model(model))
    where = Path(tempfile.gettempdir()) / f"entrenar-hf-{path.stem}-{path.stat().st_size}"
    if not (where / "config.json").is_file():
        part = where.with_name(f"{where.name}.{os.getpid()}")
        save_hf_dir(load_model(str(path), dtype=torch.float32), part, load_tokenizer(str(path)))
        part.rename(where)
    return str(where)


def load_hf(model: str, torch: Any) -> tuple[Any, Any]:
    """transformers' model (fp32) and tokenizer of MODEL (an HF dir, a GGUF or a packaged name: hf_dir_of)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = hf_dir_of(model)
    return AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32), AutoTokenizer.from_pretrained(where)


def unsloth_model(p: dict[str, Any], torch: Any) -> tuple[Any, Any]:
    """Unsloth's FastLanguageModel from the HF dir of MODEL (bf16, no 4-bit) with its LoRA on TARGETS."""
    from unsloth import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(model_name=p["hf_dir"], max_seq_length=p["max_seq_len"],
                                                   dtype=torch.bfloat16, load_in_4bit=False, local_files_only=True)
    model = FastLanguageModel.get_peft_model(model, r=p["rank"], lora_alpha=2 * p["rank"], target_modules=TARGETS,
                                             lora_dropout=0.0, bias="none", random_state=SEED,
                                             use_gradient_checkpointing=False)
    return model, tok


def build_trl_trainer(p: dict[str, Any], liger: bool = False, unsloth: bool = False) -> Any:
    """SFTTrainer + PEFT LoRA on our training sequence, configured as finetune's defaults (see DIFFERENCES); with
    unsloth, Unsloth's model and LoRA in the same trainer."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from torch.utils.data import SequentialSampler
    from trl import SFTConfig, SFTTrainer

    seq = training_sequence(p["model"], p["data"], p["mix"], p["max_seq_len"], p["chat_template"], p["steps"],
                            p["batch"])
    rows = [trl_columns(e) for e in seq]
    dataset = Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "assistant_masks")})
    model, tok = unsloth_model(p, torch) if unsloth else load_hf(p["model"], torch)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    cuda = p["device"] == "cuda"
    if not unsloth:  # Unsloth places its model itself
        model.to(p["device"])
    config = SFTConfig(
        output_dir=str(Path(p["work"]) / "trainer"), max_steps=p["steps"], per_device_train_batch_size=p["batch"],
        gradient_accumulation_steps=1, learning_rate=p["lr"], lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO}, warmup_steps=warmup_steps(p["steps"]),
        weight_decay=0.0, max_grad_norm=1.0, adam_beta1=ADAM_BETAS[0], adam_beta2=ADAM_BETAS[1], adam_epsilon=1e-8,
        bf16=cuda, fp16=False, use_cpu=not cuda, logging_steps=1, save_strategy="no", report_to="none",
        max_length=p["max_seq_len"], packing=False, gradient_checkpointing=False, dataloader_num_workers=0,
        seed=SEED, use_liger_kernel=liger, dataset_num_proc=None, remove_unused_columns=True)
    lora = LoraConfig(r=p["rank"], lora_alpha=2 * p["rank"], lora_dropout=0.0, target_modules=TARGETS,
                      task_type="CAUSAL_LM", bias="none")

    class InOrder(SFTTrainer):  # our batches in our order: no shuffling
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

    trainer = InOrder(model=model, args=config, train_dataset=dataset, processing_class=tok,
                      peft_config=None if unsloth else lora)
    trainer.entrenar_sequence = seq
    return trainer


def trl_child(p: dict[str, Any], liger: bool, unsloth: bool = False) -> dict[str, Any]:
    if unsloth:  # first: Unsloth patches transformers, trl and peft as it imports, before anything else imports them
        try:
            import unsloth as _unsloth  # noqa: F401
        except Exception as e:  # noqa: BLE001  any failure to import (not only ImportError) is the skip's reason
            raise Skip(f"unsloth does not import: {type(e).__name__}: {e}"[:500]) from None
    import torch

    if liger:
        try:
            import liger_kernel  # noqa: F401
        except ImportError as e:
            raise Skip(f"liger_kernel does not import: {e}") from None
    trainer = build_trl_trainer(p, liger, unsloth)
    cuda = p["device"] == "cuda"
    times: dict[str, Any] = {}
    trainer.add_callback(train_clock(cuda, times))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = Path(p["adapter_dir"])
    trainer.model.save_pretrained(str(out))  # PEFT format: adapter_config.json + adapter_model.safetensors
    stats = sequence_stats(trainer.entrenar_sequence, p["batch"])
    import peft
    import transformers
    import trl
    extra = {"unsloth": __import__("unsloth").__version__} if unsloth else {}
    return {"loop_s": times["end"] - times["begin"], "optimizer_steps": trainer.state.global_step,
            "final_loss": losses[-1] if losses else None, "first_loss": losses[0] if losses else None,
            "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "sequence_sha256": stats["sha256"], "adapter": str(out),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__, "torch": torch.__version__, **extra}}


def train_clock(cuda: bool, times: dict[str, Any], step_ends: bool = False) -> Any:
    """A Trainer callback writing into TIMES the seconds (CUDA synchronised) at on_train_begin ("begin"), at
    on_train_end ("end") and, with STEP_ENDS, at each step's end ("step_ends": one more sync a step)."""
    import torch
    from transformers import TrainerCallback

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    times["step_ends"] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            times["begin"] = now()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if step_ends:
                times["step_ends"].append(now())

        def on_train_end(self, *a: Any, **k: Any) -> None:
            times["end"] = now()

    return Clock()


class Skip(Exception):
    """The row cannot run here (a package does not import): a skipped row, not a failure."""


def child_main(kind: str, params: str) -> int:
    p = json.loads(params)
    try:
        row = trl_child(p, liger=kind == "trl-liger", unsloth=kind == "unsloth")
    except Skip as e:
        print(f"SKIP {e}", flush=True)
        return 0
    print("ROW " + json.dumps(row), flush=True)
    return 0


# ---- the parent ----------------------------------------------------------------------------------------------
def run(cmd: list[str], timeout: float, log: Path, first_path: str = "") -> tuple[int, str, str]:
    """CMD with the repository (and FIRST_PATH before everything) on its PYTHONPATH, its output to LOG."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*([first_path] if first_path else []), str(Path(__file__).resolve().parents[1]),
         str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
        code, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        code, out, err = 124, str(e.stdout or ""), str(e.stderr or "") + f"\ntimed out after {timeout:.0f} s"
    log.write_text(f"$ {shlex.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}\n")
    return code, out, err


def _tail(err: str) -> str:
    return " | ".join([ln for ln in err.strip().splitlines() if ln.strip()][-6:])[-900:]


def row_kind(name: str) -> str:
    """The peer a row runs: a row named NAME-after is NAME's peer run again after ours."""
    kind = name.removesuffix("-after")
    assert kind in ("trl", "trl-liger", "unsloth"), name
    return kind


def trl_row(name: str, p: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    kind = row_kind(name)
    params = {**p, "adapter_dir": str(out / name), "work": str(out / name / "work")}
    if kind == "unsloth":
        params["hf_dir"] = hf_dir_of(p["model"])
    cmd = [sys.executable, "-m", "bench.sft_peers", "--child", kind, json.dumps(params)]
    return child_row(name, kind, cmd, out, timeout, first_path=(p.get("unsloth_site") or "") if kind == "unsloth"
                     else "")


def child_row(name: str, peer: str, cmd: list[str], out: Path, timeout: float, first_path: str = "") -> dict[str, Any]:
    """A peer row from its child process (output in OUT/NAME.log): its last line `ROW {json}` (ok), `SKIP reason`
    (skipped), anything else failed with the exit code and the end of its stderr."""
    t0 = time.perf_counter()
    code, stdout, err = run(cmd, timeout, out / f"{name}.log", first_path=first_path)
    row: dict[str, Any] = {"row": name, "peer": peer, "wall_s": time.perf_counter() - t0}
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    if code == 0 and last.startswith("ROW "):
        row.update(json.loads(last[4:]), status="ok")
    elif code == 0 and last.startswith("SKIP "):
        row.update(status="skipped", reason=last[5:])
    else:
        row.update(status="failed", reason=f"exit {code}: {_tail(err)}")
    return row


def entrenar_command(p: dict[str, Any], run_dir: Path) -> list[str]:
    """`finetune` as the recipe runs it, without its in-loop task evals (the peer runs none) and QA gate."""
    cmd = [sys.executable, "-m", "entrenar", "finetune", "--json", "--model", p["model"], "--data", p["data"],
           "--mode", "lora", "--rank", str(p["rank"]), "--lr", str(p["lr"]), "--steps", str(p["steps"]),
           "--batch-size", str(p["batch"]), "--max-seq-len", str(p["max_seq_len"]), "--seed", str(SEED),
           "--on-qa-fail", "off", "--save-every-minutes", "0", "--out", str(run_dir)]
    for m in p["mix"]:
        cmd += ["--mix", m]
    if p["chat_template"]:
        cmd += ["--chat-template", p["chat_template"]]
    if p.get("padding_free"):
        cmd += ["--padding-free"]
    if p["device"] == "cpu":
        cmd += ["--device", "cpu"]
    return cmd + list(p.get("entrenar_flags") or [])


def run_entrenar(cmd: list[str], out: Path, timeout: float) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Our row's `finetune --json` command, its output in OUT/entrenar.log: (the row so far, the run's summary; None
    and the row marked failed when it did not finish)."""
    t0 = time.perf_counter()
    code, stdout, err = run(cmd, timeout, out / "entrenar.log")
    row: dict[str, Any] = {"row": "entrenar", "peer": "entrenar", "wall_s": time.perf_counter() - t0,
                           "command": shlex.join(cmd)}
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    try:
        res = json.loads(last)
    except json.JSONDecodeError:
        res = {}
    if code != 0 or not res.get("ok", True):
        row.update(status="failed", reason=f"exit {code}: {_tail(err)}")
        return row, None
    return row, res.get("train") if isinstance(res.get("train"), dict) else res


def entrenar_row(p: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    run_dir = out / "entrenar"
    if run_dir.exists():  # an earlier call's run (one cut by its time limit too): finetune refuses an --out in use
        shutil.rmtree(run_dir)
    row, summ = run_entrenar(entrenar_command(p, run_dir), out, timeout)
    if summ is None:
        return row
    tok_s, tokens = summ.get("tok_s"), summ.get("tokens")
    mems = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line) if line.startswith("{") else {}
            if rec.get("mem_mb") is not None:
                mems.append(rec["mem_mb"])
    row.update(status="ok", loop_s=tokens / tok_s if tok_s else None, optimizer_steps=summ.get("steps"),
               final_loss=summ.get("final_train_loss"), counted_tokens=tokens,
               peak_mem_mb=max(mems) if mems and p["device"] == "cuda" else None, adapter=str(run_dir))
    return row


def task_file(task: str) -> str:
    """The per-problem rows file of a task: bfcl.jsonl, humaneval.jsonl."""
    return task.split(":", 1)[0] + ".jsonl"


def task_eval(row: dict[str, Any], task: str, p: dict[str, Any], out: Path, compare: Path | None,
              timeout: float) -> None:
    """`eval --task TASK` of one row's result into row["evals"][TASK]; a peer's paired with ours (--compare)."""
    name = row["row"]
    rows_file = out / name / task_file(task)
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    model = ["--model", row["adapter"]] if name == "entrenar" else ["--model", p["model"], "--adapter", row["adapter"]]
    cmd = [sys.executable, "-m", "entrenar", "eval", "--json", *model, "--task", task,
           "--out", str(rows_file), "--overwrite"]
    if p["chat_template"]:
        cmd += ["--chat-template", p["chat_template"]]
    if p["eval_limit"]:
        cmd += ["--limit", str(p["eval_limit"])]
    if p["device"] == "cpu":
        cmd += ["--device", "cpu"]
    if p.get("eval_max_new_tokens"):
        cmd += ["--max-new-tokens", str(p["eval_max_new_tokens"])]
    if compare is not None:
        cmd += ["--compare", str(compare)]
    code, stdout, err = run(cmd, timeout, out / f"{name}.{task_file(task)[:-6]}.eval.log")
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    try:
        res = json.loads(last)
    except json.JSONDecodeError:
        res = {}
    evals = row.setdefault("evals", {})
    if code != 0:
        evals[task] = {"status": "failed", "reason": f"exit {code}: {_tail(err)}"}
        return
    evals[task] = {"status": "ok", "rows": str(rows_file), "problems": res.get("problems"),
                   "passed": res.get("passed_problems"), "accuracy": res.get("accuracy"),
                   **({"categories": res["categories"]} if res.get("categories") else {}),
                   **({"compare_with_entrenar": res["compare"]} if "compare" in res else {})}


def evals_cell(r: dict[str, Any]) -> str:
    """Per task (and BFCL category) passed/total, and for a peer whether any differs from ours (p_holm < 0.05)."""
    cells = []
    for task, e in (r.get("evals") or {}).items():
        if e.get("status") != "ok":
            cells.append(f"{task}: {e.get('status')}")
            continue
        cats = e.get("categories") or {}
        cells.append(" ".join(f"{c} {v['correct']}/{v['total']}" for c, v in cats.items()) if cats
                     else f"{task} {e.get('passed')}/{e.get('problems')}")
        units = (e.get("compare_with_entrenar") or {}).get("units") or {}
        differ = [u.split(":")[-1] for u, c in units.items() if c.get("p_holm", 1.0) < 0.05]
        cells[-1] += f" (differs from ours: {', '.join(differ)})" if differ else " (= ours)" if units else ""
    return "; ".join(cells) or "-"


def table(rows: list[dict[str, Any]], tokens: int) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    peers = [r for r in ok if r["row"] != "entrenar" and r.get("tok_s")]
    fastest = max(peers, key=lambda r: r["tok_s"]) if peers else None
    lines = [f"tokens trained per row: {tokens:,}", "",
             "| row | status | loop s | steps/s | tokens/s | vs fastest peer | peak MiB | final loss | evals |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['row']} | {r['status']}: {r.get('reason', '')[:80]} | | | | | | | |")
            continue
        ratio = f"{r['tok_s'] / fastest['tok_s']:.2f}x" if fastest and r.get("tok_s") else ""
        mem = f"{r['peak_mem_mb']:.0f}" if r.get("peak_mem_mb") is not None else "-"
        loss = f"{r['final_loss']:.4f}" if r.get("final_loss") is not None else "-"
        lines.append(f"| {r['row']} | ok | {r['loop_s']:.1f} | {r['steps_s']:.2f} | {r['tok_s']:,.0f} | {ratio} | "
                     f"{mem} | {loss} | {evals_cell(r)} |")
    return "\n".join(lines)


def make_rows(p: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    """The recipe's rows, made as its header says: BFCL-derived calls and the base's replayed answers (30%)."""
    calls, replay = out / "rows" / "calls.jsonl", out / "rows" / "replay.jsonl"
    calls.parent.mkdir(parents=True, exist_ok=True)
    steps = [[sys.executable, "-m", "entrenar", "data", "sft-from-bfcl", "--out", str(calls), "--irrelevance",
              "--swapped-no-call", "650", "--swapped-matched"],
             [sys.executable, "-m", "entrenar", "data", "replay", "--model", p["model"], "--out", str(replay),
              *(["--chat-template", p["chat_template"]] if p["chat_template"] else []),
              *(["--device", "cpu"] if p["device"] == "cpu" else [])]]
    for cmd, made in zip(steps, (calls, replay), strict=True):
        if made.is_file():  # made by an earlier call into the same --out: the same rows
            continue
        code, _, err = run(cmd, timeout, out / f"rows-{made.stem}.log")
        if code != 0:
            raise SystemExit(f"--make-rows: {shlex.join(cmd)} failed (exit {code}): {_tail(err)}")
    return {"data": str(calls), "mix": [f"{replay}:0.3"]}


def make_tiny(out: Path) -> dict[str, Any]:
    """A tiny llama with SmolLM2's tokenizer and a few tool-call rows (no weights downloaded)."""
    from entrenar.config import ModelConfig
    from entrenar.formats import save_hf_dir
    from entrenar.model import CausalLM
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, architecture="llama", tie_word_embeddings=True)
    model = CausalLM.from_scratch(cfg, seed=0)
    model_dir = save_hf_dir(model, out / "tiny-model", tok)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}]
    cities = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Bern", "Rome"]
    rows = [{"messages": [{"role": "user", "content": f"Weather in {c}?"},
                          {"role": "assistant", "content": "", "tool_calls": [
                              {"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}]}],
             "tools": tools} for c in cities * 3]
    data = out / "tiny-rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    replay = out / "tiny-replay.jsonl"
    replay.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                       {"role": "assistant", "content": w}]}) + "\n"
                              for w in ["yes", "no", "maybe", "hello", "thanks", "ok"]))
    return {"model": str(model_dir), "data": str(data), "mix": [f"{replay}:0.3"]}


def build_parser() -> argparse.ArgumentParser:
    """The flags; their defaults are recipes/smollm2_tool_calls.yaml's (tests/test_bench_sft_peers.py)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", help="MODEL: a .gguf, an HF dir or a packaged name (smollm2-135m-instruct)")
    ap.add_argument("--data", help="the training rows (JSONL), e.g. `data sft-from-bfcl`'s")
    ap.add_argument("--make-rows", action="store_true",
                    help="make the recipe's rows into OUT/rows/ (data sft-from-bfcl + data replay of --model, mixed "
                         "at 0.3) instead of --data/--mix")
    ap.add_argument("--mix", action="append", default=[], help="FILE:FRACTION as finetune's --mix (repeatable)")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--chat-template", default="chatml_tools")
    ap.add_argument("--padding-free", action=argparse.BooleanOptionalAction, default=True,
                    help="our row with finetune --padding-free, as the recipe (--no-padding-free: padded batches)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"which rows, in order ({','.join(ROWS)})")
    ap.add_argument("--categories", default="simple_python,multiple,irrelevance", help="BFCL categories")
    ap.add_argument("--humaneval", action="store_true", help="also eval --task humaneval on each result")
    ap.add_argument("--eval-limit", type=int, default=0,
                    help="evals: the first N problems (of each category for BFCL); 0 = all")
    ap.add_argument("--no-eval", action="store_true", help="speed rows only")
    ap.add_argument("--eval-only", action="store_true",
                    help="only the evals, of the rows an earlier call wrote into --out (its summary.json)")
    ap.add_argument("--entrenar-flag", action="append", default=[],
                    help="an extra finetune flag for our row (repeatable; e.g. --entrenar-flag=--pad-buckets=4)")
    ap.add_argument("--unsloth-site", default="",
                    help="a directory put first on the unsloth row's PYTHONPATH (its pinned trl/datasets)")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="per child process")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: a tiny model, tiny rows, 3 steps")
    ap.add_argument("--out", required=True)
    return ap


def write_summary(out: Path, p: dict[str, Any], stats: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """DIR/summary.json, rewritten after every row and eval (a run cut short keeps what it measured)."""
    ours = next((r for r in rows if r["row"] == "entrenar" and r["status"] == "ok"), None)
    peers = [r for r in rows if r["status"] == "ok" and r["peer"] != "entrenar" and r.get("tok_s")]
    fastest = max(peers, key=lambda r: r["tok_s"]) if peers else None
    summary = {"params": p, "sequence": stats, "rows": rows, "differences": DIFFERENCES,
               "warmup_steps": warmup_steps(p["steps"]), "min_lr_ratio": MIN_LR_RATIO,
               "fastest_peer": fastest["row"] if fastest else None,
               "ours_vs_fastest_peer_tok_s": ours["tok_s"] / fastest["tok_s"] if ours and fastest
               and ours.get("tok_s") else None,
               "ours_vs_fastest_peer_mem": ours["peak_mem_mb"] / fastest["peak_mem_mb"] if ours and fastest
               and ours.get("peak_mem_mb") and fastest.get("peak_mem_mb") else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def earlier_rows(out: Path, stats: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    """The rows an earlier call into the same --out trained on the same sequence, but for those run again now (so a
    row can be added in a later call, e.g. one whose packages travel separately)."""
    path = out / "summary.json"
    if not path.is_file():
        return []
    before = json.loads(path.read_text())
    if before.get("sequence", {}).get("sha256") != stats["sha256"]:
        return []
    kept = [r for r in before.get("rows", []) if r["row"] not in names]
    if kept:
        print(f"kept from {path}: {', '.join(r['row'] for r in kept)}", flush=True)
    return kept


def train_rows(names: list[str], p: dict[str, Any], stats: dict[str, Any], out: Path,
               timeout: float, earlier: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = list(earlier or [])
    for name in names:
        row = entrenar_row(p, out, timeout) if name == "entrenar" else trl_row(name, p, out, timeout)
        if row["status"] == "ok" and row.get("loop_s"):
            row["steps_s"] = p["steps"] / row["loop_s"]
            row["tok_s"] = stats["tokens"] / row["loop_s"]
            if row["peer"] != "entrenar":
                row["same_sequence"] = row.get("sequence_sha256") == stats["sha256"]
            elif not p["entrenar_flags"]:  # ours counts the tokens it ran: padded to each batch's longest, or the
                # real ones with --padding-free (not with buckets)
                want = stats["tokens"] if p.get("padding_free") else stats["padded_tokens"]
                row["counted_tokens_match"] = row.get("counted_tokens") == want
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_summary(out, p, stats, rows)
    return rows


def eval_rows(rows: list[dict[str, Any]], p: dict[str, Any], stats: dict[str, Any], out: Path,
              timeout: float) -> None:
    """Each of p["tasks"] on ours, then on every peer's result paired with ours; a row run again after ours
    (NAME-after) is the same recipe again, measured for its speed only."""
    ours = next((r for r in rows if r["row"] == "entrenar" and r["status"] == "ok"), None)
    for task in p["tasks"]:
        if ours is not None:
            task_eval(ours, task, p, out, None, timeout)
        ours_rows = out / "entrenar" / task_file(task) if ours and ours["evals"][task]["status"] == "ok" else None
        for r in rows:
            if r is not ours and r["status"] == "ok" and not r["row"].endswith("-after"):
                task_eval(r, task, p, out, ours_rows, timeout)
            write_summary(out, p, stats, rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1], argv[2])
    ap = build_parser()
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [f"bfcl:{args.categories}"] + (["humaneval"] if args.humaneval else [])
    if args.eval_only:  # the rows of an earlier call into the same --out (its adapters still there)
        if not (out / "summary.json").is_file():
            ap.error(f"--eval-only: {out / 'summary.json'} does not exist; run the training rows into --out first")
        before = json.loads((out / "summary.json").read_text())
        p, stats, rows = before["params"], before["sequence"], before["rows"]
        p.update(tasks=tasks, eval_limit=args.eval_limit or p.get("eval_limit", 0))
    else:
        p, stats, rows = prepare(ap, args, out, tasks), {}, []
        seq = training_sequence(p["model"], p["data"], p["mix"], p["max_seq_len"], p["chat_template"], p["steps"],
                                p["batch"])
        stats = sequence_stats(seq, p["batch"])
        names = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = [n for n in names if n not in ROWS]
        if unknown:
            ap.error(f"--rows: unknown row(s) {', '.join(unknown)}; rows: {', '.join(ROWS)}")
        earlier = earlier_rows(out, stats, names)
        rows = train_rows(names, p, stats, out, args.timeout_s, earlier)
    if not args.no_eval:
        eval_rows(rows, p, stats, out, args.timeout_s)
    summary = write_summary(out, p, stats, rows)
    print(table(rows, stats["tokens"]))
    print(json.dumps({k: summary[k] for k in ("fastest_peer", "ours_vs_fastest_peer_tok_s",
                                              "ours_vs_fastest_peer_mem")}))
    return 0 if all(r["status"] != "failed" for r in rows) else 1


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace, out: Path, tasks: list[str]) -> dict[str, Any]:
    """The run's parameters: the flags, --tiny's model and rows, or --make-rows's rows."""
    import torch

    p: dict[str, Any] = {"model": args.model, "data": args.data, "mix": args.mix, "steps": args.steps,
                         "batch": args.batch, "rank": args.rank, "lr": args.lr, "max_seq_len": args.max_seq_len,
                         "chat_template": args.chat_template, "padding_free": args.padding_free, "tasks": tasks,
                         "eval_limit": args.eval_limit, "entrenar_flags": args.entrenar_flag,
                         "unsloth_site": args.unsloth_site,
                         "device": "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"}
    if args.tiny:
        p.update(make_tiny(out), steps=3, batch=2, rank=4, max_seq_len=512, eval_limit=args.eval_limit or 1,
                 eval_max_new_tokens=16)
    elif args.make_rows:
        if not p["model"]:
            ap.error("--make-rows replays --model's answers: give --model")
        p.update(make_rows(p, out, args.timeout_s))
    if not p["model"] or not p["data"]:
        ap.error("--model and --data (or --make-rows) are required, or --tiny")
    return p


if __name__ == "__main__":
    sys.exit(main())
