"""--dtype auto, every command's default (issue 23): bf16 on a CUDA device with native bf16 (the recipe that keeps
the 2e-2 logits bound: fp32 masters, bf16 matmuls), fp32 on the CPU and on older GPUs; the choice and its reason
are logged and recorded. A user's first GPU run was fp32: 10x slower than --dtype bf16 and than the peers.

The GPU cases run on this CPU machine with torch.cuda's queries answered by a fake card."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from entrenar import cli
from entrenar.cli import models as model_commands
from entrenar.devices import resolve_dtype
from entrenar.train.config import TrainConfig
from tests.helpers.cli import run_cli as main
from tests.test_train_cli import byte_model_dir, byte_shards, pretrain_args  # noqa: F401 (fixtures)


def fake_gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)


@pytest.mark.parametrize("capability, name, device, expect", [
    ((9, 0), "NVIDIA H100 80GB HBM3", "cuda", "bf16"), ((8, 0), "NVIDIA A100", "cuda:1", "bf16"),
    ((7, 5), "Tesla T4", "cuda", "fp32"), ((9, 0), "NVIDIA H200", "cpu", "fp32")])
def test_auto_is_bf16_exactly_on_a_gpu_with_native_bf16(monkeypatch, capability, name, device, expect):
    fake_gpu(monkeypatch, capability, name)
    dtype, why = resolve_dtype("auto", device)
    assert dtype == expect and why.startswith("--dtype auto")
    if expect == "bf16":
        assert name in why and "2e-2" in why
    cfg = TrainConfig(device=device)  # the dataclass resolves it at once: no reader ever sees "auto"
    assert (cfg.dtype, cfg.dtype_reason) == (dtype, why)
    assert TrainConfig(device=device, dtype="fp32").dtype == "fp32"  # an explicit choice is kept


def test_every_command_with_a_dtype_defaults_to_auto():
    parser = cli.build_parser()
    for command in ("pretrain", "finetune", "eval", "verify", "qa", "generate"):
        sub = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == command)[1]
        opt = next(a for a in sub._actions if "--dtype" in a.option_strings)
        assert opt.default == "auto" and "auto" in opt.choices, command
        assert "bf16 on a CUDA device with native bf16" in opt.help and "(auto)" in opt.help, command


def test_pretrain_logs_and_records_the_chosen_dtype(tmp_path, byte_model_dir, byte_shards, capsys):  # noqa: F811
    out = tmp_path / "run"
    code, result, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=2), capsys)
    assert code == 0, err
    assert "dtype: fp32 (--dtype auto: fp32 on the CPU)" in err
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["dtype"], config["dtype_reason"]) == ("fp32", "--dtype auto: fp32 on the CPU")
    code, result, err = main(["eval", "--model", str(out), "--data", str(byte_shards), "--seq-len", "32",
                              "--max-batches", "2", "--json"], capsys)
    assert code == 0 and result["dtype"] == "fp32", err


def test_generate_loads_bf16_weights_on_a_bf16_gpu_and_the_stored_dtype_on_the_cpu(monkeypatch):
    seen = []
    monkeypatch.setattr("entrenar.peft.load.load_model_with_adapter",
                        lambda spec, adapter, device, dtype, force_base: seen.append((device, dtype)))
    args = argparse.Namespace(model="m", adapter=None, force_base=False, dtype="auto", json=True)
    model_commands.load_generation_model(args, "cpu")
    fake_gpu(monkeypatch, (9, 0), "NVIDIA H100")
    model_commands.load_generation_model(args, "cuda")
    args.dtype = "fp32"
    model_commands.load_generation_model(args, "cuda")
    assert seen == [("cpu", None), ("cuda", torch.bfloat16), ("cuda", torch.float32)]
