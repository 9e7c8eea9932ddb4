"""The task eval: prompts -> completions (any generator) -> extracted code -> sandboxed tests -> pass@k.

The generator is a parameter, so the same harness runs on our engine's `generate_many` (`entrenar eval --task
humaneval`) and on transformers' `generate` (bench/humaneval_parity.py): only the token ids may differ.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..devices import BF16_COMPUTE
from ..engine import CPU_SLOTS
from ..errors import InputError
from ..fileio import atomic_write, open_no_follow
from .sandbox import SandboxLimits, isolation_level, run_program, weakest_isolation
from .tasks import Problem, completion_done, extract_code, pass_at_k, program, prompt_ids


@dataclass(frozen=True)
class Completion:
    """A generated completion and whether the token limit cut it: it ended at --max-new-tokens (or the model's
    context) before an end-of-turn/EOS token or the task's stop rule (issue 38 item 11: such code is cut short)."""

    text: str
    truncated: bool


# (prompt ids of the requests, the sample index of each: one per prompt) -> one completion per prompt: a Completion,
# or its text alone from a generator that cannot tell why it stopped (the record's "truncated" is then null). One call
# holds a batch's problems x their samples (a prompt's ids once per sample), so a sampling generator seeds request i
# with seed + samples[i]: its draws depend on that seed and the prompt, not on what else the call holds.
Complete = Callable[[list[list[int]], Sequence[int]], Sequence[Completion | str]]


def completion_parts(completion: Completion | str) -> tuple[str, bool | None]:
    """(text, truncated: None when the generator did not say) of what a Complete returned."""
    if isinstance(completion, Completion):
        return completion.text, completion.truncated
    return completion, None


def truncated_count(records: Sequence[dict[str, Any]]) -> int:
    """The records whose completion the token limit cut."""
    return sum(1 for r in records if r.get("truncated"))


def truncation_note(truncated: int, completions: int, flag: str, limit: int) -> str | None:
    """The note printed when `truncated` of `completions` were cut by the token limit (`flag` `limit`), or None."""
    if not truncated:
        return None
    return (f"note: {truncated} of {completions} completions stopped at {flag} {limit} before an end-of-turn/EOS "
            f"token or the task's stop rule (\"truncated\": true in their rows): they were cut short, not finished; "
            f"a larger {flag} lets them finish")


def eta_text(done: int, total: int, elapsed_s: float) -> str:
    """"ETA 3 min 20 s" of a task eval `done` of `total` items in, at the rate so far (items done in this process:
    resumed rows are not counted in `done`)."""
    if done <= 0 or total <= done:
        return "ETA 0 s" if total <= done else "ETA unknown"
    left = elapsed_s / done * (total - done)
    return f"ETA {int(left // 60)} min {int(left % 60)} s" if left >= 60 else f"ETA {left:.0f} s"


MAX_SANDBOX_WORKERS = 16


def sandbox_workers() -> int:
    """Programs tested at once: the CPUs this process may use, at least 2, at most MAX_SANDBOX_WORKERS. A pass@10 run
    of 1,640 programs (~0.15 s each, a few up to the timeout) took 134 s two at a time on a 16-core GPU host, while
    its generation took 11.5 s."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(2, min(MAX_SANDBOX_WORKERS, cpus))


@dataclass
class TaskEvalSettings:
    samples: int = 1  # completions per problem (n of pass@k)
    batch_size: int = 8  # problems handed to the generator at once, each with its missing samples
    chat: bool = True  # the chat format (the model's template) or plain completion
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workers: int = field(default_factory=lambda: sandbox_workers())  # programs run at once, each in its own sandbox
    system: str | None = None  # the system message of every chat prompt (None: the template's default)

    def ks(self) -> list[int]:
        """The k of pass@k reported: 1, 10, 100 up to the number of samples."""
        return pass_ks(self.samples)


def pass_ks(samples: int) -> list[int]:
    """The k of pass@k a task eval of `samples` completions per problem reports: 1, 10, 100 up to `samples`."""
    return [k for k in (1, 10, 100) if k <= samples]


def mean_pass_at_k(passes: Sequence[int], samples: int, ks: Sequence[int]) -> dict[str, float]:
    """{"pass@k": the unbiased estimator (tasks.pass_at_k) averaged over problems} for each k of `ks`, from each
    problem's count of passing samples of `samples`."""
    return {f"pass@{k}": sum(pass_at_k(samples, c, k) for c in passes) / len(passes) for k in ks}


def _batches(problems: Sequence[Problem], ids: list[list[int]], size: int) -> list[list[int]]:
    """Indices of problems in batches of similar prompt length (little padding), longest first (a memory
    problem shows at once)."""
    order = sorted(range(len(problems)), key=lambda i: -len(ids[i]))
    return [order[i:i + size] for i in range(0, len(order), size)]


def task_records(problems: Sequence[Problem], tokenizer, complete: Complete, settings: TaskEvalSettings,
                 log: Callable[[str], None] | None = None, *,
                 done: dict[tuple[str, int], dict[str, Any]] | None = None,
                 on_record: Callable[[dict[str, Any]], None] | None = None,
                 row_settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Generate `settings.samples` completions per problem and test each in the sandbox: one record per
    (problem, sample), in problem order. `done`: records already made ({(task_id, sample): record}, e.g.
    read back by read_results for --resume), taken as they are and not run again. `on_record(record)` is
    called with each new record as soon as its program has run (run_task_eval appends it to --out).
    `row_settings`, when given, goes into every new record as "settings" (what --resume must match)."""
    start = time.perf_counter()
    done = done or {}
    ids = [prompt_ids(p, tokenizer, settings.chat, settings.system) for p in problems]
    records: list[dict[str, Any] | None] = [done.get((p.task_id, s)) for p in problems for s in range(settings.samples)]
    finished = 0
    todo, made_here = sum(1 for r in records if r is None), 0  # the ETA counts what this process generates
    with ThreadPoolExecutor(max_workers=max(1, settings.workers)) as pool:
        for whole in _batches(problems, ids, settings.batch_size):
            # every (problem, sample) of the batch not done yet in one call: continuous batching keeps the slots full
            # across samples (a call per sample decoded K times as long as that sample's longest answer)
            missing = [(i, s) for i in whole for s in range(settings.samples) if records[i * settings.samples + s] is None]
            if missing:  # else every row of this batch came from `done`
                if log is not None:  # a CPU batch decodes for minutes: say what is running before it does
                    log(f"problems {finished + 1}-{finished + len(whole)} of {len(problems)}: generating"
                        + (f" {settings.samples} samples each" if settings.samples > 1 else "")
                        + (f" ({len(missing)} of {len(whole) * settings.samples} not done yet)"
                           if len(missing) < len(whole) * settings.samples else ""))
                t0 = time.perf_counter()
                made = [completion_parts(c) for c in complete([ids[i] for i, _ in missing], [s for _, s in missing])]
                seconds = (time.perf_counter() - t0) / len(missing)
                assert len(made) == len(missing), (len(made), len(missing))
                codes = [extract_code(text, settings.chat) for text, _ in made]
                programs = [program(problems[i], c, settings.chat) for (i, _), c in zip(missing, codes)]
                results = pool.map(lambda src: run_program(src, settings.limits), programs)
                for (i, s), (text, truncated), code, res in zip(missing, made, codes, results):
                    record = {
                        "task_id": problems[i].task_id, "sample": s, "passed": res.passed, "status": res.status,
                        "error": res.error, "completion": text, "truncated": truncated, "code": code,
                        "prompt_tokens": len(ids[i]), "generate_seconds": round(seconds, 3),
                        "run_seconds": round(res.seconds, 3), "isolation": res.isolation}
                    if row_settings is not None:
                        record["settings"] = row_settings
                    records[i * settings.samples + s] = record
                    made_here += 1
                    if on_record is not None:
                        on_record(record)
            finished += len(whole)
            if log is not None:
                passed = sum(1 for r in records if r is not None and r["passed"])
                elapsed = time.perf_counter() - start
                log(f"{finished}/{len(problems)} problems, {passed} passing samples so far "
                    f"({elapsed:.0f} s, {eta_text(made_here, todo, elapsed)})")
    assert all(r is not None for r in records)
    return records  # type: ignore[return-value]


def read_results(out: str | Path, problems: Sequence[Problem], samples: int,
                 row_settings: dict[str, Any] | None) -> dict[tuple[str, int], dict[str, Any]]:
    """The complete rows of an earlier (possibly interrupted) --out, for --resume: {(task_id, sample): row}.
    A last line cut by the interruption (no newline, or not JSON) is dropped. A row made under other
    settings (another model, data, sampling ...: its "settings" differ from `row_settings`), for a task
    or sample this run does not have, or not a results row at all, is an InputError naming FILE:LINE."""
    out = Path(out)
    if not out.exists():
        return {}
    text = out.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if not text.endswith("\n"):  # the last row was being written when the run stopped
        lines = lines[:-1]
    wanted = {(p.task_id, s) for p in problems for s in range(samples)}
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--resume: {out}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg}); not a results file of `eval --task`") from None
        if not isinstance(row, dict) or not {"task_id", "sample", "passed", "status"} <= set(row):
            raise InputError(f"{where}: not a task-eval results row (task_id, sample, passed, status)")
        if row.get("settings") != row_settings:
            theirs = row.get("settings") or {}
            differ = sorted(k for k in set(theirs) | set(row_settings or {})
                            if theirs.get(k) != (row_settings or {}).get(k))
            raise InputError(f"{where}: made with other settings ({', '.join(f'{k}: {theirs.get(k)!r}' for k in differ)}"
                             f" there, not {', '.join(repr((row_settings or {}).get(k)) for k in differ)}); "
                             f"--resume continues only the same eval; choose another --out")
        key = (row["task_id"], row["sample"])
        if key not in wanted:
            raise InputError(f"{where}: task {key[0]!r} sample {key[1]} is not among this run's "
                             f"{len(problems)} problems x {samples} samples (another --limit or --data?)")
        rows.setdefault(key, row)
    return rows


def summarize(records: Sequence[dict[str, Any]], settings: TaskEvalSettings) -> dict[str, Any]:
    """pass@k (the unbiased estimator, averaged over problems) and what the run was."""
    per_problem: dict[str, int] = {}
    for r in records:
        per_problem[r["task_id"]] = per_problem.get(r["task_id"], 0) + int(r["passed"])
    n_problems = len(per_problem)
    level, python = isolation_level()
    # what the programs ran under, each record says (records of an older file lack it: this process's level)
    ran_under: dict[str, int] = {}
    for r in records:
        iso = r.get("isolation", level + "+audit-hook")
        ran_under[iso] = ran_under.get(iso, 0) + 1
    box: dict[str, Any] = {"isolation": weakest_isolation(ran_under) if ran_under else level + "+audit-hook"}
    if len(ran_under) > 1:  # mixed: the weakest, and how many programs ran under each
        box["isolation_counts"] = dict(sorted(ran_under.items()))
    return {"problems": n_problems, "samples": settings.samples,
            **mean_pass_at_k(list(per_problem.values()), settings.samples, settings.ks()),
            "passed_problems": sum(1 for c in per_problem.values() if c),
            "truncated": truncated_count(records),
            "format": "chat" if settings.chat else "completion",
            "sandbox": {**box, "python": python, "timeout_s": settings.limits.timeout_s,
                        "memory_mb": settings.limits.memory_mb, "nproc": settings.limits.nproc}}


def write_as_made(out: str | Path, done: dict[Any, dict[str, Any]],
                  make: Callable[[Callable[[dict[str, Any]], None]], list[dict[str, Any]]],
                  interrupted: Callable[[int], str] | None = None) -> list[dict[str, Any]]:
    """An eval's --out rows as they are made (humaneval's and bfcl's): `done`'s rows first (no cut last line to
    append after), then each record `make(append)` scores appended and flushed (a run stopped by Ctrl-C or a crash
    leaves the rows done so far, valid JSONL; `interrupted(rows kept)` is then Ctrl-C's message), then the file
    rewritten whole, atomically, in `make`'s order."""
    atomic_write(out, "".join(json.dumps(r) + "\n" for r in done.values()))
    kept = [len(done)]
    with os.fdopen(open_no_follow(out, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8") as f:
        def append(record: dict[str, Any]) -> None:
            f.write(json.dumps(record) + "\n")
            f.flush()
            kept[0] += 1

        try:
            records = make(append)
        except KeyboardInterrupt:
            if interrupted is None:
                raise
            raise KeyboardInterrupt(interrupted(kept[0])) from None
    atomic_write(out, "".join(json.dumps(r) + "\n" for r in records))
    return records


def run_task_eval(problems: Sequence[Problem], tokenizer, complete: Complete, settings: TaskEvalSettings,
                  out: str | Path | None = None, log: Callable[[str], None] | None = None, *,
                  resume: bool = False, row_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """task_records + summarize. With `out`, each record is appended to it as its program finishes (a
    run stopped by Ctrl-C or a crash leaves the rows done so far, valid JSONL), and at the end the file
    is rewritten atomically with every record in problem order. `resume`: the complete rows already in
    `out` (read_results: the same `row_settings` required) are kept and not run again."""
    start = time.perf_counter()
    done = read_results(out, problems, settings.samples, row_settings) if resume and out is not None else {}
    if out is None:
        records = task_records(problems, tokenizer, complete, settings, log, row_settings=row_settings)
    else:
        records = write_as_made(out, done, lambda append: task_records(
            problems, tokenizer, complete, settings, log, done=done, on_record=append, row_settings=row_settings))
    summary = summarize(records, settings)
    summary["generate_seconds"] = round(sum(r["generate_seconds"] for r in records), 3)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    if out is not None:
        summary["out"] = str(out)
        if resume:
            summary["resumed"] = len(done)
    return summary


def prompts_per_call(slots: int | str, device: str, problems: int) -> int:
    """The problems the harness hands the completer at once, each with its missing samples
    (TaskEvalSettings.batch_size): on CUDA every problem (the engine keeps its slots full until the last request;
    rows reach --out when the generation ends), elsewhere one slot's worth (a CPU decodes for minutes: each batch's
    rows reach --out as it ends)."""
    if str(device).startswith("cuda"):
        return max(1, problems)
    return int(slots) if slots != "auto" else CPU_SLOTS


def no_early_stop(text: str) -> bool:
    """A stop rule that never fires: a row ends at its end-of-turn / EOS token or its token limit only (BFCL's:
    parallel answers write several </tool_call> blocks). The completer skips its per-token check."""
    return False


def entrenar_completer(model, tokenizer, max_new_tokens: int, chat: bool, *, temperature: float = 0.0,
                       top_p: float = 1.0, seed: int = 0, device: str = "cpu", dtype: str = "fp32",
                       token_ids: dict | None = None, stop: Callable[[str], bool] | None = None,
                       slots: int | str = "auto", log: Callable[[str], None] | None = None,
                       slots_flag: str = "--batch-size") -> Complete:
    """Complete on entrenar's continuous-batching engine (engine.generate_many; bf16 autocast under a bf16 dtype):
    the prompts of a call through `slots` decode slots ('auto': sized from the free GPU memory and the model at
    each call, engine.resolve_slots; the choice is passed to `log` when it changes). `stop(text)` ends a row early
    (default: the HumanEval stop rule of `chat`'s format; end-of-turn / EOS always stop); a row that stopped for
    none of these, at max_new_tokens (or the context), is truncated (GenerationResult.stop_reason). The requests of a
    call, whatever their samples, are one generate_many; request i draws with seed + samples[i]. token_ids, when
    given, receives {tuple(prompt ids): generated ids} (bench/humaneval_parity.py compares them; a prompt asked
    several times in a call: its last request's)."""
    import torch

    from ..engine import GenerationSettings, describe_stats, generate_many, resolve_slots

    stop = stop if stop is not None else functools.partial(completion_done, chat=chat)
    bf16 = dtype in BF16_COMPUTE
    said: list[str] = []

    def complete(batch_ids: list[list[int]], samples: Sequence[int]) -> list[Completion]:
        context = model.cfg.max_position_embeddings
        longest = max(len(ids) for ids in batch_ids)
        if longest >= context:
            raise InputError(f"a prompt of {longest} tokens fills the model's context of {context}")
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            n, why = resolve_slots(slots, model, [len(ids) for ids in batch_ids], max_new_tokens,
                                   sampling=temperature > 0, flag=slots_flag)
            if log is not None and slots == "auto" and why not in said:
                said.append(why)
                log(why)
            settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                          seed=seed, max_slots=n,
                                          stop_text=None if stop is no_early_stop else stop)
            stats: dict = {}
            results = generate_many(model, tokenizer, batch_ids, settings, seeds=[seed + s for s in samples],
                                    stats=stats)
            if log is not None:
                log(describe_stats(stats))
        if token_ids is not None:
            token_ids.update((tuple(ids), r.token_ids) for ids, r in zip(batch_ids, results))
        return [Completion(r.text, r.stop_reason == "max_new_tokens") for r in results]

    return complete
