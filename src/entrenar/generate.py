"""Text generation: one prefill of the prompt, then one token at a time from the KV cache.

Greedy when temperature is 0, else sampling from softmax(logits / temperature) restricted to
the top-p nucleus, drawn with a seeded torch.Generator (same seed, same tokens). Stops at EOS or
the end-of-turn token (that token is returned in token_ids but not in text) or after
max_new_tokens. Text is streamed through `on_text` as soon as it decodes to whole characters.
`generate_batch` decodes many prompts at once (left padding + attention mask, one KV cache, each row
stopping on its own); `generate` is its batch of one.

Two decoders, the same tokens: "static" (static_decode.py: a preallocated cache, fixed shapes, on CUDA one
decode step replayed as a CUDA graph; the default on CUDA) and "dynamic" (a cache grown by concatenation,
finished rows leave the batch; the default on the CPU, where the static one measured no faster at batch 1
and would keep computing finished rows).

`entrenar generate` (cli/models.py) is the command-line face.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import InputError
from .model import CausalLM, KVCache
from .static_decode import SYNC_EVERY_CUDA, decode_static, last_logits

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
    decoder: str = ""  # "cuda_graph" | "static" | "dynamic" | "no_cache": which loop decoded it

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / temperature) in fp32, cut to the top-p nucleus (the top token always stays): what a
    sampled token is drawn from, here and in the engine (engine.pick_tokens)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def pick_rows(logits: torch.Tensor, temperature: float, top_p: float,
              generator: torch.Generator | None) -> torch.Tensor:
    """Next id [B] of each row of logits [B, V], on their device without a host sync: argmax at
    temperature 0, else a draw from softmax(logits / temperature) cut to the top-p nucleus. The draw is
    torch.multinomial's own one-sample method (argmax of probs / Exp(1) noise from `generator`), the same
    ids for a seed, row after row, but multinomial reads its input's validity back to the host."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = nucleus_probs(logits, temperature, top_p)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> int:
    """Next token id from one row of logits [V]: argmax at temperature 0, else nucleus sampling."""
    return int(pick_rows(logits[None], temperature, top_p, generator)[0])


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
    if not bool(torch.isfinite(logits).all()):
        raise nonfinite_logits_error(model, generated)


def nonfinite_logits_error(model: nn.Module, generated: int) -> InputError:
    """check_logits_finite's error, for NaN/Inf logits after `generated` tokens."""
    bad = first_nonfinite_tensor(model)
    cause = (f"the weights contain NaN/Inf in {bad}: the checkpoint is corrupt or diverged; re-download or "
             f"re-convert it, or use an earlier checkpoint (`entrenar inspect` lists its tensors)" if bad else
             "no weight is NaN/Inf, so an activation overflowed its dtype; run in float32 or check the model")
    where = "on the prompt" if generated == 0 else f"after {generated} generated tokens"
    return InputError(f"the model produced non-finite logits {where}: {cause}")


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
    if not 0 <= temperature < math.inf:  # also rejects NaN; inf divides every logit to 0 or NaN
        raise InputError(f"temperature (--temperature) is {temperature}; it must be a finite number >= 0 "
                         f"(0 = greedy)")
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


class Rows:
    """The host's side of decoding, the same for both decoders: each prompt's generated ids, whether it
    goes on and why it stopped (a stop token, `stop_text(text so far)`, max_new_tokens), its streamed text."""

    def __init__(self, n: int, tokenizer, stops: set[int], max_new_tokens: int,
                 on_text: Callable[[str], None] | None, stop_text: Callable[[str], bool] | None):
        self.tokenizer, self.stops, self.max_new_tokens = tokenizer, stops, max_new_tokens
        self.on_text, self.stop_text = on_text, stop_text
        self.streams = [TextStream(tokenizer, on_text) for _ in range(n)]  # fed only when streaming
        self.outs: list[list[int]] = [[] for _ in range(n)]
        self.reasons = ["max_new_tokens"] * n
        self.going = list(range(n))  # the prompts still decoding, in order

    def take(self, row: int, nxt: int) -> bool:
        """Append `nxt` to prompt `row`'s ids; whether the row goes on."""
        out = self.outs[row]
        out.append(nxt)
        if nxt in self.stops:
            self.reasons[row] = "eos" if nxt == self.tokenizer.eos_id else "end_of_turn"
            return False
        if self.on_text is not None:
            self.streams[row].push(nxt)
        if self.stop_text is not None and self.stop_text(self.tokenizer.decode(out)):
            self.reasons[row] = "stop_text"
            return False
        return len(out) < self.max_new_tokens

    def take_columns(self, model: nn.Module, first: int, tokens: torch.Tensor, bad: torch.Tensor) -> bool:
        """The static decoder's picks first..first+m-1 of every row (tokens, bad: [B, m] on the host),
        taken pick by pick for the rows still going; NaN/Inf logits of such a row raise as in the
        dynamic loop. Whether any row goes on."""
        tokens, bad = tokens.tolist(), bad.tolist()
        for j in range(len(tokens[0])):
            if any(bad[row][j] for row in self.going):
                raise nonfinite_logits_error(model, first + j)
            self.going = [row for row in self.going if self.take(row, tokens[row][j])]
            if not self.going:
                return False
        return True


def generate(model: CausalLM, tokenizer, prompt_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
             on_text: Callable[[str], None] | None = None, *, use_cache: bool = True,
             keep_logits: bool = False, stop_ids: Sequence[int] | None = None, decoder: str = "auto",
             cuda_graphs: bool = True) -> GenerationResult:
    """Continue `prompt_ids`. use_cache=False re-runs the whole sequence every step (the oracle
    for the KV cache); keep_logits keeps each step's float32 logits for that comparison."""
    return generate_batch(model, tokenizer, [prompt_ids], max_new_tokens, temperature, top_p, seed,
                          on_text=on_text, use_cache=use_cache, keep_logits=keep_logits, stop_ids=stop_ids,
                          decoder=decoder, cuda_graphs=cuda_graphs)[0]


DECODERS = ("auto", "static", "dynamic")


def generate_batch(model: CausalLM, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, *,
                   on_text: Callable[[str], None] | None = None, use_cache: bool = True,
                   keep_logits: bool = False, stop_ids: Sequence[int] | None = None,
                   stop_text: Callable[[str], bool] | None = None, decoder: str = "auto",
                   cuda_graphs: bool = True) -> list[GenerationResult]:
    """Continue every prompt at once: left padding with an attention mask (positions count real tokens),
    one KV cache for the batch, each row stopping on its own (stop token, `stop_text(text so far)` true,
    or max_new_tokens). Greedy tokens equal those of each prompt alone. on_text streams the text of a
    single prompt only. Results are in the order of `prompts`.

    decoder: "static" (a preallocated cache and fixed shapes; on CUDA the decode step is a CUDA graph
    unless cuda_graphs=False), "dynamic" (a growing cache; finished rows leave the batch) or "auto" (static
    on CUDA, dynamic elsewhere). Both give the same tokens (greedy; seeded sampling too while no row has
    left the dynamic batch)."""
    if decoder not in DECODERS:
        raise ValueError(f"decoder {decoder!r} not in {DECODERS}")
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

    def pick(logits: torch.Tensor) -> torch.Tensor:
        return pick_rows(logits[:, :n_real], temperature, top_p, generator)  # never a padding id

    n = len(prompts)
    rows = Rows(n, tokenizer, stops, max_new_tokens, on_text, stop_text)
    kept: list[torch.Tensor] | None = [] if keep_logits else None  # [B, V] per pick (static decoder)
    step_logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    static = use_cache and (decoder == "static" or (decoder == "auto" and device.type == "cuda"))
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            ids, mask = left_padded(prompts, device)
            if static:
                sync_every = 1 if on_text is not None or device.type != "cuda" else SYNC_EVERY_CUDA
                used = decode_static(model, ids, mask, max_new_tokens, pick,
                                     lambda first, tokens, bad: rows.take_columns(model, first, tokens, bad),
                                     cuda_graph=cuda_graphs, pick_in_graph=temperature == 0.0,
                                     sync_every=sync_every, kept_logits=kept)
                if kept is not None:
                    step_logits = [[kept[g][row].cpu() for g in range(len(rows.outs[row]))] for row in range(n)]
            else:
                used = "dynamic" if use_cache else "no_cache"
                _decode_dynamic(model, ids, mask, rows, pick, use_cache, step_logits if keep_logits else None)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    if on_text is not None:
        rows.streams[0].finish()  # flushes a last piece held back as an incomplete character
    outs, stop_reasons = rows.outs, rows.reasons
    texts = [tokenizer.decode(out[:-1] if reason in ("eos", "end_of_turn") else out)  # the stop token is no text
             for out, reason in zip(outs, stop_reasons)]
    return [GenerationResult(outs[i], texts[i], stop_reasons[i], len(prompts[i]), len(outs[i]),
                             seconds, seed, step_logits[i], used) for i in range(n)]


def _decode_dynamic(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor | None, rows: Rows,
                    pick: Callable[[torch.Tensor], torch.Tensor], use_cache: bool,
                    step_logits: list[list[torch.Tensor]] | None) -> None:
    """The growing-cache loop: one pick per step for the rows still going, read back at once; finished rows
    leave the batch (and the cache). use_cache=False re-runs the whole sequence every step instead."""
    device = ids.device
    cache = KVCache() if use_cache else None
    logits = last_logits(model, ids, cache, mask)
    batch = rows.going  # the prompt index of each row in the batch
    for generated in range(rows.max_new_tokens):
        check_logits_finite(model, logits, generated)
        if step_logits is not None:
            for r, row in enumerate(batch):
                step_logits[row].append(logits[r].float().cpu())
        picked = pick(logits).tolist()
        going = [r for r, row in enumerate(batch) if rows.take(row, picked[r])]  # batch positions going on
        if not going:
            break
        step = torch.tensor([[picked[r]] for r in going], dtype=torch.long, device=device)
        if len(going) < len(batch):
            keep = torch.tensor(going, dtype=torch.long, device=device)
            keep_rows(cache, keep)
            ids = ids.index_select(0, keep)
            mask = None if mask is None else mask.index_select(0, keep)
            batch = rows.going = [batch[r] for r in going]
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if use_cache:
            logits = last_logits(model, step, cache, mask)
        else:
            ids = torch.cat([ids, step], dim=1)
            logits = last_logits(model, ids, None, mask)
