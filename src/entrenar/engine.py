"""Continuous batching: many prompts through a fixed set of decode slots (`generate_many`).

`generate_batch` decodes a batch until its longest member ends; here a slot whose sequence ended takes the
next prompt at the next host read, so the decode batch stays full while prompts remain. The pieces:

- **Slots.** A KV cache of `max_slots` rows x `max_len` columns per layer (`SlotKVCache`), allocated once.
  Slot s holds one request: its prompt in columns 0..W-1 (left padded to its prefill group's width W; the
  padding columns are marked invalid), then one column per generated token. Each slot has its own next
  column `col[s]` and its own RoPE position `pos[s]` (the real tokens before the token it feeds: padding is
  not counted), on the device.
- **Masks.** A decode step lets slot s attend to columns `valid[s] & (column <= col[s])`: its own prompt's
  real tokens and what it generated since it was admitted. Columns past col[s] hold an earlier request's keys
  or zeros (a freed slot is never cleared) and are never seen. Slots are batch rows, so no slot attends to
  another's cache.
- **Admission.** Prompts are sorted by length (longest first: a memory problem shows at once, neighbours
  pad little) and prefilled in groups of at most `prefill_tokens` padded tokens straight into free slots
  (lowest free slots first, so live slots gather at the low indices). The prefill's logits give the first
  token at once.
- **Decode steps.** One step feeds every slot 0..b-1 (b: the smallest bucket, a power of two or max_slots,
  covering the highest live slot) one token; static shapes per bucket, so on CUDA each bucket's step is a
  CUDA graph (static_decode.GraphStep) captured after WARMUP_STEPS eager steps and replayed, one per attended-
  columns bucket too (attend_bucket: the step reads only the columns the live slots reach). Free slots and
  finished-but-not-yet-read rows compute too; their tokens are dropped and their column is clamped to the
  cache. The host reads the picked tokens every `sync_every` steps (1 on the CPU): then finished requests
  free their slots and pending prompts are admitted.
- **Picks.** Greedy: argmax. Sampling: softmax(logits / temperature) cut to the top-p nucleus, drawn with
  exponential noise that is a counter-based hash of (the request's key, its token index, the vocabulary id):
  no generator state, so a request's tokens depend on its seed and prompt only -- not on the slot, the
  batch, the other requests or the order -- and the draw can sit inside a CUDA graph. A request's key mixes
  its seed (sample s of a pass@k eval: seed + s) with a hash of its prompt ids.

Greedy outputs equal each prompt decoded alone (tests/test_engine.py: tiny models and the packaged SmolLM2,
fp32 on the CPU, for several slot counts; and transformers' generate). Stop rules are generate_batch's:
a stop token (EOS / end-of-turn), `stop_text(text so far)`, or the request's token limit.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import static_decode as sd
from .errors import InputError
from .generate import DEFAULT_MAX_NEW_TOKENS, GenerationResult, nonfinite_logits_error, nucleus_probs
from .model import CausalLM, StaticKVCache, padded_positions, padding_mask

SYNC_EVERY_CUDA = 8  # decode steps between two host reads on CUDA (a finished slot waits this long at most)
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill forward at most (bounds its activations)
# free slots that wait for company before a prefill: an eager forward costs the host ~60 ms on a 30-layer model
# whatever its rows (H200; ~2 ms of launches per layer), so one prefill per freed slot spent 94% of a 64-slot
# BFCL-like run prefilling; admitting when an eighth of the slots is free prefilled 8x fewer times
ADMIT_FRACTION = 8
ATTEND_MIN = 128  # the smallest attended-columns bucket of a captured decode step (attend_bucket)
_M32 = 0xFFFFFFFF
# a prefill's attention kernels: every prefill group has a new shape, and cuDNN's SDPA builds an execution plan for
# each (measured on an H200: +50 ms a prefill); the memory-efficient kernel takes the padding mask at no such cost
# (with GQA, SDPA takes the math path: scores [rows, heads, W, W] in fp32, counted in slot_memory)
PREFILL_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class GenerationSettings:
    """How `generate_many` decodes. Every request gets min(max_new_tokens, the model's context - its prompt)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0  # the sampling seed of every request not given its own (generate_many's `seeds`)
    max_slots: int = 8  # sequences decoded at once: the rows of the KV cache
    stop_ids: Sequence[int] | None = None  # None: the tokenizer's stop ids (EOS, end-of-turn)
    stop_text: Callable[[str], bool] | None = None  # ends a request when true of its text so far
    sync_every: int = 0  # decode steps between host reads; 0 = 1 on the CPU, SYNC_EVERY_CUDA on CUDA
    cuda_graphs: bool = True  # on CUDA, each bucket's decode step replayed as a CUDA graph
    # a decode step's attention: "kernel" (kernels/decode_attention: each slot's own columns), "sdpa" (every
    # attended column under a mask), "auto" (ENTRENAR_DECODE_ATTENTION if set, else the kernel on CUDA)
    decode_attention: str = "auto"
    prefill_tokens: int = PREFILL_TOKENS


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (a bijection of [0, 2^32)) on int64 tensors: every product stays below 2^63."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def request_key(seed: int, prompt: Sequence[int]) -> int:
    """The 32-bit key of a request's sampling stream: its seed and its prompt ids, nothing about the batch."""
    digest = hashlib.blake2b(f"{int(seed)}/{','.join(map(str, prompt))}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def exponential_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab] (fp32) of each row's key [B] at its token index [B]: a counter-based draw, the
    same numbers for the same (key, index) whatever the batch."""
    h = _mix32((keys + steps * 0x9E3779B1) & _M32)
    ids = torch.arange(vocab, device=keys.device)
    u = _mix32(_mix32(h[:, None] ^ ids))
    uniform = ((u >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(uniform)


def pick_tokens(logits: torch.Tensor, temperature: float, top_p: float, keys: torch.Tensor,
                steps: torch.Tensor) -> torch.Tensor:
    """Next id [B] per row of logits [B, V]: argmax at temperature 0, else a draw from softmax(logits /
    temperature) cut to the top-p nucleus, as generate.pick_rows, with the noise of exponential_noise."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = nucleus_probs(logits, temperature, top_p)
    return (probs / exponential_noise(keys, steps, probs.shape[-1])).argmax(dim=-1)


class SlotKVCache(StaticKVCache):
    """Keys/values [max_slots, K, max_len, D] per layer. A prefill (``rows`` set: the slots of its batch rows)
    writes its prompts' keys at columns 0..W-1 of those slots and attends to them alone; a decode step (``rows``
    None) feeds slots 0..b-1 one token each, written at column ``cols[s]`` of slot s, and attends to columns
    0..``attend``-1 under ``mask`` (set by the engine), or, with ``spans`` set (start, end [b] on the device), to
    columns start[s] <= t < end[s] of each slot through kernels.decode_attention, which reads only those."""

    def __init__(self, num_layers: int, max_slots: int, max_len: int, device: torch.device):
        super().__init__(num_layers, max_len)
        self.max_slots = max_slots
        self.slot_index = torch.arange(max_slots, device=device)
        self.rows: torch.Tensor | None = None
        self.cols: torch.Tensor | None = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[layer] is None:
            _, K, _, D = k.shape
            self.keys[layer] = k.new_zeros(self.max_slots, K, self.max_len, D)
            self.values[layer] = v.new_zeros(self.max_slots, K, self.max_len, D)
        keys, values = self.keys[layer], self.values[layer]
        if self.rows is not None:  # prefill: the prompts see their own keys only (padding_mask)
            W = k.shape[2]
            keys[self.rows, :, :W] = k
            values[self.rows, :, :W] = v
            return k, v
        b = k.shape[0]
        keys[self.slot_index[:b], :, self.cols] = k[:, :, 0]
        values[self.slot_index[:b], :, self.cols] = v[:, :, 0]
        return keys[:b, :, :self.attend], values[:b, :, :self.attend]

    def attend_spans(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from .kernels.decode_attention import (
            decode_attention,  # Triton: imported only where the engine uses it
        )

        start, end = self.spans
        return decode_attention(q, k, v, start, end, q.shape[-1] ** -0.5)


DECODE_ATTENTION = ("auto", "kernel", "sdpa")


LINEAR_COPY_SHARE = 0.1  # bf16 copies of the linear weights at most this share of the free device memory


def _cast_dtype(model: CausalLM, device: torch.device) -> torch.dtype | None:
    """The dtype autocast casts the linear weights to in every decode step, when a copy in it fits (CUDA only)."""
    if device.type != "cuda" or not torch.is_autocast_enabled("cuda"):
        return None
    dtype = torch.get_autocast_dtype("cuda")
    fp32 = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
               and m.weight.dtype == torch.float32)
    return dtype if fp32 * dtype.itemsize <= LINEAR_COPY_SHARE * free_device_memory(device) else None


@contextlib.contextmanager
def linear_weights_in(model: torch.nn.Module, dtype: torch.dtype | None):
    """Every fp32 nn.Linear's weight and bias (LoRA's A and B too) held as a `dtype` copy while the block runs, then
    put back. Under autocast to `dtype` a linear casts its fp32 weight at every call: a decode step (and a CUDA
    graph, which cannot keep autocast's cast cache) re-cast all of a model's weights per token; with the copies the
    matmuls see the same `dtype` values (autocast's cast is this rounding), so the tokens are the same. The tied
    embedding / LM head and the norms stay fp32. None: nothing changes."""
    swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    if dtype is not None:
        for m in model.modules():
            if not isinstance(m, torch.nn.Linear):
                continue
            for p in (m.weight, m.bias):
                # plain fp32 tensors only (a sharded DTensor parameter is not swapped)
                if p is not None and p.dtype == torch.float32 and type(p.data) is torch.Tensor:
                    swapped.append((p, p.data))
                    p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, data in swapped:
            p.data = data


def use_decode_kernel(choice: str, device: torch.device) -> bool:
    """Whether decode steps attend through kernels.decode_attention: GenerationSettings.decode_attention, "auto"
    deferring to ENTRENAR_DECODE_ATTENTION (a bench's A/B switch) and then to the device (CUDA with Triton)."""
    if choice == "auto":
        choice = os.environ.get("ENTRENAR_DECODE_ATTENTION", "auto")
    if choice not in DECODE_ATTENTION:
        raise InputError(f"decode attention {choice!r} (GenerationSettings.decode_attention or "
                         f"ENTRENAR_DECODE_ATTENTION) is not one of {', '.join(DECODE_ATTENTION)}")
    if choice == "auto":
        from .kernels import triton_available

        return device.type == "cuda" and triton_available()
    return choice == "kernel"


def check_requests(tokenizer, prompts: Sequence[list[int]], settings: GenerationSettings, cfg) -> None:
    """InputError (exit 2) for a request no decoding can serve."""
    if not prompts:
        raise InputError("no prompts given; give at least one prompt")
    if settings.max_new_tokens < 1:
        raise InputError(f"max_new_tokens is {settings.max_new_tokens}; it must be at least 1")
    if not settings.temperature >= 0:  # also rejects NaN
        raise InputError(f"temperature (--temperature) is {settings.temperature}; it must be >= 0 (0 = greedy)")
    if not 0.0 < settings.top_p <= 1.0:
        raise InputError(f"top_p (--top-p) is {settings.top_p}; it must be in (0, 1] (1 = no nucleus cut)")
    if settings.max_slots < 1:
        raise InputError(f"--batch-size (the decode slots) is {settings.max_slots}; it must be at least 1")
    context = cfg.max_position_embeddings
    for i, ids in enumerate(prompts):
        if not ids:
            raise InputError(f"prompt {i} is empty (0 tokens); give some prompt text")
        if len(ids) >= context:
            raise InputError(f"prompt {i} has {len(ids)} tokens and fills the model's context of {context} "
                             f"positions; shorten it")
        tokenizer.check_ids(ids, cfg.vocab_size)


def buckets(max_slots: int) -> list[int]:
    """The decode batch sizes: powers of two below max_slots, and max_slots."""
    out, b = [], 1
    while b < max_slots:
        out.append(b)
        b *= 2
    return out + [max_slots]


class _Requests:
    """The host's side: each request's generated ids, its token limit, why it stopped."""

    def __init__(self, tokenizer, prompts: list[list[int]], limits: list[int], stops: set[int],
                 stop_text: Callable[[str], bool] | None):
        self.tokenizer, self.prompts, self.limits = tokenizer, prompts, limits
        self.stops, self.stop_text = stops, stop_text
        self.outs: list[list[int]] = [[] for _ in prompts]
        self.reasons = ["max_new_tokens"] * len(prompts)

    def take(self, r: int, tokens: Sequence[int]) -> bool:
        """Append the picks `tokens` (one host read's) to request r up to where it stops; whether it goes on.
        A stop token or the token limit ends it at that token. stop_text is asked of the text after the last of
        these tokens only, then, when true, of each shorter prefix to find the first token that made it true:
        a stop rule is monotone (once true of a text, true of every continuation, as "a ``` line began"), so
        the request ends where generate_batch's per-token check ends it, at a decode per host read."""
        out, n0 = self.outs[r], len(self.outs[r])
        going, reason = True, "max_new_tokens"
        for nxt in tokens:
            out.append(nxt)
            if nxt in self.stops:
                going, reason = False, "eos" if nxt == self.tokenizer.eos_id else "end_of_turn"
                break
            if len(out) >= self.limits[r]:
                going = False
                break
        last = len(out) - (reason != "max_new_tokens")  # the text never includes a stop token
        if self.stop_text is not None and last > n0 and self.stop_text(self.tokenizer.decode(out[:last])):
            first = next(k for k in range(n0 + 1, last + 1) if k == last or self.stop_text(self.tokenizer.decode(out[:k])))
            del out[first:]
            going, reason = False, "stop_text"
        self.reasons[r] = reason
        return going

    def result(self, r: int, seconds: float, seed: int | None, decoder: str) -> GenerationResult:
        out, reason = self.outs[r], self.reasons[r]
        text = self.tokenizer.decode(out[:-1] if reason in ("eos", "end_of_turn") else out)
        return GenerationResult(out, text, reason, len(self.prompts[r]), len(out), seconds, seed, decoder=decoder)


class Engine:
    """The device state of one generate_many call: the slot cache and each slot's decode inputs."""

    def __init__(self, model: CausalLM, max_slots: int, max_len: int, settings: GenerationSettings,
                 n_real: int, device: torch.device):
        self.model, self.settings, self.n_real = model, settings, n_real
        self.S, self.L, self.device = max_slots, max_len, device
        self.cache = SlotKVCache(model.cfg.num_layers, max_slots, max_len, device)
        long = {"dtype": torch.long, "device": device}
        self.tok_in = torch.zeros(max_slots, 1, **long)  # the token each slot feeds next
        self.pos = torch.zeros(max_slots, 1, **long)  # its RoPE position: the slot's real tokens before it
        self.col = torch.zeros(max_slots, **long)  # its cache column
        self.keys = torch.zeros(max_slots, **long)  # the slot's request's sampling key
        self.steps = torch.zeros(max_slots, **long)  # tokens picked for the slot's request so far
        self.valid = torch.ones(max_slots, max_len, dtype=torch.bool, device=device)  # False on left padding
        self.first = torch.zeros(max_slots, **long)  # the slot's first valid column: its left padding's width
        self.prefill_rows = 0  # prompts computed by prefills (a prompt asked several times at once counts once)
        self.span_kernel = use_decode_kernel(settings.decode_attention, device)
        self.key_index = torch.arange(max_len, device=device)
        self.window = max(1, settings.sync_every)
        self.at = torch.zeros(1, **long)  # the next column of `picked`/`bad` (reset at each host read)
        self.picked = torch.zeros(max_slots, self.window, **long)
        self.bad = torch.zeros(max_slots, self.window, dtype=torch.bool, device=device)

    def pick(self, logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        s = self.settings
        return pick_tokens(logits[:, :self.n_real], s.temperature, s.top_p, keys, steps)  # never a padding id

    def prefill(self, slots: list[int], prompts: list[list[int]], keys: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts (left padded to their longest) into `slots`; their first picks [n] and whether those logits
        were non-finite [n], on the host. A prompt asked several times (pass@k's samples, GRPO's group) is computed
        once, in its first request's slot; its keys and values are copied to the others' slots and its logits give
        each request its own first pick."""
        device = self.device
        index: dict[tuple[int, ...], int] = {}
        of = [index.setdefault(tuple(p), len(index)) for p in prompts]  # each request's unique prompt
        unique = [list(p) for p in index]
        n, W = len(unique), max(len(p) for p in prompts)
        ids = torch.zeros(n, W, dtype=torch.long)
        mask = torch.zeros(n, W, dtype=torch.bool)
        for r, p in enumerate(unique):
            ids[r, W - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, W - len(p):] = True
        ids, mask = ids.to(device), mask.to(device)
        home = [slots[of.index(u)] for u in range(n)]  # the slot each unique prompt is computed in
        positions = padded_positions(mask)
        cache = self.cache
        cache.rows, cache.mask, cache.spans = (torch.tensor(home, dtype=torch.long, device=device),
                                               padding_mask(mask, W), None)  # a 1-token prefill is no decode step
        with sdpa_kernel(PREFILL_ATTENTION):  # not cuDNN's: it builds a plan per new shape (~0.1 s a prefill)
            logits = sd.last_logits(self.model, ids, cache, position_ids=positions)
        cache.rows = None
        copies = [(slot, home[u]) for slot, u in zip(slots, of) if slot != home[u]]
        if copies:
            dst, src = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*copies))
            for layer in cache.keys + cache.values:
                layer[dst, :, :W] = layer[src, :, :W]
        self.prefill_rows += n
        back = torch.tensor(of, dtype=torch.long, device=device)
        logits, mask, positions = logits[back], mask[back], positions[back]
        rows = torch.tensor(slots, dtype=torch.long, device=device)
        keys_t = torch.tensor(keys, dtype=torch.long, device=device)
        first = self.pick(logits, keys_t, torch.zeros_like(keys_t))
        self.valid[rows] = True
        self.valid[rows, :W] = mask
        self.first[rows] = W - mask.sum(1)
        self.tok_in[rows] = first[:, None]
        self.pos[rows] = positions[:, -1:] + 1
        self.col[rows] = W
        self.keys[rows] = keys_t
        self.steps[rows] = 1
        return first.cpu(), (~torch.isfinite(logits).all(-1)).cpu()

    def step_fn(self, b: int, attend: int) -> Callable[[], torch.Tensor]:
        """One decode step of slots 0..b-1 attending to `attend` columns (the same shapes at every call)."""
        cache = self.cache

        def step() -> torch.Tensor:
            col = self.col[:b]
            cache.cols, cache.attend = col, attend
            if self.span_kernel:  # the same columns as the mask below: the slot's prompt after its padding, up to col
                cache.spans = (self.first[:b], col + 1)
            else:
                cache.mask = (self.valid[:b, :attend] & (self.key_index[:attend] <= col[:, None]))[:, None, None, :]
            logits = sd.last_logits(self.model, self.tok_in[:b], cache, position_ids=self.pos[:b])
            picked = self.pick(logits, self.keys[:b], self.steps[:b])
            self.picked[:b].index_copy_(1, self.at, picked[:, None])
            self.bad[:b].index_copy_(1, self.at, ~torch.isfinite(logits).all(-1, keepdim=True))
            self.tok_in[:b].copy_(picked[:, None])
            self.pos[:b].add_(1)
            col.add_(1).clamp_(max=self.L - 1)  # a free or finished slot keeps stepping: kept inside the cache
            self.steps[:b].add_(1)
            self.at.add_(1)
            return logits

        return step


def generate_many(model: CausalLM, tokenizer, prompts: Sequence[Sequence[int]], settings: GenerationSettings,
                  *, seeds: Sequence[int] | None = None, max_new: Sequence[int] | None = None,
                  on_result: Callable[[int, GenerationResult], None] | None = None,
                  stats: dict | None = None) -> list[GenerationResult]:
    """Continue every prompt through settings.max_slots decode slots (continuous batching, see the module's
    doc); results in the order of `prompts`. `seeds`: each request's sampling seed (default settings.seed),
    e.g. seed + s for sample s of a prompt. `max_new`: each request's own token limit (default
    settings.max_new_tokens; either way at most the context left after its prompt). `on_result(index, result)`
    is called as each request ends. `stats`, when given, receives where the time went (describe_stats).
    Each result's `seconds` is the whole call's."""
    cfg = model.cfg
    prompts, seed_of, limits = _requests(tokenizer, prompts, settings, cfg, seeds, max_new)
    n = len(prompts)
    sampling = settings.temperature > 0
    stops = set(tokenizer.stop_ids if settings.stop_ids is None else settings.stop_ids)
    reqs = _Requests(tokenizer, prompts, limits, stops, settings.stop_text)
    n_real = min(cfg.vocab_size, len(tokenizer)) if hasattr(tokenizer, "__len__") else cfg.vocab_size
    device = model.head_weight.device
    S = min(settings.max_slots, n)
    max_len = max(len(p) for p in prompts) + max(limits)  # a group's width is its longest prompt
    sync_every = settings.sync_every or (SYNC_EVERY_CUDA if device.type == "cuda" else 1)
    settings = GenerationSettings(**{**settings.__dict__, "sync_every": sync_every})
    # popped from the end: longest first, a prompt's repeats side by side (one prefill row for all of them)
    pending = sorted(range(n), key=lambda i: (-len(prompts[i]), prompts[i], i))[::-1]
    results: list[GenerationResult | None] = [None] * n
    slot_req = [-1] * S  # the request each slot holds, -1 = free
    width = [0] * S  # the prefill width of each slot's request: its first generated token's column
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    counts: dict = {"prefills": 0, "prefill_seconds": 0.0, "launch_seconds": 0.0, "read_seconds": 0.0}

    def finish(r: int) -> None:
        results[r] = reqs.result(r, 0.0, seed_of[r] if sampling else None, "")
        if on_result is not None:
            on_result(r, results[r])

    try:
        with torch.inference_mode(), linear_weights_in(model, _cast_dtype(model, device)):
            eng = Engine(model, S, max_len, settings, n_real, device)
            steps = _Steps(eng, max_len, device, settings.cuda_graphs and sd.can_capture(device))

            def admit() -> None:
                """Fill free slots from `pending`, a prefill group at a time, once 1/ADMIT_FRACTION of the slots (or
                every pending prompt, or every slot) can be filled; a request whose first token already ends it
                frees its slot again."""
                while pending:
                    free = [s for s in range(S) if slot_req[s] < 0]
                    if not free or len(free) < min(max(1, S // ADMIT_FRACTION), len(pending)) and len(free) < S:
                        return
                    group = _prefill_group(pending, prompts, len(free), settings.prefill_tokens)
                    slots = free[:len(group)]
                    keys = [request_key(seed_of[r], prompts[r]) if sampling else 0 for r in group]
                    t0 = time.perf_counter()
                    first, bad = eng.prefill(slots, [prompts[r] for r in group], keys)
                    counts["prefills"] += 1
                    counts["prefill_seconds"] += time.perf_counter() - t0
                    for slot, r, tok, nonfinite in zip(slots, group, first.tolist(), bad.tolist()):
                        if nonfinite:
                            raise nonfinite_logits_error(model, 0)
                        if reqs.take(r, [tok]):
                            slot_req[slot], width[slot] = r, len(prompts[group[0]])
                        else:
                            finish(r)

            admit()
            while any(r >= 0 for r in slot_req):
                top = max(s for s in range(S) if slot_req[s] >= 0) + 1
                b = next(x for x in buckets(S) if x >= top)
                t0 = time.perf_counter()
                steps.window(b, max(width[s] + len(reqs.outs[slot_req[s]]) for s in range(b) if slot_req[s] >= 0),
                             sync_every)
                t1 = time.perf_counter()
                picked, bad = eng.picked[:b].tolist(), eng.bad[:b].tolist()
                counts["launch_seconds"] += t1 - t0  # the host queueing the window's steps (eager: running them)
                counts["read_seconds"] += time.perf_counter() - t1  # waiting for the device to finish them
                for s in range(b):
                    r = slot_req[s]
                    if r < 0:
                        continue
                    before = len(reqs.outs[r])
                    going = reqs.take(r, picked[s])
                    if any(bad[s][:len(reqs.outs[r]) - before]):  # the logits of a token it took
                        raise nonfinite_logits_error(model, before)
                    if not going:
                        slot_req[s] = -1
                        finish(r)
                admit()
    finally:
        model.train(was_training)
    seconds, decoder = time.perf_counter() - start, "engine_graph" if steps.used_graph else "engine"
    if stats is not None:
        stats.update(counts, **steps.counts, seconds=seconds, slots=S, max_len=max_len, prefill_rows=eng.prefill_rows,
                     **{k: round(counts[k], 3) for k in ("prefill_seconds", "launch_seconds", "read_seconds")},
                     attend_buckets=sorted(steps.attended))
    for res in results:
        assert res is not None
        res.seconds, res.decoder = seconds, decoder
    return results  # type: ignore[return-value]


def _prefill_group(pending: list[int], prompts: list[list[int]], room: int, prefill_tokens: int) -> list[int]:
    """The next prefill group, popped from the end of `pending` (longest first): at most `room` requests whose distinct
    prompts, padded to the first (longest) one's width, stay within `prefill_tokens` (a prompt asked several times is
    computed once)."""
    group: list[int] = []
    distinct: set[tuple[int, ...]] = set()
    while pending and len(group) < room:
        w = len(prompts[group[0]]) if group else 0  # the group's width: its first, longest prompt
        nxt = tuple(prompts[pending[-1]])
        if group and nxt not in distinct and (len(distinct) + 1) * w > prefill_tokens:
            break
        distinct.add(nxt)
        group.append(pending.pop())
    return group


class _Steps:
    """One decode step of bucket b at a time, attending to `attend` columns (attend_bucket: what the live slots reach
    within the host read, rounded up). On CUDA a graph per (b, attend) once that pair has warmed up (eagerly for good
    if a capture fails), all sharing one memory pool (a step's temporaries live only while it replays); on the
    CPU, eager over exactly the columns `columns()` says the live slots reach."""

    def __init__(self, eng: Engine, max_len: int, device: torch.device, use_graph: bool):
        self.eng, self.max_len, self.device, self.use_graph = eng, max_len, device, use_graph
        self.graphs: dict[tuple[int, int], sd.GraphStep] = {}
        self.warm: dict[tuple[int, int], int] = {}
        self.used_graph = False
        self.pool = sd.new_pool() if use_graph else None
        self.counts = {"graph_steps": 0, "eager_steps": 0, "captures": 0, "host_reads": 0}
        self.attended: set[int] = set()

    def window(self, b: int, reach: int, steps: int) -> None:
        """The `steps` decode steps of one host read, the live slots reaching column `reach` - 1 at its start: a
        graph's attended columns cover every column the window writes (attend_bucket); eager attends to exactly
        the columns reached at each step."""
        self.eng.at.zero_()
        attend = attend_bucket(reach + steps - 1, self.max_len)
        for j in range(steps):
            self.run(b, lambda j=j: min(self.max_len, reach + j), attend)
        self.counts["host_reads"] += 1
        self.attended.add(attend)

    def run(self, b: int, columns: Callable[[], int], attend: int) -> None:
        key = (b, attend)
        # the first graph of a call after WARMUP_STEPS eager steps (lazy inits: cuBLAS, Triton compiles), every later
        # one after one: an eager step costs ~35 ms of host launches on a 30-layer model (H200), a replay ~5 ms
        warmup = 1 if self.graphs else sd.WARMUP_STEPS
        if self.use_graph and key not in self.graphs and self.warm.get(key, 0) >= warmup:
            try:
                self.graphs[key] = sd.GraphStep(self.eng.step_fn(b, attend), pool=self.pool)
                self.counts["captures"] += 1
            except RuntimeError as e:  # an op that cannot be captured: the same step, eagerly
                warnings.warn(f"CUDA graph capture of the decode step failed, decoding eagerly: {e}",
                              RuntimeWarning, stacklevel=3)
                self.use_graph = False
        if key in self.graphs:
            self.graphs[key].replay()
            self.used_graph = True
            self.counts["graph_steps"] += 1
            return
        self.counts["eager_steps"] += 1
        if self.use_graph:
            sd.warmup_step(self.eng.step_fn(b, attend), self.device)
            self.warm[key] = self.warm.get(key, 0) + 1
        else:
            self.eng.step_fn(b, columns())()


def describe_stats(stats: dict) -> str:
    """generate_many's `stats` in one line for a log: prefills, their distinct prompts and seconds (host and device, up
    to their first picks), decode steps replayed from a graph or run eagerly, graph captures, host reads, the
    attended-column buckets, the host's time queueing decode steps (launch_seconds) and waiting for them at host reads
    (read_seconds); the rest of `seconds` is the host's own work between reads."""
    return (f"generation: {stats['seconds']:.2f} s on {stats['slots']} slots; {stats['prefills']} prefills "
            f"({stats['prefill_seconds']:.2f} s, {stats['prefill_rows']} distinct prompts), {stats['graph_steps']} decode steps from CUDA graphs + "
            f"{stats['eager_steps']} eager, {stats['captures']} graphs captured, {stats['host_reads']} host reads, "
            f"attended columns {stats['attend_buckets']} of {stats['max_len']}; decode steps queued in "
            f"{stats['launch_seconds']:.2f} s, waited for {stats['read_seconds']:.2f} s")


def attend_bucket(need: int, max_len: int) -> int:
    """The columns a captured decode step attends to when the live slots reach `need`: the next of 128, 256,
    512, ... at or past it, at most max_len. A step's attention reads every attended column of every slot (the
    KV cache: 455 MB a layer for 512 slots x 1,156 columns of SmolLM2), so a graph over all max_len columns spent
    most of a step on columns no slot had reached; power-of-two buckets keep the graphs per slot bucket to a
    few."""
    a = ATTEND_MIN
    while a < need:
        a *= 2
    return min(a, max_len)


def _requests(tokenizer, prompts: Sequence[Sequence[int]], settings: GenerationSettings, cfg,
              seeds: Sequence[int] | None, max_new: Sequence[int] | None) -> tuple[list[list[int]], list[int], list[int]]:
    """generate_many's requests checked: (prompts as int lists, each one's seed, each one's token limit: its own
    max_new or settings', at most the context left after its prompt)."""
    prompts = [[int(i) for i in p] for p in prompts]
    check_requests(tokenizer, prompts, settings, cfg)
    for name, given in (("seeds", seeds), ("max_new", max_new)):
        if given is not None and len(given) != len(prompts):
            raise ValueError(f"{len(given)} {name} for {len(prompts)} prompts")
    if max_new is not None and min(max_new) < 1:
        raise InputError(f"a request's max_new_tokens is {min(max_new)}; it must be at least 1")
    seed_of = [int(seeds[i]) if seeds is not None else settings.seed for i in range(len(prompts))]
    wanted = [settings.max_new_tokens] * len(prompts) if max_new is None else [int(m) for m in max_new]
    limits = [min(w, cfg.max_position_embeddings - len(p)) for w, p in zip(wanted, prompts)]
    return prompts, seed_of, limits


# ---- --batch-size auto: the slot count from free memory and the model ---------------------------------------
CPU_SLOTS = 8  # the CPU's default (batches measured no faster past a few rows there)
MAX_AUTO_SLOTS = 512  # past this a decode step is compute-bound on an H200 even for a 135M model
MEMORY_FRACTION = 0.8  # of the free memory: the rest for the allocator's fragmentation and other processes


@dataclass(frozen=True)
class SlotMemory:
    """What one generate_many call needs: bytes per slot (its KV cache columns and decode activations) and
    bytes whatever the slot count (a prefill forward's activations)."""

    per_slot: int
    fixed: int


def slot_memory(cfg, *, max_len: int, longest_prompt: int, kv_bytes: int, sampling: bool,
                cuda_graphs: bool, prefill_tokens: int = PREFILL_TOKENS) -> SlotMemory:
    """The bytes of slot_memory's two parts for a model config. Per slot: keys and values of every layer over
    max_len columns at `kv_bytes` each; the decode step's logits row (fp32) and, sampling, its softmax, sort
    and hashed noise (int64 temporaries); the attention scores of one query over max_len columns per head;
    doubled under CUDA graphs (a graph's pool holds its step's temporaries). Fixed: a prefill of prefill_tokens
    tokens (the MLP's three intermediate tensors, the residual stream, the scores of prompts up to
    longest_prompt wide)."""
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_bytes * max_len
    logits = cfg.vocab_size * (48 if sampling else 8)
    scores = cfg.num_heads * max_len * 4
    hidden = 16 * (cfg.hidden_size + cfg.intermediate_size) * 4
    act = (logits + scores + hidden) * (2 if cuda_graphs else 1)
    prefill = prefill_tokens * (3 * cfg.intermediate_size * 4 + 8 * cfg.hidden_size * 4
                                + 3 * cfg.num_heads * longest_prompt * 4)  # GQA's prefill: SDPA's math path
    return SlotMemory(per_slot=kv + act, fixed=prefill)


def auto_slots(free_bytes: int, need: SlotMemory, requests: int, cap: int = MAX_AUTO_SLOTS) -> tuple[int, str]:
    """(slots, why) for `--batch-size auto`: as many as MEMORY_FRACTION of free_bytes holds after the fixed part,
    at most `requests` (more slots than requests would stay empty) and `cap`; a multiple of 8 from 8 on; at
    least 1."""
    usable = int(free_bytes * MEMORY_FRACTION) - need.fixed
    fit = max(usable // need.per_slot, 0)
    slots = min(fit, requests, cap)
    if slots >= 8 and slots not in (requests, cap):
        slots -= slots % 8
    slots = max(1, slots)
    gib = 1 << 30
    bound = ("all the requests" if slots == requests else f"the cap of {cap}" if slots == cap
             else "the free memory")
    return slots, (f"{slots} slots, bounded by {bound} ({requests} requests; {fit} fit in "
                   f"{MEMORY_FRACTION:.0%} of {free_bytes / gib:.1f} GiB free at {need.per_slot / 2**20:.1f} MiB a "
                   f"slot + {need.fixed / gib:.2f} GiB for a prefill)")


def free_device_memory(device: torch.device) -> int:
    """Bytes a new allocation can get on a CUDA device: the driver's free memory plus what torch's caching
    allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def resolve_slots(requested: int | str, model: CausalLM, prompt_lengths: Sequence[int], max_new_tokens: int, *,
                  sampling: bool = False, cuda_graphs: bool = True, flag: str = "--batch-size") -> tuple[int, str]:
    """(slots, why) for a requested slot count: a number as given; 'auto' on CUDA sized from the free memory,
    the model and these requests (auto_slots), CPU_SLOTS elsewhere."""
    if requested != "auto":
        return int(requested), f"{flag} {requested} as given"
    device = model.head_weight.device
    if device.type != "cuda":
        return min(CPU_SLOTS, len(prompt_lengths)), f"{flag} auto: {CPU_SLOTS} slots on the CPU"
    bf16 = torch.is_autocast_enabled("cuda") or model.head_weight.dtype == torch.bfloat16
    longest = max(prompt_lengths)
    need = slot_memory(model.cfg, max_len=longest + max_new_tokens, longest_prompt=longest,
                       kv_bytes=2 if bf16 else 4, sampling=sampling, cuda_graphs=cuda_graphs)
    slots, why = auto_slots(free_device_memory(device), need, len(prompt_lengths))
    return slots, f"{flag} auto: {why}"
