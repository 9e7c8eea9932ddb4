"""The Trainer's user-facing contract through `entrenar pretrain` (tiny byte-level model, CPU):
Ctrl-C exits 130 naming the last complete checkpoint and the resume command (also in the --json
line); a resume with nothing to do exits 2 before anything in the run directory is touched; a
checkpoint with a deleted file exits 2 naming it; preflight.json is written by the command.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from entrenar.train import loop
from entrenar.train.metrics import read_jsonl
from tests import test_train_cli
from tests.helpers.cli import run_cli as main
from tests.test_train_cli import pretrain_args

# the byte-tokenizer shards and model of test_train_cli, shared (module-scoped there, built once per module)
byte_shards, byte_model_dir = test_train_cli.byte_shards, test_train_cli.byte_model_dir


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, byte_model_dir, byte_shards) -> Path:
    """A 6-step run with checkpoints at 3 and 6 and a final/."""
    out = tmp_path_factory.mktemp("finished") / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=6, extra=("--no-preflight",)))
    assert code == 0, err
    return out


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_ctrl_c_exits_130_naming_the_last_checkpoint(tmp_path, byte_model_dir, byte_shards, capsys, monkeypatch):
    orig = loop.Trainer.train_step

    def step(self, n):
        if n == 5:
            raise KeyboardInterrupt  # what Ctrl-C raises in the main thread
        return orig(self, n)
    monkeypatch.setattr(loop.Trainer, "train_step", step)
    out = tmp_path / "run"
    code, result, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=8, extra=("--no-preflight",)), capsys)
    assert code == 130
    assert "step-0000003" in err and "--resume auto" in err  # old: only "interrupted"
    assert result["ok"] is False and result["checkpoint"].endswith("step-0000003")
    assert "--resume auto" in result["resume_command"]
    monkeypatch.setattr(loop.Trainer, "train_step", orig)
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=8, extra=("--resume", "auto")), capsys)
    assert code == 0, err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, 9))


def test_resume_with_nothing_to_do_exits_2_and_touches_nothing(tmp_path, finished_run, byte_model_dir, byte_shards, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    before = snapshot(run)
    code, result, err = main(pretrain_args(byte_model_dir, byte_shards, run, steps=2, extra=("--resume", "auto")), capsys)
    assert code == 2 and "nothing to do" in err and "step 6" in err
    assert result["exit_code"] == 2
    assert snapshot(run) == before  # run.json, metrics, final/ untouched


def test_resume_path_missing_a_file_exits_2_naming_it(tmp_path, finished_run, byte_model_dir, byte_shards, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    ckpt = run / "checkpoints" / "step-0000006"
    (ckpt / "trainer_state.json").unlink()
    before = snapshot(run)
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, run, steps=9, extra=("--resume", str(ckpt))), capsys)
    assert code == 2 and "trainer_state.json" in err and "Traceback" not in err
    assert snapshot(run) == before
    # --resume auto falls back to step 3 with a message and finishes the run
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, run, steps=9, extra=("--resume", "auto")), capsys)
    assert code == 0, err
    assert "falling back" in err and "step-0000003" in err
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 10))


def test_preflight_json_written_by_the_command_with_step0(finished_run):
    pre = json.loads((finished_run / "preflight.json").read_text())
    assert pre["verify"] == {"skipped": "--no-preflight"}
    assert pre["step0"]["eval"]["loss"] > 0 and pre["step0"]["vocab_size"] == 258
