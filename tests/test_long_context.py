"""Long-context activation memory (entrenar/long_context.py): block inputs offloaded to host memory
(--offload-activations) and the MLP computed in token chunks (--mlp-chunk).

Bounds, on these tiny models: offload alone, and a chunk size not below the token count (the plain
path), are bit-identical to the plain checkpointed path (loss and every gradient), which is itself
bit-identical to no checkpointing. Chunking runs the MLP's matmuls on fewer rows (another kernel
blocking) and sums its weight gradients over tokens in another order: loss and every gradient within
relL2 1e-5 in fp32 (seen <= 1.2e-6, chunks of 1 to 16 of 74 tokens) and 1e-13 in fp64 (seen
<= 2.2e-15). A chunk dropped or out of order moves them by O(1) (test_a_dropped_or_misordered_...).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import entrenar.model as model_module
from entrenar.long_context import ActivationOffload, chunked_rows, set_mlp_chunk
from entrenar.tensors import rel_l2
from tests import test_train_cli
from tests.helpers.cli import run_cli as main
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.test_train_cli import pretrain_args

# the byte-tokenizer shards and model of test_train_cli (module-scoped fixtures), shared as test_trainer_cli does
byte_shards, byte_model_dir = test_train_cli.byte_shards, test_train_cli.byte_model_dir

BOUND = {torch.float32: 1e-5, torch.float64: 1e-13}


def _model(arch: str = "qwen2", dtype: torch.dtype = torch.float32, layers: int = 2):
    m = tiny_causal_lm(tiny_config(arch, num_layers=layers), seed=3, bias_std=0.1, norm_std=0.1).to(dtype)
    return m.train()


def _batch(vocab: int, b: int = 2, t: int = 37, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=gen), torch.randint(0, vocab, (b, t), generator=gen)


def _loss_and_grads(base, ids, labels, *, checkpointing=False, offload=False, chunk=0):
    m = copy.deepcopy(base)
    m.activation_checkpointing, m.activation_offload = checkpointing, offload
    set_mlp_chunk(m, chunk)
    loss_sum, _ = m(ids, labels=labels)
    loss_sum.backward()
    return loss_sum.detach(), {n: p.grad for n, p in m.named_parameters()}


def _check_same(ref, got, dtype, exact: bool) -> None:
    """Loss and every gradient bit-identical (exact), else within relL2 BOUND[dtype]."""
    (loss_ref, grads_ref), (loss, grads) = ref, got
    assert set(grads) == set(grads_ref) and all(g is not None for g in grads.values())
    for name, a, b in [("loss", loss, loss_ref), *((n, grads[n], g) for n, g in grads_ref.items())]:
        if exact:
            assert torch.equal(a, b), (name, rel_l2(a, b))
        else:
            assert rel_l2(a, b) <= BOUND[dtype], (name, rel_l2(a, b))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("offload,chunk", [(True, 0), (False, 16), (True, 16), (True, 7), (True, 1), (True, 74)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_offload_and_mlp_chunks_match_the_plain_path(arch, offload, chunk, dtype):
    """2 x 37 = 74 tokens: chunks of 16 (a remainder of 10), 7 (a remainder of 4), 1, 74 (not above
    the threshold: the plain path). The reference is the plain checkpointed path, and it equals no
    checkpointing bit for bit."""
    base = _model(arch, dtype)
    ids, labels = _batch(base.cfg.vocab_size)
    ref = _loss_and_grads(base, ids, labels, checkpointing=True)
    _check_same(_loss_and_grads(base, ids, labels), ref, dtype, exact=True)
    got = _loss_and_grads(base, ids, labels, checkpointing=True, offload=offload, chunk=chunk)
    _check_same(got, ref, dtype, exact=chunk in (0, ids.numel()))


def test_mlp_chunks_without_checkpointing_and_in_eval_match():
    """Chunking works on its own (the block is not recomputed) and under no_grad (eval: plain loop)."""
    base = _model("llama")
    ids, labels = _batch(base.cfg.vocab_size)
    _check_same(_loss_and_grads(base, ids, labels, chunk=16), _loss_and_grads(base, ids, labels), torch.float32,
                exact=False)
    chunked = copy.deepcopy(base).eval()
    set_mlp_chunk(chunked, 16)
    with torch.no_grad():  # fewer rows per matmul: another kernel blocking, so equal within fp32 rounding only
        assert rel_l2(chunked(ids), base.eval()(ids)) <= BOUND[torch.float32]


def _misordered(fn, x, *args, chunk):
    rows = x.reshape(-1, x.shape[-1]).split(chunk)
    outs = [fn(r, *args) for r in rows]
    outs[0], outs[1] = outs[1], outs[0]
    return torch.cat(outs).view(*x.shape[:-1], -1)


def _dropped(fn, x, *args, chunk):
    rows = x.reshape(-1, x.shape[-1]).split(chunk)
    outs = [fn(r, *args) for r in rows[:-1]] + [torch.zeros(rows[-1].shape[0], x.shape[-1], dtype=x.dtype)]
    return torch.cat(outs).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("broken", [_misordered, _dropped])
def test_a_dropped_or_misordered_chunk_fails_the_comparison(broken, monkeypatch):
    """The comparison above is red when the chunk loop loses or swaps a piece (shape-preserving, so only
    the values can tell): seen red for both by running test_offload_and_mlp_chunks_match_the_plain_path
    with these patched in."""
    base = _model("qwen2")
    ids, labels = _batch(base.cfg.vocab_size)
    ref = _loss_and_grads(base, ids, labels, checkpointing=True)
    monkeypatch.setattr(model_module, "chunked_rows", broken)
    with pytest.raises(AssertionError):
        _check_same(_loss_and_grads(base, ids, labels, checkpointing=True, chunk=16), ref, torch.float32,
                    exact=False)


def test_mlp_intermediates_exist_for_one_chunk_at_a_time(monkeypatch):
    """Every SwiGLU call, forward and recompute, sees at most `chunk` tokens (74 without chunking), and
    the threshold leaves a micro-batch of <= chunk tokens on the plain path (no extra checkpoint)."""
    base = _model("llama")
    ids, labels = _batch(base.cfg.vocab_size)
    rows: list[int] = []
    reference_swiglu = base.ops.swiglu

    def spy(gate, up):
        rows.append(gate.reshape(-1, gate.shape[-1]).shape[0])
        return reference_swiglu(gate, up)

    ops = base.ops  # a frozen dataclass: the model's ops property returns a copy with the spy
    patched = type(ops)(**{**{f: getattr(ops, f) for f in ops.__dataclass_fields__}, "swiglu": spy})
    monkeypatch.setattr(type(base), "ops", property(lambda self: patched))
    _loss_and_grads(base, ids, labels, checkpointing=True, chunk=16)
    assert rows and max(rows) == 16 and sorted(set(rows)) == [10, 16]
    # per layer: 5 pieces in the forward, up to 5 in the block's recompute (torch 2.13 stops it after the
    # last saved input: 4), 5 piece recomputes for their backward
    assert 2 * 5 * base.cfg.num_layers <= len(rows) <= 3 * 5 * base.cfg.num_layers, rows
    rows.clear()
    _loss_and_grads(base, ids, labels, checkpointing=True, chunk=74)
    assert rows == [74] * (2 * base.cfg.num_layers)  # forward + block recompute: the plain path


def test_chunked_rows_keeps_row_order_and_shape():
    x = torch.randn(3, 11, 5, requires_grad=True)
    out = chunked_rows(lambda r, k: (r.sin() * k)[:, :4], x, 3.0, chunk=4)  # elementwise: exact in any chunking
    assert out.shape == (3, 11, 4) and torch.equal(out, (x.sin() * 3.0)[..., :4])
    out.sum().backward()
    assert torch.equal(x.grad[..., :4], x.cos().detach()[..., :4] * 3.0) and not x.grad[..., 4].any()


def test_offload_moves_each_block_input_through_host_memory(monkeypatch):
    """One host copy per block per forward, equal to that block's input; only the block input goes
    (RoPE tables and the like stay by reference); the backward fetches them last block first."""
    base = _model("qwen2", layers=3)
    ids, labels = _batch(base.cfg.vocab_size)
    inputs: list[torch.Tensor] = []
    for block in base.model.layers:
        block.register_forward_pre_hook(lambda mod, args: inputs.append(args[0].detach().clone()))
    packed, fetched = [], []
    to_host, fetch = ActivationOffload._to_host, ActivationOffload._fetch

    def spy_pack(self, t):
        item = to_host(self, t)
        packed.append(item)
        return item

    def spy_fetch(self, item):
        fetched.append(item.index)
        return fetch(self, item)

    monkeypatch.setattr(ActivationOffload, "_to_host", spy_pack)
    monkeypatch.setattr(ActivationOffload, "_fetch", spy_fetch)
    _loss_and_grads(base, ids, labels, checkpointing=True, offload=True)
    layers = base.cfg.num_layers
    assert len(packed) == layers and [p.index for p in packed] == list(range(layers))
    for item, x in zip(packed, inputs[:layers], strict=True):  # inputs: forward, then recomputes
        assert torch.equal(item.host, x) and item.host.data_ptr() != x.data_ptr()
    assert fetched == list(range(layers))[::-1]


def test_offload_applies_to_checkpointed_training_forwards_only(monkeypatch):
    """Eval (no_grad) and a forward without checkpointing pack nothing: only checkpointed inputs move."""
    packs = []
    to_host = ActivationOffload._to_host
    monkeypatch.setattr(ActivationOffload, "_to_host", lambda self, t: packs.append(1) or to_host(self, t))
    base = _model("llama")
    base.activation_offload = True
    ids, labels = _batch(base.cfg.vocab_size)
    with torch.no_grad():
        base(ids, labels=labels)
    base(ids, labels=labels)[0].backward()
    assert packs == []
    base.activation_checkpointing = True
    base(ids, labels=labels)[0].backward()
    assert len(packs) == base.cfg.num_layers


def test_cli_flags_reach_the_model(tmp_path, byte_model_dir, byte_shards, capsys, monkeypatch):
    """`pretrain --offload-activations --mlp-chunk 16 --device cpu`: the checkpointed blocks' inputs go
    through the offload, the MLP runs in chunks, run.json records both, and the losses equal a run
    without the flags (offload exact; chunking within the fp32 bound of the gradients above)."""
    from entrenar import long_context

    counts = {"packs": 0, "chunked": 0}
    to_host, chunked = long_context.ActivationOffload._to_host, model_module.chunked_rows

    def spy_pack(self, t):
        counts["packs"] += 1
        return to_host(self, t)

    def spy_chunked(*a, **k):
        counts["chunked"] += 1
        return chunked(*a, **k)

    monkeypatch.setattr(long_context.ActivationOffload, "_to_host", spy_pack)
    monkeypatch.setattr(model_module, "chunked_rows", spy_chunked)
    losses = {}
    for name, extra in (("plain", ()), ("long", ("--offload-activations", "--mlp-chunk", "16"))):
        out = tmp_path / name
        code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=2,
                                          extra=("--no-preflight", "--device", "cpu", *extra)), capsys)
        assert code == 0, err
        config = json.loads((out / "run.json").read_text())["config"]
        losses[name] = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                        if "loss" in r]
        if name == "plain":
            assert counts == {"packs": 0, "chunked": 0}
            assert (config["offload_activations"], config["mlp_chunk"]) == (False, 0)
    assert (config["offload_activations"], config["mlp_chunk"]) == (True, 16)
    # 2 steps x 2 micro-batches x 2 layers: one pack per checkpointed block (implied by the offload flag)
    assert counts["packs"] == 2 * 2 * 2
    assert counts["chunked"] > 0
    assert len(losses["long"]) == len(losses["plain"]) == 2
    for a, b in zip(losses["long"], losses["plain"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


def test_cli_help_states_the_trade_off_and_bad_chunk_exits_2(tmp_path, byte_model_dir, byte_shards, capsys):
    from entrenar import cli

    with pytest.raises(SystemExit):
        cli.main(["pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--offload-activations" in text and "pinned host memory" in text and "host RAM" in text
    assert "--mlp-chunk TOKENS" in text and "one more MLP forward" in text
    code, result, _ = main(pretrain_args(byte_model_dir, byte_shards, tmp_path / "bad", steps=2,
                                         extra=("--mlp-chunk", "-1")), capsys)
    assert code == 2 and "--mlp-chunk" in result["error"]
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("quantize", [False, True])
def test_lora_and_qlora_adapters_get_the_same_gradients(quantize):
    """finetune --mode lora|qlora with the flags: the MLP's linears are LoRA (over NF4) wrappers, chunked
    like any module; offload is bit-identical even with LoRA dropout (the recompute replays the RNG)."""
    from entrenar.peft import lora

    for dropout, chunk in ((0.0, 16), (0.1, 0)):
        base = _model("qwen2")
        lora.apply_lora(base, rank=4, alpha=8, dropout=dropout, quantize_nf4=quantize, seed=0)
        with torch.no_grad():  # B starts at zero, which would leave every A gradient zero
            for module in lora.lora_modules(base).values():
                module.lora_B.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
        ids, labels = _batch(base.cfg.vocab_size)
        torch.manual_seed(5)
        ref = _loss_and_grads(base, ids, labels, checkpointing=True)
        torch.manual_seed(5)
        got = _loss_and_grads(base, ids, labels, checkpointing=True, offload=True, chunk=chunk)
        assert all(g is None for n, g in ref[1].items() if ".lora_" not in n)  # only adapters train
        trainable = {n: g for n, g in ref[1].items() if g is not None}
        assert trainable and all(g.abs().sum() > 0 for g in trainable.values())
        _check_same((ref[0], trainable), (got[0], {n: got[1][n] for n in trainable}), torch.float32,
                    exact=chunk == 0)


def test_bf16_weights_precision_offload_exact_and_chunks_close():
    """--dtype bf16-weights: the step runs on bf16 copies (train/precision.py), which the block recompute
    and the piece recomputes must see too. Offload: master gradients bit-identical. Chunks: the bf16
    weight gradients are rounded per piece before they are summed, so the bound is bf16's: 1e-2 relL2 (seen 3.7e-3)."""
    from entrenar.train.precision import BF16Weights

    base = _model("qwen2")
    ids, labels = _batch(base.cfg.vocab_size)

    def master_grads(offload: bool, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        m = copy.deepcopy(base)
        m.activation_checkpointing, m.activation_offload = True, offload
        set_mlp_chunk(m, chunk)
        precision = BF16Weights(m)
        with precision.compute():
            loss_sum, _ = m(ids, labels=labels)
            loss_sum.backward()
        assert all(p.dtype == torch.float32 for p in m.parameters())  # the masters are back
        return loss_sum.detach(), {n: p.grad for n, p in m.named_parameters()}

    ref = master_grads(False, 0)
    assert all(g.dtype == torch.float32 for g in ref[1].values())
    _check_same(ref, master_grads(True, 0), torch.float32, exact=True)
    got = master_grads(True, 16)
    for name, a, b in [("loss", got[0], ref[0]), *((n, got[1][n], g) for n, g in ref[1].items())]:
        assert rel_l2(a, b) <= 1e-2, (name, rel_l2(a, b))


class _AttentionCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the fused attention kernels SDPA dispatches to (forward ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in long_context_ops():
            self.calls += 1
        return func(*args, **(kwargs or {}))


def long_context_ops():
    from entrenar.long_context import _ATTENTION_OPS

    return _ATTENTION_OPS


@pytest.mark.parametrize("offload,chunk", [(False, 0), (True, 16)])
def test_save_attention_is_exact_and_skips_the_recomputed_attention(offload, chunk):
    """--save-attention: loss and every gradient bit-identical to plain checkpointing (the kept output is
    the very tensor the recompute would make), and the attention kernel runs once per block a step
    instead of twice (forward + recompute). With the offload and MLP chunks (nested checkpoints) too."""
    base = _model("qwen2")
    ids, labels = _batch(base.cfg.vocab_size)
    runs = {}
    for keep in (False, True):
        m = copy.deepcopy(base)
        m.activation_checkpointing, m.activation_offload, m.save_attention = True, offload, keep
        set_mlp_chunk(m, chunk)
        with _AttentionCalls() as counter:
            loss_sum, _ = m(ids, labels=labels)
            loss_sum.backward()
        runs[keep] = (loss_sum.detach(), {n: p.grad for n, p in m.named_parameters()}), counter.calls
    layers = base.cfg.num_layers
    assert runs[False][1] == 2 * layers and runs[True][1] == layers
    _check_same(runs[True][0], runs[False][0], torch.float32, exact=True)


def test_save_attention_cli_flag(tmp_path, byte_model_dir, byte_shards, capsys, monkeypatch):
    """The flag reaches run.json and every checkpointed block; without checkpointing it is exit 2 naming
    the remedy."""
    seen = []
    real = model_module.checkpoint_block

    def spy(*a, **k):
        seen.append(k.get("save_attention"))
        return real(*a, **k)

    monkeypatch.setattr(model_module, "checkpoint_block", spy)
    out = tmp_path / "keep"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=1,
                                      extra=("--no-preflight", "--device", "cpu", "--activation-checkpointing",
                                             "--save-attention")), capsys)
    assert code == 0, err
    assert json.loads((out / "run.json").read_text())["config"]["save_attention"] is True
    assert seen and all(v is True for v in seen)
    code, result, _ = main(pretrain_args(byte_model_dir, byte_shards, tmp_path / "bad", steps=1,
                                         extra=("--save-attention",)), capsys)
    assert code == 2 and "--activation-checkpointing" in result["error"]
    assert not (tmp_path / "bad").exists()
