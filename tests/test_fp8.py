"""--dtype fp8 (train/fp8.py): the swap, its device rule, and the preflight's fp8 pass (torchao's float8 in
emulation on the CPU: the same casts and scales, the matmul in torch)."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from entrenar.errors import GuardError, InputError
from entrenar.train import fp8
from entrenar.verify import preflight, rel_l2
from entrenar.verify.bisect import BLOCK_ROUNDING, bounds_for
from tests import test_train_cli
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.test_train_cli import main, pretrain_args
from tests.test_verify import byte_tokenizer as byte_tok


def tiny(num_layers: int = 2):
    return tiny_causal_lm(tiny_config("llama", vocab_size=272, num_layers=num_layers), 0, norm_std=0.1)


def test_every_block_linear_is_swapped_and_keeps_its_parameters():
    model = tiny()
    before = {n: p for n, p in model.named_parameters()}
    names = fp8.to_float8(model, emulate=True)
    expected = [f"model.layers.{i}.{m}" for i in range(2) for m in
                ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert sorted(names) == sorted(expected)
    assert sorted(fp8.float8_linear_names(model)) == sorted(expected)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)  # same tensors, same names
    assert model.lm_head is not None and type(model.lm_head) is torch.nn.Linear  # the head stays bf16


def test_a_linear_whose_width_scaled_mm_cannot_take_stays():
    model = tiny_causal_lm(tiny_config("llama", vocab_size=272, intermediate_size=120), 0)
    names = fp8.to_float8(model, emulate=True)
    assert not any("mlp" in n for n in names) and any("q_proj" in n for n in names)


def test_fp8_is_exit_2_off_a_float8_gpu_and_outside_full_mode():
    with pytest.raises(InputError, match="compute capability >= 8.9") as err:
        fp8.require_fp8("cpu", "full")
    assert err.value.exit_code == 2 and "--dtype bf16-pure" in str(err.value)
    with pytest.raises(InputError, match="--mode full"):
        fp8.require_fp8("cpu", "lora")


def _k(model_fp8, model_ref, x) -> float:
    """relL2 of the fp8 logits from float64 in units of e4m3's u sqrt(depth + 1) (the bound's k)."""
    ref = model_ref.double()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model_fp8(x).float()
    with torch.no_grad():
        exact = ref(x)
    depth = model_ref.cfg.num_layers
    return rel_l2(out.double(), exact) / (BLOCK_ROUNDING["fp8"] * math.sqrt(depth + 2))


def test_measured_fp8_rounding_leaves_the_bound_its_margin():
    """The fp8 bound is 2 u sqrt(depth + 2) at the logits: the rounding measured here (and 0.52-0.72 on an H200
    at 24 blocks, train/fp8.py) is well inside, and bf16 alone is far below it (the swap is what moves it)."""
    x = torch.randint(0, 272, (2, 96), generator=torch.Generator().manual_seed(0))
    model = tiny(4)
    ref = tiny(4)
    fp8.to_float8(model, emulate=True)
    k = _k(model, ref, x)
    bf16_k = _k(tiny(4), ref, x)
    assert k < 1.0, k  # the claimed margin: >= 2x below DEPTH_C_OF["fp8"] = 2
    assert bf16_k < k / 3
    assert bounds_for("fp8", ref.cfg).logits == pytest.approx(max(0.25, 2 * 2 ** -4 * math.sqrt(6)))


def test_preflight_checks_the_converted_model_with_fp8_bounds():
    model = tiny()
    out = preflight(model, byte_tok(), "cpu", "bf16", "torch", convert=functools.partial(fp8.to_float8, emulate=True))
    assert out["ok"] and out["dtype"] == "fp8"
    assert out["unconverted"]["ok"] and out["fp32_twin"]["ok"]  # the bf16 and fp32 passes ran first
    assert len(fp8.float8_linear_names(model)) == 14  # the preflight converted the model it checked
    fp8_err = max(s["logits_rel_l2"] for s in out["sequences"])
    bf16_err = max(s["logits_rel_l2"] for s in out["unconverted"]["sequences"])
    assert fp8_err > 3 * bf16_err  # the last pass measured the float8 path, not the bf16 one again


def test_a_broken_float8_path_stops_the_preflight_at_its_op(monkeypatch):
    """A float8 linear whose output scale is off by 2x (a wrong inverse scale) is GUARD-PARITY at the first
    swapped op, in the fp8 pass."""
    def convert_broken(model):
        names = fp8.to_float8(model, emulate=True)
        for name in names:
            mod = model.get_submodule(name)
            forward = mod.forward
            mod.forward = lambda x, forward=forward: 2 * forward(x)
        return names

    with pytest.raises(GuardError) as err:
        preflight(tiny(), byte_tok(), "cpu", "bf16", "torch", convert=convert_broken)
    e = err.value
    assert e.guard_id == "GUARD-PARITY" and "fp8" in str(e)
    assert e.details["first_divergent"]["name"] in ("layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj")

byte_model_dir, byte_shards = test_train_cli.byte_model_dir, test_train_cli.byte_shards  # the CLI tests' fixtures


def _float8_on_this_cpu(monkeypatch) -> list:
    """What the GPU path does, on the CPU: the device rule passes, the swap runs torchao in emulation, and each
    block's compile is recorded instead of run (inductor on the CPU is a C++ build)."""
    from entrenar.model import Block

    compiled: list = []
    monkeypatch.setattr(fp8, "fp8_unsupported_reason", lambda device: None)
    monkeypatch.setattr(fp8, "to_float8", functools.partial(fp8.to_float8, emulate=True))
    monkeypatch.setattr(Block, "compile", lambda self, *a, **k: compiled.append(self.layer))
    return compiled


def test_fp8_policy_casts_swaps_once_and_compiles_each_block(monkeypatch):
    from entrenar.train.precision import precision_policy

    compiled = _float8_on_this_cpu(monkeypatch)
    policy = precision_policy("fp8")
    assert policy.master_dtype == torch.bfloat16 and policy.compute_bf16
    model = policy.prepare_model(tiny())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert len(fp8.float8_linear_names(model)) == 14 and compiled == [0, 1]
    swaps: list = []
    monkeypatch.setattr(fp8, "to_float8", lambda m, **k: swaps.append(m))
    policy.prepare_model(model)  # converted already (by the preflight's last pass): not swapped again
    assert swaps == []


def test_cli_fp8_runs_the_converted_preflight_trains_and_saves(tmp_path, byte_model_dir, byte_shards, capsys,
                                                              monkeypatch):
    """`pretrain --dtype fp8` end to end (float8 emulated): the preflight's last pass is fp8, the run trains with
    Float8Linear blocks, run.json says fp8, checkpoints and final/ are bf16 tensors under the usual names."""
    from safetensors.torch import load_file

    compiled = _float8_on_this_cpu(monkeypatch)
    out = tmp_path / "run"
    code, summary, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=3, extra=("--dtype", "fp8")),
                              capsys)
    assert code == 0, err
    pre = json.loads((out / "preflight.json").read_text())["verify"]
    assert pre["dtype"] == "fp8" and pre["unconverted"]["ok"] and pre["fp32_twin"]["ok"]
    assert json.loads((out / "run.json").read_text())["config"]["dtype"] == "fp8"
    assert compiled == [0, 1]
    final = load_file(str(out / "final" / "model.safetensors"))
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    assert "model.layers.0.self_attn.q_proj.weight" in final
    assert math.isfinite(summary["final_train_loss"])


def test_cli_fp8_is_exit_2_on_the_cpu(tmp_path, byte_model_dir, byte_shards, capsys):
    out = tmp_path / "run"
    code, result, _ = main(pretrain_args(byte_model_dir, byte_shards, out, steps=3, extra=("--dtype", "fp8")),
                           capsys)
    assert code == 2 and "compute capability >= 8.9" in result["error"] and not out.exists()
