"""Continuous batching (engine.py): the outputs do not depend on batching. Greedy tokens equal each prompt decoded
alone (generate) and transformers' generate, whatever the slot count, with requests ending at different steps so
freed slots take new prompts over an earlier request's stale cache; the CUDA-graph path (every bucket's step
captured, attending through the span kernel or SDPA under the mask) runs here under the CPU stand-in with a graph's semantics;
sampling depends on a request's seed and prompt only; stop rules and per-request limits as generate_batch's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the decode-attention kernel on the CPU (before triton is imported)

import pytest
import torch

import entrenar.engine as eng
import entrenar.static_decode as sd
from entrenar.engine import (
    GenerationSettings,
    SlotMemory,
    auto_slots,
    buckets,
    exponential_noise,
    generate_many,
    resolve_slots,
    slot_memory,
)
from entrenar.errors import InputError
from entrenar.generate import generate, generate_batch
from tests.helpers.graphs import ReplayedStep
from tests.helpers.models import make_hf_model, tiny_config
from tests.helpers.tokenizers import SMOLLM, tiny_tokenizer
from tests.test_generate import PROMPT, tiny_model
from tests.test_generate_batch import REAL_PROMPTS, _hf_batch_greedy

TEXTS = [PROMPT, "the", "in the er the in", "er er", "the in", "er the er in the er the in the", "in", "the er",
         "er in in the", "the the the"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture
def cpu_graphs(monkeypatch):
    """The engine captures and replays each bucket's step on the CPU with ReplayedStep."""
    monkeypatch.setattr(sd, "can_capture", lambda device: True)
    monkeypatch.setattr(sd, "GraphStep", ReplayedStep)
    monkeypatch.setattr(sd, "warmup_step", lambda step, device: step())
    monkeypatch.setattr(sd, "new_pool", lambda: None)
    ReplayedStep.captures = 0
    return ReplayedStep


def _stop_ids(model, tok, ids, steps):
    """Stop ids that end the prompts' greedy continuations at different steps (slots free at different times)."""
    free = [generate(model, tok, x, steps, stop_ids=[]).token_ids for x in ids]
    return sorted({row[k] for k, row in zip((2, 5, 9, 1, 7), free)})


def _alone(model, tok, ids, steps, **kw):
    return [generate(model, tok, x, steps, **kw) for x in ids]


# decode steps through the span kernel (kernels/decode_attention, CUDA's default) and through SDPA under the mask
ATTENTIONS = ["kernel", "sdpa"]


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("slots", [1, 3, 4, 16])
def test_greedy_equals_each_prompt_alone_at_any_slot_count(tok, arch, slots, attention):
    model = tiny_model(len(tok), arch)
    ids = [tok.encode(t) for t in TEXTS]
    stops = _stop_ids(model, tok, ids, 12)
    alone = _alone(model, tok, ids, 12, stop_ids=stops)
    assert len({len(a.token_ids) for a in alone}) > 2  # requests end at different steps: slots are reused
    got = generate_many(model, tok, ids, GenerationSettings(max_new_tokens=12, max_slots=slots, stop_ids=stops,
                                                            decode_attention=attention))
    for a, g in zip(alone, got):
        assert (g.token_ids, g.text, g.stop_reason) == (a.token_ids, a.text, a.stop_reason)
        assert g.decoder == "engine" and g.completion_tokens == len(g.token_ids)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_short_prompt_beside_a_long_one_keeps_its_own_positions(tok, attention):
    """A 3-token prompt prefilled in one group with a 150-token one (147 columns of left padding): its answer is its
    answer alone (its RoPE positions count its own tokens, not the group's padded width). Q/K weights scaled up x10:
    the random model's attention is otherwise near uniform, blind to positions."""
    model = tiny_model(len(tok), "llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    long = (tok.encode(TEXTS[5]) * 20)[:150]
    ids = [long, tok.encode(TEXTS[1]), tok.encode(TEXTS[3])]
    alone = [a.token_ids for a in _alone(model, tok, ids, 10, stop_ids=[])]
    got = generate_many(model, tok, ids, GenerationSettings(max_new_tokens=10, max_slots=3, stop_ids=[],
                                                            decode_attention=attention))
    assert [g.token_ids for g in got] == alone


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("sync_every", [1, 4])
def test_graph_path_equals_eager_at_any_slot_count(tok, cpu_graphs, sync_every, attention):
    """Each bucket's step captured once and replayed (the step attends to the whole cache, stale columns of freed
    slots included, under the per-slot mask); the host reads every `sync_every` steps."""
    model = tiny_model(len(tok))
    ids = [tok.encode(t) for t in TEXTS]
    stops = _stop_ids(model, tok, ids, 14)
    alone = _alone(model, tok, ids, 14, stop_ids=stops)
    for slots in (2, 5):
        got = generate_many(model, tok, ids, GenerationSettings(max_new_tokens=14, max_slots=slots, stop_ids=stops,
                                                                sync_every=sync_every, decode_attention=attention))
        assert [g.token_ids for g in got] == [a.token_ids for a in alone]
        assert [g.stop_reason for g in got] == [a.stop_reason for a in alone]
        assert {g.decoder for g in got} == {"engine_graph"}
    assert cpu_graphs.captures >= 2  # more than one bucket was captured


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_graphs_per_attended_columns_bucket_equal_eager(tok, cpu_graphs, monkeypatch, attention):
    """A captured step attends only to its bucket of columns (attend_bucket): with buckets of 4, 8, 16, ... the
    steps of a window whose slots reach further take a wider graph, and the tokens are those of each prompt
    decoded alone. A graph that attended to fewer columns than a live slot reaches would lose its prompt."""
    monkeypatch.setattr(eng, "ATTEND_MIN", 4)
    model = tiny_model(len(tok))
    ids = [tok.encode(t) for t in TEXTS]
    limits = [40, 12, 30, 7, 40, 22, 16, 35, 9, 28]  # slots free at different times, then admit the next
    alone = [generate(model, tok, x, n, stop_ids=[]).token_ids for x, n in zip(ids, limits)]
    stats: dict = {}
    got = generate_many(model, tok, ids, GenerationSettings(max_new_tokens=40, max_slots=4, stop_ids=[],
                                                            sync_every=2, decode_attention=attention),
                        max_new=limits, stats=stats)
    assert [g.token_ids for g in got] == alone
    assert len(stats["attend_buckets"]) >= 3 and stats["attend_buckets"][-1] <= stats["max_len"]
    assert stats["captures"] >= 3 and stats["graph_steps"] > 0 and stats["prefills"] >= 2
    assert stats["graph_steps"] + stats["eager_steps"] == stats["host_reads"] * 2
    parts = stats["prefill_seconds"] + stats["launch_seconds"] + stats["read_seconds"]
    assert min(stats["launch_seconds"], stats["read_seconds"]) >= 0 and 0 < parts <= stats["seconds"] + 1e-3
    assert f"queued in {stats['launch_seconds']:.2f} s" in eng.describe_stats(stats)


def test_attend_bucket():
    assert [eng.attend_bucket(n, 1000) for n in (1, 128, 129, 300, 513, 1000)] == [128, 128, 256, 512, 1000, 1000]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_equals_transformers_generate(tok, tmp_path, arch):
    """Greedy tokens of transformers' generate(do_sample=False) on the same weights."""
    from entrenar.formats import load_model

    hf = make_hf_model(arch, seed=5, vocab_size=len(tok))
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    ids = [tok.encode(t) for t in TEXTS]
    theirs = _hf_batch_greedy(hf, ids, 10, tok.pad_id, None)
    got = generate_many(ours, tok, ids, GenerationSettings(max_new_tokens=10, max_slots=3, stop_ids=[]))
    assert [g.token_ids for g in got] == theirs


def test_sampling_depends_on_seed_and_prompt_only(tok):
    """A request's draws are a hash of (its key, token index, id): the same tokens at any slot count and order,
    other tokens for another seed; the noise is Exp(1) (mean 1) and independent of the batch."""
    model = tiny_model(len(tok))
    ids = [tok.encode(t) for t in TEXTS]
    kw = {"max_new_tokens": 10, "temperature": 0.9, "top_p": 0.95, "stop_ids": []}
    seeds = [7 + i % 3 for i in range(len(ids))]
    ref = [g.token_ids for g in generate_many(model, tok, ids, GenerationSettings(max_slots=1, **kw), seeds=seeds)]
    for slots in (3, 10):
        got = generate_many(model, tok, ids, GenerationSettings(max_slots=slots, **kw), seeds=seeds)
        assert [g.token_ids for g in got] == ref
        assert {g.seed for g in got} == set(seeds)
    rev = generate_many(model, tok, ids[::-1], GenerationSettings(max_slots=4, **kw), seeds=seeds[::-1])
    assert [g.token_ids for g in rev][::-1] == ref
    other = generate_many(model, tok, ids, GenerationSettings(max_slots=4, **kw), seeds=[s + 100 for s in seeds])
    assert [g.token_ids for g in other] != ref
    same_prompt = generate_many(model, tok, [ids[0]] * 4, GenerationSettings(max_slots=4, **kw), seeds=[0, 1, 2, 3])
    assert len({tuple(g.token_ids) for g in same_prompt}) > 1  # samples of one prompt differ by their seed
    noise = exponential_noise(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 5]), 50_000)
    assert abs(float(noise.mean()) - 1.0) < 0.02 and float(noise.min()) > 0
    assert torch.equal(noise[1:2], exponential_noise(torch.tensor([2]), torch.tensor([0]), 50_000))


def test_stop_text_and_per_request_limits(tok):
    """stop_text ends a request as in generate_batch ("stop_text"); a request's limit is the model's context less
    its own prompt, not the batch's longest (a long neighbour no longer shortens it)."""
    model = tiny_model(len(tok))
    ids = [tok.encode(t) for t in TEXTS[:5]]

    def stop(text: str) -> bool:
        return len(text) >= 6

    want = generate_batch(model, tok, ids, 12, stop_ids=[], stop_text=stop, decoder="dynamic")
    for sync_every in (1, 4):  # 4: the rule is asked once per host read, then of the prefixes to find its token
        got = generate_many(model, tok, ids, GenerationSettings(max_new_tokens=12, max_slots=2, stop_ids=[],
                                                                stop_text=stop, sync_every=sync_every))
        assert [(g.token_ids, g.stop_reason) for g in got] == [(w.token_ids, w.stop_reason) for w in want]
    assert "stop_text" in {g.stop_reason for g in got}
    context = model.cfg.max_position_embeddings
    long, short = [5] * (context - 3), ids[1]
    got = generate_many(model, tok, [long, short], GenerationSettings(max_new_tokens=10, max_slots=2, stop_ids=[]))
    assert len(got[0].token_ids) == 3 and got[0].stop_reason == "max_new_tokens"
    assert len(got[1].token_ids) == 10


def test_bad_requests_are_input_errors(tok):
    model = tiny_model(len(tok))
    context = model.cfg.max_position_embeddings
    for prompts, settings, match in (([], GenerationSettings(), "no prompts"),
                                     ([[1], []], GenerationSettings(), "prompt 1 is empty"),
                                     ([[1] * context], GenerationSettings(), "fills the model's context"),
                                     ([[1]], GenerationSettings(max_slots=0), "at least 1"),
                                     ([[1]], GenerationSettings(temperature=-1.0), "temperature"),
                                     ([[1]], GenerationSettings(top_p=0.0), "top_p")):
        with pytest.raises(InputError, match=match):
            generate_many(model, tok, prompts, settings)


def test_auto_slots_from_free_memory():
    """--batch-size auto's arithmetic on given numbers: what 80% of the free memory holds after a prefill's share,
    a multiple of 8, at most the requests and the cap; the reason names the bound."""
    need = SlotMemory(per_slot=100 << 20, fixed=2 << 30)  # 100 MiB a slot, 2 GiB for a prefill
    slots, why = auto_slots(40 << 30, need, requests=1000)  # 0.8 * 40 GiB - 2 GiB = 30 GiB: 307 slots -> 304
    assert slots == 304 and "bounded by the free memory" in why and "307 fit" in why
    assert auto_slots(40 << 30, need, requests=50)[0] == 50  # all the requests
    assert auto_slots(400 << 30, need, requests=5000)[0] == 512  # the cap
    assert auto_slots(1 << 30, need, requests=10)[0] == 1  # nothing fits: one slot, never 0
    cfg = tiny_config("qwen2", vocab_size=1000)
    small, big = (slot_memory(cfg, max_len=n, longest_prompt=64, kv_bytes=2, sampling=False, cuda_graphs=True)
                  for n in (128, 1024))
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    assert big.per_slot - small.per_slot >= kv_per_token * (1024 - 128)  # the KV cache grows with max_len
    sampled = slot_memory(cfg, max_len=128, longest_prompt=64, kv_bytes=2, sampling=True, cuda_graphs=True)
    assert sampled.per_slot > small.per_slot  # sampling's softmax, sort and noise per vocabulary entry
    model = tiny_model(1000)
    assert resolve_slots("auto", model, [10, 20], 8) == (2, "--batch-size auto: 8 slots on the CPU")
    assert resolve_slots(5, model, [10, 20], 8)[0] == 5


def test_buckets():
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(12) == [1, 2, 4, 8, 12]


def test_decode_attention_choice(monkeypatch):
    """auto: the kernel on CUDA only, unless ENTRENAR_DECODE_ATTENTION says otherwise; a wrong name is an InputError."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("ENTRENAR_DECODE_ATTENTION", raising=False)
    assert not eng.use_decode_kernel("auto", cpu) and eng.use_decode_kernel("kernel", cpu)
    monkeypatch.setattr("entrenar.kernels.triton_available", lambda: True)
    assert eng.use_decode_kernel("auto", torch.device("cuda")) and not eng.use_decode_kernel("sdpa", torch.device("cuda"))
    monkeypatch.setenv("ENTRENAR_DECODE_ATTENTION", "sdpa")
    assert not eng.use_decode_kernel("auto", torch.device("cuda")) and eng.use_decode_kernel("kernel", cpu)
    monkeypatch.setenv("ENTRENAR_DECODE_ATTENTION", "flash")
    with pytest.raises(InputError, match="ENTRENAR_DECODE_ATTENTION"):
        eng.use_decode_kernel("auto", cpu)


def test_stale_cache_of_a_freed_slot_unmasked_is_caught(tok, monkeypatch):
    """Mutation: a decode step attends to every column of its slot (no `column <= col[s]` term): a slot that
    took a new prompt sees the keys an earlier request left past its own end -> other tokens."""
    model = tiny_model(len(tok))
    ids = [tok.encode(t) for t in TEXTS]
    stops = _stop_ids(model, tok, ids, 12)
    alone = [a.token_ids for a in _alone(model, tok, ids, 12, stop_ids=stops)]
    real = eng.Engine.step_fn

    def unmasked(self, b, attend):
        self.key_index = torch.zeros_like(self.key_index)  # every column counts as written
        return real(self, b, attend)

    monkeypatch.setattr(eng.Engine, "step_fn", unmasked)
    got = generate_many(model, tok, ids, GenerationSettings(max_new_tokens=12, max_slots=2, stop_ids=stops))
    assert [g.token_ids for g in got] != alone


@pytest.mark.real_model
def test_packaged_smollm_greedy_equals_alone_and_transformers(smollm_model, smollm_path):
    from entrenar.tokenizer import load_tokenizer
    from tests.test_generate import _hf_from_gguf

    tok = load_tokenizer(SMOLLM)
    ids = [tok.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True).ids for p in REAL_PROMPTS]
    alone = [generate(smollm_model, tok, x, 16).token_ids for x in ids]
    for slots in (1, 2):
        got = generate_many(smollm_model, tok, ids, GenerationSettings(max_new_tokens=16, max_slots=slots))
        assert [g.token_ids for g in got] == alone
    assert alone == _hf_batch_greedy(_hf_from_gguf(smollm_path), ids, 16, tok.pad_id, sorted(tok.stop_ids))


def test_linear_weights_held_in_bf16_give_autocasts_tokens_and_are_put_back(tok, monkeypatch):
    """Under bf16 autocast a decode step re-casts every fp32 linear weight; generate_many holds bf16 copies instead
    (engine.linear_weights_in, on CUDA when they fit): the same tokens as autocast casting per call, and every
    weight is its own fp32 tensor again after the call, a LoRA model's A and B included."""
    from entrenar.peft.lora import apply_lora

    model = tiny_model(len(tok), "qwen2")  # q/k/v biases too
    apply_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # a live adapter
    ids = [tok.encode(t) for t in TEXTS]
    settings = GenerationSettings(max_new_tokens=10, max_slots=4, stop_ids=[])
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast_per_call = [g.token_ids for g in generate_many(model, tok, ids, settings)]
        seen: list[torch.dtype] = []
        real = eng.Engine.__init__

        def spy(self, model, *a, **kw):
            seen.extend({m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)})
            real(self, model, *a, **kw)

        monkeypatch.setattr(eng, "_cast_dtype", lambda model, device: torch.bfloat16)
        monkeypatch.setattr(eng.Engine, "__init__", spy)
        held = [g.token_ids for g in generate_many(model, tok, ids, settings)]
    assert set(seen) == {torch.bfloat16}  # every linear (base, LoRA A and B) held in bf16 during the call
    assert held == cast_per_call
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.data_ptr() == before[n][0] and torch.equal(p.detach(), before[n][1]), n


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_prompt_asked_several_times_is_prefilled_once_and_each_request_is_its_own(tok, attention):
    """pass@k's samples and GRPO's groups ask one prompt several times in a call: its prefill row is computed once and
    its keys/values copied to the other requests' slots; each request's tokens equal that prompt sampled alone with
    its seed (and greedy, alone), whatever the slots. A copy that missed a layer or a slot would change them."""
    model = tiny_model(len(tok), "qwen2")
    ids = [tok.encode(t) for t in TEXTS[:4]]
    asked = [ids[i % 4] for i in range(12)]  # each prompt 3 times, interleaved
    seeds = list(range(12))
    for temperature in (0.9, 0.0):
        kw = {"max_new_tokens": 8, "temperature": temperature, "top_p": 0.95, "stop_ids": [],
              "decode_attention": attention}
        alone = [generate_many(model, tok, [p], GenerationSettings(max_slots=1, **kw), seeds=[s])[0].token_ids
                 for p, s in zip(asked, seeds)]
        for slots in (12, 5):
            stats: dict = {}
            got = generate_many(model, tok, asked, GenerationSettings(max_slots=slots, **kw), seeds=seeds, stats=stats)
            assert [g.token_ids for g in got] == alone
            if slots == 12:  # one prefill for all: 4 prompts computed for 12 requests
                assert stats["prefills"] == 1 and stats["prefill_rows"] == 4
        if temperature:
            assert len({tuple(a) for a in alone[0::4]}) > 1  # the samples of one prompt differ: seeds, not copies
