"""Running out of the device's memory is the device's limit, not a bug: exit 5 with what to lower for the command
(and, for a run, that `--resume auto` continues from its last checkpoint), under --json {"out_of_memory": true};
not a traceback and exit 1 (an internal error)."""

from __future__ import annotations

import pytest
import torch

from entrenar.errors import EXIT_OUT_OF_MEMORY, out_of_memory_message
from tests.helpers.cli import run_cli
from tests.test_eval_task import _tiny_dir
from tests.test_task_in_loop import sft_rows  # noqa: F401

ALLOCATOR = ("CUDA out of memory. Tried to allocate 1.04 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
             "845.12 MiB is free.\nIf reserved but unallocated memory is large try setting ...")


def test_a_finetune_out_of_memory_exits_5_saying_what_to_lower(tmp_path, sft_rows, capsys, monkeypatch):  # noqa: F811
    from entrenar.train.loop import Trainer

    def oom(self, step):
        raise torch.OutOfMemoryError(ALLOCATOR)

    monkeypatch.setattr(Trainer, "train_step", oom)
    code, result, err = run_cli(["finetune", "--model", str(_tiny_dir(tmp_path, "m")), "--data", str(sft_rows), "--out",
                   str(tmp_path / "run"), "--mode", "lora", "--steps", "2", "--batch-size", "2", "--no-preflight",
                   "--json"], capsys)
    assert code == EXIT_OUT_OF_MEMORY == 5
    assert "out of device memory (CUDA out of memory. Tried to allocate 1.04 GiB." in err
    assert "--grad-accum" in err and "--resume auto" in err and "Traceback" not in err
    assert result == {"ok": False, "error": result["error"], "guard": None, "exit_code": 5, "out_of_memory": True}


@pytest.mark.parametrize("command, needle", [("eval", "--batch-size N below"), ("pretrain", "--seq-len"),
                                             ("merge", "a smaller batch")])
def test_the_remedy_is_the_commands(command, needle):
    text = out_of_memory_message(command, torch.OutOfMemoryError(ALLOCATOR))
    assert text.startswith("out of device memory (CUDA out of memory. Tried to allocate 1.04 GiB.") and needle in text
