"""Batched generation: prompts of different lengths decoded at once (left padding, attention mask,
positions counting real tokens, one KV cache, per-row stop) give each prompt's tokens alone, and
transformers' batched generate(do_sample=False); padding is invisible to the real tokens."""

from __future__ import annotations

import pytest
import torch

from entrenar.errors import InputError
from entrenar.generate import generate, generate_batch
from entrenar.model import padding_mask
from entrenar.tensors import rel_l2
from tests.helpers.models import make_hf_model
from tests.helpers.tokenizers import QWEN, SMOLLM, tiny_tokenizer
from tests.test_generate import PROMPT, tiny_model

PROMPTS = [PROMPT, "the", "in the er the in", "er er"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _alone_and_batched(model, tok, prompts, steps, **kw):
    ids = [tok.encode(p) for p in prompts]
    alone = [generate(model, tok, x, steps, keep_logits=True, **kw) for x in ids]
    batched = generate_batch(model, tok, ids, steps, keep_logits=True, **kw)
    return alone, batched


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_batch_equals_each_prompt_alone(tok, arch):
    model = tiny_model(len(tok), arch)
    alone, batched = _alone_and_batched(model, tok, PROMPTS, 12, stop_ids=[])
    assert len({len(tok.encode(p)) for p in PROMPTS}) > 1  # really padded
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids and b.text == a.text
        errs = [rel_l2(x, y) for x, y in zip(b.step_logits, a.step_logits)]
        assert len(errs) == 12 and max(errs) <= 1e-5, errs


def test_batch_without_cache_equals_with_cache(tok):
    model = tiny_model(len(tok))
    ids = [tok.encode(p) for p in PROMPTS]
    cached = generate_batch(model, tok, ids, 8, stop_ids=[], keep_logits=True)
    full = generate_batch(model, tok, ids, 8, stop_ids=[], keep_logits=True, use_cache=False)
    for a, b in zip(cached, full):
        assert a.token_ids == b.token_ids
        assert max(rel_l2(x, y) for x, y in zip(a.step_logits, b.step_logits)) <= 1e-5


def test_ignoring_the_padding_mask_is_caught(tok, monkeypatch):
    """Mutation: the mask lets real tokens attend to the padding -> the padded rows' logits move."""
    import entrenar.model as em

    model = tiny_model(len(tok))
    monkeypatch.setattr(em, "padding_mask", lambda attention_mask, T: padding_mask(torch.ones_like(attention_mask), T))
    alone, batched = _alone_and_batched(model, tok, PROMPTS, 3, stop_ids=[])
    assert rel_l2(batched[1].step_logits[0], alone[1].step_logits[0]) > 1e-3


def test_padding_rows_stay_finite():
    """A padding query with no real key before it attends to itself (else softmax over nothing = NaN,
    which reaches the real rows through its keys/values in the next layer)."""
    mask = padding_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool), 4)
    assert mask.shape == (2, 1, 4, 4)
    assert bool(mask.any(-1).all())  # every query sees at least one key
    assert not bool(mask[0, 0, 2:, :2].any())  # real queries never see padding
    assert torch.equal(mask[1, 0], torch.ones(4, 4, dtype=torch.bool).tril())


def test_each_row_stops_on_its_own(tok):
    model = tiny_model(len(tok))
    ids = [tok.encode(p) for p in PROMPTS]
    free = [r.token_ids for r in generate_batch(model, tok, ids, 12, stop_ids=[])]
    stop = free[1][2]  # a token row 1 makes at its third step: the end of turn now
    stopper = tiny_tokenizer()
    stopper.eot_id = stop
    out = generate_batch(model, stopper, ids, 12)
    assert out[1].stop_reason == "end_of_turn" and len(out[1].token_ids) <= 3
    for row, r in zip(free, out):  # each row: its own tokens up to its own first stop token
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert r.token_ids == row[:cut]
        assert r.stop_reason == ("end_of_turn" if stop in row else "max_new_tokens")
    assert any(stop not in row for row in free)  # some row went on to max_new_tokens


def test_stop_text_ends_a_row_and_keeps_the_others(tok):
    model = tiny_model(len(tok))
    ids = [tok.encode(p) for p in PROMPTS]
    free = generate_batch(model, tok, ids, 10, stop_ids=[])
    target = free[2].text[: len(tok.decode(free[2].token_ids[:3]))]  # row 2's text after 3 tokens
    out = generate_batch(model, tok, ids, 10, stop_ids=[], stop_text=lambda text: text == target)
    assert out[2].stop_reason == "stop_text" and out[2].token_ids == free[2].token_ids[:3]
    for i in (0, 1, 3):
        assert out[i].token_ids == free[i].token_ids[: len(out[i].token_ids)]  # the same tokens, maybe fewer


def test_batch_rejects_bad_prompts(tok):
    model = tiny_model(len(tok))
    with pytest.raises(InputError, match="prompt 1 is empty"):
        generate_batch(model, tok, [[1, 2], []], 4)
    with pytest.raises(InputError, match="no prompts"):
        generate_batch(model, tok, [], 4)


def _hf_batch_greedy(hf, prompts: list[list[int]], n: int, pad_id: int, eos: list[int] | None) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=eos,
                          pad_token_id=pad_id)
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if eos and t in eos), len(row))
        rows.append(row[:cut])
    return rows


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_batch_matches_transformers_batched_generate_tiny(tok, tmp_path, arch):
    from entrenar.formats import load_model

    hf = make_hf_model(arch, seed=5, vocab_size=len(tok))
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.float32)
    ids = [tok.encode(p) for p in PROMPTS]
    ref = _hf_batch_greedy(hf, ids, 10, tok.pad_id, None)
    out = generate_batch(ours, tok, ids, 10, stop_ids=[])
    assert [r.token_ids for r in out] == ref


# ---- the packaged models (short: 3 prompts, 16 tokens) -------------------------------------------------
REAL_PROMPTS = ["What is 2 + 2?", "Write a Python function that reverses a string.", "Name a color."]


def _real_batch_parity(model, path, name):
    from entrenar.tokenizer import load_tokenizer
    from tests.test_generate import _hf_from_gguf

    tok = load_tokenizer(name)
    ids = [tok.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True).ids for p in REAL_PROMPTS]
    batched = generate_batch(model, tok, ids, 16)
    alone = [generate(model, tok, x, 16) for x in ids]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    ref = _hf_batch_greedy(_hf_from_gguf(path), ids, 16, tok.pad_id, sorted(tok.stop_ids))
    assert [r.token_ids for r in batched] == ref


@pytest.mark.real_model
def test_batch_matches_alone_and_transformers_smollm(smollm_model, smollm_path):
    _real_batch_parity(smollm_model, smollm_path, SMOLLM)


@pytest.mark.real_model
def test_batch_matches_alone_and_transformers_qwen(qwen_model, qwen_path):
    _real_batch_parity(qwen_model, qwen_path, QWEN)
