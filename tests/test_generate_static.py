"""The static decoder (static_decode.py: preallocated KV cache, fixed shapes, a CUDA graph per decode step on
CUDA) gives the dynamic decoder's tokens and transformers' on the CPU: batch 1 and batch 4 with left
padding, per-row stop with the host reading the picks only every k steps, max_new_tokens up to the
model's context. The graph path runs here under ReplayedStep, a CPU stand-in for torch.cuda.CUDAGraph
with its semantics: the step's aten ops are recorded once (not executed: every tensor they write is put
back), then each replay re-runs exactly those ops on the recorded tensors, so any Python value the step
read at capture stays frozen, as in a real graph; a host read (.item(), bool(t)) or an op with a
data-dependent output shape inside the step fails the capture."""

from __future__ import annotations

import pytest
import torch

import entrenar.static_decode as sd
from entrenar.generate import Rows, generate, generate_batch
from entrenar.tensors import rel_l2
from tests.helpers.graphs import ReplayedStep
from tests.helpers.models import make_hf_model
from tests.test_generate import PROMPT, tiny_model
from tests.test_generate_batch import PROMPTS, _hf_batch_greedy
from tests.test_tokenizer import QWEN, SMOLLM, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture
def cpu_graphs(monkeypatch):
    """decode_static captures and replays its step on the CPU with ReplayedStep."""
    monkeypatch.setattr(sd, "can_capture", lambda device: True)
    monkeypatch.setattr(sd, "GraphStep", ReplayedStep)
    monkeypatch.setattr(sd, "warmup_step", lambda step, device: step())
    ReplayedStep.captures = 0
    return ReplayedStep


def test_replayed_step_freezes_python_values_and_refuses_host_syncs():
    """The stand-in is a real graph's contract, not a plain re-call: a Python value read at capture stays."""
    buf = torch.zeros(3)
    state = {"k": 1.0}
    step = ReplayedStep(lambda: buf.add_(state["k"]))
    assert torch.equal(buf, torch.zeros(3))  # the capture executed nothing
    state["k"] = 5.0
    step.replay()
    step.replay()
    assert torch.equal(buf, torch.full((3,), 2.0))  # 1.0 twice: the value seen at capture
    with pytest.raises(RuntimeError, match="host sync"):
        ReplayedStep(lambda: buf.add_(1.0) if bool(buf.sum() > 0) else buf)
    with pytest.raises(RuntimeError, match="data-dependent"):
        ReplayedStep(lambda: buf.nonzero())
    with pytest.raises(RuntimeError, match="random draw"):
        ReplayedStep(lambda: buf.exponential_(generator=torch.Generator().manual_seed(0)))


# ---- static == dynamic == transformers -------------------------------------------------------------------
def _both(model, tok, prompts, steps, **kw):
    ids = [tok.encode(p) for p in prompts]
    dynamic = generate_batch(model, tok, ids, steps, keep_logits=True, decoder="dynamic", **kw)
    static = generate_batch(model, tok, ids, steps, keep_logits=True, decoder="static", **kw)
    return dynamic, static


def _same(dynamic, static, bound: float = 1e-5):
    for d, s in zip(dynamic, static):
        assert s.token_ids == d.token_ids and s.text == d.text and s.stop_reason == d.stop_reason
        errs = [rel_l2(x, y) for x, y in zip(s.step_logits, d.step_logits)]
        assert len(errs) == len(d.token_ids) and max(errs) <= bound, errs


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_static_equals_dynamic_batch_1_and_4(tok, arch, graph, request):
    if graph:
        request.getfixturevalue("cpu_graphs")
    model = tiny_model(len(tok), arch)
    for prompts in ([PROMPT], PROMPTS):  # batch 1, and batch 4 of different lengths (left padding)
        dynamic, static = _both(model, tok, prompts, 12, stop_ids=[])
        assert {r.decoder for r in static} == {"cuda_graph" if graph else "static"}
        assert {r.decoder for r in dynamic} == {"dynamic"}
        _same(dynamic, static)
    if graph:
        assert ReplayedStep.captures == 2  # one per call: the graph really ran


def test_graph_replay_equals_eager_static_bitwise(tok, cpu_graphs):
    model = tiny_model(len(tok))
    ids = [tok.encode(p) for p in PROMPTS]
    replayed = generate_batch(model, tok, ids, 10, stop_ids=[], keep_logits=True, decoder="static")
    assert cpu_graphs.captures == 1
    eager = generate_batch(model, tok, ids, 10, stop_ids=[], keep_logits=True, decoder="static",
                           cuda_graphs=False)
    for a, b in zip(replayed, eager):
        assert a.token_ids == b.token_ids and b.decoder == "static"
        assert all(torch.equal(x, y) for x, y in zip(a.step_logits, b.step_logits))


def _column_read_on_the_host(model, cache, buf):
    """decode_logits with the bug a graph punishes: the cache column read back as a Python int (right on
    every eager call, frozen at the capture's column in a graph). tolist() dispatches no op on the CPU."""
    (col,) = buf.at.tolist()
    cache.at = torch.tensor([col])
    cache.mask = (buf.valid & (buf.key_index <= col))[:, None, None, :]
    return sd.last_logits(model, buf.ids, cache, position_ids=buf.position)


def test_a_value_frozen_at_capture_changes_the_tokens(tok, cpu_graphs, monkeypatch):
    model = tiny_model(len(tok))
    ids = [tok.encode(PROMPT)]
    kw = {"stop_ids": [], "decoder": "static", "keep_logits": True}
    right = generate_batch(model, tok, ids, 12, **kw)[0]
    monkeypatch.setattr(sd, "decode_logits", _column_read_on_the_host)
    eager = generate_batch(model, tok, ids, 12, cuda_graphs=False, **kw)[0]
    assert eager.token_ids == right.token_ids
    assert max(rel_l2(a, b) for a, b in zip(eager.step_logits, right.step_logits)) <= 1e-6
    frozen = generate_batch(model, tok, ids, 12, **kw)[0]
    assert frozen.decoder == "cuda_graph"
    # picks 0-3: the prefill, two eager warm-up steps, the first replay (the capture's column); then stale
    errs = [rel_l2(a, b) for a, b in zip(frozen.step_logits, right.step_logits)]
    assert max(errs[:4]) <= 1e-6 and min(errs[4:]) > 1e-3, errs


def test_a_host_sync_in_the_step_falls_back_to_eager_with_a_warning(tok, cpu_graphs, monkeypatch):
    model = tiny_model(len(tok))
    ids = [tok.encode(PROMPT)]
    right = generate_batch(model, tok, ids, 12, stop_ids=[], decoder="static")[0].token_ids
    original = sd.decode_logits
    monkeypatch.setattr(sd, "decode_logits", lambda model, cache, buf: original(model, cache, buf)
                        if int(buf.at) >= 0 else None)
    with pytest.warns(RuntimeWarning, match="capture of the decode step failed.*host sync"):
        out = generate_batch(model, tok, ids, 12, stop_ids=[], decoder="static")[0]
    assert out.decoder == "static" and out.token_ids == right


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_static_graph_matches_transformers_batched_generate_tiny(tok, tmp_path, arch, cpu_graphs):
    from entrenar.formats import load_model

    hf = make_hf_model(arch, seed=5, vocab_size=len(tok))
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    ids = [tok.encode(p) for p in PROMPTS]
    ref = _hf_batch_greedy(hf, ids, 10, tok.pad_id, None)
    out = generate_batch(ours, tok, ids, 10, stop_ids=[], decoder="static")
    assert [r.token_ids for r in out] == ref and out[0].decoder == "cuda_graph"
    alone = [generate(ours, tok, x, 10, stop_ids=[], decoder="static").token_ids for x in ids]
    assert alone == ref


# ---- stops, the host reading every k steps, the end of the cache ------------------------------------------
def _rows_every(model, tok, ids, max_new, stopper, every, **kw):
    """decode_static with the host reading the picks every `every` steps, through generate's Rows."""
    from entrenar.generate import left_padded

    rows = Rows(len(ids), stopper, set(stopper.stop_ids), max_new, None, kw.get("stop_text"))
    with torch.inference_mode():
        x, mask = left_padded(ids, torch.device("cpu"))
        sd.decode_static(model, x, mask, max_new, lambda logits: logits[:, :len(tok)].argmax(-1),
                         lambda first, t, b: rows.take_columns(model, first, t, b), cuda_graph=True,
                         pick_in_graph=True, sync_every=every)
    return rows


@pytest.mark.parametrize("every", [1, 5, 16])
def test_each_row_stops_on_its_own_with_host_reads_every_k(tok, every, cpu_graphs):
    model = tiny_model(len(tok))
    ids = [tok.encode(p) for p in PROMPTS]
    free = [r.token_ids for r in generate_batch(model, tok, ids, 12, stop_ids=[], decoder="dynamic")]
    stop = free[1][2]  # a token row 1 makes at its third step: the end of turn now
    stopper = tiny_tokenizer()
    stopper.eot_id = stop
    expected = generate_batch(model, stopper, ids, 12, decoder="dynamic")
    assert expected[1].stop_reason == "end_of_turn" and any(r.stop_reason == "max_new_tokens" for r in expected)
    rows = _rows_every(model, tok, ids, 12, stopper, every)
    assert rows.outs == [r.token_ids for r in expected]
    assert rows.reasons == [r.stop_reason for r in expected]


def test_stop_text_with_host_reads_every_k(tok, cpu_graphs):
    model = tiny_model(len(tok))
    ids = [tok.encode(p) for p in PROMPTS]
    free = generate_batch(model, tok, ids, 10, stop_ids=[], decoder="dynamic")
    target = free[2].text[: len(tok.decode(free[2].token_ids[:3]))]  # row 2's text after 3 tokens
    rows = _rows_every(model, tok, ids, 10, tiny_tokenizer(), 4, stop_text=lambda text: text == target)
    assert rows.reasons[2] == "stop_text" and rows.outs[2] == free[2].token_ids[:3]


def test_all_rows_stopped_ends_decoding_at_the_next_host_read(tok, cpu_graphs):
    """Once every row has stopped, no more than k - 1 further steps run (here k = 4, stop at pick 2)."""
    model = tiny_model(len(tok))
    ids = [tok.encode(PROMPT)]
    free = generate(model, tok, ids[0], 40, stop_ids=[], decoder="dynamic").token_ids
    stopper = tiny_tokenizer()
    stopper.eot_id = free[1]
    calls = []
    original = ReplayedStep.replay
    ReplayedStep.replay = lambda self: (calls.append(1), original(self))[1]
    try:
        rows = _rows_every(model, tok, ids, 40, stopper, 4)
    finally:
        ReplayedStep.replay = original
    assert rows.outs[0] == free[: free.index(free[1]) + 1] and rows.reasons[0] == "end_of_turn"
    assert len(calls) <= 4 - sd.WARMUP_STEPS  # picks 1..4 (2 warm-up steps, then replays), then stop


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 7])
def test_short_runs(tok, max_new, cpu_graphs):
    """max_new_tokens of 1 (the prefill's pick only), through the warm-up steps (no graph yet), to replays."""
    model = tiny_model(len(tok))
    dynamic, static = _both(model, tok, PROMPTS, max_new, stop_ids=[])
    _same(dynamic, static)
    assert static[0].decoder == ("cuda_graph" if max_new > 1 + sd.WARMUP_STEPS else "static")


def test_the_last_cache_column(tok, cpu_graphs):
    """prompt + max_new_tokens filling the model's whole context: the last fed token lands in the cache's
    last column, and the picks equal the dynamic decoder's."""
    model = tiny_model(len(tok))
    longest = max(len(tok.encode(p)) for p in PROMPTS)
    fill = model.cfg.max_position_embeddings - longest
    dynamic, static = _both(model, tok, PROMPTS, fill, stop_ids=[])
    assert len(static[0].token_ids) == fill and static[0].decoder == "cuda_graph"
    _same(dynamic, static)


def test_nonfinite_logits_raise_in_the_static_decoder(tok, cpu_graphs):
    from entrenar.errors import InputError
    from tests.test_generate import POISONED, _poisoned_model

    with pytest.raises(InputError) as e:
        generate(_poisoned_model(tok), tok, tok.encode(PROMPT), 8, decoder="static")
    assert POISONED in str(e.value) and "on the prompt" in str(e.value)


def test_seeded_sampling_static_equals_dynamic_at_batch_1(tok, cpu_graphs):
    """Sampling draws outside the graph from the seeded generator: batch 1 gives the dynamic decoder's
    tokens (one draw per step from the same generator)."""
    model = tiny_model(len(tok))
    prompt = tok.encode(PROMPT)
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "stop_ids": []}
    a = generate(model, tok, prompt, 20, decoder="dynamic", **kw)
    b = generate(model, tok, prompt, 20, decoder="static", **kw)
    assert a.token_ids == b.token_ids and b.decoder == "cuda_graph"
    c = generate(model, tok, prompt, 20, decoder="static", **{**kw, "seed": 1235})
    assert c.token_ids != b.token_ids


def test_streaming_through_the_static_decoder(tok, cpu_graphs):
    model = tiny_model(len(tok))
    pieces: list[str] = []
    result = generate(model, tok, tok.encode(PROMPT), 30, stop_ids=[], on_text=pieces.append, decoder="static")
    assert "".join(pieces) == result.text == tok.decode(result.token_ids)
    assert result.token_ids == generate(model, tok, tok.encode(PROMPT), 30, stop_ids=[], decoder="dynamic").token_ids


def test_unknown_decoder_is_refused(tok):
    with pytest.raises(ValueError, match="decoder"):
        generate(tiny_model(len(tok)), tok, [1, 2], 2, decoder="fast")


# ---- the packaged models (short) -------------------------------------------------------------------------
REAL_PROMPTS = ["What is 2 + 2?", "Write a Python function that reverses a string.", "Name a color.",
                "Say hi."]


def _real_static_parity(model, path, name, prompts=REAL_PROMPTS):
    from entrenar.tokenizer import load_tokenizer
    from tests.test_generate import _hf_from_gguf

    tok = load_tokenizer(name)
    ids = [tok.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True).ids for p in prompts]
    assert len({len(x) for x in ids}) == len(ids)  # unequal lengths: every batch is left-padded
    static = generate_batch(model, tok, ids, 16, decoder="static")
    assert static[0].decoder == "cuda_graph"
    alone = [generate(model, tok, x, 16, decoder="static").token_ids for x in ids]
    dynamic = [r.token_ids for r in generate_batch(model, tok, ids, 16, decoder="dynamic")]
    assert [r.token_ids for r in static] == alone == dynamic
    ref = _hf_batch_greedy(_hf_from_gguf(path), ids, 16, tok.pad_id, sorted(tok.stop_ids))
    assert alone == ref


@pytest.mark.real_model
def test_static_matches_dynamic_and_transformers_smollm(smollm_model, smollm_path, cpu_graphs):
    _real_static_parity(smollm_model, smollm_path, SMOLLM)


@pytest.mark.real_model
def test_static_matches_dynamic_and_transformers_qwen(qwen_model, qwen_path, cpu_graphs):
    """Qwen2's part (Q/K/V biases, its template and vocabulary) on two of the four prompts, SmolLM2's case above
    runs all four (CI time): the longest, and the one whose greedy tokens change when the static decoder drops
    the padding mask (its row is 6 tokens shorter); the padded batch, each alone, dynamic and transformers."""
    _real_static_parity(qwen_model, qwen_path, QWEN, [REAL_PROMPTS[1], REAL_PROMPTS[2]])
