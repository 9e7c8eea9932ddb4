"""One writer per run directory (issue 29), and SIGTERM as Ctrl-C on one process (issue 28, item 5).

A writer is a real `entrenar pretrain` in a subprocess that pauses after step 4 (its step-3 checkpoint
complete) until the test lets it go; meanwhile the test runs other commands in this process:
  - a second writer (`--resume auto`, or none) is refused with exit 2 naming the holder, and the first
    finishes bit-identical to a run alone;
  - read-only commands work on the run in progress from its complete checkpoints (and a checkpoint
    without its COMPLETE marker is refused);
  - a SIGKILLed writer frees the directory at once: `--resume auto` right after is accepted;
  - SIGTERM ends a run like Ctrl-C: exit 143, the last complete checkpoint and the resume command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from entrenar.train.metrics import read_jsonl
from entrenar.train.runlock import LOCK_FILE
from tests import test_train_cli
from tests.helpers.cli import run_cli as main
from tests.test_train_cli import pretrain_args

byte_shards, byte_model_dir = test_train_cli.byte_shards, test_train_cli.byte_model_dir
SRC = str(Path(__file__).resolve().parents[1] / "src")
STEPS, PAUSE_AT = 8, 4

# `entrenar pretrain ARGV` that, after step PAUSE_AT (and the checkpoint written in the background before it),
# writes GO.paused and waits (at most 120 s) for GO
PAUSING = """
import sys, threading, time
from pathlib import Path
from entrenar.train import metrics
go = Path(sys.argv[1])
orig = metrics.Progress.update
def update(self, step, *a, **k):
    orig(self, step, *a, **k)
    if step == {pause}:
        for t in threading.enumerate():  # the step-3 checkpoint, written in the background, is complete
            if t.name.startswith("entrenar-checkpoint-"):
                t.join()
        go.with_suffix(".paused").write_text("")
        t0 = time.monotonic()
        while not go.exists() and time.monotonic() - t0 < 120:
            time.sleep(0.05)
metrics.Progress.update = update
from entrenar import cli
sys.exit(cli.main(sys.argv[2:]))
"""


def start_paused(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, Path]:
    """The writer, started and waited for until it pauses; returns (process, the file that releases it)."""
    script, go = tmp_path / "pausing.py", tmp_path / "go"
    script.write_text(PAUSING.format(pause=PAUSE_AT))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(go), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.monotonic()
    while not go.with_suffix(".paused").exists():
        if proc.poll() is not None or time.monotonic() - t0 > 180:
            proc.kill()
            pytest.fail(f"the writer never reached step {PAUSE_AT}: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    return proc, go


def finish(proc: subprocess.Popen, go: Path) -> dict:
    go.write_text("")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def alone(tmp_path_factory, byte_model_dir, byte_shards) -> Path:
    """The reference: the same run with nothing else on its directory."""
    out = tmp_path_factory.mktemp("alone") / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=STEPS, extra=("--no-preflight",)))
    assert code == 0, err
    return out


def test_second_writer_refused_readers_served_and_the_first_finishes_as_if_alone(
        tmp_path, alone, byte_model_dir, byte_shards, capsys):
    run = tmp_path / "run"
    argv = pretrain_args(byte_model_dir, byte_shards, run, steps=STEPS, extra=("--no-preflight",))
    proc, go = start_paused(tmp_path, argv)
    try:
        holder = json.loads((run / LOCK_FILE).read_text())
        assert holder["pid"] == proc.pid and "pretrain" in holder["command"]
        before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}

        # a second writer, as a requeued job script would start it, and one without --resume: both exit 2
        for extra in (("--resume", "auto"), ()):
            code, result, err = main(pretrain_args(byte_model_dir, byte_shards, run, steps=STEPS, extra=extra), capsys)
            assert code == 2 and result["exit_code"] == 2, err
            assert f"pid {proc.pid}" in err and "being written by another run" in err and "--resume auto" in err
        assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # it wrote nothing

        # read-only commands on the run in progress: its complete checkpoints
        latest = run / "checkpoints" / "latest"
        code, ev, err = main(["eval", "--model", str(latest), "--data", str(byte_shards), "--seq-len", "32",
                              "--batch-size", "2", "--max-batches", "2", "--json"], capsys)
        assert code == 0 and ev["model"].endswith("step-0000003"), err
        code, _, err = main(["generate", "--model", str(latest), "--prompt", "def ", "--max-new-tokens", "4",
                             "--json"], capsys)
        assert code == 0, err
        code, result, err = main(["eval", "--model", str(run), "--data", str(byte_shards), "--json"], capsys)
        assert code == 2 and result["exit_code"] == 2 and "still training" in err and "step-0000003" in err  # names what it can read
        code, pl, err = main(["plot", str(run), "--json"], capsys)
        assert code == 0 and pl["steps"] == PAUSE_AT, err
        assert proc.poll() is None  # none of it disturbed the writer
    finally:
        result = finish(proc, go)
    assert result["ok"] and result["steps"] == STEPS
    assert "resumed" not in json.loads((run / "run.json").read_text())
    assert [r["loss"] for r in read_jsonl(run / "metrics.jsonl")] == [r["loss"] for r in read_jsonl(alone / "metrics.jsonl")]
    a, b = load_file(str(run / "final/model.safetensors")), load_file(str(alone / "final/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)  # bit-identical


def test_a_killed_writer_frees_the_directory_at_once(tmp_path, alone, byte_model_dir, byte_shards, capsys):
    run = tmp_path / "run"
    argv = pretrain_args(byte_model_dir, byte_shards, run, steps=STEPS, extra=("--no-preflight",))
    proc, _ = start_paused(tmp_path, argv)
    proc.kill()  # SIGKILL: no clean-up; its holder record stays behind
    proc.wait(timeout=30)
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == proc.pid
    code, result, err = main([*argv, "--resume", "auto"], capsys)  # at once: no stale-lock wait, no --force
    assert code == 0 and result["start_step"] == 3, err
    assert [r["loss"] for r in read_jsonl(run / "metrics.jsonl")] == [r["loss"] for r in read_jsonl(alone / "metrics.jsonl")]


def test_a_checkpoint_without_complete_is_not_read(tmp_path, alone, capsys):
    """A save in progress (its hidden temporary) or an interrupted one: refused, naming a complete one."""
    ckpts = tmp_path / "run" / "checkpoints"
    shutil.copytree(alone / "checkpoints" / "step-0000006", ckpts / "step-0000006")
    for name in (".step-0000009.tmp-4242", "step-0000008"):
        shutil.copytree(alone / "checkpoints" / "step-0000006", ckpts / name)
        (ckpts / name / "COMPLETE").unlink()
        code, result, err = main(["generate", "--model", str(ckpts / name), "--prompt", "x", "--json"], capsys)
        assert code == 2 and result["exit_code"] == 2 and "COMPLETE" in err and "step-0000006" in err, err


def test_sigterm_ends_a_run_like_ctrl_c(tmp_path, byte_model_dir, byte_shards):
    """SLURM preemption / `docker stop`: exit 143 (128 + SIGTERM), the last complete checkpoint and the resume
    command in the message and the JSON line; the run directory is free afterwards."""
    run = tmp_path / "run"
    proc, _ = start_paused(tmp_path, pretrain_args(byte_model_dir, byte_shards, run, steps=STEPS,
                                                   extra=("--no-preflight",)))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["exit_code"] == 143 and result["checkpoint"].endswith("step-0000003")
    assert "stopped by SIGTERM" in err and "step-0000003" in err and "Traceback" not in err
    assert "--resume auto" in result["resume_command"]


def test_a_run_that_died_before_writing_anything_does_not_block_a_retry(tmp_path, byte_model_dir, byte_shards, capsys):
    """Killed between taking the lock and writing run.json: the directory holds only RUN/.lock."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": "elsewhere"}))
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, run, steps=2, extra=("--no-preflight",)), capsys)
    assert code == 0 and "never reached step 1" in err, err
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
