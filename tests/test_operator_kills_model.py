"""Operator mutants of src/entrenar/model.py (target model-forward in tools/mutation_targets.yaml) that
the parity tests did not see, each checked against an oracle outside our model: Meta's Llama 3.1 RoPE
scaling reference, transformers' forward, torch's cross-entropy, the initialisation formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from entrenar.formats import load_model
from entrenar.model import Block, CausalLM, KVCache, rope_inv_freq, rope_tables
from entrenar.tensors import IGNORE_INDEX, rel_l2
from tests.helpers.models import make_hf_model, tiny_causal_lm, tiny_config


# ---- RoPE: llama3 scaling against Meta's reference ------------------------------------------------
def meta_llama3_scaling(freqs: list[float], factor: float, low: float = 1.0, high: float = 4.0,
                        old_ctx: float = 8192) -> list[float]:
    """llama-models' ``apply_scaling`` (Meta's Llama 3.1 reference, defaults 1 / 4 / 8192), per frequency."""
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def plain_inv_freq(d: int, theta: float) -> list[float]:
    return [1.0 / theta ** (i / d) for i in range(0, d, 2)]


def _regions(freqs: list[float], low: float, high: float, old_ctx: float) -> set[str]:
    waves = [2 * math.pi / f for f in freqs]
    return {"high" if w < old_ctx / high else "low" if w > old_ctx / low else "medium" for w in waves}


LLAMA3_CASES = {
    # only the factor given: the other three take Meta's values (1, 4, 8192)
    "defaults": ({"rope_type": "llama3", "factor": 8.0}, {}),
    "explicit": ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                  "original_max_position_embeddings": 4096}, {"low": 2.0, "high": 8.0, "old_ctx": 4096}),
}


@pytest.mark.parametrize("case", list(LLAMA3_CASES))
def test_llama3_inv_freq_matches_meta_reference(case):
    scaling, kw = LLAMA3_CASES[case]
    cfg = tiny_config(hidden_size=512, num_heads=4, num_kv_heads=4, rope_theta=500000.0, rope_scaling=scaling)
    assert cfg.head_dim == 128
    base = plain_inv_freq(128, 500000.0)
    want = meta_llama3_scaling(base, scaling["factor"], **kw)
    # the test means something only if the three wavelength regions all occur
    assert _regions(base, kw.get("low", 1.0), kw.get("high", 4.0), kw.get("old_ctx", 8192)) == {
        "high", "medium", "low"}
    got = rope_inv_freq(cfg)
    assert got.dtype == torch.float64
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = tiny_config(hidden_size=512, num_heads=4, num_kv_heads=4, rope_theta=500000.0, rope_scaling=scaling)
    hf = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0,
                     rope_parameters={**scaling, "rope_theta": 500000.0})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    assert rel_l2(rope_inv_freq(cfg), theirs.double()) < 1e-6  # theirs is float32


def test_llama3_wavelength_on_the_low_boundary_is_smoothed_not_divided():
    """Frequency 0 (inv_freq 1, wavelength exactly 2 pi) sits exactly on old_ctx / low_freq_factor: Meta's
    reference treats it as medium (smooth 0: f / factor), neither left alone nor divided twice."""
    old_ctx = 8 * math.pi  # 8 pi / 4 == 2 pi exactly in binary floating point
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 16.0,
               "original_max_position_embeddings": old_ctx}
    cfg = tiny_config(hidden_size=64, num_heads=4, num_kv_heads=4, rope_scaling=scaling)
    base = plain_inv_freq(16, cfg.rope_theta)
    assert 2 * math.pi / base[0] == old_ctx / 4.0
    want = meta_llama3_scaling(base, 8.0, low=4.0, high=16.0, old_ctx=old_ctx)
    got = rope_inv_freq(cfg)
    assert got[0].item() == want[0] == 1.0 / 8.0
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype,want", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                        (torch.float64, torch.float64)])
def test_rope_tables_are_float64_angles_returned_in_fp32_or_fp64(dtype, want):
    cfg = tiny_config(rope_theta=1e6)
    positions = torch.tensor([[0, 1, 7, 4095]])
    cos, sin = rope_tables(cfg, positions, dtype)
    assert cos.dtype == sin.dtype == want and cos.shape == (1, 4, cfg.head_dim // 2)
    angles = torch.tensor([[[p * f for f in plain_inv_freq(cfg.head_dim, 1e6)] for p in (0, 1, 7, 4095)]],
                          dtype=torch.float64)
    assert torch.allclose(cos.double(), angles.cos(), atol=1e-7 if want == torch.float32 else 1e-13)
    assert torch.allclose(sin.double(), angles.sin(), atol=1e-7 if want == torch.float32 else 1e-13)


# ---- token ids out of the vocabulary --------------------------------------------------------------
def test_check_ids_accepts_exactly_0_to_vocab_minus_1():
    model = CausalLM(tiny_config(vocab_size=11))
    model._check_ids(torch.tensor([[0, 10, 5]]))  # both ends of the vocabulary are valid ids
    model._check_ids(torch.zeros(1, 0, dtype=torch.long))  # nothing to check
    for bad in ([[0, 11, 5]], [[3, -1, 4]], [[12, 2, 2]]):
        with pytest.raises(ValueError, match="out of range for vocab_size 11"):
            model._check_ids(torch.tensor(bad))


def test_forward_on_the_cpu_checks_ids_before_the_embedding():
    """An id == vocab_size is the classic tokenizer / model mismatch: a ValueError naming it, not an
    IndexError from inside nn.Embedding."""
    model = CausalLM(tiny_config(vocab_size=11)).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="token id 11 out of range for vocab_size 11"):
        model(torch.tensor([[1, 2, 11]]))


# ---- initialisation -------------------------------------------------------------------------------
def test_init_weights_follows_the_scaled_residual_formula():
    """N(0, initializer_range), o_proj / down_proj N(0, initializer_range / sqrt(2 * num_layers)) (GPT-2's
    scaled residual init), norm weights 1 and biases 0 -- even after they were changed."""
    cfg = tiny_config("qwen2", hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                      num_layers=3, initializer_range=0.05, tie_word_embeddings=False)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    model.init_weights(seed=0)
    residual = 0.05 / math.sqrt(2 * 3)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            want = residual if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.05
            assert abs(p.std().item() / want - 1) < 0.03 and abs(p.mean().item()) < 0.05 * want, (name, p.std())
    again = CausalLM(cfg)
    again.init_weights(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))  # seeded


def test_init_weights_chunks_are_distinct_and_independent_of_the_threads(monkeypatch):
    """init_weights draws each INIT_CHUNK numbers from its own generator on INIT_THREADS threads: the same weights
    on 1 thread as on 4, and no two chunks of a tensor repeat each other (a seed without the chunk index would
    tile every large matrix with one block of numbers)."""
    from entrenar import model as M

    cfg = tiny_config("llama", num_layers=2)
    monkeypatch.setattr(M, "INIT_CHUNK", 1000)
    weights = []
    for threads in (1, 4):
        monkeypatch.setattr(M, "INIT_THREADS", threads)
        m = CausalLM(cfg)
        m.init_weights(seed=3)
        weights.append(m.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    big = weights[0]["model.embed_tokens.weight"].view(-1)
    assert big.numel() >= 3000
    assert not torch.equal(big[:1000], big[1000:2000]) and not torch.equal(big[1000:2000], big[2000:3000])
    other = CausalLM(cfg)
    other.init_weights(seed=4)
    assert not torch.equal(other.model.embed_tokens.weight, weights[0]["model.embed_tokens.weight"])


def test_from_scratch_skips_the_default_init_and_equals_init_weights():
    """CausalLM.from_scratch (what pretrain builds) is allocated without torch's default init and equals a model
    built normally then init_weights(seed), bit for bit: init_weights sets every parameter."""
    cfg = tiny_config("qwen2", num_layers=2)
    built = CausalLM(cfg)
    built.init_weights(seed=5)
    fresh = CausalLM.from_scratch(cfg, seed=5)
    assert all(p.device.type == "cpu" for p in fresh.parameters())
    assert fresh.state_dict().keys() == built.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), built.state_dict().values()))


# ---- KV cache: a prompt fed in pieces (T > 1 after a cache) -------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill_with_the_cache_equals_transformers(arch, tmp_path):
    """Positions and the mask of a multi-token chunk after a cached prefix (past > 0, T > 1): each piece's
    logits equal transformers' logits of the whole sequence at those positions."""
    hf = make_hf_model(arch, seed=4)
    hf.save_pretrained(tmp_path / "m")
    ours = load_model(tmp_path / "m", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits
        cache = KVCache()
        pieces = [ours(ids[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 13), (13, 17))]
    assert cache.length == 17
    got = torch.cat(pieces, dim=1)
    assert rel_l2(got, want) < 1e-5
    for a, b in ((5, 6), (6, 13), (13, 17)):
        assert rel_l2(got[:, a:b], want[:, a:b]) < 1e-5, (a, b)


# ---- the loss path ---------------------------------------------------------------------------------
def test_loss_sum_and_count_are_torch_cross_entropy_over_the_kept_labels(tmp_path):
    hf = make_hf_model("qwen2", seed=5, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "m")
    ours = load_model(tmp_path / "m", dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    labels[0, -1] = labels[1, -1] = IGNORE_INDEX
    labels[1, :3] = IGNORE_INDEX
    with torch.no_grad():
        loss_sum, n = ours(ids, labels=labels)
        logits = hf(ids).logits.double()
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    assert int(n) == 18 - 2 - 3
    assert abs(loss_sum.item() - want.item()) < 1e-4 * want.item()


# ---- activation checkpointing only where it was asked for -----------------------------------------------
def _block_calls(model: CausalLM, ids: torch.Tensor, backward: bool) -> int:
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in model.modules() if isinstance(m, Block)]
    try:
        if backward:
            model(ids, labels=ids)[0].backward()
        else:
            with torch.no_grad():
                model(ids)
    finally:
        for h in hooks:
            h.remove()
    return len(calls)


def test_blocks_are_recomputed_only_when_checkpointing_a_training_step():
    model = tiny_causal_lm(tiny_config(), seed=0)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    layers = model.cfg.num_layers
    model.train()
    assert _block_calls(model, ids, backward=True) == layers  # checkpointing off: no recompute
    model.activation_checkpointing = True
    assert _block_calls(model, ids, backward=True) == 2 * layers  # each block again in the backward
    assert _block_calls(model, ids, backward=False) == layers  # no grad: nothing to recompute
    model.eval()
    assert _block_calls(model, ids, backward=True) == layers  # eval mode: not a training step
