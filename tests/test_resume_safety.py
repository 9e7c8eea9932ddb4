"""Issue 38 item 4: following our own advice deleted user data. On a non-empty --out the message said "continue it
with --resume auto"; `finetune --out DIR --resume auto` on a folder that was no run then replaced DIR/final/ (an HF
model) with an adapter and overwrote DIR/metrics.jsonl, and a run.json that was not JSON was exit 1 with a traceback.
Now --resume writes only into a run directory of ours (or an empty --out); anything else is exit 2 with every file
byte-identical, and "--resume auto" is advised only where it continues a run."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.test_distributed import base_model, sft_data  # noqa: F401


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root (and the names of the directories): what must not change."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def finetune(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", "2",
            "--batch-size", "2", "--max-seq-len", "64", "--lr", "1e-3", "--warmup", "0", "--val-fraction", "0",
            "--seed", "3", "--device", "cpu", "--no-preflight", "--json", "--mode", "lora", "--rank", "4", *extra]


def users_folder(root: Path, run_json: str | None = None) -> Path:
    """A folder of the user's that is no run of ours: an HF model in final/, a metrics.jsonl of another tool."""
    d = root / "mine"
    (d / "final").mkdir(parents=True)
    (d / "final" / "config.json").write_text('{"model_type": "llama"}\n')
    (d / "final" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    (d / "notes.txt").write_text("my experiment\n")
    if run_json is not None:
        (d / "run.json").write_text(run_json)
    return d


@pytest.mark.parametrize("run_json", [None, "not json {", '{"command": "something else"}'])
@pytest.mark.parametrize("resume", ["auto", "PATH"])
def test_resume_into_a_folder_that_is_no_run_is_exit_2_and_touches_nothing(tmp_path, base_model, sft_data,  # noqa: F811
                                                                            capsys, run_json, resume):
    d = users_folder(tmp_path, run_json)
    before = tree(d)
    spec = "auto" if resume == "auto" else str(d / "final")
    code, result, err = run_cli(finetune(base_model, sft_data, d, "--resume", spec), capsys)
    assert code == 2 and result["exit_code"] == 2, err[-2000:]
    assert "not a run directory written by entrenar" in result["error"] and "nothing was changed" in result["error"]
    assert "Traceback" not in err and tree(d) == before


def test_the_advice_on_a_non_empty_out_is_true(tmp_path, base_model, sft_data, capsys):  # noqa: F811
    d = users_folder(tmp_path)
    before = tree(d)
    code, result, _ = run_cli(finetune(base_model, sft_data, d), capsys)
    assert code == 2 and "--resume" not in result["error"] and "not a run directory" in result["error"]
    assert tree(d) == before
    run = tmp_path / "run"  # a run of ours: the advice holds, and following it continues the run
    code, result, err = run_cli(finetune(base_model, sft_data, run, "--save-every", "1"), capsys)
    assert code == 0, err[-2000:]
    code, result, _ = run_cli(finetune(base_model, sft_data, run, "--steps", "3"), capsys)
    assert code == 2 and "continue it with --resume auto" in result["error"]
    code, result, err = run_cli(finetune(base_model, sft_data, run, "--steps", "3", "--resume", "auto"), capsys)
    assert code == 0 and result["start_step"] == 2, err[-2000:]
    # a finished run whose checkpoints were deleted (to save space): no advice to resume, and a resume is refused
    shutil.rmtree(run / "checkpoints")
    before = tree(run)
    code, result, _ = run_cli(finetune(base_model, sft_data, run, "--steps", "4"), capsys)
    assert code == 2 and "--resume auto" not in result["error"] and "no checkpoint to continue" in result["error"]
    code, result, _ = run_cli(finetune(base_model, sft_data, run, "--steps", "4", "--resume", "auto"), capsys)
    assert code == 2 and "nothing was changed" in result["error"] and tree(run) == before


def test_resume_auto_on_a_new_or_empty_out_starts_at_step_0(tmp_path, base_model, sft_data, capsys):  # noqa: F811
    """A requeued job script passes --resume auto from its first launch: nothing there, nothing to lose."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "new", empty):
        code, result, err = run_cli(finetune(base_model, sft_data, out, "--resume", "auto"), capsys)
        assert code == 0 and result["start_step"] == 0, err[-2000:]
        assert json.loads((out / "run.json").read_text())["command"] == "finetune"
