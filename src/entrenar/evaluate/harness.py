"""The task eval: prompts -> completions (any generator) -> extracted code -> sandboxed tests -> pass@k.

The generator is a parameter, so the same harness runs on our `generate_batch` (`entrenar eval --task
humaneval`) and on transformers' `generate` (bench/humaneval_parity.py): only the token ids may differ.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fileio import atomic_write
from .sandbox import SandboxLimits, isolation_level, run_program
from .tasks import Problem, completion_done, extract_code, pass_at_k, program, prompt_ids

# (prompt ids of a batch, index of the sample being drawn) -> one completion text per prompt. Sample s of
# every problem comes from the same call, so a sampling generator can seed it with seed + s.
Complete = Callable[[list[list[int]], int], list[str]]


@dataclass
class TaskEvalSettings:
    samples: int = 1  # completions per problem (n of pass@k)
    batch_size: int = 8  # prompts decoded at once
    chat: bool = True  # the chat format (the model's template) or plain completion
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workers: int = 2  # programs run at once (each in its own sandbox)

    def ks(self) -> list[int]:
        """The k of pass@k reported: 1, 10, 100 up to the number of samples."""
        return [k for k in (1, 10, 100) if k <= self.samples]


def _batches(problems: Sequence[Problem], ids: list[list[int]], size: int) -> list[list[int]]:
    """Indices of problems in batches of similar prompt length (little padding), longest first (a memory
    problem shows at once)."""
    order = sorted(range(len(problems)), key=lambda i: -len(ids[i]))
    return [order[i:i + size] for i in range(0, len(order), size)]


def run_task_eval(problems: Sequence[Problem], tokenizer, complete: Complete, settings: TaskEvalSettings,
                  out: str | Path | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Generate `settings.samples` completions per problem, test each in the sandbox, write one JSON line
    per (problem, sample) to `out` (atomically, at the end) and return the summary with pass@k."""
    start = time.perf_counter()
    ids = [prompt_ids(p, tokenizer, settings.chat) for p in problems]
    records: list[dict[str, Any] | None] = [None] * (len(problems) * settings.samples)
    gen_seconds = 0.0
    done = 0
    with ThreadPoolExecutor(max_workers=max(1, settings.workers)) as pool:
        for batch in _batches(problems, ids, settings.batch_size):
            for s in range(settings.samples):
                t0 = time.perf_counter()
                texts = complete([ids[i] for i in batch], s)
                gen_seconds += time.perf_counter() - t0
                assert len(texts) == len(batch), (len(texts), len(batch))
                codes = [extract_code(t, settings.chat) for t in texts]
                programs = [program(problems[i], c, settings.chat) for i, c in zip(batch, codes)]
                results = pool.map(lambda src: run_program(src, settings.limits), programs)
                for i, text, code, res in zip(batch, texts, codes, results):
                    records[i * settings.samples + s] = {
                        "task_id": problems[i].task_id, "sample": s, "passed": res.passed, "status": res.status,
                        "error": res.error, "completion": text, "code": code,
                        "prompt_tokens": len(ids[i]), "seconds_run": round(res.seconds, 3)}
            done += len(batch)
            if log is not None:
                passed = sum(1 for r in records if r is not None and r["passed"])
                log(f"{done}/{len(problems)} problems, {passed} passing samples so far "
                    f"({time.perf_counter() - start:.0f} s)")
    rows = [r for r in records if r is not None]
    assert len(rows) == len(records)
    per_problem = [sum(rows[i * settings.samples + s]["passed"] for s in range(settings.samples))
                   for i in range(len(problems))]
    summary: dict[str, Any] = {
        "problems": len(problems), "samples": settings.samples,
        **{f"pass@{k}": sum(pass_at_k(settings.samples, c, k) for c in per_problem) / len(problems)
           for k in settings.ks()},
        "passed_problems": sum(1 for c in per_problem if c), "format": "chat" if settings.chat else "completion",
        "sandbox": {"isolation": isolation_level()[0] + "+audit-hook", "python": isolation_level()[1], "timeout_s": settings.limits.timeout_s,
                    "memory_mb": settings.limits.memory_mb, "nproc": settings.limits.nproc},
        "generate_seconds": round(gen_seconds, 3), "seconds": round(time.perf_counter() - start, 3)}
    if out is not None:
        atomic_write(out, "".join(json.dumps(r) + "\n" for r in rows))
        summary["out"] = str(out)
    return summary

