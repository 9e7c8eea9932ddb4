"""The command line's structure: every command's --device goes through the one validator. (That library
modules never import the CLI -- issue 11: generate.py and merge.py imported `cli.add_command`, a cycle --
is tests/test_layers.py's: the cli package is the top layer.)"""

from __future__ import annotations

import pytest

from entrenar import cli
from tests.test_layers import MODULES


def _device_actions(parser) -> dict[str, str]:
    """{command path: --device default} for every (sub)command that has --device."""
    out: dict[str, str] = {}

    def walk(p, path: str) -> None:
        for action in p._actions:
            if "--device" in action.option_strings:
                out[path] = action.default
            if action.__class__.__name__ == "_SubParsersAction":
                for name, child in action.choices.items():
                    walk(child, f"{path} {name}".strip())

    walk(parser, "")
    return out


def test_every_device_option_comes_from_the_shared_helper():
    devices = _device_actions(cli.build_parser())
    assert {"pretrain", "finetune", "eval", "verify", "qa", "generate"} <= set(devices)
    for path, default in devices.items():  # issue 36 item 1: a GPU host computes on its GPU by default
        assert default == "auto", (path, default)
    text = "\n".join(p.read_text(encoding="utf-8") for name, p in MODULES.items() if name != "entrenar.cli.registry")
    assert text.count('"--device"') == 0, "a command declares --device itself instead of add_device_option"


@pytest.mark.parametrize("argv", [
    ["eval", "--model", "m", "--data", "d", "--device", "tpu"],
    ["generate", "--model", "m", "--prompt", "hi", "--device", "cuda:x"],
    ["verify", "--model", "m", "--device", "gpu"],
    ["finetune", "--model", "m", "--data", "d", "--out", "o", "--device", "bogus"],
])
def test_bad_device_is_one_message_everywhere(argv, capsys):
    assert cli.main(argv) == 2
    assert "not a device; use cpu, cuda, cuda:N or auto" in capsys.readouterr().err


def test_resolve_device_rules(monkeypatch):
    import torch

    from entrenar.devices import resolve_device
    from entrenar.errors import InputError

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("CPU") == "cpu"
    with pytest.raises(InputError, match="no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100")
    assert resolve_device("auto") == "cuda:0"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(InputError, match="2 CUDA device"):
        resolve_device("cuda:2")
