"""`entrenar qa --dtype / --kernels / --device` reach the model the golden prompts run on.

qa's own gates are tested in test_qa*.py; generating its golden prompts takes ~20 s even on a tiny model
here, so these tests replace the prompt run by a recorder of the model it was given (the load, the flags and
the JSON line are the real CLI's)."""

from __future__ import annotations

import pytest
import torch

from entrenar.verify import qa
from tests.helpers.cli import run_cli as main
from tests.test_cli_flags_documented import _generate_dir


@pytest.fixture(scope="module")
def qa_model_dir(tmp_path_factory):
    return _generate_dir(tmp_path_factory.mktemp("qa") / "m")


@pytest.mark.parametrize("flags,dtype,kernels", [
    ((), torch.float32, "torch"),  # defaults: fp32, auto = torch on a CPU
    (("--dtype", "bf16"), torch.bfloat16, "torch"),
    (("--dtype", "fp16", "--kernels", "torch"), torch.float16, "torch"),
])
def test_qa_runs_the_prompts_on_the_dtype_kernels_and_device_asked(qa_model_dir, monkeypatch, capsys, flags, dtype,
                                                                   kernels):
    seen = {}

    def record(model, tokenizer, prompts=qa.GOLDEN):
        seen.update(dtypes={p.dtype for p in model.parameters()}, kernels=model.kernels,
                    devices={p.device.type for p in model.parameters()}, vocab=len(tokenizer))
        return {"ok": True, "exit_code": 0, "prompts": len(prompts)}

    monkeypatch.setattr(qa, "run_qa", record)
    code, result, err = main(["qa", "--model", str(qa_model_dir), "--device", "cpu", *flags, "--json"], capsys)
    assert code == 0 and result["ok"], err
    assert seen["dtypes"] == {dtype} and seen["kernels"] == kernels and seen["devices"] == {"cpu"}
    assert result["prompts"] == len(qa.GOLDEN) and result["model"] == str(qa_model_dir)


def test_qa_refuses_a_dtype_it_does_not_offer(qa_model_dir, capsys):
    code, result, err = main(["qa", "--model", str(qa_model_dir), "--dtype", "bf16-pure", "--json"], capsys)
    assert code == 2 and "--dtype" in result["error"], err
