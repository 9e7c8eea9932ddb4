"""Issue 38 item 8: exit 1 with a traceback on what the user (or the machine) caused. `data pack`, `tokenizer train`,
`data sft-from-code` and `plot` with --out under /proc; a full disk during a fine-tune's save (SafetensorError "File
too large", "please report it"). Now exit 2 naming the path and the cause, before any work for --out; a failed save
leaves the previous complete checkpoint (and `latest` pointing at it) and nothing half-written."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli
from tests.test_distributed import base_model, sft_data  # noqa: F401


@pytest.mark.parametrize("command", ["pack", "tokenizer", "sft-from-code", "plot"])
def test_out_under_proc_is_exit_2_naming_it(tmp_path, command, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text('def f(x):\n    """Double x."""\n    return 2 * x\n')
    (src / "a.txt").write_text("hello world\n" * 50)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0}) + "\n")
    out = "/proc/entrenar-test/out"
    argv = {"pack": ["data", "pack", "--model", "smollm2-135m-instruct", "--out", out, str(src / "a.txt")],
            "tokenizer": ["tokenizer", "train", "--vocab-size", "300", "--out", out, str(src / "a.txt")],
            "sft-from-code": ["data", "sft-from-code", "--out", out + ".jsonl", str(src)],
            "plot": ["plot", str(run), "--out", out + ".png"]}[command]
    code, result, err = run_cli([*argv, "--json"], capsys)
    assert code == 2 and result["exit_code"] == 2, (result, err[-1500:])
    assert "/proc" in result["error"] and "cannot be created" in result["error"] and "Traceback" not in err


def finetune(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", "3",
            "--batch-size", "2", "--max-seq-len", "64", "--lr", "1e-3", "--warmup", "0", "--val-fraction", "0",
            "--save-every", "1", "--seed", "3", "--device", "cpu", "--no-preflight", "--json", "--mode", "full",
            *extra]


def full_disk(kind: str) -> Exception:
    from safetensors import SafetensorError

    if kind == "safetensors":  # what safetensors raises when the OS refuses the write (RLIMIT_FSIZE: EFBIG)
        return SafetensorError("Error while serializing: IoError(Os { code: 27, kind: FileTooLarge, message: "
                               "\"File too large\" })")
    if kind == "tokenizers":  # Tokenizer.save on a full disk: a plain Exception with the OS's text
        return Exception("No space left on device (os error 28)")
    if kind == "torch":  # torch.save's zip writer (optimizer.pt) on a full disk
        return RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                            "data/3: file write failed; unexpected pos 1536 vs 1472")
    return OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("kind, mode", [("safetensors", "async"), ("oserror", "sync"), ("tokenizers", "async"),
                                        ("torch", "sync")])
def test_a_full_disk_during_a_checkpoint_is_exit_2_and_keeps_the_previous_one(tmp_path, base_model, sft_data,  # noqa: F811
                                                                               capsys, monkeypatch, kind, mode):
    """--save-mode async (the default): the background writer's error reaches the training thread (the next step)
    as the same exit 2 a synchronous save gives."""
    from entrenar.train import checkpoint

    real, calls = checkpoint.write_safetensors, []

    def writer(tensors, path, *a, **k):
        calls.append(path)
        if Path(path).name == "model.safetensors" and ".step-0000002" in str(path):  # the second checkpoint's
            Path(path).write_bytes(b"\0" * 100)  # part of it reached the disk
            raise full_disk(kind)
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(checkpoint, "write_safetensors", writer)
    out = tmp_path / "run"
    code, result, err = run_cli(finetune(base_model, sft_data, out, "--save-mode", mode), capsys)
    assert code == 2 and result["exit_code"] == 2 and "please report" not in result["error"], (result, err[-1500:])
    ckpts = out / "checkpoints"
    assert str(ckpts / "step-0000002") in result["error"] and ("File too large" in result["error"] or
                                                               "No space left" in result["error"] or
                                                               "unexpected pos" in result["error"])
    assert str(ckpts / "step-0000001") in result["error"] and "--resume auto" in result["error"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-0000001"]  # no half step-2, no temporary
    assert (ckpts / "latest").resolve().name == "step-0000001" and (ckpts / "step-0000001" / "COMPLETE").is_file()
    assert not (out / "final").exists()
    assert json.loads((out / "run.json").read_text())["config"]["save_mode"] == mode
    monkeypatch.undo()  # space freed: the advice continues the run
    code, result, err = run_cli([*finetune(base_model, sft_data, out), "--resume", "auto"], capsys)
    assert code == 0 and result["start_step"] == 1, err[-1500:]


def test_a_full_disk_while_writing_final_is_exit_2(tmp_path, base_model, sft_data, capsys, monkeypatch):  # noqa: F811
    from entrenar import fileio

    real = fileio.write_safetensors

    def writer(tensors, path, *a, **k):
        if "final" in str(path):
            raise full_disk("oserror")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(fileio, "write_safetensors", writer)
    out = tmp_path / "run"
    code, result, err = run_cli(finetune(base_model, sft_data, out), capsys)
    assert code == 2 and str(out / "final") in result["error"] and "No space left" in result["error"], err[-1500:]
    assert not (out / "final").exists() and not (out / "final.tmp").exists()
    assert (out / "checkpoints" / "step-0000003" / "COMPLETE").is_file()
