"""The fixed probe batch: real text, tokenized by the model's own tokenizer.

Two sequences, each run on its own (batch 1, no padding to get wrong):
- ``short``: fewer than 32 tokens, so a reduction that reads garbage past a partial warp (rows
  shorter than 32) shows up here and nowhere else;
- ``long``: ``seq_len`` tokens (512 by default) of prose and Python, cycled if the tokenizer
  packs the text into fewer tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SHORT_TEXT = "The quick brown fox jumps over the lazy dog."

LONG_TEXT = """\
Rivers carve valleys slowly. Over thousands of years, water carries sand and stones downstream,
grinding the rock beneath it until a narrow gorge becomes a wide, flat plain. Farmers settled
along those plains because floods left behind rich soil every spring, and the first cities grew
where rivers met the sea. Trade followed the water: boats moved grain, timber and cloth far more
cheaply than carts on muddy roads could.

def merge_sorted(left: list[int], right: list[int]) -> list[int]:
    \"\"\"Merge two sorted lists into one sorted list.\"\"\"
    out, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            out.append(left[i])
            i += 1
        else:
            out.append(right[j])
            j += 1
    out.extend(left[i:])
    out.extend(right[j:])
    return out


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

A language model reads text as a sequence of tokens and, at every position, predicts the next
one. Training adjusts millions of weights so that the predicted distribution puts more mass on
the token that actually came next. The loss is the average negative log-probability of those
correct tokens; a model that guesses uniformly over a vocabulary of fifty thousand words scores
about 10.8 nats, while a well-trained model scores closer to two.

In the morning the market opened at seven. Vendors stacked oranges into pyramids, a baker
pulled trays of bread from a brick oven, and a man with a bicycle sold coffee from two large
flasks strapped to the rear rack. By nine the square was full: students, tourists with maps,
old men arguing about football, and a dog asleep in the only patch of shade.
"""


@dataclass
class ProbeSequence:
    name: str
    input_ids: torch.Tensor  # [1, T] long

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Ids from our ChatTokenizer (with BOS as in training) or a bare ``tokenizers.Tokenizer``."""
    import tokenizers

    if isinstance(tokenizer, tokenizers.Tokenizer):  # its encode has add_special_tokens, and returns an Encoding
        return list(tokenizer.encode(text).ids)
    # Not a `try: ... except TypeError`: a TypeError raised inside our own encode is a bug to see, not a cue
    # to retry without BOS.
    return list(tokenizer.encode(text, add_special=True))


def build_probe(tokenizer: Any, seq_len: int = 512, short: bool = True) -> list[ProbeSequence]:
    """The probe sequences: ``short`` (< 32 tokens) and ``long`` (exactly ``seq_len`` tokens)."""
    if seq_len < 32:
        raise ValueError(f"seq_len {seq_len} < 32: the long probe must reach past a 32-wide reduction")
    probe = []
    if short:
        ids = encode_text(tokenizer, SHORT_TEXT)[:31]
        assert 1 < len(ids) < 32, f"short probe has {len(ids)} tokens"
        probe.append(ProbeSequence("short", torch.tensor([ids], dtype=torch.long)))
    first = encode_text(tokenizer, LONG_TEXT)
    ids = list(first)
    if len(ids) < seq_len:  # cycle the text body (without a second BOS) until long enough
        body = encode_text(tokenizer, "\n" + LONG_TEXT)
        bos = getattr(tokenizer, "bos_id", None)
        if getattr(tokenizer, "add_bos", False) and bos is not None and body and body[0] == bos:
            body = body[1:]
        while len(ids) < seq_len:
            ids.extend(body)
    probe.append(ProbeSequence("long", torch.tensor([ids[:seq_len]], dtype=torch.long)))
    return probe
