"""Defaults that keep a run from silent stretches and lost work, through the CLI: `--eval-batches` on the CPU is
steps/10 (1 to 20), stated and logged (a 2-step llama-370m CPU run spent 475 s of evals against an ETA of 53 s);
`--save-every-minutes` (30) checkpoints a long run by wall clock and leaves a short run's files as they were;
`--kernels triton` on the CPU names the run's device, not a `--device cpu` the user never typed."""

from __future__ import annotations

import json

import pytest

from entrenar.train.config import TrainConfig, default_eval_batches
from entrenar.train.metrics import read_jsonl
from tests.test_cli_flags_documented import byte_model_dir, checkpoint_steps, pretrain, small_shards  # noqa: F401


def test_cpu_eval_batches_default_is_a_small_share_and_logged(tmp_path, byte_model_dir, small_shards,  # noqa: F811
                                                              capsys):
    assert default_eval_batches("cpu", 2) == (1, default_eval_batches("cpu", 2)[1])
    assert default_eval_batches("cpu", 50)[0] == 5 and default_eval_batches("cpu", 1000) == (20, "")
    assert default_eval_batches("cuda:0", 2) == (20, "")
    # not given on the command line (None): decided by the rule; in code the default stays 20
    assert TrainConfig(steps=2, device="cpu", eval_batches=None).eval_batches == 1
    assert TrainConfig(steps=2, device="cpu").eval_batches == 20
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "a", "--steps", "2", "--device", "cpu",
                             capsys=capsys)
    assert code == 0, err
    assert "--eval-batches 1: the CPU default for --steps 2 (steps/10, 1 to 20; 20 on a GPU)" in err
    assert {r["batches"] for r in read_jsonl(tmp_path / "a" / "eval.jsonl")} == {1}
    config = json.loads((tmp_path / "a" / "run.json").read_text())["config"]
    assert config["eval_batches"] == 1 and "the CPU default" in config["eval_batches_reason"]
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "b", "--steps", "2", "--device", "cpu",
                             "--eval-batches", "2", capsys=capsys)
    assert code == 0 and "the CPU default" not in err, err
    assert {r["batches"] for r in read_jsonl(tmp_path / "b" / "eval.jsonl")} == {2}


def test_save_every_minutes_checkpoints_by_time_and_leaves_a_short_run_alone(tmp_path, byte_model_dir,  # noqa: F811
                                                                            small_shards, capsys):  # noqa: F811
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "short", "--steps", "3", "--keep", "0",
                            capsys=capsys)  # the default 30 minutes: a short run's one end checkpoint
    assert code == 0, err
    assert checkpoint_steps(tmp_path / "short") == [3]
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "timed", "--steps", "3", "--keep", "0",
                            "--save-every-minutes", "0.000001", capsys=capsys)  # 60 us: due after every step
    assert code == 0, err
    assert checkpoint_steps(tmp_path / "timed") == [1, 2, 3]
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "off", "--steps", "3", "--keep", "0",
                            "--save-every-minutes", "0", capsys=capsys)
    assert code == 0 and checkpoint_steps(tmp_path / "off") == [3], err
    code, js, err = pretrain(byte_model_dir, small_shards, tmp_path / "bad", "--steps", "3",
                             "--save-every-minutes", "-1", capsys=capsys)
    assert code == 2 and "--save-every-minutes must be a number of minutes >= 0" in js["error"], js


def test_timed_saves_wait_a_whole_period_after_any_checkpoint():
    from entrenar.train.periodic import TimedSaves

    now = [0.0]
    saves = TimedSaves(30, clock=lambda: now[0])
    now[0] = 29 * 60
    assert not saves.due()
    now[0] = 30 * 60
    assert saves.due()
    saves.saved()
    now[0] = 59 * 60
    assert not saves.due()
    assert not TimedSaves(0, clock=lambda: now[0]).due()

    class Job:  # under torchrun: the ranks agree (one all-reduce) every DIST_CHECK_EVERY steps only
        active, reduced = True, 0

        def any_true(self, flag: bool) -> bool:
            self.reduced += 1
            return flag

    from entrenar.train.periodic import DIST_CHECK_EVERY

    job, now[0] = Job(), 0.0
    saves = TimedSaves(30, job, clock=lambda: now[0])
    now[0] = 31 * 60
    answers = [saves.due() for _ in range(2 * DIST_CHECK_EVERY)]
    assert job.reduced == 2 and answers.index(True) == DIST_CHECK_EVERY - 1


def test_kernels_triton_on_the_cpu_names_the_runs_device_not_a_flag(monkeypatch):
    from entrenar.errors import InputError
    from entrenar.kernels import _common, resolve_kernels

    monkeypatch.setattr(_common, "_INTERPRETER_AT_IMPORT", False)
    with pytest.raises(InputError) as e:
        resolve_kernels("triton", "cpu")
    assert "--device cpu is not one" not in str(e.value)
    assert "this command runs on cpu (the --device given, or --device auto's choice" in str(e.value)
    assert "--kernels torch" in str(e.value)


def test_tool_remedy_names_the_packaged_chatml_tools_template():
    from entrenar.errors import InputError
    from tests.helpers.tokenizers import tiny_tokenizer

    tok = tiny_tokenizer()  # its own ChatML template renders no tools
    with pytest.raises(InputError, match=r"--chat-template chatml_tools \(packaged"):
        tok.encode_chat([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "f"}}])
