"""--dtype bf16-weights (train/precision.py) and the Trainer's step timing without a device sync per step."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from entrenar.cli.train import add_options
from entrenar.train import checkpoint as ckpt_mod
from entrenar.train import loop
from entrenar.train.config import TrainConfig
from entrenar.train.metrics import peak_flops, read_jsonl
from entrenar.train.precision import BF16Weights, precision_policy, verify_dtype
from tests import test_train_loop as T

CPU = torch.device("cpu")


def _micro(n_micro: int = 2, batch: int = 2, seed: int = 4) -> list[dict]:
    loader = T.ListLoader(T.make_samples(8, seed=seed), batch, seed=0)
    return [loader.next_batch() for _ in range(n_micro)]


def _backward(model, micro, precision=None, dtype="bf16-weights") -> float:
    total = sum(T.CE.count(b) for b in micro)
    with precision.compute() if precision is not None else contextlib.nullcontext():
        return float(loop.backward_micro_batches(model, micro, CPU, dtype, total)) / total


def test_forward_and_backward_run_on_bf16_copies_masters_stay_fp32():
    model = T.tiny_model(2)
    masters = dict(model.named_parameters())
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, _a: seen.append(m.weight.dtype))
    precision = BF16Weights(model)
    _backward(model, _micro(), precision)
    assert seen == [torch.bfloat16, torch.bfloat16]  # each micro-batch's forward saw the bf16 copy
    for name, p in model.named_parameters():  # the masters are back in place, fp32, with fp32 grads
        assert p is masters[name] and p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name
    assert all(c.grad is None for c in precision.copies)  # bf16 grads handed over as they arrived


def test_grads_are_summed_over_micro_batches_in_fp32():
    micro = _micro()
    model = T.tiny_model(2)
    precision = BF16Weights(model)
    per_micro = []
    for b in micro:  # each micro-batch alone, normalised by the step's total as the step does
        model.zero_grad(set_to_none=True)
        total = sum(T.CE.count(x) for x in micro)
        with precision.compute():
            loop.backward_micro_batches(model, [b], CPU, "bf16-weights", total)
        per_micro.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    _backward(model, micro, precision)
    for name, p in model.named_parameters():
        # exactly the fp32 sum of the two (bf16-accumulated grads would be rounded to bf16)
        assert torch.equal(p.grad, per_micro[0][name] + per_micro[1][name]), name


def test_swap_is_undone_when_the_step_raises():
    model = T.tiny_model(2)
    before = {n: p for n, p in model.named_parameters()}
    precision = BF16Weights(model)
    with pytest.raises(RuntimeError, match="boom"), precision.compute():
        assert model.model.norm.weight.dtype == torch.bfloat16
        raise RuntimeError("boom")
    assert {n: p for n, p in model.named_parameters()} == before
    assert not precision.active


def test_activation_checkpointing_recomputes_with_the_same_bf16_weights():
    micro = _micro()
    grads = []
    for checkpointing in (False, True):
        model = T.tiny_model(2)
        model.activation_checkpointing = checkpointing
        _backward(model, micro, BF16Weights(model))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_copies_are_refreshed_from_the_masters_each_step():
    model = T.tiny_model(2)
    precision = BF16Weights(model)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)  # an optimizer update of the master
    with precision.compute():
        assert torch.equal(model.model.norm.weight, (3.0 * torch.ones(32)).to(torch.bfloat16))


def test_bf16_weights_loss_and_grads_close_to_fp32():
    micro = _micro()
    ref = T.tiny_model(2)
    loss_ref = _backward(ref, micro, None, "fp32")
    model = T.tiny_model(2)
    loss = _backward(model, micro, BF16Weights(model))
    assert loss == pytest.approx(loss_ref, rel=1e-2)
    g_ref = torch.cat([p.grad.flatten() for p in ref.parameters()])
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float((g - g_ref).norm() / g_ref.norm()) < 5e-2


@pytest.mark.parametrize("dtype, stored", [("bf16-weights", torch.float32), ("bf16-pure", torch.bfloat16)])
def test_bf16_run_resumes_exactly(tmp_path, dtype, stored):
    """bf16-weights keeps fp32 masters, bf16-pure bf16 weights: either way the same bits after a resume."""
    T.run(tmp_path / "full", 4, save_every=2, dtype=dtype)
    T.run(tmp_path / "part", 2, save_every=2, dtype=dtype)
    T.run(tmp_path / "part", 4, save_every=2, dtype=dtype, resume="auto")
    a = ckpt_mod.load_checkpoint(tmp_path / "full" / "checkpoints" / "latest")["model"]
    b = ckpt_mod.load_checkpoint(tmp_path / "part" / "checkpoints" / "latest")["model"]
    assert all(a[k].dtype == stored and torch.equal(a[k], b[k]) for k in a)
    la = [r["loss"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")]
    lb = [r["loss"] for r in read_jsonl(tmp_path / "part" / "metrics.jsonl")]
    assert la == lb


def test_trainer_builds_copies_only_for_bf16_weights(tmp_path):
    for dtype, expect in (("fp32", False), ("bf16", False), ("bf16-weights", True)):
        T.run(tmp_path / dtype, 1, dtype=dtype)
        assert (precision_policy(dtype).weight_copies(T.tiny_model()) is not None) == expect
    with pytest.raises(ValueError, match="bf16w"):
        precision_policy("bf16w")


def test_dtype_choices_flag_help_and_dependent_checks(capsys):
    import argparse

    p = argparse.ArgumentParser()
    add_options(p, TrainConfig, "pretrain")
    assert p.parse_args(["--model", "x", "--dtype", "bf16-weights"]).dtype == "bf16-weights"
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "x", "--dtype", "bf16w"])
    p.print_help()
    help_text = " ".join(capsys.readouterr().out.split())
    from entrenar.train.config import DTYPE_GUIDE

    # the choice is offered in --help; what it means is the one guide `entrenar help dtype` prints
    assert "bf16-weights" in help_text and "2.5e-2 relL2 from fp32, outside" in " ".join(DTYPE_GUIDE["bf16-weights"].split())
    assert verify_dtype("bf16-weights") == "bf16" and verify_dtype("fp32") == "fp32"
    assert precision_policy("bf16-weights").autocast(CPU).fast_dtype == torch.bfloat16
    assert precision_policy("bf16-weights").autocast(CPU)._enabled and not precision_policy("fp32").autocast(CPU)._enabled


def test_mfu_of_bf16_weights_uses_the_bf16_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_a: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    assert peak_flops(cuda, "bf16-weights") == peak_flops(cuda, "bf16") == peak_flops(cuda, "bf16-pure") == 989.4e12


# ---- step timing: one readback per step, no synchronize -------------------------------------------
def _trainer(tmp_path, **overrides):
    cfg = TrainConfig(**{"steps": 6, "batch_size": 2, "seq_len": 32, "lr": 1e-3, "warmup": 1, "seed": 5,
                         **overrides})
    return loop.build_trainer(T.tiny_model(), T.ListLoader(T.make_samples(16), 2, seed=3),
                        T.ListLoader(T.make_samples(8, seed=99), 4), cfg, tmp_path, log=T.quiet)


def test_step_time_runs_from_the_previous_readback_when_steps_follow(tmp_path):
    tr = _trainer(tmp_path)
    now = time.perf_counter()
    first = tr.step_time(1, now - 1.0, now - 0.5)  # no previous step: from its own start
    assert first >= 1.0
    anchor = tr._timing[1]
    assert tr.step_time(2, anchor + 0.1, anchor + 0.25) == pytest.approx(0.25)  # readback to readback
    assert tr.step_time(3, anchor + 0.3, anchor + 0.75) == pytest.approx(0.5)
    tr.eval_history.append({"step": 3})  # an eval between steps 3 and 4: not counted in step 4
    now = time.perf_counter()
    assert tr.step_time(4, now - 0.2, now - 0.1) == pytest.approx(0.2, abs=0.05)
    anchor = tr._timing[1]
    tr.saves += 1  # a checkpoint started between steps 4 and 5 (Trainer.save counts it): likewise
    now = time.perf_counter()
    assert tr.step_time(5, now - 0.2, anchor + 1.0) == pytest.approx(0.2, abs=0.05)
    assert tr.step_time(7, anchor + 2.0, anchor + 3.0) < 1.0  # not step 6: not consecutive


def test_slow_evals_are_not_in_the_step_times(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, eval_every=2)
    real_eval = loop.evaluate

    def slow_eval(*a, **kw):
        time.sleep(0.6)
        return real_eval(*a, **kw)

    monkeypatch.setattr(loop, "evaluate", slow_eval)
    t0 = time.perf_counter()
    summary = tr.fit()
    wall = time.perf_counter() - t0
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    seconds = [r["tokens"] / r["tok_s"] if i == 0 else (r["tokens"] - recs[i - 1]["tokens"]) / r["tok_s"]
               for i, r in enumerate(recs)]
    # 3 evals of >= 0.6 s each, none inside a step: the steps' time leaves all three out of the wall time
    # (not "every step < 0.5 s": on a loaded 2-core CI machine a tiny step itself can take that long)
    assert len(recs) == 6
    assert sum(seconds) == pytest.approx(tr.step_seconds) and tr.step_seconds <= wall - 3 * 0.6
    assert summary["tok_s"] == pytest.approx(summary["tokens"] / tr.step_seconds)


# ---- the update queued before the readback (fused AdamW with found_inf) ---------------------------------
def _fused_optimizer(monkeypatch) -> None:
    """The fused AdamW the Trainer gets on CUDA, here on the CPU (torch's CPU fused kernel takes found_inf)."""
    from entrenar.train.optim import param_groups

    monkeypatch.setattr(loop, "build_optimizer", lambda model, lr, wd, **kw: torch.optim.AdamW(
        param_groups(model, wd), lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True))


def _never_queue(monkeypatch) -> None:
    monkeypatch.setattr(loop.Trainer, "queue_update", lambda self, loss_sum, grad_norm: False)


def _final(run_dir) -> tuple[dict, dict]:
    ck = ckpt_mod.load_checkpoint(run_dir / "checkpoints" / "latest")
    return ck["model"], ck["optimizer"]


def _same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    (ma, oa), (mb, ob) = a, b
    states = zip(oa["state"].values(), ob["state"].values(), strict=True)
    return (all(torch.equal(ma[k], mb[k]) for k in ma)
            and all(torch.equal(x[k], y[k]) for x, y in states for k in x))


@pytest.mark.parametrize("nan_call", [None, 2])
def test_queued_update_is_the_same_update(tmp_path, monkeypatch, nan_call):
    """Queued before the guards (and skipped on the device for a non-finite step) or applied after
    them: the same weights, optimizer state (step counts included) and skipped steps."""
    _fused_optimizer(monkeypatch)
    if nan_call:
        T._nan_at_call(monkeypatch, nan_call)
    calls = []
    orig = loop.Trainer.queue_update
    monkeypatch.setattr(loop.Trainer, "queue_update", lambda self, *a: calls.append(1) or orig(self, *a))
    T.run(tmp_path / "queued", 4, on_nonfinite="skip")
    assert len(calls) == 4
    if nan_call:
        T._nan_at_call(monkeypatch, nan_call)  # the counter starts again for the second run
    _never_queue(monkeypatch)
    T.run(tmp_path / "after", 4, on_nonfinite="skip")
    assert _same(_final(tmp_path / "queued"), _final(tmp_path / "after"))
    skipped = [[r["skipped"] for r in read_jsonl(tmp_path / d / "metrics.jsonl")] for d in ("queued", "after")]
    assert skipped[0] == skipped[1] == [False, nan_call == 2, False, False]


def test_queued_update_of_a_nonfinite_step_is_not_applied(tmp_path, monkeypatch):
    """GUARD-NONFINITE stop after a queued update: the kept checkpoint is step 3's state, exactly."""
    _fused_optimizer(monkeypatch)
    T.run(tmp_path / "three", 3, save_every=3)
    T._nan_at_call(monkeypatch, 4)
    with pytest.raises(loop.GuardError, match="GUARD-NONFINITE"):
        T.run(tmp_path / "stop", 8, save_every=0)
    assert _same(_final(tmp_path / "three"), _final(tmp_path / "stop"))


def test_update_not_queued_where_the_host_may_veto_it(tmp_path, monkeypatch):
    _fused_optimizer(monkeypatch)
    for policy in ("skip", "stop"):
        tr = _trainer(tmp_path / policy, on_spike=policy)
        assert tr.queue_update(torch.tensor(1.0), torch.tensor(1.0)) is False
    tr = _trainer(tmp_path / "b")
    assert tr.queue_update(torch.tensor(1.0), torch.tensor(1.0)) is True
    monkeypatch.undo()
    assert _trainer(tmp_path / "c").queue_update(torch.tensor(1.0), torch.tensor(1.0)) is False  # foreach (CPU)


@pytest.mark.parametrize("nf4", [False, True])
def test_bf16_weights_with_lora_and_qlora_adapters(nf4):
    """Only the adapters (fp32 masters) get gradients; the frozen base computes in bf16 too."""
    from entrenar.peft import apply_lora

    micro = _micro()
    model = apply_lora(T.tiny_model(2), rank=4, alpha=8.0, quantize_nf4=nf4, seed=0)
    ref = apply_lora(T.tiny_model(2), rank=4, alpha=8.0, quantize_nf4=nf4, seed=0)
    loss = _backward(model, micro, BF16Weights(model))
    loss_ref = _backward(ref, micro, None, "fp32")
    assert loss == pytest.approx(loss_ref, rel=2e-2)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert (p.grad is not None) == p.requires_grad == ("lora_" in name), name
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    g_ref = torch.cat([p.grad.flatten() for p in ref.parameters() if p.requires_grad])
    assert float(g_ref.norm()) > 0 and float((g - g_ref).norm() / g_ref.norm()) < 5e-2  # (A's grads are 0: B = 0)


# ---- --dtype bf16-pure: bf16 weights, gradients and AdamW state ----------------------------------------
def test_bf16_pure_trains_bf16_weights_and_adamw_state_close_to_fp32(tmp_path):
    """8 bytes per parameter (bf16 weight, gradient, two moments) instead of fp32's 16; the losses stay
    within bf16 rounding of an fp32 run of the same steps."""
    model = T.tiny_model()
    T.run(tmp_path / "pure", 4, save_every=4, dtype="bf16-pure", model=model)
    T.run(tmp_path / "fp32", 4, dtype="fp32")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ck = ckpt_mod.load_checkpoint(tmp_path / "pure" / "checkpoints" / "latest")
    assert ck["model"] and all(t.dtype == torch.bfloat16 for t in ck["model"].values())
    states = list(ck["optimizer"]["state"].values())
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in states)
    pure = [r["loss"] for r in read_jsonl(tmp_path / "pure" / "metrics.jsonl")]
    ref = [r["loss"] for r in read_jsonl(tmp_path / "fp32" / "metrics.jsonl")]
    assert len(pure) == 4 and all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(pure, ref, strict=True))


def test_bf16_pure_is_full_training_only():
    from entrenar.errors import InputError

    for mode in ("lora", "qlora"):
        with pytest.raises(InputError, match="bf16-pure.*--mode full"):
            TrainConfig(mode=mode, dtype="bf16-pure").validate()
    TrainConfig(mode="full", dtype="bf16-pure").validate()
    assert verify_dtype("bf16-pure") == "bf16" and precision_policy("bf16-pure").weight_copies(T.tiny_model()) is None


@pytest.mark.parametrize("dtype,compute", [("bf16-weights", torch.bfloat16), ("bf16", torch.float32),
                                           ("fp32", torch.float32)])
def test_the_trainer_computes_on_bf16_copies_only_for_bf16_weights(tmp_path, dtype, compute):
    """Through Trainer.fit: --dtype bf16-weights runs the training forward on bf16 copies, --dtype bf16 on the
    fp32 parameters (autocast casts per op) and fp32 as they are; the parameters stay fp32 in every case."""
    tr = _trainer(tmp_path, dtype=dtype, steps=2)
    seen = []
    q_proj = tr.model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_pre_hook(lambda m, _a: seen.append(m.weight.dtype) if m.training else None)
    tr.fit()
    assert seen and set(seen) == {compute}
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())


def _lora_model() -> torch.nn.Module:
    from entrenar.peft import apply_lora

    return apply_lora(T.tiny_model(3), rank=4, alpha=8, targets="q_proj,v_proj", seed=1)


def _frozen_linear_dtypes(model: torch.nn.Module) -> set:
    return {p.dtype for path, m in model.named_modules() if type(m) is torch.nn.Linear and ".layers." in f".{path}"
            for p in m.parameters(recurse=False) if not p.requires_grad}


def test_bf16_stores_a_lora_base_in_bf16_and_trains_the_same(tmp_path, monkeypatch):
    """--dtype bf16: the frozen linears (the LoRA base_layers and the linears --targets leaves out) are stored in
    bf16, the adapters, embedding and norms stay fp32, and the run's losses and adapters equal those of a run
    that keeps the frozen linears fp32 (autocast rounded them to bf16 at every use): half their memory, the
    same training."""
    from entrenar.train import precision as precision_mod

    stored = _lora_model()
    T.run(tmp_path / "bf16", 4, model=stored, dtype="bf16", mode="lora", save_every=2)
    assert _frozen_linear_dtypes(stored) == {torch.bfloat16}
    trainable = {p.dtype for p in stored.parameters() if p.requires_grad}
    assert trainable == {torch.float32}
    assert stored.model.embed_tokens.weight.dtype == torch.float32
    assert stored.model.norm.weight.dtype == torch.float32

    monkeypatch.setattr(precision_mod, "frozen_linears_in_bf16", lambda model: 0)  # the fp32 base of before
    kept = _lora_model()
    T.run(tmp_path / "fp32-base", 4, model=kept, dtype="bf16", mode="lora", save_every=2)
    assert _frozen_linear_dtypes(kept) == {torch.float32}
    losses = [[r["loss"] for r in read_jsonl(tmp_path / run / "metrics.jsonl")] for run in ("bf16", "fp32-base")]
    assert losses[0] == losses[1]
    adapters = [{n: p for n, p in m.named_parameters() if p.requires_grad} for m in (stored, kept)]
    assert all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])


def test_bf16_frozen_cast_leaves_fp32_runs_and_trainable_linears_alone():
    model = T.tiny_model(3)
    precision_policy("bf16").prepare_model(model)  # a full fine-tune: nothing frozen
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    lora = _lora_model()
    precision_policy("fp32").prepare_model(lora)
    assert _frozen_linear_dtypes(lora) == {torch.float32}
    assert precision_policy("fp32").prepare_frozen(lora) is lora and _frozen_linear_dtypes(lora) == {torch.float32}
    precision_policy("bf16").prepare_frozen(lora)
    assert _frozen_linear_dtypes(lora) == {torch.bfloat16}
