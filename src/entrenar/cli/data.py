"""`entrenar data pack | sft-from-code | tasks-from-code | sft-from-bfcl | replay | check`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..data.from_code import ANSWER_FORMATS
from ..data.sft import CHAT_TEMPLATE_HELP, DEFAULT_MAX_SKIP_FRACTION, TRUNCATION_POLICIES
from ..data.tabular import COLUMNS_HELP, SOURCES_HELP
from ..errors import InputError


def _load_tokenizer(spec: str, chat_template: str | None = None) -> Any:
    from ..tokenizer import load_tokenizer, use_chat_template_file

    tok = load_tokenizer(spec)
    use_chat_template_file(tok, chat_template)
    if getattr(tok, "name", None) is None:
        try:
            tok.name = spec  # the report names the tokenizer as the user gave it
        except AttributeError:
            pass  # a tokenizer object with fixed attributes keeps its own name (or none)
    return tok


def cmd_pack(args: argparse.Namespace) -> dict[str, Any]:
    from ..data import corpus
    from ..data.corpus import pack

    if 1 <= args.shard_tokens < corpus.MIN_SHARD_TOKENS:
        raise InputError(f"--shard-tokens {args.shard_tokens} is below the minimum of {corpus.MIN_SHARD_TOKENS:,} "
                         f"tokens per shard file: it would write a file per {args.shard_tokens} tokens. Leave it "
                         f"out (64 Mi tokens per file) or give at least {corpus.MIN_SHARD_TOKENS:,}")
    tok = _load_tokenizer(args.model)
    t0 = time.perf_counter()
    index = pack(args.inputs, tok, args.out, val_fraction=args.val_fraction, seed=args.seed,
                 shard_tokens=args.shard_tokens, tokenizer_spec=args.model, progress=not args.json,
                 workers=args.workers, strict=args.strict, overwrite=args.overwrite)
    seconds = time.perf_counter() - t0
    splits = {s: {"documents": v["documents"], "tokens": v["tokens"], "shards": len(v["shards"])}
              for s, v in index["splits"].items()}
    skipped = index["skipped"]
    # the report goes to stderr under --json (stdout's last line is the JSON object)
    report = sys.stderr if args.json else sys.stdout
    print(f"packed {index['documents']} documents, {index['tokens']} tokens ({index['dtype']}) into "
          f"{args.out} in {seconds:.1f}s: " + ", ".join(f"{s} {v['documents']} docs / {v['tokens']} tokens"
                                                       for s, v in splits.items()), file=report)
    if skipped["count"]:
        print(f"skipped {skipped['count']} file(s) that cannot be read or decoded"
              + (" (first 20)" if skipped["count"] > 20 else "") + ":", file=report)
        for line in skipped["listed"]:
            print(f"  {line}", file=report)
    result = {"out": str(args.out), "documents": index["documents"], "tokens": index["tokens"],
              "dtype": index["dtype"], "source_sha256": index["source_sha256"], "splits": splits,
              "skipped": skipped, "seconds": seconds, "workers": args.workers,
              "tokenizer_files": index["tokenizer"]["files"]}
    if args.val_fraction > 0 and splits["val"]["documents"] == 0:
        result["warning"] = (f"--val-fraction {args.val_fraction} put no document in val "
                             f"({index['documents']} documents); raise it for a validation split")
        print(f"warning: {result['warning']}", file=sys.stderr)
    return result


def read_system_prompt(path: str | Path) -> str:
    """The text of a --system-prompt-file (exit 2 when it is missing or empty)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file (--system-prompt-file)")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise InputError(f"{path}: the system prompt file is empty (--system-prompt-file)")
    return text


def cmd_sft_from_code(args: argparse.Namespace) -> dict[str, Any]:
    from ..data.from_code import sft_from_code

    system_prompt = read_system_prompt(args.system_prompt_file) if args.system_prompt_file else None
    stats = sft_from_code(args.dirs, args.out, system_prompt=system_prompt, excludes=args.exclude,
                          overwrite=args.overwrite, answer=args.answer, min_body_lines=args.min_body_lines,
                          self_contained=args.self_contained)
    if not args.json:
        print(f"wrote {stats['rows']} rows to {stats['out']} from {stats['files']} files "
              f"({stats['files_unparsable']} unparsable, skipped); {stats['functions']} functions, "
              f"{stats['functions_with_docstring']} with docstrings, {stats['stubs_skipped']} stubs skipped, "
              f"{stats['short_skipped']} shorter than --min-body-lines, {stats['not_self_contained_skipped']} not "
              "self-contained")
    return stats


def cmd_tasks_from_code(args: argparse.Namespace) -> dict[str, Any]:
    from ..data.tasks_from_code import tasks_from_code

    if args.limit < 0:
        raise InputError(f"--limit must be >= 0 (0 = all), got {args.limit}")
    stats = tasks_from_code(args.sources, args.out, excludes=args.exclude, overwrite=args.overwrite,
                            verify=not args.no_verify, limit=args.limit)
    if not args.json:
        named = ", ".join(f"{name} {n}" for name, n in list(stats["packages"].items())[:5])
        print(f"wrote {stats['rows']} tasks ({stats['with_context']} with their module's helpers in the prompt) to "
              f"{stats['out']} from {stats['files']} files: {stats['functions_with_doctests']} functions with "
              f"doctests, {stats['not_self_contained']} not self-contained, {stats['humaneval_overlap']} overlapping "
              f"HumanEval, {stats['needs_packages']} importing modules outside the standard library, which the "
              f"tests' sandbox does not have"
              f"{f' ({named})' if named else ''}, {stats['failed_verification']} failing their own tests (left out)")
    return stats


def cmd_sft_from_bfcl(args: argparse.Namespace) -> dict[str, Any]:
    from ..data.bfcl_data import ALIASES, write_sft_from_bfcl

    categories = [ALIASES.get(c.strip(), c.strip()) for c in args.categories.split(",") if c.strip()]
    system_prompt = read_system_prompt(args.system_prompt_file) if args.system_prompt_file else None
    if args.swapped_no_call < 0:
        raise InputError(f"--swapped-no-call {args.swapped_no_call}: must be >= 0")
    if args.swapped_nearest and not args.swapped_no_call:
        raise InputError("--swapped-nearest chooses the donors of --swapped-no-call's rows: give --swapped-no-call N "
                         "(N > 0) with it, or leave it out")
    stats = write_sft_from_bfcl(args.out, categories, system_prompt, args.irrelevance, args.overwrite,
                                args.swapped_no_call, args.swapped_matched, args.swapped_nearest)
    if not args.json:
        per = ", ".join(f"{c} {n}" for c, n in stats["per_category"].items())
        print(f"wrote {stats['rows']} rows to {stats['out']} ({per}); {len(stats['unanswerable'])} questions "
              f"skipped whose BFCL answer cannot be met: {', '.join(stats['unanswerable']) or 'none'}; "
              f"{len(stats['schema_conflicts'])} whose answer breaks its own function's schema: "
              f"{', '.join(stats['schema_conflicts']) or 'none'}"
              + (f"; {stats['swapped_no_call']} no-call rows with another question's functions"
                 if stats.get("swapped_no_call") else "")
              + (f" (near misses: mean similarity {stats['swapped_mean_similarity']})"
                 if stats.get("swapped_nearest") else ""))
    return stats


def cmd_replay(args: argparse.Namespace) -> dict[str, Any]:
    """`data replay`: the base model's own answers to general and code requests, as SFT rows (data/replay.py)."""
    import json
    import math

    from ..data.replay import read_prompts, replay_rows
    from ..devices import resolve_device, resolve_dtype
    from ..evaluate.harness import entrenar_completer, no_early_stop, prompts_per_call
    from ..fileio import atomic_write
    from ..outpaths import check_jsonl_out
    from ..peft.load import load_any_model
    from ..tokenizer import use_chat_template_file

    out = check_jsonl_out(args.out, args.overwrite)
    if args.samples < 1:
        raise InputError(f"--samples must be >= 1, got {args.samples}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise InputError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.samples > 1 and args.temperature == 0:
        raise InputError(f"--samples {args.samples} with --temperature 0: greedy samples are all the same; give "
                         f"--temperature > 0 (e.g. 0.7)")
    if args.max_new_tokens < 1 or (args.batch_size != "auto" and args.batch_size < 1):
        raise InputError("--max-new-tokens and --batch-size must be >= 1")
    if args.limit < 0:
        raise InputError(f"--limit must be >= 0 (0 = every request), got {args.limit}")
    prompts = read_prompts(args.prompts)[:args.limit or None]
    system = read_system_prompt(args.system_prompt_file) if args.system_prompt_file else None
    device = resolve_device(args.device)
    model, tok, path = load_any_model(args.model, device, "torch")
    if tok is None:
        raise InputError(f"{args.model}: no tokenizer found, needed to write prompts and read answers")
    use_chat_template_file(tok, args.chat_template)
    if tok.chat_template is None:
        raise InputError(f"{args.model} has no chat template: replay rows are chats; give --chat-template FILE")
    dtype, _ = resolve_dtype("auto", device)
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    complete = entrenar_completer(model, tok, args.max_new_tokens, True, temperature=args.temperature,
                                  seed=args.seed, device=device, dtype=dtype, stop=no_early_stop,
                                  slots=args.batch_size, log=log)
    rows, counts = replay_rows(prompts, tok, complete, args.samples,
                               prompts_per_call(args.batch_size, device, len(prompts)), system, log=log)
    if not rows:
        raise InputError(f"--prompts {args.prompts}: no answer of {args.model} passed the chat gates; nothing to "
                         f"replay")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    result = {**counts, "out": str(out), "model": str(path), "samples": args.samples,
              "temperature": args.temperature}
    if not args.json:
        print(f"wrote {counts['kept']} replay rows of {path} to {out}; {counts['dropped']} prompts left out (no "
              f"answer passed the chat gates)")
    return result


def cmd_check(args: argparse.Namespace) -> dict[str, Any]:
    from ..data.preference import is_preference_file, load_preference
    from ..data.sft import load_sft
    from ..data.tabular import check_source, parse_columns

    if not 0.0 <= args.max_skip_fraction <= 1.0:
        raise InputError(f"--max-skip-fraction must be in [0, 1], got {args.max_skip_fraction}")
    columns = parse_columns(args.columns)
    check_source(Path(args.data), "--data")
    tok = _load_tokenizer(args.model, args.chat_template)
    load = load_preference if is_preference_file(args.data, columns) else load_sft  # DPO rows
    # without --skip-invalid every invalid row is listed (FILE:ROW each), then one exit 2
    _, report = load(args.data, tok, args.max_seq_len, truncation=args.truncation, skip_invalid=args.skip_invalid,
                     max_skip_fraction=None, columns=columns, list_invalid=True)
    # The report is shown before the guard decides, so a failing data set still shows its numbers.
    print("\n".join(report.summary_lines()), file=sys.stderr if args.json else sys.stdout, flush=True)
    report.check(args.max_skip_fraction)
    return {"report": report.to_dict()}


def register(sub: argparse._SubParsersAction) -> None:
    from .registry import add_command

    def dispatch(args: argparse.Namespace) -> dict:
        return args.data_func(args)

    p = add_command(sub, "data", dispatch, "prepare and check training data")
    data_sub = p.add_subparsers(dest="data_command", required=True,
                                metavar="{pack,sft-from-code,tasks-from-code,sft-from-bfcl,replay,check}")

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        q = data_sub.add_parser(name, help=help, description=help)
        q.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
        q.set_defaults(data_func=func)
        return q

    q = add("pack", cmd_pack, "corpus (text, .py, JSONL with a text field) -> token shards + index.json")
    q.add_argument("--model", required=True, help="MODEL whose tokenizer encodes the corpus")
    q.add_argument("--out", required=True, help="output directory for shards and index.json")
    q.add_argument("--val-fraction", type=float, default=0.0,
                   help="fraction of documents for val: each document goes to val by a seeded hash of its text, "
                        "so about this fraction, the same for any --workers (0)")
    q.add_argument("--seed", type=int, default=0, help="seed of the train/val split's hash (0)")
    q.add_argument("--shard-tokens", type=int, default=1 << 26,
                   help="tokens per shard file, at least 64 Ki (64 Mi = 67108864)")
    q.add_argument("--workers", type=int, default=1,
                   help="processes that tokenize in parallel; the shards are identical for any value (1)")
    q.add_argument("--strict", action="store_true",
                   help="exit 2 (nothing written) on a file that cannot be read or decoded, instead of "
                        "skipping, counting and listing it")
    q.add_argument("--overwrite", action="store_true", help="replace an existing --out (a previous pack)")
    q.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="files, directories or globs: text, .py, .jsonl(.gz) and .parquet with a text field")

    q = add("sft-from-code", cmd_sft_from_code, "Python source -> docstring-to-function SFT JSONL")
    q.add_argument("--out", required=True, help="output JSONL file")
    q.add_argument("--system-prompt-file", help="text file used as every row's system prompt (none)")
    q.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip .py files whose path relative to DIR matches; repeatable (none)")
    q.add_argument("--answer", choices=ANSWER_FORMATS, default="plain",
                   help="the assistant's answer: the function's source (plain), or inside a ```python block as "
                        "chat models answer (fenced) (plain)")
    q.add_argument("--min-body-lines", type=int, default=1, metavar="N",
                   help="skip functions whose body after the docstring spans fewer than N lines (1)")
    q.add_argument("--self-contained", action="store_true",
                   help="skip methods and functions that read module-level names other than imports "
                        "(helpers, constants)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    q.add_argument("dirs", nargs="+", metavar="SOURCE", help="directories of Python source or single .py files")

    q = add("tasks-from-code", cmd_tasks_from_code, "docstring examples (doctests) of Python source -> coding tasks "
            "with tests (eval --task humaneval --data; finetune --objective grpo --reward tests)")
    q.add_argument("--out", required=True, help="output JSONL file")
    q.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip .py files whose path relative to SOURCE matches (repeatable)")
    q.add_argument("--no-verify", action="store_true",
                   help="keep tasks whose own function fails its tests in the sandbox (checked by default)")
    q.add_argument("--limit", type=int, default=0, metavar="N", help="the first N tasks kept only; 0 = all (0)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    q.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="directories of Python source, .py files, or `stdlib` (this Python's standard library, "
                        "tests and GUIs left out); functions named as HumanEval's entry points are left out")

    q = add("sft-from-bfcl", cmd_sft_from_bfcl, "BFCL's live_* questions -> tool-call SFT JSONL (ground-truth calls)")
    q.add_argument("--out", required=True, help="output JSONL file")
    q.add_argument("--categories", default="live_simple,live_multiple,live_parallel,live_parallel_multiple",
                   help="BFCL live categories with calls, comma-separated; disjoint from the non-live ones "
                        "`eval --task bfcl` scores (live_simple,live_multiple,live_parallel,live_parallel_multiple)")
    q.add_argument("--irrelevance", action="store_true",
                   help="also live_irrelevance's questions, answered in plain text without a call")
    q.add_argument("--swapped-no-call", type=int, default=0, metavar="N",
                   help="also N of these questions shown another question's functions (on another subject) and "
                        "answered without a call: teaches telling a fitting function from one that does not (0)")
    q.add_argument("--swapped-matched", action="store_true",
                   help="--swapped-no-call's donors from the question's own category with as many functions as its "
                        "own: the no-call rows match the call rows' distribution")
    q.add_argument("--swapped-nearest", action="store_true",
                   help="--swapped-no-call's donor is the question closest in topic whose functions still cannot "
                        "answer it (a near miss: triangle area shown body-mass-index, not weather); each donor's "
                        "functions at most twice; combines with --swapped-matched")
    q.add_argument("--system-prompt-file", help="text file used as every row's system prompt (none)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing --out file")

    _add_replay(add("replay", cmd_replay, "a model's own answers to general and code requests -> SFT JSONL to "
                    "mix into a fine-tune (finetune --mix FILE:FRACTION), so it keeps what it could do"))

    q = add("check", cmd_check, "validate SFT (or preference: prompt/chosen/rejected) rows against a model's chat "
                                "template, listing every invalid row; report loss tokens")
    q.add_argument("--model", required=True, help="MODEL whose tokenizer and chat template to use")
    q.add_argument("--data", required=True, help=f"SFT or preference rows: {SOURCES_HELP}")
    q.add_argument("--columns", metavar="MAP", default=None, help=COLUMNS_HELP + " (the rows' own keys)")
    q.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP + " (the model's)")
    q.add_argument("--max-seq-len", "--seq-len", type=int, required=True, help="the training sequence length")
    q.add_argument("--truncation", choices=TRUNCATION_POLICIES, default="skip",
                   help="a response cut by --max-seq-len: skip the sample or keep it cut (skip)")
    q.add_argument("--skip-invalid", action="store_true", help="skip and count invalid rows instead of exit 2")
    q.add_argument("--max-skip-fraction", type=float, default=DEFAULT_MAX_SKIP_FRACTION,
                   help=f"GUARD-DATA above this fraction of skipped rows ({DEFAULT_MAX_SKIP_FRACTION})")


def _add_replay(q: argparse.ArgumentParser) -> None:
    """`data replay`'s options (data/replay.py)."""
    from ..train.config import _int_or_auto
    from .registry import add_device_option

    q.add_argument("--model", required=True, help="MODEL whose answers to replay (the base of the fine-tune)")
    q.add_argument("--prompts", default="builtin", metavar="builtin|FILE.jsonl",
                   help="the requests: builtin (200 general and code requests, disjoint from `eval --task chat`'s) "
                        "or JSONL rows with a \"prompt\" (builtin)")
    q.add_argument("--out", required=True, help="output JSONL file")
    q.add_argument("--limit", type=int, default=0, help="the first N requests only; 0 = all (0)")
    q.add_argument("--samples", type=int, default=1,
                   help="answers tried per request; the first that passes the chat gates is kept (1: greedy)")
    q.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 for --samples > 1 (0)")
    q.add_argument("--seed", type=int, default=0, help="sample s draws with seed + s (0)")
    q.add_argument("--max-new-tokens", type=int, default=256, help="per answer; a cut answer is not kept (256)")
    q.add_argument("--batch-size", type=_int_or_auto, default="auto",
                   help="decode slots: N, or auto (sized from the GPU's free memory and the model; 8 on the CPU) (auto)")
    q.add_argument("--system-prompt-file", help="text file used as every row's system prompt (and the prompts')")
    q.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP + " (the model's)")
    add_device_option(q)
    q.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
