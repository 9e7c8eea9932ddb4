"""Checkpoints written in the background (--save-mode async, the default; issue 36 item 5).

A save takes a snapshot and a thread writes it while training goes on. Shown here with the writer held at a known
point (checkpoint.WRITE_HOOK) until the training thread has run further, never by guessing with sleeps:
- the checkpoint holds its own step (every file's sha256 equals the synchronous save's, the LoRA adapter files
  included) although the next step changed the weights while it was written;
- COMPLETE is written only after every file of the checkpoint was fsynced;
- Ctrl-C waits for the write in flight (then named as the last checkpoint), also when Ctrl-C or SIGTERM comes as the
  save is taken; an error exit abandons it (no COMPLETE);
- a SIGKILL during the write leaves the previous COMPLETE checkpoint and `latest`, the half-written one visibly
  incomplete, and --resume auto continues from the previous one bit-identically;
- under torchrun (2 gloo ranks, FSDP2) the sharded checkpoint written in the background equals the synchronous one
  (sharded_runs, run by tests/test_distributed_toy.py's worker: one launch for both).
A full disk in the background writer is exit 2 with the synchronous save's message: tests/test_exit2_outs.py.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from entrenar import peft
from entrenar.errors import GuardError
from entrenar.train import checkpoint as C
from entrenar.train import loop
from entrenar.train.loop import TrainConfig, TrainingInterrupted, build_trainer
from entrenar.train.model_files import checkpoint_files
from tests.helpers.cli import child_env
from tests.test_train_loop import ListLoader, losses, make_samples, quiet, run, tiny_model

HOLD_S = 60.0  # how long a held writer waits for the training thread before the test fails


class Held:
    """WRITE_HOOK holding the write of checkpoint `step` at `stage` until `release()`; `reached` is set when the
    writer got there."""

    def __init__(self, step: int, stage: str = "start", hold_s: float = HOLD_S):
        self.name, self.stage, self.hold_s = C.step_dir_name(step), stage, hold_s
        self.reached, self.go, self.timed_out = threading.Event(), threading.Event(), False

    def __call__(self, stage: str, where: Path) -> None:
        if stage == self.stage and self.name in where.name:
            self.reached.set()
            self.timed_out = not self.go.wait(self.hold_s)

    def release(self) -> None:
        self.go.set()


def after_step_at(monkeypatch, step: int, action) -> None:
    """Run `action()` when the trainer reaches after_step(step), i.e. once step `step` is done, before its own
    eval and checkpoint."""
    orig = loop.Trainer.after_step

    def after_step(self, s: int) -> None:
        if s == step:
            action(self)
        orig(self, s)
    monkeypatch.setattr(loop.Trainer, "after_step", after_step)


def lora_run(run_dir: Path, mode: str, steps: int = 3) -> dict:
    """A LoRA run whose checkpoints carry the adapter files (the commands' checkpoint_files)."""
    model = tiny_model()
    torch.manual_seed(123)
    model = peft.apply_lora(model, rank=4, alpha=8)
    cfg = TrainConfig(steps=steps, batch_size=2, seq_len=32, lr=1e-2, warmup=1, save_every=2, keep=3, seed=5,
                      save_mode=mode)
    trainer = build_trainer(model, ListLoader(make_samples(16), 2, seed=3), None, cfg, run_dir, log=quiet,
                            checkpoint_files=checkpoint_files)
    trainer.begin(None)
    return trainer.fit()


def digests(ckpt: Path) -> dict[str, str]:
    meta = json.loads((ckpt / "meta.json").read_text())["sha256"]
    return {k: v for k, v in meta.items() if k != "run_config.json"}  # it records --save-mode


def test_a_checkpoint_written_while_training_goes_on_holds_its_own_step(tmp_path, monkeypatch):
    lora_run(tmp_path / "sync", "sync")
    held, seen = Held(2), {}

    def step3_done(trainer) -> None:  # step 3 changed the weights while step-2 was being written
        seen["writing"] = trainer.checkpointer.in_flight
        seen["reached"] = held.reached.wait(HOLD_S)
        seen["complete"] = (tmp_path / "async" / "checkpoints" / "step-0000002").exists()
        held.release()
    monkeypatch.setattr(C, "WRITE_HOOK", held)
    after_step_at(monkeypatch, 3, step3_done)
    lora_run(tmp_path / "async", "async")
    assert seen == {"writing": 2, "reached": True, "complete": False} and not held.timed_out
    for step in ("step-0000002", "step-0000003"):
        a, b = (tmp_path / mode / "checkpoints" / step for mode in ("sync", "async"))
        assert "adapter_model.safetensors" in digests(a) and digests(a) == digests(b), step
    assert losses(tmp_path / "sync") == losses(tmp_path / "async")


def test_the_end_of_run_waits_for_its_checkpoint_and_says_how_long(tmp_path, monkeypatch):
    """The run's end holds it until the last checkpoint is COMPLETE, and end_save counts that wait: the write of the
    last step is held ~0.5 s; the summary's end_save_s and the `end of run` line include it."""
    held, lines = Held(3), []
    monkeypatch.setattr(C, "WRITE_HOOK", held)
    after_step_at(monkeypatch, 3, lambda trainer: threading.Timer(0.5, held.release).start())
    model = tiny_model()
    cfg = TrainConfig(steps=3, batch_size=2, seq_len=32, lr=1e-2, warmup=1, keep=2, seed=5, save_mode="async")
    trainer = build_trainer(model, ListLoader(make_samples(8), 2, seed=3), None, cfg, tmp_path, log=lines.append)
    trainer.begin(None)
    result = trainer.fit()
    assert held.reached.is_set() and not held.timed_out
    assert (tmp_path / "checkpoints" / "step-0000003" / "COMPLETE").is_file()
    end = trainer.end_save
    assert set(end) == {"checkpoint_s", "final_s", "write_wait_s", "total_s"}
    assert end["write_wait_s"] >= 0.3 and result["end_save_s"] == end["total_s"] >= end["write_wait_s"]
    assert any(ln.startswith("end of run: checkpoint and final/ held the run") for ln in lines), lines


@pytest.mark.parametrize("save_every", [0, 2])
def test_a_last_save_without_earlier_snapshots_copies_into_pageable_memory(tmp_path, monkeypatch, save_every):
    """Pinned host memory is for snapshots that later saves reuse; the run's last save, when no save before it
    allocated the buffers, copies into pageable memory (pinning ~45 GB held a 7B run's end 45 s). After periodic
    saves the last one reuses their pinned buffers."""
    pins = []
    real_save = C.Checkpointer.save

    def save(self, *a, **kw):
        path = real_save(self, *a, **kw)
        pins.append(self._buffers.pin)
        return path
    monkeypatch.setattr(C.Checkpointer, "save", save)
    cfg = TrainConfig(steps=4, batch_size=2, seq_len=32, lr=1e-2, warmup=1, keep=3, seed=5, save_mode="async",
                      save_every=save_every)
    trainer = build_trainer(tiny_model(), ListLoader(make_samples(8), 2, seed=3), None, cfg, tmp_path,
                            log=lambda _: None)
    trainer.begin(None)
    trainer.fit()
    assert pins == ([False] if save_every == 0 else [True, True])
    assert (tmp_path / "checkpoints" / "step-0000004" / "COMPLETE").is_file()


def test_complete_is_written_after_every_file_is_synced(tmp_path, monkeypatch):
    synced: set[str] = set()
    checked: list[str] = []
    real_fsync, real_write = os.fsync, C._write_bytes

    def fsync(fd: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def write_bytes(path: Path, data: bytes) -> None:
        if path.name == C.COMPLETE:
            entries = {os.path.realpath(p) for p in [*path.parent.rglob("*"), path.parent]}
            assert entries <= synced, f"not synced before COMPLETE: {sorted(entries - synced)}"
            checked.append(path.parent.name)
        real_write(path, data)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(C, "_write_bytes", write_bytes)
    lora_run(tmp_path / "run", "async", steps=2)
    assert len(checked) == 1 and checked[0].startswith(".step-0000002.tmp")


@pytest.mark.parametrize("stop", ["ctrl-c", "error", "stuck"])
def test_ctrl_c_waits_for_the_write_in_flight_and_an_error_abandons_it(tmp_path, monkeypatch, stop):
    """Ctrl-C (and SIGTERM, the same KeyboardInterrupt) while step-2 is being written: the write is finished and
    named as the last checkpoint. An error (a guard) instead: the write is abandoned, stops before its next file and
    is gone (never COMPLETE, no temporary left) when the error leaves the trainer, so the checkpoint the error names
    stays the newest. A write that does not stop (stuck: held with its files written, not synced) is left behind
    after checkpoint.ABANDON_WAIT_S, and never becomes COMPLETE either."""
    held = Held(2, "written" if stop == "stuck" else "start")
    monkeypatch.setattr(C, "WRITE_HOOK", held)
    monkeypatch.setattr(C, "ABANDON_WAIT_S", 0.5 if stop == "stuck" else HOLD_S)
    written, real_save_file, real_write = [], C.save_file, C.write_safetensors
    if stop == "error":  # the held writer goes on once the trainer has abandoned it
        abandon = C.CommitGate.abandon

        def abandon_then_release(gate) -> None:
            abandon(gate)
            held.release()

        def save_file(tensors, path, *a, **k):
            written.append(Path(path).name)
            return real_save_file(tensors, path, *a, **k)

        def write_safetensors(tensors, path, *a, **k):  # the weights' writer
            written.append(Path(path).name)
            return real_write(tensors, path, *a, **k)
        monkeypatch.setattr(C.CommitGate, "abandon", abandon_then_release)
        monkeypatch.setattr(C, "save_file", save_file)
        monkeypatch.setattr(C, "write_safetensors", write_safetensors)
    raised = []

    def step3_done(trainer) -> None:
        assert held.reached.wait(HOLD_S)
        if stop == "ctrl-c":
            threading.Timer(0.2, held.release).start()  # the write ends while the stop waits for it
            raise KeyboardInterrupt
        raised.append(time.monotonic())
        raise GuardError("GUARD-TEST", "stop")
    after_step_at(monkeypatch, 3, step3_done)
    with pytest.raises(TrainingInterrupted if stop == "ctrl-c" else GuardError) as e:
        run(tmp_path, 4, save_every=2)
    root = tmp_path / "checkpoints"
    if stop == "ctrl-c":
        assert e.value.last_checkpoint == root / "step-0000002" and (root / "step-0000002" / "COMPLETE").is_file()
        assert os.readlink(root / "latest") == "step-0000002"
        return
    if stop == "stuck":
        assert time.monotonic() - raised[0] < 0.5 + 5.0  # the abandon wait, not the write, bounds the error's exit
        (writer,) = C.writers_running()
        (tmp,) = root.iterdir()  # the half-written temporary, without COMPLETE
        assert tmp.name.startswith(".step-0000002.tmp") and not (tmp / C.COMPLETE).exists()
        exits: list[int] = []  # the command's exit past the stuck writer (cli.main's atexit) removes its temporary
        monkeypatch.setattr(C.os, "_exit", exits.append)
        C._leave(2)
        assert exits == [2] and not tmp.exists()
        held.release()  # it goes on to its next check, which stops it
        writer.join(HOLD_S)
    assert not C.writers_running() and not held.timed_out
    assert sorted(p.name for p in root.iterdir()) == [] and written == []  # error: stopped before its first file


def test_a_second_ctrl_c_abandons_the_write_the_first_waits_for(tmp_path, monkeypatch):
    """Ctrl-C while step-2 is being written waits for it; a second Ctrl-C during that wait abandons it: the stop
    names no checkpoint (none is complete), the write never becomes COMPLETE and the stop waits for it to stop, so
    its temporary is gone when the stop ends (it was left behind). The second signal interrupts the
    wait itself: on Python 3.11 a Thread.join interrupted so marked the running writer thread stopped, and the stop
    named step-2, which was never written."""
    held, armed = Held(2), threading.Event()
    monkeypatch.setattr(C, "WRITE_HOOK", held)
    abandon = C.CommitGate.abandon

    def abandon_then_release(gate) -> None:  # the held writer goes on once the stop has abandoned it
        abandon(gate)
        held.release()
    monkeypatch.setattr(C.CommitGate, "abandon", abandon_then_release)
    wait = C.Checkpointer.wait

    def wait_then_second_ctrl_c(self, *a, **k) -> bool:
        if armed.is_set():  # the stop's wait for the write in flight (the saves' waits come before)
            armed.clear()
            threading.Timer(0.1, _thread.interrupt_main).start()
        return wait(self, *a, **k)
    monkeypatch.setattr(C.Checkpointer, "wait", wait_then_second_ctrl_c)

    def step3_done(trainer) -> None:
        assert held.reached.wait(HOLD_S)
        armed.set()
        raise KeyboardInterrupt
    after_step_at(monkeypatch, 3, step3_done)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # interrupt_main raises KeyboardInterrupt
    try:
        with pytest.raises(TrainingInterrupted) as e:
            run(tmp_path, 4, save_every=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert e.value.last_checkpoint is None
    # the stop waited for the abandoned write to stop at its next check: its temporary is gone before the exit
    assert not C.writers_running() and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []


def test_a_stop_waiting_for_the_write_gives_it_up_once_a_rank_is_gone(tmp_path, monkeypatch):
    """Under torchrun the survivors of a lost rank are SIGTERMed by the launcher, possibly before their own collective
    failed: the stop's wait for the checkpoint being written, which cannot complete without that rank's shards, ends
    once a rank is found gone (Trainer.ranks_gone, jobwatch's; planted here), the write abandoned: no COMPLETE, and
    the stop names no checkpoint (the command then reports the lost rank, exit 4)."""
    held = Held(2, hold_s=10.0)  # a stop that waited for the write instead sees it written after 10 s
    monkeypatch.setattr(C, "WRITE_HOOK", held)
    monkeypatch.setattr(loop, "SETTLE_POLL_S", 0.05)
    monkeypatch.setattr(loop.Trainer, "ranks_gone", lambda self: [1])

    def step3_done(trainer) -> None:
        assert held.reached.wait(HOLD_S)
        raise KeyboardInterrupt  # torchrun's SIGTERM
    after_step_at(monkeypatch, 3, step3_done)
    with pytest.raises(TrainingInterrupted) as e:
        run(tmp_path, 4, save_every=2)
    assert e.value.last_checkpoint is None and not held.timed_out
    (writer,) = C.writers_running()  # still held at its start
    held.release()
    writer.join(HOLD_S)
    assert not C.writers_running() and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("committed_here", [True, False], ids=["rank0", "another-rank"])
def test_a_stop_names_the_checkpoint_committed_before_the_write_failed(tmp_path, monkeypatch, committed_here):
    """Under torchrun rank 0's writer commits step-2 (COMPLETE) and then broadcasts the outcome to the other ranks'
    writers; a node lost in between fails that broadcast (rank0), or the other ranks never hear of the commit
    (another-rank). Either way step-2 is COMPLETE on disk, and the stop that follows (torchrun's SIGTERM, a
    KeyboardInterrupt) must name it: the survivors' exit 4 names the checkpoint to resume from. Before the fix the
    write's error hid the commit and the stop named none (CI, tests/test_multinode.py[launcher], KeyError)."""
    start = C.Checkpointer._start

    def start_then_fail(self, step, *a, **k):
        write = start(self, step, *a, **k)

        def write_then_fail(gate):
            write(gate if committed_here else C.CommitGate())  # another rank: the commit is not this gate's
            raise ConnectionResetError("the peers' writers are gone")
        return write_then_fail
    monkeypatch.setattr(C.Checkpointer, "_start", start_then_fail)

    def step3_done(trainer) -> None:
        if committed_here:  # the write's error is raised, and its commit is known all the same
            with pytest.raises(ConnectionResetError):
                trainer.checkpointer.wait()
            assert trainer.last_saved == tmp_path / "checkpoints" / "step-0000002"
        raise KeyboardInterrupt  # torchrun's SIGTERM
    after_step_at(monkeypatch, 3, step3_done)
    with pytest.raises(TrainingInterrupted) as e:
        run(tmp_path, 4, save_every=2)
    root = tmp_path / "checkpoints"
    assert (root / "step-0000002" / C.COMPLETE).is_file()
    assert e.value.last_checkpoint == root / "step-0000002"


KILL = """
import os, signal, threading
from tests import test_train_loop as T
from entrenar.train import checkpoint, loop
held = threading.Event()
def hook(stage, where):  # the write of step-4 stops half done: its files written, not synced, no COMPLETE
    if stage == "written" and checkpoint.step_dir_name(4) in where.name:
        held.set()
        threading.Event().wait()
checkpoint.WRITE_HOOK = hook
orig = loop.Progress.update
def update(self, step, *a, **k):
    orig(self, step, *a, **k)
    if step == 5:  # step 5 ran while step-4 was being written; then the process dies with it
        assert held.wait(120)
        os.kill(os.getpid(), signal.SIGKILL)
loop.Progress.update = update
T.run({run_dir!r}, 6, save_every=2)
"""


def test_sigkill_during_a_background_write_keeps_the_previous_checkpoint_and_resumes_exactly(tmp_path):
    killed = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILL.format(run_dir=str(killed))], capture_output=True, text=True,
                          timeout=300, check=False, env=child_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    uninterrupted = losses(killed)  # steps 1-5 of the run: step 5 went on while the checkpoint was written
    assert len(uninterrupted) == 5
    root = killed / "checkpoints"
    (half,) = [d for d in root.iterdir() if C.step_dir_name(4) in d.name]
    assert half.name.startswith(".") and (half / C.MODEL).is_file() and not (half / C.COMPLETE).exists()
    assert [d.name for d in C.complete_checkpoints(root)] == ["step-0000002"]
    assert os.readlink(root / "latest") == "step-0000002"
    assert run(killed, 6, save_every=2, resume="auto")["start_step"] == 2
    assert losses(killed)[:5] == uninterrupted  # steps 3-5 again from step-2: bit-identical
    assert C.load_checkpoint(root / "latest")["trainer_state"]["step"] == 6


def sharded_runs(ctx, out: Path) -> None:
    """Two ranks' part (tests/test_distributed_toy.py's worker, one torchrun launch for both): the same FSDP2 run
    with --save-mode sync, then async with every rank's shard write of step-2 held until step 3 has changed the
    weights (the staged copy is what must be written). Rank 0 records what it saw in OUT/async/seen.json."""
    from tests.test_distributed_toy import ListLoader as RankLoader
    from tests.test_distributed_toy import samples, tiny

    go, seen = threading.Event(), {}

    def hook(stage: str, where: Path) -> None:
        if stage == "start" and C.step_dir_name(2) in where.name:
            seen["held"] = go.wait(HOLD_S)

    orig = loop.Trainer.after_step

    def after_step(self, step: int) -> None:
        if step == 3 and self.cfg.save_mode == "async":
            seen["writing"] = self.checkpointer.in_flight
            go.set()
        orig(self, step)
    loop.Trainer.after_step = after_step
    try:
        for mode in ("sync", "async"):
            C.WRITE_HOOK = hook if mode == "async" else None
            cfg = TrainConfig(steps=3, batch_size=2, seq_len=32, lr=1e-2, warmup=1, save_every=2, seed=5,
                              save_mode=mode, parallel="fsdp", device="cpu")
            trainer = build_trainer(tiny(0), RankLoader(samples(), 2), None, cfg, out / mode, log=quiet, ctx=ctx)
            trainer.begin(None)
            trainer.fit()
    finally:
        loop.Trainer.after_step, C.WRITE_HOOK = orig, None
    if ctx.is_main:
        (out / "async" / "seen.json").write_text(json.dumps(seen))


def check_sharded_runs(out: Path) -> None:
    """What sharded_runs wrote: the background checkpoints equal the synchronous ones, file by file."""
    assert json.loads((out / "async" / "seen.json").read_text()) == {"held": True, "writing": 2}
    for step in ("step-0000002", "step-0000003"):
        a, b = (out / mode / "checkpoints" / step for mode in ("sync", "async"))
        da, db = ({k: v for k, v in digests(d).items() if k != "dcp/.metadata"} for d in (a, b))
        assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng.safetensors"} <= set(da) and da == db, step
    assert losses(out / "sync") == losses(out / "async")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("moment", ["snapshot", "thread-started"])
def test_a_stop_signal_as_the_save_is_taken_waits_for_that_write(tmp_path, monkeypatch, moment, signum):
    """Ctrl-C or SIGTERM delivered (the real signal, under the commands' handler) at the moment the background save
    of step-2 is taken: while its snapshot is copied, or once its writer thread has started but before the trainer
    holds it as the write in flight. The stop waits for that write: step-2 is COMPLETE and named, `latest` points at
    it, no writer is left running and no temporary stays (the signal raised inside the save dropped it: the stop
    named no checkpoint and left the writer and its `.step-N.tmp-PID` behind)."""
    from entrenar import stops

    sent = []

    def deliver() -> None:
        if not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)  # the handler runs at the next bytecode of this (the main) thread

    if moment == "snapshot":
        real_snapshot = C.snapshot

        def snapshot(step, *a, **k):
            if step == 2:
                deliver()
            return real_snapshot(step, *a, **k)
        monkeypatch.setattr(C, "snapshot", snapshot)
    else:
        real_init = C._Write.__init__

        def init(self, step, write, *a, **k):
            real_init(self, step, write, *a, **k)  # the thread is running now
            if step == 2:
                deliver()
        monkeypatch.setattr(C._Write, "__init__", init)
    with stops.handled(), pytest.raises(TrainingInterrupted) as e:
        run(tmp_path, 4, save_every=2)
    root = tmp_path / "checkpoints"
    assert sent == [signum] and stops.received() == signum
    assert e.value.last_checkpoint == root / "step-0000002" and (root / "step-0000002" / C.COMPLETE).is_file()
    assert os.readlink(root / "latest") == "step-0000002"
    assert not C.writers_running() and sorted(p.name for p in root.iterdir()) == ["latest", "step-0000002"]
