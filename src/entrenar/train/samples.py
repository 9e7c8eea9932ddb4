"""Sample generations during training (`--sample-prompts FILE --sample-every N --sample-max-new-tokens M`).

At step 0 of a fresh run, every N steps and at the last step, the model being trained continues each prompt of
FILE greedily (at most M new tokens; end-of-turn / EOS stop it): one line per prompt in RUN/samples.jsonl
`{"step", "prompt", "completion", "stop_reason", "seconds"}`, a short line per prompt on stderr, and the step's
completions as text to the --report-to trackers. Rank 0 generates (from its own replica, under DDP: no
collective is involved); FSDP2 is refused (its shards would need every rank to decode in lock step).

FILE: plain text, one prompt per line (blank lines skipped), or JSONL rows `{"prompt": TEXT}` or
`{"messages": [...]}`. A prompt TEXT is a user turn rendered with the chat template (with the generation
prompt) when the run is a finetune of a model that has one, else continued as plain text; messages need a template.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError
from .metrics import JsonlLog, NullLog

SAMPLES_FILE = "samples.jsonl"
_SHOWN_CHARS = 160  # of a completion on stderr (samples.jsonl has all of it)


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """The prompts of FILE as rows {"prompt": text} or {"messages": [...]}; exit 2 naming FILE:LINE."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--sample-prompts {path}: no such file (one prompt per line, or JSONL rows of prompt or "
                         f"messages)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"--sample-prompts {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise InputError(f"--sample-prompts {path}: no prompt in it (one prompt per line, or JSONL rows)")
    as_json = path.suffix == ".jsonl" or numbered[0][1].lstrip().startswith("{")
    if not as_json:
        return [{"prompt": line} for _, line in numbered]
    rows = []
    for n, line in numbered:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not valid JSON ({e.msg}); --sample-prompts rows are "
                             f'{{"prompt": TEXT}} or {{"messages": [...]}}') from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
            rows.append({"prompt": row["prompt"]})
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"] and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in row["messages"]):
            rows.append({"messages": row["messages"]})
        else:
            raise InputError(f'{path}:{n}: a --sample-prompts row needs "prompt" (non-empty text) or "messages" '
                             f"(a list of {{role, content}}); got {line[:80]!r}")
    return rows


class SampleGenerator:
    """The prompts of --sample-prompts encoded once (a bad file is exit 2 before training); `bind` gives it the
    run, `start` its first step, `maybe(step, model)` generates when due."""

    def __init__(self, path: str, tokenizer: Any, *, chat: bool, every: int, steps: int, max_new_tokens: int,
                 device: str, dtype: str):
        if tokenizer is None:
            raise InputError("--sample-prompts generates text: it needs the model's tokenizer, and this run has none")
        self.tokenizer, self.every, self.steps, self.max_new_tokens = tokenizer, every, steps, max_new_tokens
        self.device, self.dtype = device, dtype
        self.rows = read_prompts(path)
        chat = chat and tokenizer.chat_template is not None
        self.texts: list[str] = []
        self.ids: list[list[int]] = []
        for n, row in enumerate(self.rows, 1):
            messages = row.get("messages")
            if messages is None and not chat:
                self.texts.append(row["prompt"])
                self.ids.append(tokenizer.encode(row["prompt"]))
                continue
            if tokenizer.chat_template is None:
                raise InputError(f"--sample-prompts {path}: prompt {n} is a chat (messages), and the model has no "
                                 f"chat template: give plain prompts, or --chat-template FILE (finetune)")
            messages = messages or [{"role": "user", "content": row["prompt"]}]
            self.texts.append(messages[-1]["content"])
            self.ids.append(tokenizer.encode_chat(messages, add_generation_prompt=True).ids)
        self.log: JsonlLog | NullLog = NullLog()
        self.tracking: Any = None
        self.message: Callable[[str], None] = print
        self.is_main = True

    def bind(self, run_dir: Path, is_main: bool, tracking: Any, message: Callable[[str], None]) -> None:
        self.log = JsonlLog(Path(run_dir) / SAMPLES_FILE) if is_main else NullLog()
        self.tracking, self.message, self.is_main = tracking, message, is_main

    def start(self, step: int, model: torch.nn.Module) -> None:
        """The run starts (0: samples.jsonl emptied, the base's samples) or resumes after `step` (later lines go)."""
        if step == 0:
            self.log.reset()
            self.maybe(0, model)
        else:
            self.log.truncate_after(step)

    def due(self, step: int) -> bool:
        return step == 0 or step == self.steps or bool(self.every and step % self.every == 0)

    def maybe(self, step: int, model: torch.nn.Module, last: bool = False) -> None:
        """Generate after `step` when it is due (`last`: the run ends there, an early stop)."""
        if self.is_main and (last or self.due(step)):
            self.generate(step, model)

    def generate(self, step: int, model: torch.nn.Module) -> list[dict[str, Any]]:
        from ..evaluate.harness import BF16_COMPUTE
        from ..generate import generate_batch

        context = model.cfg.max_position_embeddings
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16,
                                                 enabled=self.dtype in BF16_COMPUTE):
                results = [generate_batch(model, self.tokenizer, [ids], max(1, min(self.max_new_tokens,
                                                                                    context - len(ids))))[0]
                           for ids in self.ids]  # one prompt at a time: no padding, the tokens of `generate`
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - t0
        records = [{"step": step, "prompt": text, "completion": r.text, "stop_reason": r.stop_reason}
                   for text, r in zip(self.texts, results)]
        for record in records:
            self.log.write(record)
        self.message(f"step {step}: samples ({len(records)} prompts, {seconds:.1f} s) -> {SAMPLES_FILE}")
        for record in records:
            shown = " ".join(record["completion"].split())
            self.message(f"  {record['prompt'][:40]!r} -> {shown[:_SHOWN_CHARS]!r}"
                         + ("..." if len(shown) > _SHOWN_CHARS else ""))
        if self.tracking is not None:
            self.tracking.log_text(step, "samples", "\n\n".join(
                f"PROMPT: {r['prompt']}\nCOMPLETION: {r['completion']}" for r in records))
        return records
