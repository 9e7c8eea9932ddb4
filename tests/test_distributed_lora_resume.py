"""A LoRA run under torchrun resumes from its own (sharded) checkpoint: the checkpoint holds the adapter's tensors
only, so the restore must not ask it for the frozen base (it did: "Missing key(s) in state_dict: model.embed_tokens
.weight, ..."). SFT here; tests/test_grpo_ddp.py resumes GRPO the same way."""

from __future__ import annotations

from tests.helpers.cli import run_cli_process
from tests.test_distributed import (  # noqa: F401
    _rewind,
    base_model,
    close,
    finetune_args,
    losses,
    ok,
    sft_data,
    weights,
    worst_rel,
)


def test_lora_under_two_ranks_resumes_its_own_checkpoint(tmp_path, base_model, sft_data):  # noqa: F811
    lora = ("--mode", "lora", "--rank", "4", "--lr", "2e-3", "--parallel", "ddp")
    run, rewound = tmp_path / "run", tmp_path / "rewound"
    ok(run_cli_process(finetune_args(base_model, sft_data, run, 2, lora), nproc=2))
    _rewind(run, rewound, 5)
    res = ok(run_cli_process(finetune_args(base_model, sft_data, rewound, 2, (*lora, "--resume", "auto")), nproc=2))
    assert res["start_step"] == 5
    assert close(losses(rewound), losses(run))
    a, b = weights(rewound / "final/adapter_model.safetensors"), weights(run / "final/adapter_model.safetensors")
    assert len(a) > 0 and worst_rel(a, b) <= 1e-5
