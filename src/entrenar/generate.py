"""Text generation: one prefill of the prompt, then one token at a time from the KV cache.

Greedy when temperature is 0, else sampling from softmax(logits / temperature) restricted to
the top-p nucleus, drawn with a seeded torch.Generator (same seed, same tokens). Stops at EOS or
the end-of-turn token (that token is returned in token_ids but not in text) or after
max_new_tokens. Text is streamed through `on_text` as soon as it decodes to whole characters.

`entrenar generate` (model_commands.py) is the command-line face.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import InputError
from .model import CausalLM, KVCache

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids, incl. the stop token when one ended generation
    text: str  # decoded generated text, without the stop token
    stop_reason: str  # "eos" | "end_of_turn" | "max_new_tokens"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    seed: int | None = None
    step_logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # only if keep_logits

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> int:
    """Next token id from one row of logits [V]: argmax at temperature 0, else nucleus sampling."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class TextStream:
    """Decodes the growing id list and hands out only new, complete characters."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)
        self._emit(final=False)

    def _emit(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            return  # a multi-byte character is split across tokens: wait for the rest
        if text.startswith(self.sent):
            new = text[len(self.sent):]
            if new and self.on_text is not None:
                self.on_text(new)
            self.sent = text

    def finish(self) -> str:
        self._emit(final=True)
        return self.tokenizer.decode(self.ids)


def first_nonfinite_tensor(model: nn.Module) -> str | None:
    """Name of the first floating-point parameter or buffer holding NaN/Inf, or None."""
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def check_logits_finite(model: nn.Module, logits: torch.Tensor, generated: int) -> None:
    """NaN/Inf logits stop generation with an InputError (exit 2) naming the poisoned tensor when there
    is one. Sampling from them would not fail: argmax of NaN is token 0 (often <|endoftext|>), and the
    command reported success on a destroyed model."""
    if bool(torch.isfinite(logits).all()):
        return
    bad = first_nonfinite_tensor(model)
    cause = (f"the weights contain NaN/Inf in {bad}: the checkpoint is corrupt or diverged; re-download or "
             f"re-convert it, or use an earlier checkpoint (`entrenar inspect` lists its tensors)" if bad else
             "no weight is NaN/Inf, so an activation overflowed its dtype; run in float32 or check the model")
    where = "on the prompt" if generated == 0 else f"after {generated} generated tokens"
    raise InputError(f"the model produced non-finite logits {where}: {cause}")


def generate(model: CausalLM, tokenizer, prompt_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             on_text: Callable[[str], None] | None = None, *, use_cache: bool = True,
             keep_logits: bool = False, stop_ids: Sequence[int] | None = None) -> GenerationResult:
    """Continue `prompt_ids`. use_cache=False re-runs the whole sequence every step (the oracle
    for the KV cache); keep_logits keeps each step's float32 logits for that comparison."""
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids:
        raise InputError("the prompt is empty (0 tokens); give some prompt text")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
    if not temperature >= 0:  # also rejects NaN
        raise InputError(f"temperature (--temperature) is {temperature}; it must be >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p (--top-p) is {top_p}; it must be in (0, 1] (1 = no nucleus cut)")
    cfg = model.cfg
    tokenizer.check_ids(prompt_ids, cfg.vocab_size)
    if len(prompt_ids) + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {cfg.max_position_embeddings} positions; shorten one of them")
    stops = set(tokenizer.stop_ids if stop_ids is None else stop_ids)
    # ids past the tokenizer (a vocabulary rounded up to a multiple of 64) are padding rows: never sampled
    n_real = min(cfg.vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else cfg.vocab_size
    device = model.head_weight.device
    generator = None
    if temperature > 0:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=device).manual_seed(seed)

    stream = TextStream(tokenizer, on_text)
    out: list[int] = []
    step_logits: list[torch.Tensor] = []
    stop_reason = "max_new_tokens"
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
            cache = KVCache() if use_cache else None
            logits = model(ids, cache=cache)[0, -1]
            for _ in range(max_new_tokens):
                check_logits_finite(model, logits, len(out))
                if keep_logits:
                    step_logits.append(logits.float().cpu())
                nxt = sample_next(logits[:n_real], temperature, top_p, generator)
                out.append(nxt)
                if nxt in stops:
                    stop_reason = "eos" if nxt == tokenizer.eos_id else "end_of_turn"
                    break
                stream.push(nxt)
                if len(out) == max_new_tokens:
                    break
                if use_cache:
                    step = torch.tensor([[nxt]], dtype=torch.long, device=device)
                    logits = model(step, cache=cache)[0, -1]
                else:
                    ids = torch.cat([ids, torch.tensor([[nxt]], dtype=torch.long, device=device)], dim=1)
                    logits = model(ids)[0, -1]
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    text = stream.finish()
    return GenerationResult(out, text, stop_reason, len(prompt_ids), len(out), seconds, seed, step_logits)
