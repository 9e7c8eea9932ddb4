"""A LoRA run works from any folder and after its folder moved (issue 28 item 3).

The base was recorded as the path typed (`--model runs/t1`, relative to the cwd of the training), so
generate / eval / export on the run from another directory failed with "runs/t1: no such file". The
base is now recorded as an absolute path (plus the path relative to the adapter directory, next to the
weights fingerprint that was already recorded); when the recorded path is gone, a base found at the
same place relative to the run is used if its fingerprint matches; otherwise exit 2 names the recorded
base and the remedy `--model BASE --adapter RUN`.

Seen red before the fix: generate from another cwd (no such file), the moved folder (no such file),
the gone base (a message that did not say it was the recorded base, nor the remedy).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from entrenar.fileio import MANIFEST, write_manifest
from entrenar.formats import save_hf_dir
from tests.helpers.cli import run_cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """work/runs/base (a tiny HF model) and work/runs/lora, fine-tuned with `--model runs/base` typed
    from work/ (a relative path, as a user types it)."""
    import os

    from entrenar.cli import main
    from tests.test_peft_seed import tiny_base_and_data

    work = tmp_path_factory.mktemp("work")
    base, data = tiny_base_and_data(work / "runs")
    base.rename(work / "runs" / "base")
    data.rename(work / "sft.jsonl")
    here = os.getcwd()
    os.chdir(work)
    try:
        rc = main(["finetune", "--model", "runs/base", "--data", "sft.jsonl", "--out", "runs/lora", "--mode",
                   "lora", "--rank", "2", "--steps", "1", "--batch-size", "2", "--val-fraction", "0", "--max-seq-len", "64",
                   "--no-preflight", "--json"])
    finally:
        os.chdir(here)
    assert rc == 0
    return work


def _generate(model: str, *extra: str) -> list[str]:
    return ["generate", "--model", model, "--prompt", "Say 1.", "--max-new-tokens", "2", "--temperature", "0",
            "--json", *extra]


def test_the_base_is_recorded_absolute_with_its_place_relative_to_the_adapter(trained):
    final = trained / "runs" / "lora" / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    note = json.loads((final / "entrenar_adapter.json").read_text())
    assert Path(cfg["base_model_name_or_path"]) == trained / "runs" / "base"
    assert Path(note["base_model"]).is_absolute() and note["base_model_relative"] == "../../base"
    assert note["base_fingerprint"]["method"]


def test_a_lora_run_works_from_another_folder(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, result, err = run_cli(_generate(str(trained / "runs" / "lora")), capsys)
    assert code == 0, err[-3000:]
    assert result["completion_tokens"] >= 1


def test_a_run_moved_together_with_its_base_finds_it_by_fingerprint(trained, tmp_path, capsys):
    moved = tmp_path / "elsewhere"
    shutil.copytree(trained / "runs", moved)
    note_path = moved / "lora" / "final" / "entrenar_adapter.json"
    # as if trained elsewhere: the recorded absolute path does not exist here
    for name in ("entrenar_adapter.json", "adapter_config.json"):
        p = moved / "lora" / "final" / name
        p.write_text(p.read_text().replace(str(trained), "/nonexistent/work"))
    write_manifest(moved / "lora" / "final")  # as written there: its sha256 record matches
    assert json.loads(note_path.read_text())["base_model"].startswith("/nonexistent/work")
    code, _, err = run_cli(_generate(str(moved / "lora")), capsys)
    assert code == 0, err[-3000:]
    assert "not found" in err and str(moved / "base") in err  # says which base it used and why


def test_a_base_found_relative_to_the_run_with_other_weights_is_refused(trained, tmp_path, capsys):
    moved = tmp_path / "elsewhere"
    shutil.copytree(trained / "runs", moved)
    for name in ("entrenar_adapter.json", "adapter_config.json"):
        p = moved / "lora" / "final" / name
        p.write_text(p.read_text().replace(str(trained), "/nonexistent/work"))
    write_manifest(moved / "lora" / "final")
    from entrenar.formats import load_model

    other = load_model(moved / "base")
    with __import__("torch").no_grad():
        for p in other.parameters():
            p.add_(0.5)
    shutil.rmtree(moved / "base")
    from entrenar.tokenizer import load_tokenizer

    save_hf_dir(other, moved / "base", load_tokenizer(trained / "runs" / "base"))
    code, _, err = run_cli(_generate(str(moved / "lora")), capsys)
    assert code == 2 and "/nonexistent/work/runs/base" in err and "--model BASE --adapter" in err, err[-3000:]


@pytest.mark.parametrize("command", ["generate", "eval", "export"])
def test_a_gone_base_is_exit_2_naming_the_recorded_base_and_the_remedy(trained, tmp_path, capsys, command):
    run = tmp_path / "lora"
    shutil.copytree(trained / "runs" / "lora", run)
    for name in ("entrenar_adapter.json", "adapter_config.json"):
        p = run / "final" / name
        p.write_text(p.read_text().replace(str(trained), "/nonexistent/work"))
    write_manifest(run / "final")
    argv = {"generate": _generate(str(run)),
            "eval": ["eval", "--model", str(run), "--data", str(trained / "sft.jsonl"), "--json"],
            "export": ["export", "gguf", str(run), str(tmp_path / "o.gguf"), "--json"]}[command]
    code, result, err = run_cli(argv, capsys)
    assert code == 2, err[-3000:]
    assert "/nonexistent/work/runs/base" in result["error"] and "recorded" in result["error"]
    assert f"--model BASE --adapter {run}" in result["error"]
    # ... and the remedy works
    fix = {"generate": _generate(str(trained / "runs" / "base"), "--adapter", str(run)),
           "eval": ["eval", "--model", str(trained / "runs" / "base"), "--adapter", str(run), "--data",
                    str(trained / "sft.jsonl"), "--json"],
           "export": ["export", "gguf", str(trained / "runs" / "base"), str(tmp_path / "o.gguf"), "--adapter",
                      str(run), "--json"]}[command]
    code, _, err = run_cli(fix, capsys)
    assert code == 0, err[-3000:]


def test_a_run_recorded_with_a_relative_base_before_this_fix_is_found_from_another_folder(trained, tmp_path,
                                                                                          monkeypatch, capsys):
    """Adapters written before absolute paths: `runs/base` typed in work/ is found under the folders
    above the run (work/ is one of them), its fingerprint checked."""
    work = tmp_path / "work"
    shutil.copytree(trained / "runs", work / "runs")
    for name, key in (("adapter_config.json", "base_model_name_or_path"), ("entrenar_adapter.json", "base_model")):
        p = work / "runs" / "lora" / "final" / name
        d = json.loads(p.read_text())
        d[key] = "runs/base"
        d.pop("base_model_relative", None)
        p.write_text(json.dumps(d))
    (work / "runs" / "lora" / "final" / MANIFEST).unlink()  # adapters of before this fix had no sha256 record
    monkeypatch.chdir(tmp_path)  # runs/base does not exist from here
    code, _, err = run_cli(_generate(str(work / "runs" / "lora")), capsys)
    assert code == 0, err[-3000:]
    assert str(work / "runs" / "base") in err


def test_verify_against_hf_on_a_lora_run_loads_its_base_and_adapter(trained, tmp_path, monkeypatch, capsys):
    """Issue 28 item 7: `verify --against hf` on a LoRA run directory was exit 1, "Unrecognized model in
    runs/t1" (transformers was given the adapter directory); it now compares against transformers + peft
    on the recorded base, from any folder."""
    monkeypatch.chdir(tmp_path)
    code, result, err = run_cli(["verify", "--model", str(trained / "runs" / "lora"), "--against", "hf",
                                 "--seq-len", "32", "--json"], capsys)
    assert code == 0, err[-3000:]
    assert result["ok"] is True
