"""Generation never emits a padding id (issue 28 item 9): a preset trained on shards of a 1000-token
tokenizer has vocab_size rounded up to 1024 (docs/design.md "Presets"); ids 1000..1023 are rows no text
encodes to, yet sampling could pick them (they are never trained down, only never targets).

Seen red before the fix: greedy decoding returned the padding id whose logit was made the largest.
"""

from __future__ import annotations

import pytest
import torch

import entrenar.generate as gen_mod
from entrenar.generate import generate
from tests.helpers.tokenizers import tiny_tokenizer
from tests.test_generate import tiny_model


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ids_past_the_tokenizer_are_never_generated(temperature, monkeypatch):
    tok = tiny_tokenizer()
    n = len(tok)
    model = tiny_model(n + 64 - n % 64)  # rounded up to a multiple of 64, as presets do
    assert model.cfg.vocab_size > n
    boost = torch.zeros(model.cfg.vocab_size)
    boost[n:] = 100.0  # the padding rows win every step (as an untrained row may)
    # the head is F.linear over head_weight (no lm_head module call, so a forward hook never fires): boost the
    # logits where generate reads them, and count the calls so this cannot pass without the boost
    calls, raw_logits = [], gen_mod.last_logits

    def boosted(*args, **kwargs):
        calls.append(1)
        out = raw_logits(*args, **kwargs)
        return out + boost.to(out.dtype)

    monkeypatch.setattr(gen_mod, "last_logits", boosted)
    out = generate(model, tok, tok.encode("the in the"), 12, temperature=temperature, seed=0, stop_ids=[],
                   keep_logits=True)
    assert calls, "generate did not read its logits through last_logits"
    assert all(0 <= i < n for i in out.token_ids), out.token_ids
    # rows past the tokenizer win on the raw logits of every step, and are never emitted
    assert all(int(torch.argmax(lg)) >= n for lg in out.step_logits)
