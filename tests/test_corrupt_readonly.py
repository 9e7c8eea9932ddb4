"""Issue 38 item 6: corrupt checkpoints passed read-only commands. Corrupted tensor bytes gave `eval` exit 0 with
"loss": null; a corrupted safetensors header was exit 1 with a SafetensorError traceback. Now a checkpoint or a run's
final/ is checked against the sha256 recorded when it was written (meta.json, final/sha256.json) before it is read,
and an unreadable safetensors file of any directory is exit 2 naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entrenar.fileio import MANIFEST
from tests.helpers.cli import run_cli
from tests.test_distributed import base_model, sft_data  # noqa: F401


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_model, sft_data) -> dict[str, Path]:  # noqa: F811
    """A full and a LoRA fine-tune of 2 steps, each with a checkpoint at step 2 and final/."""
    out = {}
    for mode in ("full", "lora"):
        run = tmp_path_factory.mktemp(mode) / "run"
        code, result, err = run_cli(["finetune", "--model", str(base_model), "--data", str(sft_data), "--out", str(run),
                                     "--steps", "2", "--batch-size", "2", "--max-seq-len", "64", "--lr", "1e-3",
                                     "--val-fraction", "0", "--seed", "3", "--device", "cpu", "--no-preflight",
                                     "--mode", mode, "--rank", "4", "--json"], capture=True)
        assert code == 0, (result, err)
        out[mode] = run
    return out


def flip(path: Path, at: int) -> bytes:
    """Flip one byte of `path` at offset `at` (negative: from the end); returns the original bytes."""
    data = path.read_bytes()
    bad = bytearray(data)
    bad[at] ^= 0x5A
    path.write_bytes(bytes(bad))
    return data


def read_only(model: Path, sft: Path) -> dict[str, list[str]]:
    return {"eval": ["eval", "--model", str(model), "--data", str(sft), "--max-seq-len", "64", "--json"],
            "inspect": ["inspect", str(model), "--json"],
            "generate": ["generate", "--model", str(model), "--prompt", "one", "--max-new-tokens", "2", "--json"]}


@pytest.mark.parametrize("mode, where, name", [
    ("full", "checkpoints/step-0000002", "model.safetensors"),
    ("full", "final", "model.safetensors"),
    ("lora", "checkpoints/step-0000002", "adapter_model.safetensors"),
    ("lora", "final", "adapter_model.safetensors"),
])
def test_corrupt_weights_of_a_run_are_exit_2_naming_the_file(runs, sft_data, capsys, mode, where, name):  # noqa: F811
    run = runs[mode]
    target = run / where / name
    model = run if where == "final" else run / where
    original = flip(target, -3)  # in the tensor data: the header still parses, the values are wrong
    try:
        for command, argv in read_only(model, sft_data).items():  # inspect of an adapter too (issue 38 item 11)
            code, result, err = run_cli(argv, capsys)
            assert code == 2 and result["exit_code"] == 2, (command, result, err[-1500:])
            assert str(target) in result["error"] and "sha256" in result["error"], (command, result)
    finally:
        target.write_bytes(original)
    code, result, err = run_cli(read_only(model, sft_data)["eval"], capsys)  # restored: it reads again
    assert code == 0 and result["loss"] is not None, err[-1500:]


def test_the_records_cover_what_a_model_load_reads(runs):
    for run in runs.values():
        final = json.loads((run / "final" / MANIFEST).read_text())["sha256"]
        assert set(final) == {str(p.relative_to(run / "final")) for p in (run / "final").rglob("*")
                              if p.is_file() and p.name != MANIFEST}
        meta = json.loads((run / "checkpoints" / "step-0000002" / "meta.json").read_text())["sha256"]
        weights = "model.safetensors" if (run / "final" / "config.json").is_file() else "adapter_model.safetensors"
        assert weights in meta and ("config.json" in meta or "adapter_config.json" in meta)


def test_an_unreadable_header_of_an_hf_dir_or_adapter_is_exit_2(runs, tmp_path, sft_data, capsys):  # noqa: F811
    """Directories without a record of ours (an HF model, a PEFT adapter from elsewhere): the header is checked."""
    import shutil

    for mode, name in (("full", "model.safetensors"), ("lora", "adapter_model.safetensors")):
        copy = tmp_path / mode
        shutil.copytree(runs[mode] / "final", copy)
        (copy / MANIFEST).unlink()  # someone else's directory: nothing recorded
        flip(copy / name, 3)  # the header's length: safetensors cannot parse it
        argv = read_only(copy, sft_data)["eval"]
        if mode == "lora":  # an adapter from elsewhere, on the base it names
            argv = ["eval", "--model", str(json.loads((copy / "adapter_config.json").read_text())
                                           ["base_model_name_or_path"]), "--adapter", str(copy), "--data",
                    str(sft_data), "--max-seq-len", "64", "--json"]
        code, result, err = run_cli(argv, capsys)
        assert code == 2 and str(copy / name) in result["error"], (mode, result, err[-1500:])
        assert "Traceback" not in err
