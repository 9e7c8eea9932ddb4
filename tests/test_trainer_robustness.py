"""What a new user hit (issue 18) and what a checkpoint must never do (issue 11 item 8), on the tiny
model of test_train_loop.

- a checkpoint called good after a NaN is finite and not exploded, and resuming from it with a sane
  --lr trains (full and LoRA; --lr inf part-way through a run, --lr 1e20 from the start);
- a non-finite final eval or non-finite weights never make a final/ (GUARD-NONFINITE, exit 3); an
  eval that climbs back to ln(vocab) is GUARD-EVAL-COLLAPSE;
- a checkpoint missing any one file: --resume PATH exits 2 naming it, --resume auto falls back;
- a checkpoint whose optimizer.pt carries a pickled callable is refused (exit 2) and runs nothing;
- metrics.jsonl / eval.jsonl are strict JSON (NaN -> null + "nonfinite");
- resume with nothing to do is refused; changed settings are logged; Ctrl-C names the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from entrenar.errors import GuardError, InputError
from entrenar.train import checkpoint as ckpt_mod
from entrenar.train import guards, loop
from entrenar.train.loop import TrainConfig, TrainingInterrupted, build_trainer, train
from entrenar.train.metrics import read_jsonl
from entrenar.train.optim import Schedule
from tests import test_train_loop as T


def lora_model():
    from entrenar import peft

    m = T.tiny_model()
    torch.manual_seed(123)
    return peft.apply_lora(m, rank=4, alpha=8)


MODELS = {"full": T.tiny_model, "lora": lora_model}


def checkpoint_weights_ok(run_dir: Path, start_max_abs: float) -> list[str]:
    """Names of the complete checkpoints; asserts each holds finite, non-exploded weights."""
    names = []
    for d in ckpt_mod.complete_checkpoints(run_dir / "checkpoints"):
        tensors = ckpt_mod.load_checkpoint(d)["model"].values()
        top = max(float(t.abs().max()) for t in tensors)
        assert math.isfinite(top) and top < 100 * start_max_abs, (d.name, top)
        names.append(d.name)
    return names


def strict_rows(path: Path) -> list[dict]:
    """Parse a JSONL file rejecting NaN/Infinity tokens, as jq or JavaScript would."""
    def refuse(token: str):
        raise ValueError(f"non-strict JSON token {token} in {path}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines() if line.strip()]


# ---- 18.1: the last good checkpoint after a NaN is good ---------------------------------------------
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_lr_inf_midway_keeps_a_finite_checkpoint_that_resumes(tmp_path, monkeypatch, mode):
    """Steps 1-2 at a sane lr (step-2 checkpoint), then lr = inf: step 3's update makes the weights NaN,
    step 4's loss is NaN -> stop. The old loop saved the NaN weights of step 3 as 'the last good
    checkpoint' (seen red: latest -> step-0000003 with NaN tensors); it must stay at step 2."""
    model = MODELS[mode]()
    start = guards.weights_max_abs([p for p in model.parameters() if p.requires_grad])
    orig = Schedule.lr_at
    monkeypatch.setattr(Schedule, "lr_at", lambda self, step: float("inf") if step >= 2 else orig(self, step))
    with pytest.raises(GuardError) as e:
        T.run(tmp_path, 6, model=model, save_every=2, lr=1e-2)
    assert e.value.guard_id == "GUARD-NONFINITE" and e.value.exit_code == 3
    assert "step 4" in str(e.value) and "step-0000002" in str(e.value)
    assert checkpoint_weights_ok(tmp_path, start) == ["step-0000002"]
    assert os.readlink(tmp_path / "checkpoints" / "latest") == "step-0000002"
    monkeypatch.setattr(Schedule, "lr_at", orig)  # the remedy: resume with a sane lr
    out = T.run(tmp_path, 6, model=MODELS[mode](), save_every=2, lr=1e-3, resume="auto")
    assert out["start_step"] == 2
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in rows)
    checkpoint_weights_ok(tmp_path, start)


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_lr_1e20_keeps_no_exploded_checkpoint(tmp_path, mode):
    """--lr 1e20: step 1's update leaves finite weights of ~1e20, step 2 is NaN. The old loop kept
    step-0000001 with those weights (seen red); no checkpoint of them may be written, the message says
    so, and a rerun at a sane lr trains."""
    model = MODELS[mode]()
    start = guards.weights_max_abs([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(GuardError) as e:
        T.run(tmp_path, 4, model=model, lr=1e20, warmup=0)
    assert e.value.guard_id == "GUARD-NONFINITE" and "no checkpoint was kept" in str(e.value)
    assert checkpoint_weights_ok(tmp_path, start) == []
    out = T.run(tmp_path, 3, model=MODELS[mode](), lr=1e-3, resume="auto")  # nothing to resume: step 0
    assert out["start_step"] == 0 and len(read_jsonl(tmp_path / "metrics.jsonl")) == 3
    assert all(math.isfinite(r["loss"]) for r in read_jsonl(tmp_path / "metrics.jsonl"))


def test_periodic_checkpoint_of_exploded_weights_is_refused(tmp_path):
    """save_every=1 with --lr 1e20: the step-1 checkpoint would hold ~1e20 weights -> GUARD-NONFINITE at
    step 1, nothing saved."""
    with pytest.raises(GuardError) as e:
        T.run(tmp_path, 3, save_every=1, lr=1e20, warmup=0)
    assert e.value.guard_id == "GUARD-NONFINITE" and "exploded" in str(e.value)
    assert ckpt_mod.complete_checkpoints(tmp_path / "checkpoints") == []


def test_weights_problem_unit():
    ok = [torch.ones(3), torch.full((2,), -2.0)]
    assert guards.weights_max_abs(ok) == 2.0
    assert guards.weights_problem(ok, 1.0) is None
    assert "NaN" in guards.weights_problem([torch.tensor([1.0, float("nan")])], 1.0)
    assert "inf" in guards.weights_problem([torch.tensor([float("-inf")])], 1.0)
    assert "exploded" in guards.weights_problem([torch.tensor([1e20])], 1.0)
    assert guards.weights_problem([torch.tensor([999.0])], 1.0) is None  # 999x: not exploded


# ---- 18.2: success is never reported on a destroyed model -------------------------------------------
@pytest.mark.parametrize("lr,expect", [(float("inf"), "eval loss is nan"), (1e20, "exploded")])
def test_destroyed_final_model_is_guard_and_writes_no_final(tmp_path, monkeypatch, lr, expect):
    """--steps 1 at lr inf: the update makes the weights NaN; the old loop returned ok with eval NaN and
    wrote an all-NaN final/ (seen red). At 1e20 the eval is exactly ln(vocab) (RMSNorm hides the scale)
    but the weights are ~1e20. Both: GUARD-NONFINITE, exit 3, no final/, no checkpoint."""
    monkeypatch.setattr(Schedule, "lr_at", lambda self, step: lr)  # --lr inf is refused as input now
    written = []
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=32, lr=1e-3, warmup=0, seed=5)
    with pytest.raises(GuardError) as e:
        train(T.tiny_model(), T.ListLoader(T.make_samples(16), 2, seed=3), T.ListLoader(T.make_samples(8, 99), 4),
              cfg, tmp_path, preflight={}, save_final=lambda m, p: written.append(p), log=T.quiet)
    assert e.value.guard_id == "GUARD-NONFINITE" and e.value.exit_code == 3
    assert expect in str(e.value)
    assert written == [] and not (tmp_path / "final").exists()
    assert ckpt_mod.complete_checkpoints(tmp_path / "checkpoints") == []


def test_nonfinite_final_weights_without_eval_write_no_final(tmp_path):
    written = []
    cfg = TrainConfig(steps=1, batch_size=2, seq_len=32, lr=1e20, warmup=0, seed=5)
    trainer = build_trainer(T.tiny_model(), T.ListLoader(T.make_samples(16), 2, seed=3), None, cfg, tmp_path,
                      save_final=lambda m, p: written.append(p), log=T.quiet)
    trainer.save = lambda step, *a, **k: None  # no checkpoint in the way: the final/ check alone
    with pytest.raises(GuardError) as e:
        trainer.fit()
    assert e.value.guard_id == "GUARD-NONFINITE" and "final/" in str(e.value) and written == []


def test_eval_collapse_unit():
    v = math.log(49152)  # the objective's uniform loss (cross-entropy)
    guards.check_eval_collapse(10.0, None, v, 5)  # no earlier eval: nothing to collapse from
    guards.check_eval_collapse(10.0, 10.7, v, 5)  # never well below ln V (from-scratch start)
    guards.check_eval_collapse(4.0, 0.586, v, 5)  # worse, but far from uniform
    with pytest.raises(GuardError) as e:
        guards.check_eval_collapse(10.8027, 0.586, v, 5)  # the --lr 1e6 report: 0.586 -> ln(49152)
    assert e.value.guard_id == "GUARD-EVAL-COLLAPSE" and e.value.exit_code == 3
    assert "uniform" in str(e.value) and "--lr" in e.value.remedy


def test_eval_collapse_in_the_loop(tmp_path, monkeypatch):
    """Eval 1.0 at step 0, then exactly ln(vocab) (weights zeroed -> uniform logits) -> the guard stops
    the run at that eval; no final/."""
    real = loop.evaluate
    calls = {"n": 0}

    def fake(model, batches, *a, **k):
        ev = real(model, batches, *a, **k)
        calls["n"] += 1
        return {**ev, "loss": 1.0 if calls["n"] == 1 else math.log(T.VOCAB)}
    monkeypatch.setattr(loop, "evaluate", fake)
    written = []
    cfg = TrainConfig(steps=4, batch_size=2, seq_len=32, lr=1e-3, warmup=0, eval_every=2, seed=5)
    with pytest.raises(GuardError) as e:
        train(T.tiny_model(), T.ListLoader(T.make_samples(16), 2), T.ListLoader(T.make_samples(8, 99), 4), cfg,
              tmp_path, save_final=lambda m, p: written.append(p), log=T.quiet)
    assert e.value.guard_id == "GUARD-EVAL-COLLAPSE" and "step 2" in str(e.value) and written == []


# ---- 18.8: a checkpoint with a file deleted ------------------------------------------------------------
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ckpts") / "run"
    T.run(run_dir, 4, save_every=2)
    return run_dir


@pytest.mark.parametrize("name", ckpt_mod.REQUIRED)
def test_checkpoint_missing_a_file(tmp_path, two_checkpoints, name):
    """Old: FileNotFoundError traceback for --resume PATH and --resume auto (seen red)."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir, symlinks=True)
    newest = run_dir / "checkpoints" / "step-0000004"
    (newest / name).unlink()
    with pytest.raises(InputError) as e:
        T.run(run_dir, 6, save_every=2, resume=str(newest))
    assert e.value.exit_code == 2 and name in str(e.value)
    messages: list[str] = []
    path, ckpt = ckpt_mod.load_resume(run_dir, "auto", messages.append)
    assert path == run_dir / "checkpoints" / "step-0000002" and ckpt["meta"]["step"] == 2
    assert any(name in m or "incomplete" in m for m in messages), messages
    out = T.run(run_dir, 6, save_every=2, resume="auto")
    assert out["start_step"] == 2 and [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 7))


def test_resume_auto_with_every_checkpoint_broken_is_refused(tmp_path, two_checkpoints):
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir, symlinks=True)
    for d in ckpt_mod.complete_checkpoints(run_dir / "checkpoints"):
        (d / "optimizer.pt").unlink()
    with pytest.raises(InputError, match="optimizer.pt"):
        T.run(run_dir, 6, save_every=2, resume="auto")  # never silently restarts a run from step 0


def test_resume_auto_falls_back_past_a_corrupt_checkpoint(tmp_path, two_checkpoints):
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir, symlinks=True)
    opt = run_dir / "checkpoints" / "step-0000004" / "model.safetensors"
    data = bytearray(opt.read_bytes())
    data[-3] ^= 0xFF
    opt.write_bytes(bytes(data))
    messages: list[str] = []
    path, _ = ckpt_mod.load_resume(run_dir, "auto", messages.append)
    assert path.name == "step-0000002" and any("sha256" in m and "falling back" in m for m in messages)


# ---- 11.8: nothing executes on load ------------------------------------------------------------------
class _Payload:
    """Unpickling this creates a directory: the stand-in for arbitrary code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_checkpoint_with_a_pickled_callable_is_refused_and_runs_nothing(tmp_path, two_checkpoints):
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir, symlinks=True)
    ckpt = run_dir / "checkpoints" / "step-0000004"
    marker = tmp_path / "code-ran"
    opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    opt["payload"] = _Payload(marker)
    torch.save(opt, ckpt / "optimizer.pt")
    meta = json.loads((ckpt / "meta.json").read_text())  # an attacker rewrites the recorded sha256 too
    meta["sha256"]["optimizer.pt"] = ckpt_mod.sha256_file(ckpt / "optimizer.pt")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(InputError) as e:
        T.run(run_dir, 6, save_every=2, resume=str(ckpt))
    assert e.value.exit_code == 2 and "optimizer.pt" in str(e.value) and "refused" in str(e.value)
    assert not marker.exists(), "loading the checkpoint executed code"
    # the payload is real: the old torch.load(weights_only=False) would have run it (seen red)
    torch.load(ckpt / "optimizer.pt", weights_only=False)
    assert marker.is_dir()


def test_checkpoint_files_are_json_and_safetensors(two_checkpoints):
    ckpt = two_checkpoints / "checkpoints" / "step-0000004"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(ckpt_mod.REQUIRED)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["data"] == {"epoch": 0, "pos": 8} and state["weights_ref"] > 0
    meta = json.loads((ckpt / "meta.json").read_text())
    assert set(meta["sha256"]) == set(ckpt_mod.HASHED)
    torch.load(ckpt / "optimizer.pt", weights_only=True)  # plain tensors and containers only


def test_rng_state_round_trips_through_json_and_safetensors(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    as_json, tensors = ckpt_mod._rng_to_files(ckpt_mod.rng_state())
    as_json = json.loads(json.dumps(as_json))
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    ckpt_mod.set_rng_state(ckpt_mod._rng_from_files(as_json, tensors))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect


# ---- 18.9: strict JSON logs -----------------------------------------------------------------------
def test_metrics_jsonl_is_strict_json_with_nonfinite_flag(tmp_path, monkeypatch):
    """A skipped NaN step: the old log had a bare NaN token (seen red: strict parsers reject it)."""
    T._nan_at_call(monkeypatch, 2)
    T.run(tmp_path, 3, on_nonfinite="skip")
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert rows[1]["loss"] is None and rows[1]["skipped"] is True
    assert "loss" in rows[1]["nonfinite"] and "nonfinite" not in rows[0]
    assert all(isinstance(r["loss"], float) for r in (rows[0], rows[2]))
    strict_rows(tmp_path / "eval.jsonl")


def test_strict_record_unit():
    from entrenar.train.metrics import strict_record

    assert strict_record({"a": 1.0, "b": None}) == {"a": 1.0, "b": None}
    assert strict_record({"loss": float("nan"), "g": float("-inf"), "s": 2}) == \
        {"loss": None, "g": None, "s": 2, "nonfinite": ["loss", "g"]}


# ---- 18.11: resume with nothing to do, changed settings, Ctrl-C -----------------------------------------
def test_resume_with_nothing_to_do_is_refused_and_final_untouched(tmp_path):
    """--resume auto --steps 2 on a run at step 6: the old loop reported 'done' and rewrote final/ with
    final_train_loss NaN (seen red)."""
    saved = []
    samples, evals = T.make_samples(16), T.make_samples(8, seed=99)

    def go(steps: int):
        cfg = TrainConfig(steps=steps, batch_size=2, seq_len=32, lr=3e-3, warmup=2, seed=5)
        return train(T.tiny_model(), T.ListLoader(samples, 2, seed=3), T.ListLoader(evals, 4), cfg, tmp_path,
                     resume="auto", preflight={}, save_final=lambda m, p: saved.append(p), log=T.quiet)
    go(6)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(InputError) as e:
        go(2)
    assert e.value.exit_code == 2 and "nothing to do" in str(e.value) and "step 6" in str(e.value)
    assert len(saved) == 1 and (tmp_path / "metrics.jsonl").read_text() == before
    with pytest.raises(InputError, match="nothing to do"):
        go(6)


def test_resume_logs_changed_settings(tmp_path):
    T.run(tmp_path, 2, save_every=2)
    messages: list[str] = []
    samples, evals = T.make_samples(16), T.make_samples(8, seed=99)
    cfg = TrainConfig(steps=4, batch_size=2, seq_len=32, lr=1e-3, warmup=2, save_every=2, keep=3, seed=5, clip=1.0)
    train(T.tiny_model(), T.ListLoader(samples, 2, seed=3), T.ListLoader(evals, 4), cfg, tmp_path, resume="auto",
          log=messages.append)
    assert "resume: lr changed 0.003 -> 0.001" in messages
    assert "resume: steps changed 2 -> 4" in messages


def test_ctrl_c_names_the_last_checkpoint_and_the_resume_command(tmp_path, monkeypatch):
    orig = loop.Trainer.train_step

    def step(self, n):
        if n == 4:
            raise KeyboardInterrupt
        return orig(self, n)
    monkeypatch.setattr(loop.Trainer, "train_step", step)
    with pytest.raises(TrainingInterrupted) as e:
        T.run(tmp_path, 6, save_every=2)
    assert isinstance(e.value, KeyboardInterrupt)
    assert e.value.last_checkpoint == tmp_path / "checkpoints" / "step-0000002"
    assert e.value.checkpoint == str(e.value.last_checkpoint) and "--resume auto" in e.value.resume_command
    assert "step-0000002" in str(e.value) and "step 4" in str(e.value)
    monkeypatch.setattr(loop.Trainer, "train_step", orig)
    assert T.run(tmp_path, 6, save_every=2, resume="auto")["start_step"] == 2


def test_ctrl_c_before_any_checkpoint_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(loop.Trainer, "train_step", lambda self, n: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(TrainingInterrupted) as e:
        T.run(tmp_path, 3)
    assert e.value.last_checkpoint is None and "no checkpoint was written yet" in str(e.value)


def test_resume_command_is_this_command_line_with_resume_auto(monkeypatch):
    from entrenar.train.commands import _resume_command

    monkeypatch.setattr(sys, "argv", ["/venv/bin/entrenar", "finetune", "--model", "m x", "--resume", "PATH",
                                      "--lr", "1e-4", "--resume=auto"])
    assert _resume_command() == "entrenar finetune --model 'm x' --lr 1e-4 --resume auto"
    monkeypatch.setattr(sys, "argv", ["pytest", "-q"])
    assert _resume_command() is None


# ---- the seed reaches everything random in training --------------------------------------------------
def test_seed_drives_dropout_same_seed_same_run(tmp_path):
    """LoRA dropout draws from the global RNG, which the Trainer seeds from cfg.seed: the same seed
    twice gives identical losses, another seed other ones (a Trainer that seeds a constant, or not at
    all, fails the second half)."""
    from entrenar import peft

    def dropout_model():
        m = T.tiny_model()
        torch.manual_seed(123)
        return peft.apply_lora(m, rank=4, alpha=8, dropout=0.3)

    T.run(tmp_path / "a", 3, model=dropout_model(), lr=1e-2)
    T.run(tmp_path / "b", 3, model=dropout_model(), lr=1e-2)
    T.run(tmp_path / "c", 3, model=dropout_model(), lr=1e-2, seed=6)
    assert T.losses(tmp_path / "a") == T.losses(tmp_path / "b")
    assert T.losses(tmp_path / "a")[1:] != T.losses(tmp_path / "c")[1:]


def test_resume_after_a_kill_mid_log_line(tmp_path):
    """A SIGKILL while metrics.jsonl's line for step 5 was being written leaves half a line: the old
    truncate_after died on it with JSONDecodeError (seen red); resume drops it, a bad line elsewhere
    is named."""
    T.run(tmp_path, 4, save_every=2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.1')
    T.run(tmp_path, 6, save_every=2, resume="auto")
    assert [r["step"] for r in strict_rows(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError, match="metrics.jsonl:2"):
        T.run(tmp_path, 8, save_every=2, resume="auto")


# ---- 11.8 for sharded (torch.distributed.checkpoint) checkpoints ------------------------------------
def _dcp_save(state: dict, path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def test_dcp_files_of_a_real_sharded_save_pass_the_check(tmp_path):
    model = T.tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, T.VOCAB, (2, 5)), labels=torch.randint(0, T.VOCAB, (2, 5)))[0].backward()
    opt.step()
    _dcp_save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "dcp")
    ckpt_mod.check_dcp_files(tmp_path / "dcp")  # metadata types and the non-tensor entries are all plain


def test_dcp_entry_or_metadata_with_a_pickled_callable_is_refused_and_runs_nothing(tmp_path):
    """torch.distributed.checkpoint pickle.load()s .metadata and torch.load(weights_only=False)s every
    non-tensor entry: a sharded checkpoint from someone else ran code on --resume (seen red below)."""
    marker = tmp_path / "code-ran"
    _dcp_save({"w": torch.ones(3), "payload": _Payload(marker)}, tmp_path / "entry")
    with pytest.raises(InputError, match="refused") as e:
        ckpt_mod.check_dcp_files(tmp_path / "entry")
    assert e.value.exit_code == 2 and "payload" in str(e.value) and not marker.exists()

    _dcp_save({"w": torch.ones(3)}, tmp_path / "meta")
    (tmp_path / "meta" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))  # a crafted .metadata
    with pytest.raises(InputError, match=r"\.metadata: refused"):
        ckpt_mod.check_dcp_files(tmp_path / "meta")
    assert not marker.exists()

    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # the payload is real: DCP's own loader runs it
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.zeros(3), "payload": None}, checkpoint_id=str(tmp_path / "entry"))
    assert marker.is_dir()


def test_cuda_rng_of_more_devices_than_visible_restores_those_visible(monkeypatch):
    """A checkpoint saved where 4 CUDA devices were visible, resumed where 2 are (a 4 -> 2 GPU resume under
    torchrun, CUDA_VISIBLE_DEVICES, another machine): the 2 visible devices get their states, and the
    resume does not die in torch.cuda.set_rng_state_all with IndexError (seen on 4x H200)."""
    import torch.cuda.random as cuda_random

    restored = {}

    def set_state(new_state, device=0):
        if int(device) >= 2:  # what torch.cuda.default_generators[idx] does past the visible devices
            raise IndexError("tuple index out of range")
        restored[int(device)] = new_state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(cuda_random, "set_rng_state", set_state)
    state = {**ckpt_mod.rng_state(), "cuda": [torch.full((8,), i, dtype=torch.uint8) for i in range(4)]}
    ckpt_mod.set_rng_state(state)
    assert sorted(restored) == [0, 1] and all(int(restored[i][0]) == i for i in (0, 1))


# ---- garbage collection on a schedule (loop.scheduled_gc) ----------------------------------------------
def test_fit_runs_with_automatic_gc_off_and_collects_on_schedule(tmp_path, monkeypatch):
    """Inside fit the automatic collector is off (a pause at a random point of a step would hold every
    other rank at the next all-reduce), generation 1 is collected every GC_EVERY steps and everything
    every GC_FULL_EVERY steps, and the collector is on again afterwards, also when the run stops with an
    error."""
    import gc

    monkeypatch.setattr(loop, "GC_EVERY", 2)
    monkeypatch.setattr(loop, "GC_FULL_EVERY", 4)
    collects, enabled_in_step = [], []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda gen=2: collects.append(gen) or real_collect(gen))
    cfg = TrainConfig(steps=5, batch_size=2, seq_len=32, lr=1e-3, warmup=0, seed=5)
    trainer = build_trainer(T.tiny_model(), T.ListLoader(T.make_samples(16), 2, seed=3), None, cfg, tmp_path,
                      log=T.quiet)
    trainer.save = lambda step, *a, **k: None
    step_of = trainer.train_step
    trainer.train_step = lambda step: enabled_in_step.append(gc.isenabled()) or step_of(step)
    assert gc.isenabled()
    trainer.fit()
    assert enabled_in_step == [False] * 5
    assert collects == [2, 1, 2]  # a full one at the start, generation 1 at step 2, a full one at step 4
    assert gc.isenabled()

    def boom(step):
        raise RuntimeError("device lost")
    trainer.train_step, trainer.start_step = boom, 0
    with pytest.raises(RuntimeError):
        trainer.fit()
    assert gc.isenabled()


def test_gc_every_zero_leaves_the_collector_alone(tmp_path, monkeypatch):
    import gc

    monkeypatch.setattr(loop, "GC_EVERY", 0)
    with loop.scheduled_gc(0, 1000):
        assert gc.isenabled()
    gc.disable()
    try:  # a caller that turned it off itself keeps it off
        with loop.scheduled_gc(3, 1000):
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
