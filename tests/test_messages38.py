"""Misleading messages of issue 38 item 10, each reproduced first: argparse abbreviations (`pretrain --mode lora`
was read as `--model lora`), a preference file given to SFT ("row lacks 'completion'"), a --chat-template file's
errors blamed on the model, "ppl" printed for a preference loss, the --beta-too-large divergence blamed on the
learning rate alone, and `--data DIR` that is not what the command reads ("no such file")."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from entrenar import cli
from entrenar.errors import GuardError, InputError
from entrenar.train import guards
from entrenar.train.objective import PreferenceLoss
from tests.helpers.cli import run_cli as main
from tests.helpers.tokenizers import tiny_tokenizer

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A one-layer model with the tiny ChatML tokenizer (271 tokens): cheap to load, renders chats."""
    from entrenar.formats import save_hf_dir
    from tests.helpers.models import tiny_causal_lm, tiny_config

    tok = tiny_tokenizer()
    model = tiny_causal_lm(tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1,
                                       tie_word_embeddings=True, max_position_embeddings=128), 0)
    out = tmp_path_factory.mktemp("tinychat") / "model"
    save_hf_dir(model, out, tok)
    return out


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pairs(path: Path) -> Path:
    return _jsonl(path, [{"prompt": f"Say {w}.", "chosen": f"{w}!", "rejected": f"no {w}"} for w in WORDS])


# ---- argparse abbreviations ----------------------------------------------------------------------------
def test_no_parser_accepts_abbreviations():
    seen = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        seen.append(path)
        assert p.allow_abbrev is False, path
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}")

    walk(cli.build_parser(), "entrenar")
    assert "entrenar pretrain" in seen and "entrenar data pack" in seen and "entrenar export gguf" in seen


def test_bench_scripts_take_no_abbreviations():
    """bench/'s scripts (the suite and each measurement) build their parsers with allow_abbrev=False too."""
    import ast

    root = Path(__file__).resolve().parents[1] / "bench"
    calls = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                abbrev = next((k.value for k in node.keywords if k.arg == "allow_abbrev"), None)
                calls.append((path.relative_to(root).as_posix(), getattr(abbrev, "value", True)))
    assert len(calls) >= 20 and ("suite.py", False) in calls
    assert [c for c in calls if c[1] is not False] == []


def test_pretrain_mode_is_not_read_as_model(tmp_path, capsys):
    """pretrain has --model and no --mode: `--mode lora` was taken for `--model lora` (then 'lora: no such
    file'); it is an unrecognized argument."""
    code, result, err = main(["pretrain", "--mode", "lora", "--model", "tiny", "--data", str(tmp_path), "--out",
                              str(tmp_path / "o"), "--json"], capsys)
    assert code == 2 and result["usage"], err
    assert "unrecognized arguments: --mode lora" in result["error"]


# ---- a preference file given to SFT ------------------------------------------------------------------
def test_a_preference_row_read_as_sft_names_its_kind(tmp_path):
    from entrenar.data.sft import load_sft

    data = _pairs(tmp_path / "pairs.jsonl")
    with pytest.raises(InputError) as e:
        load_sft(data, tiny_tokenizer(), 64)
    text = str(e.value)
    assert "preference row (prompt/chosen/rejected)" in text and "--objective dpo|ipo|dpo-norm" in text
    assert "lacks 'completion'" not in text


@pytest.mark.parametrize("command", ["finetune", "eval"])
def test_finetune_and_eval_name_a_preference_file(tmp_path, tiny_chat_model, command, capsys):
    """finetune --objective sft on a preference file; eval on an SFT file with a preference row (a file of pairs
    is evaluated as pairs since issue 38 item 11: tests/test_eval_preference.py)."""
    data = _pairs(tmp_path / "pairs.jsonl")
    line = 1
    if command == "eval":
        data.write_text(json.dumps({"prompt": "Say one.", "completion": "one!"}) + "\n" + data.read_text())
        line = 2
    argv = ([command, "--model", str(tiny_chat_model), "--data", str(data), "--json"]
            + (["--out", str(tmp_path / "run"), "--steps", "1"] if command == "finetune" else []))
    code, result, err = main(argv, capsys)
    assert code == 2, err
    assert f"{data}:{line}: this is a preference row" in result["error"]


# ---- --chat-template FILE errors name the file -------------------------------------------------------
@pytest.mark.parametrize("template, what", [
    ("{{ raise_exception('this template refuses') }}", "failed on these messages"),
    ("{% for m in messages %}{{ m['content'] | upper }}<|im_end|>{% endfor %}", "does not write assistant message"),
])
def test_chat_template_file_errors_name_the_file_not_the_model(tmp_path, template, what):
    from entrenar.tokenizer import use_chat_template_file

    tok = tiny_tokenizer()  # its source is "tiny.gguf", as a model's GGUF
    file = tmp_path / "mine.jinja"
    file.write_text(template)
    use_chat_template_file(tok, file)
    with pytest.raises(InputError) as e:
        tok.encode_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}])
    assert f"--chat-template {file}" in str(e.value) and what in str(e.value)
    assert "tiny.gguf" not in str(e.value)


# ---- preference losses: no perplexity, and --beta named when the run diverges --------------------------
def test_preference_divergence_names_beta():
    """GUARD-EVAL-DIVERGED of a preference objective names --beta (and this run's value) next to --lr."""
    objective = PreferenceLoss("dpo", beta=1000.0)
    with pytest.raises(GuardError) as e:
        guards.check_eval_diverged(353.7, 0.0, objective.uniform_loss(0), 6, lambda: None,
                                   objective.uniform_name, *objective.diverged)
    text = f"{e.value}"
    assert "--beta too large" in text and "lower --beta (this run's: 1000" in text and "--lr" in text
    with pytest.raises(GuardError) as e:  # cross-entropy keeps its own causes: no --beta there
        guards.check_eval_diverged(9.0, 2.0, 5.6, 6, lambda: None)
    assert "--beta" not in str(e.value) and "lower --lr" in str(e.value)


def test_dpo_run_logs_no_perplexity_and_its_divergence_names_beta(tmp_path, tiny_chat_model, capsys):
    """The run of the issue: LoRA DPO with --beta 1000 went 0.69 -> 354 in 6 steps; the evals logged 'ppl
    5.2e21' and GUARD-EVAL-DIVERGED said 'lower --lr' only."""
    data = _pairs(tmp_path / "pairs.jsonl")
    code, result, err = main(["finetune", "--model", str(tiny_chat_model), "--data", str(data), "--val", str(data),
                              "--out", str(tmp_path / "run"), "--objective", "dpo", "--beta", "1000", "--mode",
                              "lora", "--lr", "0.05", "--steps", "12", "--eval-every", "2", "--batch-size", "2",
                              "--no-preflight", "--json"], capsys)
    evals = [line for line in err.splitlines() if "eval loss" in line]
    assert evals and not any("ppl" in line for line in evals), evals
    assert code == 3 and result["guard"] == "GUARD-EVAL-DIVERGED", err
    assert "--beta" in result["error"]


# ---- --data that is not what the command reads -----------------------------------------------------------
def test_data_dir_says_what_it_is_and_what_is_expected(tmp_path, tiny_chat_model, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello")
    code, result, err = main(["finetune", "--model", str(tiny_chat_model), "--data", str(texts), "--out",
                              str(tmp_path / "r1"), "--steps", "1", "--json"], capsys)
    assert code == 2, err
    assert "a directory (1 entries: a.txt)" in result["error"] and "JSONL file" in result["error"]
    assert "no such file" not in result["error"]
    code, result, err = main(["pretrain", "--model", "tiny", "--data", str(texts), "--out", str(tmp_path / "r2"),
                              "--steps", "1", "--json"], capsys)
    assert code == 2, err
    assert "not a directory of token shards" in result["error"] and "entrenar data pack" in result["error"]
    assert "a directory (1 entries: a.txt)" in result["error"]
