"""--device auto, every computing command's default (issue 36 item 1): a user on a GPU host trained on the CPU
(53 min of CPU time, still in step 1) because the default was cpu. auto = this process's GPU when CUDA is available
(cuda:LOCAL_RANK under torchrun, else cuda:0), the CPU otherwise; the choice and why are logged and in run.json.

The GPU cases run on this CPU machine with torch.cuda's queries answered by fake cards: nothing here needs CUDA."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from entrenar import cli
from entrenar.cli.main import _resolve_common
from entrenar.devices import resolve_device_reason, resolve_dtype
from entrenar.errors import InputError
from entrenar.train.config import TrainConfig
from tests.helpers.cli import run_cli as main
from tests.test_train_cli import byte_model_dir, byte_shards, pretrain_args  # noqa: F401 (fixtures)

COMPUTING = ("pretrain", "finetune", "eval", "verify", "qa", "generate")


def _index(device: int | str | torch.device | None) -> int:
    return 0 if device is None else torch.device("cuda", device).index if isinstance(device, int) else \
        (torch.device(device).index or 0)


def fake_gpus(monkeypatch, capabilities: tuple[tuple[int, int], ...] = ((9, 0), (9, 0))) -> None:
    """Cards 0..N-1 with these compute capabilities, named 'FAKE GPU <index>'."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capabilities[_index(device)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"FAKE GPU {_index(device)}")


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_auto_is_the_first_gpu_in_a_plain_process(monkeypatch):
    fake_gpus(monkeypatch)
    device, why = resolve_device_reason("auto")
    assert device == "cuda:0"
    assert why == "--device auto: FAKE GPU 0, CUDA available"


def test_auto_is_the_local_ranks_gpu_under_torchrun(monkeypatch):
    fake_gpus(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    device, why = resolve_device_reason("auto")
    assert device == "cuda:1"
    assert "FAKE GPU 1" in why and "LOCAL_RANK=1" in why


def test_dtype_auto_reads_the_resolved_device(monkeypatch):
    """LOCAL_RANK=1's card is a T4 (no native bf16) beside an H100: --dtype auto must judge card 1, not card 0."""
    fake_gpus(monkeypatch, ((9, 0), (7, 5)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = TrainConfig()  # both auto
    assert (cfg.device, cfg.dtype) == ("cuda:1", "fp32")
    assert "LOCAL_RANK=1" in cfg.device_reason and "cuda:1 (no native bf16)" in cfg.dtype_reason
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = TrainConfig()
    assert (cfg.device, cfg.dtype) == ("cuda:0", "bf16")
    assert resolve_dtype("auto", cfg.device)[0] == "bf16"


def test_more_local_ranks_than_gpus_is_exit_2_naming_the_cause(monkeypatch):
    fake_gpus(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(InputError, match=r"LOCAL_RANK=2 but this node has 2 CUDA device\(s\).*--device cpu"):
        resolve_device_reason("auto")
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(InputError, match="LOCAL_RANK='one' is not an integer"):
        resolve_device_reason("auto")


@pytest.mark.parametrize("local_rank", [None, "1"])
def test_without_cuda_auto_is_the_cpu_also_under_torchrun(monkeypatch, local_rank):
    """A torchrun job on a CPU host (gloo) resolves to the CPU, whatever its LOCAL_RANK."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert resolve_device_reason("auto") == ("cpu", "--device auto: no CUDA device")


def test_the_cli_resolves_logs_and_keeps_the_reason(monkeypatch, capsys):
    fake_gpus(monkeypatch)
    args = argparse.Namespace(device="auto", kernels="torch")
    _resolve_common(args)
    assert (args.device, args.device_reason) == ("cuda:0", "--device auto: FAKE GPU 0, CUDA available")
    assert "device: cuda:0 (--device auto: FAKE GPU 0, CUDA available)" in capsys.readouterr().err
    args = argparse.Namespace(device="cpu", kernels="torch")  # --device cpu stays, and is not announced
    _resolve_common(args)
    assert (args.device, args.device_reason) == ("cpu", "--device cpu as given")
    assert "device:" not in capsys.readouterr().err


def test_every_computing_command_defaults_to_auto():
    defaults: dict[str, str] = {}

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for action in p._actions:
            if "--device" in action.option_strings:
                defaults[path] = action.default
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}".strip())

    walk(cli.build_parser(), "")
    assert set(COMPUTING) <= set(defaults), set(COMPUTING) - set(defaults)
    assert all(d == "auto" for d in defaults.values()), defaults


def test_pretrain_logs_and_records_the_chosen_device(tmp_path, byte_model_dir, byte_shards, capsys,  # noqa: F811
                                                     monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU host CI is, stated
    out = tmp_path / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=1), capsys)
    assert code == 0, err
    assert "device: cpu (--device auto: no CUDA device)" in err
    assert err.index("device: cpu") < err.index("dtype: fp32")  # at the start, before --dtype auto's line
    config = json.loads((out / "run.json").read_text())["config"]
    assert (config["device"], config["device_reason"]) == ("cpu", "--device auto: no CUDA device")
    out2 = tmp_path / "run2"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out2, steps=1, extra=("--device", "cpu")),
                             capsys)
    assert code == 0, err
    config = json.loads((out2 / "run.json").read_text())["config"]
    assert (config["device"], config["device_reason"]) == ("cpu", "--device cpu as given")


def test_torchrun_context_takes_the_local_ranks_gpu(monkeypatch):
    """init_from_env with what auto resolved to under LOCAL_RANK=1 joins on cuda:1 with NCCL (no process group is
    really made: its calls are recorded)."""
    import torch.distributed as dist
    from torch.distributed import device_mesh

    from entrenar.train import distributed

    fake_gpus(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls: dict = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.setdefault("set_device", dev))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.update(backend=backend, device_id=kw.get("device_id")))
    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda kind, shape, **kw: calls.setdefault("mesh", kind))
    monkeypatch.setattr(distributed, "_CURRENT", distributed.DistContext())
    device, _ = resolve_device_reason("auto")
    ctx = distributed.init_from_env(device)
    assert ctx.device == torch.device("cuda", 1) and calls["set_device"] == torch.device("cuda", 1)
    assert (calls["backend"], calls["device_id"], calls["mesh"]) == ("nccl", torch.device("cuda", 1), "cuda")
