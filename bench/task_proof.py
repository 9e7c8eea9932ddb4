"""Does training make a model better at its task, and no worse at the rest? Everything through the real CLI.

    python -m bench.task_proof toolcall --model MODEL --work DIR [--chat-template FILE] [--mode lora|full] ...
    python -m bench.task_proof humaneval --model MODEL --work DIR --recipe bad|good ...

toolcall: BFCL before (simple_python, multiple, irrelevance), a tool-call SFT on rows built from BFCL's live_*
categories (disjoint from the scored ones: `data sft-from-bfcl`), with the in-loop task metric on a slice of
simple_python, BFCL after, HumanEval before and after; each change paired on the same questions (exact McNemar).
toolcall's retention options: `--replay F` mixes `data replay`'s rows (the base's own answers to general and code
requests) at fraction F, `--kl-to-base B` pulls those rows to the base, `--swapped-matched` matches the no-call rows to
the call rows, `--retain` puts retained tasks in the loop's panel; the chat task is scored before and after too, and
every after-eval pairs itself with the base's per-problem file (`eval --compare`: one verdict per category).
humaneval: SFT on docstring -> function rows of the standard library with `--eval-task humaneval` in the loop (the
recipe that lost problems, and one that should not). Writes DIR/summary.json (and prints it); every per-problem
file stays in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

from entrenar.evaluate.paired import describe_change, paired_change


def cli(*argv: str, log: Path | None = None) -> dict[str, Any]:
    """`python -m entrenar ARGV --json`; its JSON line (stderr to `log` and to our stderr's tail on failure)."""
    t0 = time.time()
    cmd = [sys.executable, "-m", "entrenar", *argv, "--json"]
    print("$ entrenar " + " ".join(argv), flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if log is not None:
        log.write_text(p.stderr)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    out = json.loads(lines[-1]) if lines else {"ok": False, "error": "no JSON line", "exit_code": p.returncode}
    out["_seconds"] = round(time.time() - t0, 1)
    if p.returncode != 0 and not (p.returncode == 3 and out.get("guard")):
        print(p.stderr[-3000:], file=sys.stderr, flush=True)
    print(f"  -> exit {p.returncode} in {out['_seconds']} s", flush=True)
    return out


def verdicts(path: Path, category: str | None = None) -> dict[str, bool]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return {r["task_id"]: bool(r["passed"]) for r in rows if category is None or r.get("category") == category}


def compare(before: Path, after: Path, name: str, category: str | None = None) -> dict[str, Any]:
    ch = paired_change(verdicts(before, category), verdicts(after, category))
    line = describe_change(ch, name, 0, 1).replace("at step 0", "before").replace("at step 1", "after")
    print(line, flush=True)
    return {**ch, "line": line}


def _device_args(a: argparse.Namespace) -> list[str]:
    return ["--device", a.device, "--batch-size", str(a.eval_batch)]


def toolcall(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    template = ["--chat-template", a.chat_template] if a.chat_template else []
    limit = ["--limit", str(a.limit)] if a.limit else []
    cats = a.categories
    res: dict[str, Any] = {"model": a.model, "mode": a.mode, "lr": a.lr, "steps": a.steps, "rank": a.rank,
                           "batch_size": a.batch_size, "grad_accum": a.grad_accum,
                           "keep_best": a.keep_best, "irrelevance_rows": a.irrelevance_rows,
                           "irrelevance_copies": a.irrelevance_copies, "swapped_no_call": a.swapped_no_call}
    rows = work / "rows.jsonl"
    res["rows"] = cli("data", "sft-from-bfcl", "--out", str(rows), "--irrelevance", "--overwrite",
                      "--swapped-no-call", str(a.swapped_no_call), *(["--swapped-matched"] if a.swapped_matched else []),
                      *(["--swapped-nearest"] if a.swapped_nearest else []))
    res.update(replay=a.replay, kl_to_base=a.kl_to_base, swapped_matched=a.swapped_matched,
               swapped_nearest=a.swapped_nearest, retain=a.retain)
    # every call row and every swapped no-call row, and the first --irrelevance-rows of live_irrelevance's rows
    # (it has 880: as many as 40% of the rows would teach abstaining more than calling)
    kept, no_call = [], 0
    for line in rows.read_text().splitlines():
        row = json.loads(line)
        always = any(m.get("tool_calls") for m in row["messages"]) or "+tools-of-" in row["id"]
        if always or no_call < a.irrelevance_rows:
            kept.extend([line] * (1 if always else a.irrelevance_copies))
            no_call += not always
    rows.write_text("\n".join(kept) + "\n")
    res["rows"].update(kept=len(kept), kept_without_call=no_call)
    if a.base_from:  # the base's evals of an earlier step on the same model and settings: not run twice
        import shutil

        for f in ("base_bfcl.jsonl", "base_he.jsonl", "base_chat.jsonl"):
            if (Path(a.base_from) / f).is_file():
                shutil.copy(Path(a.base_from) / f, work / f)
    if not (work / "base_bfcl.jsonl").is_file():
        res["base_bfcl"] = cli("eval", "--task", f"bfcl:{cats}", "--model", a.model, *template, *limit,
                               *_device_args(a), "--out", str(work / "base_bfcl.jsonl"), "--overwrite",
                               log=work / "base_bfcl.log")
    if not (work / "base_chat.jsonl").is_file():
        res["base_chat"] = cli("eval", "--task", "chat", "--model", a.model, *template, *limit, *_device_args(a),
                               "--out", str(work / "base_chat.jsonl"), "--overwrite", log=work / "base_chat.log")
    mix: list[str] = []
    if a.replay:  # the base's own answers, mixed in so the fine-tune keeps them (data/replay.py)
        res["replay_rows"] = cli("data", "replay", "--model", a.model, *template, "--out", str(work / "replay.jsonl"),
                                 "--device", a.device, "--batch-size", str(a.eval_batch), "--overwrite", *limit,
                                 log=work / "replay.log")
        mix = ["--mix", f"{work / 'replay.jsonl'}:{a.replay}"]
    kl = ["--kl-to-base", str(a.kl_to_base)] if a.kl_to_base else []
    retain = [x for spec in a.retain for x in ("--retain-task", spec)]
    if not a.skip_humaneval and not (work / "base_he.jsonl").is_file():
        res["base_humaneval"] = cli("eval", "--task", "humaneval", "--model", a.model, *template, *limit,
                                    *_device_args(a), "--out", str(work / "base_he.jsonl"), "--overwrite",
                                    log=work / "base_he.log")
    run = work / "run"
    lora = ["--rank", str(a.rank)] if a.mode != "full" else []
    res["finetune"] = cli("finetune", "--model", a.model, "--data", str(rows), "--out", str(run), "--mode", a.mode,
                          *lora, "--lr", str(a.lr), "--steps", str(a.steps), "--batch-size", str(a.batch_size),
                          "--grad-accum", str(a.grad_accum),
                          "--max-seq-len", str(a.max_seq_len), "--max-skip-fraction", "0.5", *template,
                          "--eval-task", a.in_loop_task, "--eval-task-limit", str(a.in_loop_limit),
                          "--eval-task-every", str(a.in_loop_every), "--keep-best", a.keep_best, "--eval-batches", "10",
                          "--device", a.device, "--seed", "0", *mix, *kl, *retain,
                          log=work / "finetune.log")
    if not res["finetune"].get("ok"):
        return res
    res["after_chat"] = cli("eval", "--task", "chat", "--model", str(run), *limit, *_device_args(a),
                            "--out", str(work / "after_chat.jsonl"), "--overwrite",
                            "--compare", str(work / "base_chat.jsonl"), log=work / "after_chat.log")
    res["after_bfcl"] = cli("eval", "--task", f"bfcl:{cats}", "--model", str(run), *limit, *_device_args(a),
                            "--out", str(work / "after_bfcl.jsonl"), "--overwrite",
                            "--compare", str(work / "base_bfcl.jsonl"), log=work / "after_bfcl.log")
    res["paired"] = {c: compare(work / "base_bfcl.jsonl", work / "after_bfcl.jsonl", f"bfcl {c}", c)
                     for c in cats.split(",")}
    res["paired"]["chat"] = compare(work / "base_chat.jsonl", work / "after_chat.jsonl", "chat")
    res["qa"] = cli("qa", "--model", str(run), "--device", a.device, log=work / "qa.log")
    if a.peft_check and a.mode != "full":  # the adapter in transformers + peft, verdicts against ours
        cmd = [sys.executable, "-m", "bench.peft_check", "--base", a.model, "--adapter", str(run / "final"),
               "--categories", cats, "--limit", str(a.peft_check), "--ours", str(work / "after_bfcl.jsonl"),
               "--out", str(work / "peft_bfcl.jsonl"), *(["--chat-template", a.chat_template] if a.chat_template else [])]
        print("$ " + " ".join(cmd[1:]), flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        (work / "peft_check.log").write_text(p.stderr)
        res["peft_check"] = json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr[-2000:]}
    if not a.skip_humaneval:
        res["after_humaneval"] = cli("eval", "--task", "humaneval", "--model", str(run), *limit, *_device_args(a),
                                     "--out", str(work / "after_he.jsonl"), "--overwrite", log=work / "after_he.log")
        res["paired"]["humaneval"] = compare(work / "base_he.jsonl", work / "after_he.jsonl", "humaneval")
    return res


STDLIB_MODULES = ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "colorsys.py", "bisect.py",
                  "heapq.py", "statistics.py", "fractions.py", "difflib.py", "base64.py", "quopri.py", "calendar.py",
                  "ipaddress.py", "html/__init__.py", "json/encoder.py", "urllib/parse.py", "posixpath.py", "random.py")


def humaneval_recipe(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / m) for m in STDLIB_MODULES[:a.modules] if (stdlib / m).is_file()]
    rows = work / f"code_{a.answer}.jsonl"
    res: dict[str, Any] = {"model": a.model, "recipe": a.recipe, "mode": a.mode, "lr": a.lr, "steps": a.steps}
    res["rows"] = cli("data", "sft-from-code", "--out", str(rows), *files, "--answer", a.answer,
                      *(["--self-contained"] if a.answer == "fenced" else []), "--overwrite")
    lora = ["--rank", str(a.rank)] if a.mode != "full" else []
    limit = ["--eval-task-limit", str(a.limit)] if a.limit else []
    res["finetune"] = cli("finetune", "--model", a.model, "--data", str(rows), "--out", str(work / "run"),
                          "--mode", a.mode, *lora, "--lr", str(a.lr), "--steps", str(a.steps), "--batch-size",
                          str(a.batch_size), "--grad-accum", str(a.grad_accum), "--max-seq-len", str(a.max_seq_len),
                          "--eval-task", "humaneval", *limit,
                          "--eval-task-every", str(a.in_loop_every), "--on-task-regression", a.on_regression,
                          "--keep-best", a.keep_best, "--device", a.device, "--seed", "0",
                          log=work / "finetune.log")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("toolcall", "humaneval"):
        q = sub.add_parser(name, allow_abbrev=False)
        q.add_argument("--model", required=True)
        q.add_argument("--work", required=True)
        q.add_argument("--device", default="cuda")
        q.add_argument("--mode", default="lora", choices=("lora", "qlora", "full"))
        q.add_argument("--rank", type=int, default=16)
        q.add_argument("--lr", default="auto")
        q.add_argument("--steps", type=int, default=100)
        q.add_argument("--batch-size", type=int, default=16)
        q.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (the same rows a step)")
        q.add_argument("--max-seq-len", type=int, default=4096)
        q.add_argument("--limit", type=int, default=0, help="questions per category / problems (smoke runs)")
        q.add_argument("--eval-batch", default="auto", help="eval/replay --batch-size: N or auto (auto)")
        q.add_argument("--in-loop-every", type=int, default=0)
        q.add_argument("--skip-humaneval", action="store_true")
    t = sub.choices["toolcall"]
    t.add_argument("--chat-template")
    t.add_argument("--base-from", help="a work directory whose base_*.jsonl to reuse")
    t.add_argument("--categories", default="simple_python,multiple,irrelevance")
    t.add_argument("--in-loop-task", default="bfcl:simple_python,irrelevance")
    t.add_argument("--in-loop-limit", type=int, default=100)
    t.add_argument("--irrelevance-rows", type=int, default=300)
    t.add_argument("--irrelevance-copies", type=int, default=1, help="each kept no-call row this many times")
    t.add_argument("--swapped-no-call", type=int, default=0,
                   help="data sft-from-bfcl --swapped-no-call: questions shown other questions' functions, no call")
    t.add_argument("--replay", type=float, default=0.0, help="finetune --mix data replay's rows at this fraction")
    t.add_argument("--kl-to-base", type=float, default=0.0, help="finetune --kl-to-base (on the replay rows)")
    t.add_argument("--swapped-matched", action="store_true", help="data sft-from-bfcl --swapped-matched")
    t.add_argument("--swapped-nearest", action="store_true", help="data sft-from-bfcl --swapped-nearest")
    t.add_argument("--peft-check", type=int, default=0, metavar="N",
                   help="after the run: the first N questions of each category in transformers + peft (bench/peft_check)")
    t.add_argument("--retain", action="append", default=[], metavar="TASK", help="finetune --retain-task TASK")
    t.add_argument("--keep-best", default="task", choices=("last", "task"),
                   help="last: the final step's weights, so no scored question picks the checkpoint")
    h = sub.choices["humaneval"]
    h.add_argument("--recipe", default="bad")
    h.add_argument("--modules", type=int, default=len(STDLIB_MODULES), help="the first N of STDLIB_MODULES")
    h.add_argument("--answer", default="plain", choices=("plain", "fenced"))
    h.add_argument("--on-regression", default="warn", choices=("warn", "stop"))
    h.add_argument("--keep-best", default="last", choices=("last", "task"))
    a = p.parse_args()
    res = toolcall(a) if a.what == "toolcall" else humaneval_recipe(a)
    (Path(a.work) / "summary.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k in ("paired",)}, default=str)[:4000], flush=True)


if __name__ == "__main__":
    main()
