"""`entrenar pretrain | finetune | eval | plot`: their options and handlers. The options come from the
dataclass fields of train/config.py (one default, help and choices per field); pretrain and finetune
run in train/commands.py (model, data, the one loop), eval's task options are cli/evaluate.py's."""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..data.tabular import SOURCES_HELP, is_dataset_dir, parse_columns
from ..errors import InputError
from ..peft.load import load_any_model
from ..train.commands import cmd_finetune, cmd_pretrain
from ..train.config import (
    DataConfig,
    LoRAConfig,
    TrainConfig,
    _cli,
    _field_default,
    default_of,
    flag_of,
    from_args,
)
from ..train.loop import evaluate
from .evaluate import add_task_options, check_pair_flags, check_task_flags, cmd_pair_eval, cmd_task_eval
from .registry import add_command


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- dataclass fields -> argparse options -------------------------------------------------------------
def _argument_type(parse: typing.Callable[[str], Any]) -> typing.Callable[[str], Any]:
    """A field's own parser as argparse `type=`: its ValueError message is what argparse prints."""
    @functools.wraps(parse)
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return typed


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """`cls`'s evaluated annotations, once per class: evaluating every string annotation again for each field was
    ~0.5 s of every command's parser (150 fields), in each CLI call and each test that makes one."""
    return typing.get_type_hints(cls)


def _base_type(cls: type, name: str) -> type:
    hint = _type_hints(cls)[name]
    if typing.get_origin(hint) is list:  # a repeatable flag (add_options: action="append")
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_options(p: argparse.ArgumentParser, cls: type, command: str) -> None:
    """One argparse option per field of `cls` that `command` offers; dest is the field name."""
    for f in fields(cls):
        spec = _cli(f, command)
        if spec is None:
            continue
        default = spec["default"] if "default" in spec else _field_default(f)
        shown = spec["default_help"] if spec["default_help"] is not None else default
        typ = _base_type(cls, f.name)
        flag = flag_of(cls, f.name, command)
        quiet = spec["required"] or typ is bool  # a switch's default is "off": nothing to show
        help_text = spec["help"] + ("" if quiet else f" ({shown})")
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text.replace("%", "%%")}
        if typ is bool:
            kwargs["action"] = "store_true"
        elif typing.get_origin(typ) is list:  # a flag given several times: each adds one value
            kwargs.update(action="append", type=typing.get_args(typ)[0],
                          default=list(default) if default is not None else None,
                          metavar=spec["metavar"] or flag.lstrip("-").replace("-", "_").upper())
        else:
            kwargs.update(type=_argument_type(spec["parse"]) if spec["parse"] else typ, default=default)
            if spec["choices"]:
                kwargs["choices"] = spec["choices"]
            else:
                kwargs["metavar"] = spec["metavar"] or flag.lstrip("-").replace("-", "_").upper()
            if spec["required"]:
                kwargs["required"] = True
                kwargs.pop("default")
        p.add_argument(flag, *spec["aliases"], **kwargs)


# ---- eval ------------------------------------------------------------------------------------------
def resolve_eval_seq_len(args: argparse.Namespace) -> None:
    """eval's one --max-seq-len: the window of token shards (pretrain's default) or the longest SFT sample / pair
    of a .jsonl (finetune's default); args.max_seq_len is what the .jsonl readers take."""
    if args.seq_len is None:
        args.seq_len = default_of(TrainConfig, "seq_len", "pretrain") if Path(args.data).is_dir() else \
            default_of(DataConfig, "max_seq_len", "finetune")
    args.max_seq_len = args.seq_len


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    check_task_flags(args)
    if args.task != "loss":
        return cmd_task_eval(args)
    if args.data is None:
        raise InputError("--data is required for --task loss (token shards directory or SFT .jsonl)")
    resolve_eval_seq_len(args)
    dcfg = from_args(DataConfig, args, "eval")
    dcfg.validate()
    if args.batch_size == "auto":  # the slots of a task eval; the loss's batches stay at 8 rows
        args.batch_size = 8
    ecfg = from_args(TrainConfig, args, "eval", command="eval")
    ecfg.validate()  # --batch-size, --seq-len, --max-batches, --device; --dtype auto resolved
    if args.dtype == "auto" and not args.json:
        _log(f"dtype: {ecfg.dtype} ({ecfg.dtype_reason})")
    data = Path(args.data)
    if not data.exists():
        raise InputError(f"--data {data}: no such file or directory (token shards, or SFT rows: {SOURCES_HELP})")
    shards = data.is_dir() and not is_dataset_dir(data)  # a save_to_disk folder holds rows
    for flag, given in (("--chat-template", args.chat_template), ("--columns", args.columns)):
        if shards and given is not None:
            raise InputError(f"{flag} reads chat rows: {data} holds token shards (no chats); drop it, or give "
                             f"SFT rows ({SOURCES_HELP})")
    from ..data.preference import is_preference_file

    columns = parse_columns(args.columns)
    if not shards and is_preference_file(data, columns):  # prompt/chosen/rejected rows: rewards against a reference
        return cmd_pair_eval(args, data, dcfg.max_skip_fraction, ecfg.dtype, columns)
    check_pair_flags(args, data, "token shards" if shards else "SFT rows")
    model, tok, path = load_any_model(args.model, args.device, args.kernels, args.adapter,
                                      getattr(args, "force_base", False))
    if shards:
        from ..data.corpus import (
            PretrainLoader,
            check_same_tokenizer,
            check_shards_fit,
            read_index,
            shard_tokenizer,
        )

        index = read_index(data)
        # the shards' ids must mean the model's tokens (issue 28 item 4), and fit its embedding (item 7)
        check_same_tokenizer(data, shard_tokenizer(data, index), tok, args.model, "--model",
                             alternative="evaluate a model of the shards' tokenizer")
        check_shards_fit(data, index, model.cfg.vocab_size)
        split = args.split or ("val" if (index["splits"].get("val") or {}).get("tokens", 0) > args.seq_len
                               else "train")
        loader = PretrainLoader(data, split, args.seq_len, args.batch_size)
        what = f"{data} split {split}, seq_len {args.seq_len}"
    else:
        from ..data.sft import SFTLoader, load_sft
        from ..tokenizer import use_chat_template_file

        if tok is None:
            raise InputError(f"{args.model}: no tokenizer found, needed to encode {data}")
        use_chat_template_file(tok, args.chat_template)
        examples, report = load_sft(data, tok, args.max_seq_len, truncation=args.truncation,
                                    max_skip_fraction=dcfg.max_skip_fraction, columns=columns)
        pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id
        loader = SFTLoader(examples, args.batch_size, pad_id=pad_id, max_seq_len=args.max_seq_len)
        what = f"{data} ({report.kept} samples, max_seq_len {args.max_seq_len})"
    t0 = time.perf_counter()
    ev = evaluate(model, loader.iter_epoch(), args.device, ecfg.dtype, args.eval_batches)
    dt = time.perf_counter() - t0
    ln_v = math.log(model.cfg.vocab_size)
    if not args.json:
        print(f"eval {path} on {what}: loss {ev['loss']:.4f}, perplexity {ev['ppl']:.3f} over {ev['tokens']} "
              f"loss tokens ({ev['batches']} batches, {dt:.1f}s); ln(vocab) = {ln_v:.4f}")
    return {"model": str(path), "data": str(data), **ev, "ln_vocab": ln_v, "seconds": dt, "dtype": ecfg.dtype}


# ---- plot ------------------------------------------------------------------------------------------
def cmd_plot(args: argparse.Namespace) -> dict[str, Any]:
    from ..plot import plot_run

    result = plot_run(Path(args.run), Path(args.out) if args.out else None)
    if not args.json:
        print(f"wrote {result['out']}")  # issue 18: a silent success left users looking for the file
    return result


# ---- registration ------------------------------------------------------------------------------------
def _run_options(p: argparse.ArgumentParser) -> None:
    """The options of a run that are not configuration (where it goes, whether it continues)."""
    p.add_argument("--out", required=True, help="run directory (created; or continued with --resume)")
    p.add_argument("--resume", default=None, metavar="auto|PATH",
                   help="continue from the newest COMPLETE checkpoint of --out, or from PATH (none: a new run)")


def register(sub: argparse._SubParsersAction) -> None:
    """pretrain / finetune / eval options come from the dataclass fields of train/config.py."""
    for name, func, help_text in (
            ("pretrain", cmd_pretrain, "pretrain (or continue pretraining) on token shards"),
            ("finetune", cmd_finetune, "supervised fine-tuning on chat JSONL (full | lora | qlora)"),
            ("eval", cmd_eval, "loss and perplexity of MODEL|RUN on data, reward accuracy on pairs, or pass@k of code")):
        p = add_command(sub, name, func, help_text)
        for cls in (TrainConfig, LoRAConfig, DataConfig):
            add_options(p, cls, name)
        if name != "eval":
            _run_options(p)
        else:
            add_task_options(p)

    p = add_command(sub, "plot", cmd_plot, "RUN/curves.png: loss, eval loss, lr and grad-norm vs step")
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--out", default=None, help="output image (RUN/curves.png)")

