"""Tests that kill the mutants the suite let live (issue 16 item 5).

``tools/mutants.py --operators`` applies one-operator mutants (+/-, *//, </<=, constants, and/or,
dropped calls) to the numerically critical functions listed in tools/mutation_targets.yaml. Each test
here is named after the survivor it kills; the mutant is quoted in its docstring, and each was run
red against that mutant (``tools/mutants.py --operators --target NAME``).
"""

from __future__ import annotations

import torch

from entrenar.generate import sample_next


# ---- generation sampling (src/entrenar/generate.py: sample_next) -------------------------------------
def _draws(logits: torch.Tensor, temperature: float, top_p: float, n: int = 300) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return [sample_next(logits, temperature, top_p, gen) for _ in range(n)]


def test_temperature_divides_the_logits():
    """Mutant: ``logits / temperature`` -> ``logits * temperature``. A low temperature must sharpen the
    distribution (all draws are the argmax), a high one flatten it (every token drawn)."""
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert set(_draws(logits, 0.02, 1.0)) == {3}
    hot = _draws(logits, 50.0, 1.0)
    assert set(hot) == {0, 1, 2, 3}
    # at temperature 50 the probabilities are within 6% of uniform: no token takes half the draws
    assert max(hot.count(i) for i in range(4)) < 0.4 * len(hot)


def test_temperature_sampling_follows_softmax_of_scaled_logits():
    """At temperature 2 the draw frequencies match softmax(logits / 2) (not softmax(logits * 2))."""
    logits = torch.tensor([0.0, 1.0, 2.0])
    n = 4000
    draws = _draws(logits, 2.0, 1.0, n)
    want = torch.softmax(logits / 2.0, dim=-1)
    got = torch.tensor([draws.count(i) / n for i in range(3)])
    assert torch.allclose(got, want, atol=0.03), (got, want)


def test_top_p_excludes_a_token_whose_preceding_mass_already_reaches_p():
    """Mutant: ``before >= top_p`` -> ``before > top_p``. Two equally likely tokens (0.5 each, exact in
    binary) and top_p 0.5: the nucleus is the first token alone, so every draw is the same token."""
    draws = _draws(torch.zeros(2), 1.0, 0.5, 200)
    assert len(set(draws)) == 1
