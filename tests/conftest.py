"""Shared fixtures. The packaged real models load once per session (fp32, read-only: tests that
train or mutate a model must ``copy.deepcopy`` it first). Commands that load them run under
``flock /tmp/entrenar-real.lock``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.models import make_hf_model

SMOLLM = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"

# The files that take minutes on the 2-core CI machine, longest first (durations of `make test`'s --durations): under
# `--dist loadfile --no-loadscope-reorder` (Makefile) pytest-xdist hands files out in collection order, so these start
# first and the many short files even out the two workers' ends. xdist's default order (files with the most tests
# first) left these few-test files for last: a worker ran test_train_real.py and test_peft_real.py alone for
# minutes at the end of the suite.
SLOW_FILES_FIRST = ("test_distributed.py", "test_multinode.py", "test_train_real.py", "test_peft_real.py",
                    "test_distributed_stops.py", "test_qlora_long_system_real.py", "test_export_real.py",
                    "test_dpo_train.py", "test_generate_batch.py", "test_parity_bounds.py", "test_generate_static.py",
                    "test_verify_real.py", "test_generate.py", "test_eval_task_real.py", "test_packaged.py",
                    "test_dpo_bench.py", "test_qa.py", "test_generate_tools.py", "test_engine.py")


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture()
def poisoned_outputs(monkeypatch):
    """Every Triton kernel output starts as NaN (-7 for integers): a kernel that leaves a row unwritten
    fails its comparison. Kernel test modules use it with pytestmark = pytest.mark.usefixtures(...)."""
    from entrenar.kernels import _common

    def nan_empty(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        return t.fill_(float("nan")) if dtype.is_floating_point else t.fill_(-7)

    monkeypatch.setattr(_common, "empty", nan_empty)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF (llama architecture, Q4_1 + Q8_0 + F32)."""
    from entrenar.model_spec import packaged_path

    return packaged_path(SMOLLM)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    """The packaged Qwen2.5-Coder-0.5B-Instruct GGUF, assembled once into the cache directory."""
    from entrenar.model_spec import packaged_path

    return packaged_path(QWEN)


@pytest.fixture(scope="session")
def smollm_model(smollm_path):
    """Our CausalLM of the packaged SmolLM2 (fp32, eval mode). Do not modify it in place."""
    from entrenar.formats import load_model

    return load_model(smollm_path, dtype=torch.float32)


@pytest.fixture(scope="session")
def qwen_model(qwen_path):
    """Our CausalLM of the packaged Qwen2.5-Coder-0.5B (fp32, ~2 GB, eval mode). Do not modify it."""
    from entrenar.formats import load_model

    return load_model(qwen_path, dtype=torch.float32)


@pytest.fixture()
def tiny_hf_dir(tmp_path):
    """Factory: (transformers model, directory it was saved to with save_pretrained)."""
    counter = iter(range(1000))

    def make(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
        model = make_hf_model(arch, seed, **overrides).to(dtype)
        out = tmp_path / f"hf-{arch}-{next(counter)}"
        model.save_pretrained(out)
        return model, out

    return make
