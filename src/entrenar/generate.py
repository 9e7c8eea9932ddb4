"""Text generation: one prefill of the prompt, then one token at a time from the KV cache.

Greedy when temperature is 0, else sampling from softmax(logits / temperature) restricted to
the top-p nucleus, drawn with a seeded torch.Generator (same seed, same tokens). Stops at EOS or
the end-of-turn token (that token is returned in token_ids but not in text) or after
max_new_tokens. Text is streamed through `on_text` as soon as it decodes to whole characters.
`generate_batch` decodes many prompts at once (left padding + attention mask, one KV cache, each row
stopping on its own); `generate` is its batch of one.

`entrenar generate` (cli/models.py) is the command-line face.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .errors import InputError
from .model import CausalLM, KVCache

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids, incl. the stop token when one ended generation
    text: str  # decoded generated text, without the stop token
    stop_reason: str  # "eos" | "end_of_turn" | "max_new_tokens" | "stop_text" (generate_batch's stop_text)
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


def _check_request(tokenizer, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float,
                   top_p: float, cfg) -> None:
    """InputError (exit 2) for a request no decoding can serve; `prompts` are lists of ints."""
    if not prompts:
        raise InputError("no prompts given; give at least one prompt")
    for i, ids in enumerate(prompts):
        if not ids:
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            raise InputError(f"{which} is empty (0 tokens); give some prompt text")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens is {max_new_tokens}; it must be at least 1")
    if not temperature >= 0:  # also rejects NaN
        raise InputError(f"temperature (--temperature) is {temperature}; it must be >= 0 (0 = greedy)")
    if not 0.0 < top_p <= 1.0:
        raise InputError(f"top_p (--top-p) is {top_p}; it must be in (0, 1] (1 = no nucleus cut)")
    for ids in prompts:
        tokenizer.check_ids(ids, cfg.vocab_size)
    longest = max(len(ids) for ids in prompts)
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise InputError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {cfg.max_position_embeddings} positions; shorten one of them")


def left_padded(prompts: Sequence[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(ids [B, T], attention mask [B, T] or None when every prompt has the same length). Padding goes on
    the left so every row's next token is the last column; id 0 fills it (never attended to)."""
    width = max(len(ids) for ids in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for r, row in enumerate(prompts):
        ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[r, width - len(row):] = True
    padded = bool((~mask).any())
    return ids.to(device), (mask.to(device) if padded else None)


def keep_rows(cache: KVCache | None, rows: torch.Tensor) -> None:
    """Drop finished rows from the KV cache (in place), so later steps compute only the rows still going."""
    if cache is not None:
        cache.keys = [k.index_select(0, rows) for k in cache.keys]
        cache.values = [v.index_select(0, rows) for v in cache.values]


def last_logits(model: CausalLM, ids: torch.Tensor, cache: KVCache | None,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Logits [B, V] of each row's last position only: the LM head of a whole prompt would be a
    [B, T, vocab] product (Qwen2.5-0.5B: 27% of the prefill's FLOPs, 2.5 GB at batch 64 x 128 tokens)
    of which decoding reads one row; forward(labels=None) is this head on every position."""
    h = model.hidden_states(ids, cache=cache, attention_mask=attention_mask)[:, -1]
    return F.linear(h, model.head_weight)


def next_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> list[int]:
    """Next id of each row of logits [B, V]: one argmax and one host read for the batch when greedy; rows
    drawn in order from the one seeded generator when sampling (batch 1 draws as a lone prompt does)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1).tolist()
    return [sample_next(row, temperature, top_p, generator) for row in logits]


def generate(model: CausalLM, tokenizer, prompt_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             on_text: Callable[[str], None] | None = None, *, use_cache: bool = True,
             keep_logits: bool = False, stop_ids: Sequence[int] | None = None) -> GenerationResult:
    """Continue `prompt_ids`. use_cache=False re-runs the whole sequence every step (the oracle
    for the KV cache); keep_logits keeps each step's float32 logits for that comparison."""
    return generate_batch(model, tokenizer, [prompt_ids], max_new_tokens, temperature, top_p, seed,
                          on_text=on_text, use_cache=use_cache, keep_logits=keep_logits, stop_ids=stop_ids)[0]


def generate_batch(model: CausalLM, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, *,
                   on_text: Callable[[str], None] | None = None, use_cache: bool = True,
                   keep_logits: bool = False, stop_ids: Sequence[int] | None = None,
                   stop_text: Callable[[str], bool] | None = None) -> list[GenerationResult]:
    """Continue every prompt at once: left padding with an attention mask (positions count real tokens),
    one KV cache for the batch, each row stopping on its own (stop token, `stop_text(text so far)` true,
    or max_new_tokens); finished rows leave the batch. Greedy tokens equal those of each prompt alone.
    on_text streams the text of a single prompt only. Results are in the order of `prompts`."""
    prompts = [[int(i) for i in p] for p in prompts]
    cfg = model.cfg
    _check_request(tokenizer, prompts, max_new_tokens, temperature, top_p, cfg)
    if on_text is not None and len(prompts) != 1:
        raise ValueError("on_text streams one prompt's text; give one prompt")
    stops = set(tokenizer.stop_ids if stop_ids is None else stop_ids)
    # ids past the tokenizer (a vocabulary rounded up to a multiple of 64) are padding rows: never sampled
    n_real = min(cfg.vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else cfg.vocab_size
    device = model.head_weight.device
    generator = None
    if temperature > 0:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=device).manual_seed(seed)

    n = len(prompts)
    streams = [TextStream(tokenizer, on_text) for _ in range(n)]  # fed only when streaming (decoding per token)
    outs: list[list[int]] = [[] for _ in range(n)]
    step_logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    stop_reasons = ["max_new_tokens"] * n
    rows = list(range(n))  # the prompt index of each row still in the batch
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            ids, mask = left_padded(prompts, device)
            cache = KVCache() if use_cache else None
            logits = last_logits(model, ids, cache, mask)
            for generated in range(max_new_tokens):
                check_logits_finite(model, logits, generated)
                if keep_logits:
                    for r, row in enumerate(rows):
                        step_logits[row].append(logits[r].float().cpu())
                picked = next_tokens(logits[:, :n_real], temperature, top_p, generator)  # never a padding id
                going = []  # positions (in the batch) of the rows that continue
                for r, (row, nxt) in enumerate(zip(rows, picked)):
                    outs[row].append(nxt)
                    if nxt in stops:
                        stop_reasons[row] = "eos" if nxt == tokenizer.eos_id else "end_of_turn"
                        continue
                    if on_text is not None:
                        streams[row].push(nxt)
                    if stop_text is not None and stop_text(tokenizer.decode(outs[row])):
                        stop_reasons[row] = "stop_text"
                        continue
                    if len(outs[row]) < max_new_tokens:
                        going.append(r)
                if not going:
                    break
                step = torch.tensor([[picked[r]] for r in going], dtype=torch.long, device=device)
                if len(going) < len(rows):
                    keep = torch.tensor(going, dtype=torch.long, device=device)
                    keep_rows(cache, keep)
                    ids = ids.index_select(0, keep)
                    mask = None if mask is None else mask.index_select(0, keep)
                    rows = [rows[r] for r in going]
                if mask is not None:
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                if use_cache:
                    logits = last_logits(model, step, cache, mask)
                else:
                    ids = torch.cat([ids, step], dim=1)
                    logits = last_logits(model, ids, None, mask)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    if on_text is not None:
        streams[0].finish()  # flushes a last piece held back as an incomplete character
    texts = [tokenizer.decode(out[:-1] if reason in ("eos", "end_of_turn") else out)  # the stop token is no text
             for out, reason in zip(outs, stop_reasons)]
    return [GenerationResult(outs[i], texts[i], stop_reasons[i], len(prompts[i]), len(outs[i]),
                             seconds, seed, step_logits[i]) for i in range(n)]
