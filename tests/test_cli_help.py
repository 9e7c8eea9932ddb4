"""--help that reads well (docs/design.md "Command line"): every option with a value shows its default (or says
why it has none) as the last parenthesized part of its help; one name for the sequence length (--max-seq-len,
with --seq-len an alias that still works); eval's task flags grouped by the tasks they apply to; the --dtype
guide written once (`entrenar help dtype`), one line in each command's --help."""

from __future__ import annotations

import argparse

import pytest

from entrenar import cli
from entrenar.cli.config_file import leaf_parser
from entrenar.cli.main import _leaves, parse_command
from tests.helpers.cli import run_cli as main


def last_parenthesized(text: str) -> str | None:
    """The text of the help's final '(...)' (nested parentheses kept), or None when it does not end with one."""
    text = text.rstrip()
    if not text.endswith(")"):
        return None
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            return text[i + 1:-1]
    return None


def default_problem(action: argparse.Action) -> str | None:
    """Why `action`'s help does not show its default, or None when it does. An option that takes a value and has
    a default must end its help with '(DEFAULT)'; one whose default is none says in the parentheses what then
    happens (not a condition such as '(with --chat)' or an example '(e.g. ...)')."""
    if action.nargs == 0 or not action.option_strings or action.required or action.help == argparse.SUPPRESS:
        return None
    shown = last_parenthesized((action.help or "").replace("%%", "%"))
    if shown is None:
        return "no '(default)' at the end of its help"
    if action.default in (None, []):
        if shown.startswith(("e.g.", "with ", "--json")):
            return f"'({shown})' does not say what happens without it"
        return None
    forms = {str(action.default)} | ({f"{action.default:g}"} if isinstance(action.default, (int, float)) else set())
    if not any(form in shown for form in forms):
        return f"'({shown})' does not show its default {action.default!r}"
    return None


def test_every_option_of_every_command_shows_its_default():
    parser = cli.build_parser()
    leaves = _leaves(parser)
    assert {leaf.prog for leaf in leaves} >= {"entrenar generate", "entrenar convert", "entrenar export gguf",
                                              "entrenar data pack", "entrenar eval", "entrenar finetune"}
    problems = [f"{leaf.prog} {action.option_strings[0]}: {why}" for leaf in leaves for action in leaf._actions
                if (why := default_problem(action))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("help_text, default, problem", [
    ("0 = greedy", 0.0, "no '(default)'"),
    ("sampling seed (same seed, same text)", 0, "does not show its default 0"),
    ("a template file (e.g. one that renders tools)", None, "does not say what happens"),
    ("0 = greedy (0.0)", 0.0, None), ("tokens (64 Mi = 67108864)", 1 << 26, None), ("seed (none: random)", None, None),
])
def test_the_default_check_fires(help_text, default, problem):
    p = argparse.ArgumentParser()
    action = p.add_argument("--x", default=default, help=help_text)
    got = default_problem(action)
    assert (got is None) if problem is None else (problem in got), got


@pytest.mark.parametrize("command, dest", [("pretrain", "seq_len"), ("finetune", "max_seq_len"),
                                           ("eval", "seq_len")])
def test_max_seq_len_is_the_name_and_seq_len_still_works(command, dest):
    base = {"pretrain": ["--model", "m", "--data", "d", "--out", "o"],
            "finetune": ["--model", "m", "--data", "d", "--out", "o"], "eval": ["--model", "m"]}[command]
    for flag in ("--max-seq-len", "--seq-len"):
        assert getattr(parse_command([command, *base, flag, "64"]), dest) == 64
    leaf, _ = leaf_parser(cli.build_parser(), [command])
    action = next(a for a in leaf._actions if a.dest == dest)
    assert action.option_strings == ["--max-seq-len", "--seq-len"]  # shown first: the one name


def test_eval_has_one_sequence_length_chosen_by_the_data(tmp_path):
    from entrenar.cli.train import resolve_eval_seq_len

    shards = tmp_path / "shards"
    shards.mkdir()
    for data, expected in ((shards, 512), (tmp_path / "rows.jsonl", 2048)):
        args = parse_command(["eval", "--model", "m", "--data", str(data)])
        resolve_eval_seq_len(args)
        assert (args.seq_len, args.max_seq_len) == (expected, expected)


def test_eval_task_flags_are_grouped_by_task():
    leaf, _ = leaf_parser(cli.build_parser(), ["eval"])
    groups = {g.title: {a.dest for a in g._group_actions} for g in leaf._action_groups}
    assert {"limit", "max_new_tokens", "out", "overwrite", "system_prompt_file", "resume"} <= \
        groups["--task humaneval, bfcl and chat"]
    assert {"samples", "temperature", "top_p", "task_seed"} == groups["--task humaneval and bfcl: sampling (pass@k)"]
    assert {"timeout", "prompt_format"} == groups["--task humaneval only"]
    from entrenar.cli.evaluate import (
        NOT_BFCL,  # the flags refused with --task bfcl are exactly the humaneval ones
        SAMPLING,
    )

    assert set(NOT_BFCL) == groups["--task humaneval only"]
    assert set(SAMPLING) == groups["--task humaneval and bfcl: sampling (pass@k)"]


def test_the_dtype_guide_is_written_once(capsys):
    from entrenar.train.config import DTYPE_GUIDE, DTYPES

    for command in ("pretrain", "finetune", "eval"):
        leaf, _ = leaf_parser(cli.build_parser(), [command])
        text = next(a for a in leaf._actions if a.dest == "dtype").help
        assert len(text) < 300 and "`entrenar help dtype`" in text and text.endswith("(auto)")
    code, result, err = main(["help", "dtype", "--json"], capsys)
    assert code == 0, err
    assert set(DTYPE_GUIDE) == {"auto", *DTYPES}  # every choice has its paragraph
    for name, paragraph in DTYPE_GUIDE.items():
        assert f"  {name} " in result["text"] and paragraph.split()[0] in result["text"]
    code, _, _ = main(["help", "dtype"], capsys)
    assert code == 0


def test_help_names_a_command_or_refuses(capsys):
    code, result, _ = main(["help", "data", "pack", "--json"], capsys)
    assert code == 0 and result["text"].startswith("usage: entrenar data pack")
    code, result, _ = main(["help", "dtypes", "--json"], capsys)
    assert code == 2 and "no topic or command 'dtypes'" in result["error"]


def test_the_parser_evaluates_each_config_class_annotations_once(monkeypatch):
    """Every CLI call (and every test that makes one) builds the parser: evaluating the config dataclasses' string
    annotations again for each of their ~150 fields cost ~0.5 s a call. Two builds evaluate each class once at
    most (none when an earlier build in this process already did)."""
    import typing

    from entrenar.cli import train as cli_train

    evaluated: list[type] = []
    real = typing.get_type_hints

    def counting(obj, *args, **kwargs):
        evaluated.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", counting)
    cli.build_parser()
    cli.build_parser()
    assert len(evaluated) == len(set(evaluated)) <= 3, evaluated  # TrainConfig, DataConfig, LoRAConfig
    assert cli_train._base_type(cli_train.TrainConfig, "steps") is int
