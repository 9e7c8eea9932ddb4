"""Bad inputs a new user hit (issue 18), one table row each: argv, expected exit code, a substring
the message must contain, and what must not have been written. Every row runs through `cli.main`
with --json, so each also checks the JSON contract: one strict-JSON line {"ok": false, ...}.

Seen red before the fixes (run against the tree before them): convert-gguf-out (made a directory),
batch/rank rows (no check: the run started), alpha-0 (ZeroDivisionError traceback), alpha-negative
("--lr must be > 0, got -0.0004"), max-seq-len-0 ("--seq-len must be ..."), sft-from-code rows
(IsADirectoryError; a silent overwrite), uncreatable --out rows (tracebacks), argparse rows (no JSON
line), lr-auto-pretrain (ValueError traceback).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from entrenar import cli
from entrenar.config import ModelConfig
from entrenar.formats import save_hf_dir
from entrenar.model import CausalLM
from tests.helpers.cli import run_cli, strict_loads
from tests.helpers.models import tiny_causal_lm, tiny_config


# ---- fixtures: one small world per module ------------------------------------------------------------
@dataclass
class World:
    root: Path
    model: Path  # a tiny HF model directory with SmolLM2's tokenizer and chat template
    sft: Path  # 11 chat rows
    byte_model: Path  # a tiny model over a byte vocabulary (pretrain)
    shards: Path  # byte shards (pretrain)
    adapter: Path  # a LoRA adapter of `model`
    sft_one_long: Path  # the 11 short rows and one far longer than 64 tokens
    a_file: Path  # an existing regular file
    big_shards: Path  # shards packed with SmolLM2's 49,152-token tokenizer (more than byte_model's 258)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from entrenar.data.corpus import pack
    from entrenar.peft import apply_lora, save_adapter
    from entrenar.tokenizer import load_tokenizer
    from tests.helpers.tokenizers import STDLIB, ByteTokenizer

    root = tmp_path_factory.mktemp("world")
    tok = load_tokenizer("smollm2-135m-instruct")
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, tie_word_embeddings=True,
                      max_position_embeddings=256)
    m = tiny_causal_lm(cfg, 0)
    model = save_hf_dir(m, root / "tiny", tok)
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Say {i}.", "completion": f"{i}!"}) + "\n" for i in range(11)))
    bm = tiny_causal_lm(tiny_config(vocab_size=258, hidden_size=32, intermediate_size=64, tie_word_embeddings=True,
                                    max_position_embeddings=256), 0)
    byte_model = save_hf_dir(bm, root / "bytemodel")
    shards = root / "shards"
    pack([str(STDLIB / "decoder.py")], ByteTokenizer(), shards, val_fraction=0.0, seed=1)
    lm = apply_lora(CausalLM(cfg), 4, 8.0, targets="q_proj,v_proj", seed=0)
    adapter = save_adapter(lm, root / "adapter", str(model))
    a_file = root / "a_file.txt"
    a_file.write_text("keep me\n")
    one_long = root / "one_long.jsonl"
    one_long.write_text(sft.read_text() + json.dumps({"prompt": "Say " + "many words " * 60, "completion": "no"})
                        + "\n")
    big_shards = root / "big_shards"
    (root / "prose.txt").write_text("Say one. Say two. Say three, four and five.\n" * 20)
    pack([str(root / "prose.txt")], tok, big_shards, val_fraction=0.0, seed=1)
    return World(root, model, sft, byte_model, shards, Path(adapter), one_long, a_file, big_shards)


def finetune(w: World, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(w.model), "--data", str(w.sft), "--out", str(out), "--steps", "1",
            "--val-fraction", "0", "--max-seq-len", "64", "--no-preflight", "--json", *extra]


def pretrain(w: World, out: Path, *extra: str) -> list[str]:
    return ["pretrain", "--model", str(w.byte_model), "--data", str(w.shards), "--out", str(out), "--steps", "1",
            "--seq-len", "32", "--no-preflight", "--json", *extra]


@dataclass
class Case:
    argv: Callable[[World, Path], list[str]]  # (world, a fresh tmp dir) -> argv
    code: int
    message: str  # substring of stderr (and of the JSON "error")
    untouched: Callable[[World, Path], list[Path]]  # paths that must not exist afterwards
    absent_message: str | None = None  # a misleading text that must not appear
    guard: str | None = None  # the JSON line's "guard" (None: a plain input error)


def _nothing(w: World, t: Path) -> list[Path]:
    return []


def _with_template(w: World, t: Path, template: str) -> Path:
    """A copy of the tiny model whose tokenizer carries ``template`` as its chat template."""
    import shutil

    m = t / "templated"
    shutil.copytree(w.model, m)
    (m / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((m / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (m / "tokenizer_config.json").write_text(json.dumps(cfg))
    return m


def chat(w: World, t: Path, template: str) -> list[str]:
    return ["generate", "--model", str(_with_template(w, t, template)), "--prompt", "hi", "--chat",
            "--max-new-tokens", "2", "--json"]


RUNAWAY = "{% for i in range(99999) %}{% for j in range(99999) %}{{ 'x' * 64 }}{% endfor %}{% endfor %}"


CASES = {
    # item 7: validate before allocating
    "finetune-batch-over-samples": Case(lambda w, t: finetune(w, t / "run", "--batch-size", "100000"), 2,
                                        "--batch-size 100000 is more than the 11 training samples",
                                        lambda w, t: [t / "run"]),
    "pretrain-batch-over-windows": Case(lambda w, t: pretrain(w, t / "run", "--batch-size", "100000"), 2,
                                        "--batch-size 100000 is more than the", lambda w, t: [t / "run"]),
    "lora-rank-over-width": Case(lambda w, t: finetune(w, t / "run", "--mode", "lora", "--rank", "100000"), 2,
                                 "--rank 100000 is larger than", lambda w, t: [t / "run"]),
    # item 8: tracebacks
    "lora-alpha-0-lr-auto": Case(lambda w, t: finetune(w, t / "run", "--mode", "lora", "--alpha", "0"), 2,
                                 "--alpha must be", lambda w, t: [t / "run"]),
    "sft-from-code-out-is-dir": Case(lambda w, t: ["data", "sft-from-code", "--out", str(w.root), str(STDLIB_JSON),
                                                   "--json"], 2, "is a directory", _nothing),
    "convert-out-under-a-file": Case(lambda w, t: ["convert", str(w.model), str(w.a_file / "sub"), "--json"], 2,
                                     "cannot be created", _nothing),
    "finetune-out-under-a-file": Case(lambda w, t: finetune(w, w.a_file / "run"), 2, "cannot be created",
                                      _nothing),
    "merge-out-under-a-file": Case(lambda w, t: ["merge", "--base", str(w.model), "--adapter", str(w.adapter),
                                                 "--out", str(w.a_file / "merged"), "--json"], 2,
                                   "cannot be created", _nothing),
    # item 9: argparse errors still print the JSON line
    "argparse-missing-flag": Case(lambda w, t: ["finetune", "--model", str(w.model), "--data", str(w.sft), "--json"],
                                  2, "the following arguments are required: --out", _nothing),
    "argparse-bad-choice": Case(lambda w, t: finetune(w, t / "run", "--mode", "bogus"), 2, "invalid choice",
                                lambda w, t: [t / "run"]),
    "argparse-data-pack-missing-model": Case(lambda w, t: ["data", "pack", "--out", str(t / "p"), str(w.sft),
                                                           "--json"], 2, "required: --model", lambda w, t: [t / "p"]),
    # GUARD-DATA is exit 2 (found before training: bad input), and its remedy's flag exists on finetune
    "finetune-guard-data-remedy-flag": Case(lambda w, t: ["finetune", "--model", str(w.model), "--data",
                                                          str(w.sft_one_long), "--out", str(t / "run"),
                                                          "--max-seq-len", "64", "--max-skip-fraction", "0.01",
                                                          "--json"], 2, "raise --max-skip-fraction",
                                            lambda w, t: [t / "run"], guard="GUARD-DATA"),
    "eval-guard-data-max-skip-fraction": Case(lambda w, t: ["eval", "--model", str(w.model), "--data",
                                                            str(w.sft_one_long), "--max-seq-len", "64",
                                                            "--max-skip-fraction", "0.01", "--json"], 2,
                                              "raise --max-skip-fraction", _nothing, guard="GUARD-DATA"),
    "eval-batch-size-0": Case(lambda w, t: ["eval", "--model", str(w.model), "--data", str(w.sft),
                                            "--batch-size", "0", "--json"], 2,
                              "--batch-size must be a positive integer", _nothing),
    "argparse-steps-1e9": Case(lambda w, t: pretrain(w, t / "run", "--steps", "1e9"), 2,
                               "argument --steps: invalid int value", lambda w, t: [t / "run"]),
    # item 10: silent overwrites
    "sft-from-code-over-a-file": Case(lambda w, t: ["data", "sft-from-code", "--out", str(w.a_file),
                                                    str(STDLIB_JSON), "--json"], 2, "--overwrite", _nothing),
    "pack-over-a-pack": Case(lambda w, t: ["data", "pack", "--model", str(w.model), "--out", str(w.shards),
                                           str(w.sft), "--json"], 2, "--overwrite", _nothing),
    # item 11: messages that point the wrong way
    "finetune-max-seq-len-0": Case(lambda w, t: [*finetune(w, t / "run")[:-4], "--max-seq-len", "0", "--json"], 2,
                                   "--max-seq-len must be a positive integer", lambda w, t: [t / "run"],
                                   absent_message="--seq-len must"),
    "lora-alpha-negative": Case(lambda w, t: finetune(w, t / "run", "--mode", "lora", "--alpha", "-16"), 2,
                                "--alpha must be", lambda w, t: [t / "run"], absent_message="--lr must"),
    "lr-auto-for-pretrain": Case(lambda w, t: pretrain(w, t / "run", "--lr", "auto"), 2, "--lr auto",
                                 lambda w, t: [t / "run"]),
    "bad-device": Case(lambda w, t: finetune(w, t / "run", "--device", "gpu0"), 2, "not a device",
                       lambda w, t: [t / "run"]),
    # issue 28 item 4: eval checks the data's tokenizer
    "eval-shards-of-another-tokenizer": Case(lambda w, t: ["eval", "--model", str(w.model), "--data",
                                                           str(w.shards), "--json"], 2,
                                             "a different tokenizer", _nothing),
    # issue 28 item 7: user errors that were exit 1 with a traceback
    "eval-data-of-a-larger-vocabulary": Case(lambda w, t: ["eval", "--model", str(w.byte_model), "--data",
                                                           str(w.big_shards), "--json"], 2,
                                             "more than the model's vocab_size 258", _nothing,
                                             absent_message="out of range"),
    "export-gguf-into-proc": Case(lambda w, t: ["export", "gguf", str(w.model), "/proc/entrenar-x.gguf", "--json"],
                                  2, "cannot be created", _nothing),
    "convert-into-proc": Case(lambda w, t: ["convert", str(w.model), "/proc/entrenar-x", "--json"], 2,
                              "cannot be created", _nothing),
    "chat-template-include": Case(lambda w, t: chat(w, t, "{% include 'other.jinja' %}"), 2,
                                  "may not include", _nothing),
    # issue 28 item 6: a template that never ends
    "chat-template-runaway": Case(lambda w, t: chat(w, t, RUNAWAY), 2, "the chat template wrote more than",
                                  _nothing),
    # issue 28 item 8: bounds where a typo costs hours or the machine
    "tokenizer-vocab-size-1e9": Case(lambda w, t: ["tokenizer", "train", "--vocab-size", "1000000000", "--out",
                                                   str(t / "tok"), str(w.sft), "--json"], 2,
                                     "--vocab-size 1000000000 is more than", lambda w, t: [t / "tok"]),
    "tokenizer-vocab-size-2m": Case(lambda w, t: ["tokenizer", "train", "--vocab-size", "2000000", "--out",
                                                  str(t / "tok"), str(w.sft), "--json"], 2,
                                    "--vocab-size 2000000 is more than", lambda w, t: [t / "tok"]),
    "pack-shard-tokens-7": Case(lambda w, t: ["data", "pack", "--model", str(w.model), "--out", str(t / "p"),
                                              "--shard-tokens", "7", str(w.sft), "--json"], 2,
                                "--shard-tokens 7 is below", lambda w, t: [t / "p"]),
    "pretrain-seq-len-over-max-positions": Case(lambda w, t: pretrain(w, t / "run", "--seq-len", "512"), 2,
                                                "--max-seq-len 512 is more than the model's max_position_embeddings 256",
                                                lambda w, t: [t / "run"]),
    # issue 28 item 9: an input with no usable text is not a tokenizer
    "tokenizer-train-no-text": Case(lambda w, t: ["tokenizer", "train", "--vocab-size", "300", "--out",
                                                  str(t / "tok"), str(_blank(t)), "--json"], 2,
                                    "no text to learn from", lambda w, t: [t / "tok"]),
}


def _file(t: Path, name: str, text: str) -> Path:
    (t / name).write_text(text)
    return t / name


def _rows_with(w: World, t: Path, line: str) -> Path:
    """The 11 SFT rows with `line` as line 2."""
    rows = w.sft.read_text().splitlines(keepends=True)
    return _file(t, "rows.jsonl", rows[0] + line + "\n" + "".join(rows[1:]))


NESTED = "[" * 100_000 + "]" * 100_000  # json.loads: RecursionError
LONG_ROW = json.dumps({"prompt": "Say " + "word " * (2 << 20), "completion": "no"})  # 10 M characters


def _fifo(t: Path, name: str) -> Path:
    import os

    os.mkfifo(t / name)  # nothing ever writes it: opening it for reading blocks for ever
    return t / name


def _model_with_fifo_weights(w: World, t: Path) -> Path:
    import shutil

    m = t / "fifo_model"
    shutil.copytree(w.model, m)
    (m / "model.safetensors").unlink()
    (m / "sha256.json").unlink(missing_ok=True)
    _fifo(m, "model.safetensors")
    return m


def generate(w: World, *extra: str) -> list[str]:
    return ["generate", "--model", str(w.model), "--prompt", "hi", "--max-new-tokens", "2", "--json", *extra]


def humaneval(w: World, *extra: str) -> list[str]:
    return ["eval", "--model", str(w.model), "--task", "humaneval", "--limit", "1", "--json", *extra]


RECURSIVE = "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"
HUGE_RANGE = "{% for i in range(100000000) %}{% endfor %}{{ messages[0]['content'] }}"
CASES.update({
    # issue 51 item 5: exit 1 with a traceback on bad input
    "chat-template-huge-range": Case(lambda w, t: chat(w, t, HUGE_RANGE), 2, "more than the sandbox allows",
                                     _nothing),
    "chat-template-recursive-macro": Case(lambda w, t: chat(w, t, RECURSIVE), 2, "recursed without end",
                                          _nothing),
    "finetune-chat-template-recursive-macro": Case(
        lambda w, t: finetune(w, t / "run", "--chat-template", str(_file(t, "rec.jinja", RECURSIVE))), 2,
        "rec.jinja: the chat template recursed without end", lambda w, t: [t / "run"]),
    "data-check-nested-json": Case(lambda w, t: ["data", "check", "--model", str(w.model), "--data",
                                                 str(_rows_with(w, t, NESTED)), "--max-seq-len", "64", "--json"],
                                   2, "rows.jsonl:2: malformed JSON (nested too deeply", _nothing),
    "finetune-nested-json": Case(lambda w, t: [*finetune(w, t / "run")[:4], str(_rows_with(w, t, NESTED)),
                                               *finetune(w, t / "run")[5:]], 2,
                                 "rows.jsonl:2: malformed JSON (nested too deeply", lambda w, t: [t / "run"]),
    "eval-data-nested-json": Case(lambda w, t: ["eval", "--model", str(w.model), "--data",
                                                str(_rows_with(w, t, NESTED)), "--max-seq-len", "64", "--json"],
                                  2, "rows.jsonl:2: malformed JSON (nested too deeply", _nothing),
    "eval-timeout-inf": Case(lambda w, t: humaneval(w, "--timeout", "inf", "--out", str(t / "r.jsonl")), 2,
                             "--timeout must be > 0 and at most", lambda w, t: [t / "r.jsonl"]),
    # issue 51 item 6
    "eval-temperature-inf": Case(lambda w, t: humaneval(w, "--temperature", "inf", "--out", str(t / "r.jsonl")), 2,
                                 "--temperature must be a finite number", lambda w, t: [t / "r.jsonl"]),
    "generate-temperature-inf": Case(lambda w, t: generate(w, "--temperature", "inf"), 2,
                                     "it must be a finite number >= 0", _nothing),
    "data-check-line-over-the-row-limit": Case(
        lambda w, t: ["data", "check", "--model", str(w.model), "--data", str(_rows_with(w, t, LONG_ROW)),
                      "--max-seq-len", "64", "--json"], 2, "rows.jsonl:2: malformed JSON (a line of", _nothing),
    "generate-model-is-a-fifo": Case(lambda w, t: ["generate", "--model", str(_fifo(t, "m.gguf")), "--prompt", "hi",
                                                   "--json"], 2, "a FIFO (named pipe), not a regular file", _nothing),
    "generate-weights-are-a-fifo": Case(lambda w, t: ["generate", "--model", str(_model_with_fifo_weights(w, t)),
                                                      "--prompt", "hi", "--json"], 2,
                                        "model.safetensors: a FIFO (named pipe)", _nothing),
    "generate-chat-template-is-a-fifo": Case(lambda w, t: generate(w, "--chat", "--chat-template",
                                                                   str(_fifo(t, "t.jinja"))), 2,
                                             "a FIFO (named pipe), not a regular file", _nothing),
})


def _blank(t: Path) -> Path:
    d = t / "blank"
    d.mkdir(exist_ok=True)
    (d / "empty.txt").write_text("")
    (d / "spaces.md").write_text("   \n\n\t \n")
    (d / "rows.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    return d
STDLIB_JSON = Path(json.__file__).parent


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, world, tmp_path, capsys):
    case = CASES[name]
    before = {p: p.read_bytes() for p in (world.a_file, world.sft, world.shards / "index.json")}
    code, result, err = run_cli(case.argv(world, tmp_path), capsys)
    assert code == case.code, err[-3000:]
    assert case.message in err, err[-3000:]
    assert "Traceback" not in err
    if case.absent_message:
        assert case.absent_message not in err
    assert result is not None, "--json must print a JSON line on failure too"
    assert result["ok"] is False and result["exit_code"] == case.code and case.message in result["error"]
    assert result["guard"] == case.guard
    for path in case.untouched(world, tmp_path):
        assert not path.exists(), f"{path} was written"
    for path, data in before.items():
        assert path.read_bytes() == data, f"{path} was changed"


def test_convert_to_a_gguf_path_writes_a_gguf_file_not_a_directory(world, tmp_path, capsys):
    """Issue 18 item 5: `convert MODEL out/merged.gguf` made a directory named merged.gguf (seen red);
    it now writes the GGUF file (dispatching to `export gguf`)."""
    out = tmp_path / "merged.gguf"
    code, result, err = run_cli(["convert", str(world.model), str(out), "--json"], capsys)
    assert code == 0, err[-3000:]
    assert out.is_file() and out.read_bytes()[:4] == b"GGUF" and result["ok"] is True


def test_finetune_header_names_the_model_as_given(world, tmp_path, capsys):
    """Issue 18 item 12: the data header showed the packaged model's GGUF path (seen red)."""
    argv = ["finetune", "--model", "smollm2-135m-instruct", "--data", str(world.sft), "--out", str(tmp_path / "r"),
            "--batch-size", "1000", "--max-seq-len", "64", "--json"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2 and "--batch-size 1000 is more than" in err  # stops after the header, before the model
    assert "(tokenizer smollm2-135m-instruct," in err and ".gguf" not in err.split("--batch-size 1000")[0]
    assert not (tmp_path / "r").exists()


def test_lora_rank_over_some_layers_width_trains_with_a_warning(tmp_path, capsys):
    """Issue 24 part 4: `--rank 256` on Qwen2.5-0.5B was exit 2 because k_proj/v_proj are 896 -> 128 (seen red),
    although q/o_proj (896) and the MLP (896 x 4864) use all 256. Here the same shape at small size: k/v_proj
    are 32 -> 16, the others 32 wide; --rank 24 trains, and the warning names the layers capped at 16."""
    # the world's model is no better than uniform (GUARD-INIT-LOSS); this base is
    from tests.test_peft_seed import tiny_base_and_data

    base, data = tiny_base_and_data(tmp_path)
    argv = ["finetune", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1",
            "--batch-size", "2", "--max-seq-len", "64", "--no-preflight", "--json", "--mode", "lora", "--rank", "24"]
    code, result, err = run_cli(argv, capsys)
    assert code == 0, err[-3000:]
    assert result["ok"] is True and (tmp_path / "run" / "final" / "adapter_config.json").is_file()
    warning = next(ln for ln in err.splitlines() if "--rank 24" in ln and "warning" in ln)
    assert "k_proj" in warning and "v_proj" in warning and "16" in warning and "q_proj" not in warning


def test_check_creatable(tmp_path, monkeypatch):
    from entrenar.errors import InputError
    from entrenar.outpaths import check_creatable

    check_creatable(tmp_path / "a" / "b" / "c")  # missing parents are fine: they will be created
    assert not (tmp_path / "a").exists()  # ... but not here
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="is a file, not a directory"):
        check_creatable(tmp_path / "f" / "sub" / "x", "--out")
    # root may write anywhere, so a read-only parent is simulated
    monkeypatch.setattr("os.access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(InputError, match=f"{tmp_path} is not writable"):
        check_creatable(tmp_path / "new", "--out")


# ---- the JSON contract ---------------------------------------------------------------------------------
def test_ctrl_c_prints_json_with_exit_130_and_the_resume_hint(monkeypatch, capsys):
    from entrenar.cli import train as commands

    class Interrupted(KeyboardInterrupt):  # what the trainer raises: carries the checkpoint and command
        checkpoint = "runs/x/checkpoints/step-0000004"
        resume_command = "entrenar pretrain ... --resume auto"

        def __str__(self) -> str:
            return f"the last complete checkpoint is {self.checkpoint}; continue with: {self.resume_command}"

    def boom(args):
        raise Interrupted()

    monkeypatch.setattr(commands, "cmd_plot", boom)
    code, result, err = run_cli(["plot", "some-run", "--json"], capsys)
    assert code == 130
    assert result == {"ok": False, "error": f"interrupted: {Interrupted()}", "exit_code": 130, "guard": None,
                      "checkpoint": Interrupted.checkpoint, "resume_command": Interrupted.resume_command}
    assert "step-0000004" in err and "--resume auto" in err


def test_the_trainers_interruption_reaches_the_json_line(monkeypatch, capsys):
    from entrenar.cli import train as commands
    from entrenar.train.loop import TrainingInterrupted

    def boom(args):
        raise TrainingInterrupted(5, Path("runs/x/checkpoints/step-0000004"), "entrenar pretrain --resume auto")

    monkeypatch.setattr(commands, "cmd_plot", boom)
    code, result, err = run_cli(["plot", "r", "--json"], capsys)
    assert "step-0000004" in err
    assert code == 130 and result["checkpoint"] == "runs/x/checkpoints/step-0000004"
    assert result["resume_command"] == "entrenar pretrain --resume auto" and "step-0000004" in result["error"]


def test_plain_ctrl_c_still_prints_json(monkeypatch, capsys):
    from entrenar.cli import train as commands

    def boom(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "cmd_plot", boom)
    code, result, _ = run_cli(["plot", "some-run", "--json"], capsys)
    assert code == 130 and result["ok"] is False and result["error"] == "interrupted"


def test_an_internal_error_prints_the_json_line_then_raises(monkeypatch, capsys):
    from entrenar.cli import train as commands

    def bug(args):
        raise RuntimeError("index out of range in something")

    monkeypatch.setattr(commands, "cmd_plot", bug)
    with pytest.raises(RuntimeError):  # the traceback is kept: it is what a bug report needs
        cli.main(["plot", "r", "--json"])
    line = strict_loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["ok"] is False and line["exit_code"] == 1 and line["internal"] is True
    assert "RuntimeError: index out of range" in line["error"]


def test_nonfinite_numbers_are_null_and_named(monkeypatch, capsys):
    from entrenar.cli import train as commands

    monkeypatch.setattr(commands, "cmd_plot", lambda args: {
        "loss": float("nan"), "ok_value": 1.5, "curve": [1.0, float("inf"), -float("inf")],
        "nested": {"x": float("nan")}})
    code, result, _ = run_cli(["plot", "r", "--json"], capsys)
    assert code == 0
    assert result["loss"] is None and result["curve"] == [1.0, None, None] and result["nested"] == {"x": None}
    assert result["ok_value"] == 1.5
    assert result["nonfinite"] == ["curve[1]", "curve[2]", "loss", "nested.x"]


def test_strict_json_leaves_finite_values_alone():
    nonfinite: list[str] = []
    obj = {"a": [1, 2.5, "NaN", None, True], "b": {"c": -0.0}}
    assert cli.strict_json(obj, nonfinite=nonfinite) == obj and nonfinite == []
    assert math.isnan(float("nan"))  # the helper below must see a real NaN
    assert cli.strict_json(float("nan"), nonfinite=nonfinite) is None and nonfinite == ["$"]


def test_errors_are_strict_json_too(monkeypatch, capsys):
    from entrenar.cli import train as commands
    from entrenar.errors import GuardError

    def guard(args):
        raise GuardError("GUARD-NONFINITE", "loss is nan", "lower --lr", details={"loss": float("nan")})

    monkeypatch.setattr(commands, "cmd_plot", guard)
    code, result, _ = run_cli(["plot", "r", "--json"], capsys)
    assert code == 3 and result["guard"] == "GUARD-NONFINITE" and result["details"] == {"loss": None}
    assert result["nonfinite"] == ["details.loss"]


def test_help_and_success_without_json_print_no_json(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["finetune", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "0 = keep all" in out  # --keep 0 keeps every checkpoint (issue 18 item 12)
    assert "--max-skip-fraction" in out  # GUARD-DATA's remedy names a flag finetune has


# ---- runs that never trained do not block a retry ------------------------------------------------------
def test_run_dir_that_never_reached_step_1_is_reused(world, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")  # what an OOM-killed first step left behind
    (out / "data_report.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    (out / "checkpoints").mkdir()
    code, _, err = run_cli(pretrain(world, out), capsys)
    assert code == 0, err[-3000:]
    assert "never reached step 1" in err
    run = json.loads((out / "run.json").read_text())
    # run.json: asdict of the configs plus provenance
    from dataclasses import fields

    from entrenar.train.config import DataConfig, TrainConfig

    assert run["command"] == "pretrain" and run["lora"] is None
    assert set(run["config"]) == {f.name for f in fields(TrainConfig)} and run["config"]["steps"] == 1
    assert set(run["data"]) == {f.name for f in fields(DataConfig)} and run["data"]["data"] == str(world.shards)
    assert run["config"]["model"] == str(world.byte_model) and run["config"]["command"] == "pretrain"
    assert {"argv", "git_commit", "versions", "started_at", "host"} <= set(run)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("leftover", ["metrics-line", "checkpoint", "user-file"])
def test_run_dir_with_progress_or_other_files_still_blocks(world, tmp_path, capsys, leftover):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")
    if leftover == "metrics-line":
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
    elif leftover == "checkpoint":
        (out / "checkpoints" / "step-0000001").mkdir(parents=True)
    else:
        (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(pretrain(world, out), capsys)
    assert code == 2 and "not empty" in err
    assert (out / "run.json").read_text() == "{}"


def test_lora_warns_when_adapters_outgrow_the_model(capsys):
    from entrenar.train.commands import _check_lora_fits
    from entrenar.train.config import LoRAConfig

    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=4, tie_word_embeddings=True, max_position_embeddings=64)
    model = CausalLM(cfg)
    _check_lora_fits(model, LoRAConfig(rank=32))
    assert "more than the model's" in capsys.readouterr().err
    _check_lora_fits(model, LoRAConfig(rank=2))
    assert capsys.readouterr().err == ""


def test_plot_prints_its_path(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 3.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tok_s": 100.0}) + "\n"
        for s in (1, 2, 3)))
    assert cli.main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run / 'curves.png'}"
    code, result, _ = run_cli(["plot", str(run), "--out", str(tmp_path / "c.png"), "--json"], capsys)
    assert code == 0 and result["out"] == str(tmp_path / "c.png") and (tmp_path / "c.png").is_file()


def test_a_nan_from_torch_is_also_caught(monkeypatch, capsys):
    """A tensor's .item() NaN (what eval returns on a broken model) goes through the same rule."""
    from entrenar.cli import train as commands

    monkeypatch.setattr(commands, "cmd_plot", lambda args: {"loss": torch.tensor(float("nan")).item()})
    code, result, _ = run_cli(["plot", "r", "--json"], capsys)
    assert code == 0 and result["loss"] is None and result["nonfinite"] == ["loss"]


def test_export_gguf_into_a_read_only_directory_is_exit_2_before_loading(world, tmp_path, monkeypatch, capsys):
    """Issue 28 item 7: a PermissionError traceback at write time (convert and merge already said exit 2).
    Root may write anywhere, so the read-only directory is simulated as in test_check_creatable."""
    from entrenar import export

    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr("os.access", lambda path, mode: Path(path) != ro)
    monkeypatch.setattr(export, "_merged_model", lambda *a: pytest.fail("loaded before checking OUT"))
    code, result, err = run_cli(["export", "gguf", str(world.model), str(ro / "m.gguf"), "--json"], capsys)
    assert code == 2 and f"{ro} is not writable" in result["error"], err[-2000:]
    assert not list(ro.iterdir())


@pytest.mark.parametrize("command", ["eval", "verify"])
def test_kernels_triton_on_the_cpu_is_exit_2_naming_the_remedy(world, monkeypatch, capsys, command):
    """Issue 28 item 7: `--kernels triton` on the CPU was exit 1, a RuntimeError from the first kernel.
    (The CPU interpreter, TRITON_INTERPRET=1, is what the kernel tests use: it stays allowed.)"""
    from entrenar.kernels import _common

    monkeypatch.setattr(_common, "_INTERPRETER_AT_IMPORT", False)
    argv = {"eval": ["eval", "--model", str(world.model), "--data", str(world.sft), "--max-seq-len", "64"],
            "verify": ["verify", "--model", str(world.model), "--seq-len", "32"]}[command]
    code, result, err = run_cli([*argv, "--kernels", "triton", "--device", "cpu", "--json"], capsys)
    assert code == 2, err[-2000:]
    assert "--kernels triton" in result["error"] and "--kernels torch" in result["error"]


def test_a_packaged_chat_template_is_taken_by_name_by_data_check_and_finetune(world, tmp_path, capsys):
    """README's tool-call recipes name the packaged templates (`--chat-template chatml_tools`): an installed
    package has no src/entrenar/templates path to give. finetune saves the template with the model."""
    from importlib.resources import files

    text = files("entrenar").joinpath("templates", "chatml_tools.jinja").read_text()
    code, _, err = run_cli(["data", "check", "--model", str(world.model), "--data", str(world.sft),
                            "--max-seq-len", "64", "--chat-template", "chatml_tools", "--json"], capsys)
    assert code == 0, err[-2000:]
    code, _, err = run_cli(finetune(world, tmp_path / "run", "--chat-template", "chatml_tools"), capsys)
    assert code == 0, err[-2000:]
    final = tmp_path / "run" / "final"
    saved = [f for f in ("tokenizer_config.json", "chat_template.jinja") if (final / f).is_file()
             and (text in (final / f).read_text() or json.dumps(text) in (final / f).read_text())]
    assert saved, sorted(p.name for p in final.iterdir())
