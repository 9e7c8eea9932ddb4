"""The preflight inside `entrenar finetune`: a planted defect in the training path stops the run
before step 1 with exit 3, GUARD-PARITY and the op named; a clean path trains."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import entrenar.model as model_mod
from entrenar import cli
from entrenar.formats import save_hf_dir
from entrenar.kernels import TORCH_OPS
from entrenar.kernels.rope import rope_reference
from tests.helpers.models import tiny_causal_lm, tiny_config


@pytest.fixture(scope="module")
def tiny_dir_and_data(tmp_path_factory):
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")  # tokenizer only (GGUF metadata): chat template + ids
    m = tiny_causal_lm(tiny_config("qwen2", vocab_size=len(tok), hidden_size=32, intermediate_size=64, rope_theta=1e6,
                                   max_position_embeddings=256), 0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    root = tmp_path_factory.mktemp("preflight")
    model_dir = save_hf_dir(m, root / "model", tok)
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "completion": f"{w}!"}) + "\n"
                            for w in ("one", "two", "three", "four", "five", "six")))
    return model_dir, data


def _finetune(model_dir, data, out, capsys) -> tuple[int, dict, str]:
    code = cli.main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--steps", "2",
                     "--batch-size", "2", "--max-seq-len", "64", "--val-fraction", "0.34", "--kernels", "triton",
                     "--lr", "1e-4", "--json"])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else {}, captured.err


def _route_triton(monkeypatch, ops):
    """kernels='triton' runs ``ops`` (torch references, possibly with a planted defect); 'torch' stays clean."""
    monkeypatch.setattr(model_mod, "get_ops", lambda kind: TORCH_OPS if kind == "torch" else ops)


def test_preflight_stops_finetune_with_rope_defect_before_step_1(tiny_dir_and_data, tmp_path, capsys,
                                                                  monkeypatch):
    model_dir, data = tiny_dir_and_data
    swapped = dataclasses.replace(TORCH_OPS, rope=lambda q, k, cos, sin, style: rope_reference(
        q, k, cos, sin, "gptj" if style == "neox" else "neox"))
    _route_triton(monkeypatch, swapped)
    out = tmp_path / "run"
    code, result, err = _finetune(model_dir, data, out, capsys)
    assert code == 3, err
    assert result["guard"] == "GUARD-PARITY"
    assert "layers.0.q_rope" in err and "RoPE" in err
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()  # stopped before step 1


def test_clean_triton_path_passes_preflight_and_trains(tiny_dir_and_data, tmp_path, capsys, monkeypatch):
    model_dir, data = tiny_dir_and_data
    _route_triton(monkeypatch, dataclasses.replace(TORCH_OPS))
    out = tmp_path / "run"
    code, result, err = _finetune(model_dir, data, out, capsys)
    assert result.get("guard") != "GUARD-PARITY", err
    if code == 3:  # a random tiny model may trip GUARD-INIT-LOSS, which runs after the preflight passed
        assert result["guard"] == "GUARD-INIT-LOSS", err
        return
    assert code == 0, err
    pre = json.loads((out / "preflight.json").read_text())
    assert pre["verify"]["ok"] and pre["verify"]["kernels"] == "triton"
    assert [s["name"] for s in pre["verify"]["sequences"]] == ["short", "long"]


def test_verify_import_error_stops_finetune_with_the_cause(tiny_dir_and_data, tmp_path, capsys, monkeypatch):
    """An ImportError inside entrenar.verify used to turn the preflight off silently (run trained, preflight.json
    said 'skipped'); now it stops the run before step 1 naming the failed import."""
    import sys

    import entrenar.cli.verify  # noqa: F401 -- the CLI registers `verify` from it, before the patch

    model_dir, data = tiny_dir_and_data
    _route_triton(monkeypatch, dataclasses.replace(TORCH_OPS))  # a clean path: only the import is broken
    monkeypatch.setitem(sys.modules, "entrenar.verify", None)  # `from ..verify import preflight` -> ImportError
    out = tmp_path / "run"
    code, result, err = _finetune(model_dir, data, out, capsys)
    assert code == 3 and result["guard"] == "GUARD-PARITY", err
    assert "entrenar.verify does not import" in err and "ModuleNotFoundError" in err and "--no-preflight" in err
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()
