"""The checkpoint directory's bookkeeping on its own: which step directories count as complete, incomplete or
stale temporaries, what pruning keeps, and the CUDA RNG states' round trip through the on-disk files (a CPU
never has them, so the loop tests cannot see them)."""

from __future__ import annotations

import os

import pytest
import torch

from entrenar.errors import InputError
from entrenar.train import checkpoint as ckpt


def _layout(root, complete=(1, 2, 3, 4), incomplete=(5,), temporaries=(3, 6)):
    """step-N directories (with COMPLETE where complete), atomic_dir temporaries `.step-N.tmp-PID`, a
    `latest` link to the newest complete one and an unrelated directory."""
    root.mkdir(parents=True)
    for s in complete:
        d = root / ckpt.step_dir_name(s)
        d.mkdir()
        (d / ckpt.COMPLETE).write_text("")
    for s in incomplete:
        (root / ckpt.step_dir_name(s)).mkdir()
    for s in temporaries:
        (root / f".{ckpt.step_dir_name(s)}.tmp-4242").mkdir()
    os.symlink(ckpt.step_dir_name(max(complete)), root / "latest")
    (root / "notes").mkdir()
    return root


def test_complete_incomplete_and_stale_are_told_apart(tmp_path):
    root = _layout(tmp_path / "checkpoints")
    assert [d.name for d in ckpt.complete_checkpoints(root)] == [ckpt.step_dir_name(s) for s in (1, 2, 3, 4)]
    assert sorted(d.name for d in ckpt.incomplete_checkpoints(root)) == sorted(
        [ckpt.step_dir_name(5), f".{ckpt.step_dir_name(3)}.tmp-4242", f".{ckpt.step_dir_name(6)}.tmp-4242"])
    assert [d.name for d in ckpt.stale_tmp_dirs(root, max_step=4)] == [f".{ckpt.step_dir_name(3)}.tmp-4242"]
    assert [d.name for d in ckpt.stale_tmp_dirs(root, max_step=9, min_step=5)] == [
        f".{ckpt.step_dir_name(6)}.tmp-4242"]
    missing = tmp_path / "none"
    assert ckpt.complete_checkpoints(missing) == ckpt.incomplete_checkpoints(missing) == []
    assert ckpt.stale_tmp_dirs(missing, 10) == []


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_prune_keeps_the_newest_and_removes_superseded_temporaries(tmp_path, keep):
    root = _layout(tmp_path / "checkpoints")
    ckpt.prune(root, keep=keep)
    left = sorted(p.name for p in root.iterdir())
    # the `keep` newest complete, the incomplete step 5 (newer than any complete: a save may be under way),
    # the temporary of step 6 (likewise), the link and the unrelated directory; step 3's temporary is gone
    newest = [ckpt.step_dir_name(s) for s in (1, 2, 3, 4)][-keep:]
    assert left == sorted([*newest, ckpt.step_dir_name(5), f".{ckpt.step_dir_name(6)}.tmp-4242", "latest", "notes"])


def test_prune_zero_keeps_every_complete_checkpoint(tmp_path):
    root = _layout(tmp_path / "checkpoints")
    ckpt.prune(root, keep=0)
    assert [d.name for d in ckpt.complete_checkpoints(root)] == [ckpt.step_dir_name(s) for s in (1, 2, 3, 4)]
    assert not (root / f".{ckpt.step_dir_name(3)}.tmp-4242").exists()  # superseded temporaries still go


def test_cuda_rng_states_round_trip_through_the_checkpoint_files():
    """Three devices' states (as torch.cuda.get_rng_state_all gives them) -> JSON + tensors -> the same list."""
    cuda = [torch.randint(0, 256, (16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
            for i in range(3)]
    state = {**ckpt.rng_state(), "cuda": cuda}
    as_json, tensors = ckpt._rng_to_files(state)
    assert as_json["cuda_devices"] == 3 and sorted(tensors) == ["cuda.0", "cuda.1", "cuda.2", "torch"]
    back = ckpt._rng_from_files(as_json, tensors)
    assert len(back["cuda"]) == 3 and all(torch.equal(a, b) for a, b in zip(back["cuda"], cuda, strict=True))
    assert torch.equal(back["torch"], state["torch"])
    cpu_only = ckpt._rng_from_files(*ckpt._rng_to_files({**state, "cuda": None}))
    assert cpu_only["cuda"] is None


def _intact(root):
    """Give every COMPLETE step directory of `root` the files an intact checkpoint has."""
    for d in ckpt.complete_checkpoints(root):
        for name in ckpt.REQUIRED:
            (d / name).touch()


def test_resume_path_of_a_run_directory_is_its_newest_complete_checkpoint(tmp_path):
    """--resume RUN (a run directory, not a checkpoint) continues from RUN's newest complete checkpoint and
    says which; --resume RUN/checkpoints/latest follows the link; a checkpoint path is taken as it is."""
    run = tmp_path / "run"
    root = _layout(run / "checkpoints")
    _intact(root)
    said: list[str] = []
    newest = (root / ckpt.step_dir_name(4)).resolve()
    assert ckpt.find_resume(tmp_path / "other", str(run), said.append) == newest
    assert said == [f"resume: continuing from {root / ckpt.step_dir_name(4)}"]
    assert ckpt.find_resume(tmp_path / "other", str(root / "latest"), said.append) == newest
    older = root / ckpt.step_dir_name(2)
    assert ckpt.find_resume(tmp_path / "other", str(older), said.append) == older.resolve()
    assert len(said) == 1  # only the run-directory form names what it chose


def test_resume_path_refuses_an_incomplete_or_missing_checkpoint(tmp_path):
    root = _layout(tmp_path / "run" / "checkpoints")
    _intact(root)
    with pytest.raises(InputError, match=f"no {ckpt.COMPLETE} marker"):
        ckpt.find_resume(tmp_path, str(root / ckpt.step_dir_name(5)), print)
    with pytest.raises(InputError, match="no such checkpoint directory"):
        ckpt.find_resume(tmp_path, str(root / ckpt.step_dir_name(9)), print)
    (root / ckpt.step_dir_name(3) / ckpt.RNG).unlink()
    with pytest.raises(InputError, match=f"missing {ckpt.RNG}"):
        ckpt.find_resume(tmp_path, str(root / ckpt.step_dir_name(3)), print)
