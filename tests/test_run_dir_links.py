"""No file a run writes is written through a symbolic link planted in its run directory (issue 51 item 2:
`pretrain --out RUN --resume auto` truncated and overwrote the file outside RUN that a linked RUN/.lock pointed to).

For each name a run writes, a finished run is copied, that name is replaced by a link to a file (or a directory)
outside the run, and the run is continued with `--resume auto`. The target stays byte for byte what it was. The
run's own files (.lock and runlock.RUN_ENTRIES) are refused with exit 2 naming the link before anything is written;
final/ and the temporaries a write renames into place replace the link (the run ends with exit 0).

Seen red before the fix: every case (.lock's target truncated and overwritten with the holder's JSON; the logs
appended to through their links; the other names followed, or not replaced, without a word).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from entrenar.train.runlock import LOCK_FILE, RUN_ENTRIES
from tests import test_train_cli
from tests.helpers.cli import run_cli
from tests.test_train_cli import pretrain_args

byte_shards, byte_model_dir = test_train_cli.byte_shards, test_train_cli.byte_model_dir

REFUSED = (LOCK_FILE, *(n for n in RUN_ENTRIES if n != ".nodes-check"))  # several nodes only
# final/, and the hidden temporaries of atomic writes (tmp:NAME is .NAME.tmp-PID; run_cli runs in this process)
REPLACED = ("final", "final.tmp", "tmp:run.json", "tmp:data_report.json", "tmp:metrics.jsonl", "tmp:eval.jsonl")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, byte_model_dir, byte_shards) -> Path:
    out = tmp_path_factory.mktemp("links") / "run"
    code, _, err = run_cli(pretrain_args(byte_model_dir, byte_shards, out, steps=4, extra=("--profile", "2:1")),
                           capture=True)
    assert code == 0, err[-2000:]
    return out


def plant(run: Path, name: str, outside: Path) -> tuple[Path, dict[str, bytes]]:
    """RUN/name replaced by a link to a file (or, for a directory name, a directory) outside the run; returns the
    link's target and its bytes (every file under it)."""
    entry = run / name
    directory = name in ("final", "final.tmp")
    target = outside / (name.strip(".") + ("-dir" if directory else ".txt"))
    if directory:
        target.mkdir()
        (target / "keep.txt").write_text("a directory of someone else's\n")
    else:
        target.write_text("a file of someone else's\n")
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)
    os.symlink(target, entry)
    return target, snapshot(target)


def snapshot(target: Path) -> dict[str, bytes]:
    if target.is_dir():
        return {str(f.relative_to(target)): f.read_bytes() for f in sorted(target.rglob("*")) if f.is_file()}
    return {"": target.read_bytes()}


@pytest.mark.parametrize("name", [*REFUSED, *REPLACED])
def test_a_link_in_the_run_directory_is_never_written_through(name, finished_run, byte_model_dir, byte_shards,
                                                              tmp_path, capsys):
    if name.startswith("tmp:"):
        name = f".{name.removeprefix('tmp:')}.tmp-{os.getpid()}"
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    shutil.copytree(finished_run, run, symlinks=True)
    target, before = plant(run, name, outside)
    argv = pretrain_args(byte_model_dir, byte_shards, run, steps=6, extra=("--resume", "auto", "--profile", "5:1"))
    code, result, err = run_cli(argv, capsys)
    assert snapshot(target) == before and sorted(p.name for p in outside.iterdir()) == [target.name], err[-2000:]
    if name in REFUSED:
        assert code == 2 and result["exit_code"] == 2, err[-2000:]
        assert f"{run / name} is a symbolic link" in result["error"] and "Traceback" not in err
        assert (run / name).is_symlink()  # left for the user to look at
        return
    assert code == 0 and result["start_step"] == 4, err[-2000:]
    if name == "final":
        assert not (run / "final").is_symlink() and (run / "final" / "config.json").is_file()
    else:
        assert not (run / name).exists() and not (run / name).is_symlink()  # the temporary is gone
