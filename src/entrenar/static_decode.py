"""Decoding with fixed shapes: a preallocated KV cache and one decode step over static buffers, replayed
as a CUDA graph on CUDA (generate.py's fast path; it knows tensors only, generate.py the stop rules).

Every decode step has the same shapes: the cache is [B, K, max_len, D] per layer (model.StaticKVCache),
written in place at the step's column; each row's validity over all max_len columns (left padding False)
is built once; the step reads the token, RoPE position and cache column of each row from device buffers
and writes the picked token and the next step's inputs back to them. Nothing in a step waits for the host
(no `.item()`, no data-dependent shape, no Python branch on a tensor value), so on CUDA the step is
captured once in a torch.cuda.CUDAGraph and replayed per token: one launch per token instead of a few
hundred kernels. The host reads the picked tokens only every `sync_every` steps; the rows it finds
stopped keep decoding on the device until then (their extra tokens are dropped by generate.py).

Greedy picks are captured with the forward; sampling draws from a seeded torch.Generator outside the graph
(after each replay), so its generator state is never frozen into a graph.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .devices import on_side_stream
from .model import CausalLM, KVCache, StaticKVCache, padded_positions, padding_mask

WARMUP_STEPS = 2  # eager decode steps (on a side stream) before the capture: lazy inits happen outside it
SYNC_EVERY_CUDA = 16  # decode steps between two host reads of the picked tokens on CUDA


def last_logits(model: CausalLM, ids: torch.Tensor, cache: KVCache | StaticKVCache | None,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, V] of each row's last position only: the LM head of a whole prompt would be a
    [B, T, vocab] product (Qwen2.5-0.5B: 27% of the prefill's FLOPs, 2.5 GB at batch 64 x 128 tokens)
    of which decoding reads one row; forward(labels=None) is this head on every position."""
    h = model.hidden_states(ids, position_ids=position_ids, cache=cache, attention_mask=attention_mask)[:, -1]
    return F.linear(h, model.head_weight)


@dataclass
class DecodeBuffers:
    """The static inputs and outputs of one decode step (fixed shapes and addresses)."""

    ids: torch.Tensor  # [B, 1] the token each row feeds next
    position: torch.Tensor  # [B, 1] its RoPE position: the row's real tokens before it
    at: torch.Tensor  # [1] its cache column (the same in every row: prompts are left padded)
    n_out: torch.Tensor  # [1] tokens picked so far per row
    tokens: torch.Tensor  # [B, max_new] the picked tokens
    bad: torch.Tensor  # [B, max_new] bool: the logits of that pick held NaN/Inf
    valid: torch.Tensor  # [B, max_len] bool: False on left padding (every generated column is True)
    key_index: torch.Tensor  # [max_len] 0..max_len-1


def decode_logits(model: CausalLM, cache: StaticKVCache, buf: DecodeBuffers) -> torch.Tensor:
    """Logits [B, V] of one token per row at column buf.at: the forward a CUDA graph captures."""
    cache.mask = (buf.valid & (buf.key_index <= buf.at))[:, None, None, :]  # written columns, no padding
    return last_logits(model, buf.ids, cache, position_ids=buf.position)


def record(buf: DecodeBuffers, logits: torch.Tensor, picked: torch.Tensor) -> None:
    """Store the picks [B] (and whether their logits were finite), and make them the next step's input."""
    buf.bad.index_copy_(1, buf.n_out, ~torch.isfinite(logits).all(-1, keepdim=True))
    buf.tokens.index_copy_(1, buf.n_out, picked[:, None])
    buf.ids.copy_(picked[:, None])
    buf.position.add_(1)
    buf.at.add_(1)
    buf.n_out.add_(1)


def can_capture(device: torch.device) -> bool:
    """Whether decode steps on `device` can be captured as a CUDA graph."""
    return device.type == "cuda"


def new_pool() -> tuple:
    """A CUDA graph memory pool that several captured steps share (they never replay at once)."""
    return torch.cuda.graph_pool_handle()


class GraphStep:
    """One decode step captured in a CUDA graph; replay() runs it on the same buffers."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool: tuple | None = None):
        self.graph = torch.cuda.CUDAGraph()
        # autocast's cache of cast weights would be freed when autocast exits, under a live graph: off here
        no_cast_cache = torch.autocast("cuda", torch.get_autocast_dtype("cuda"),
                                       enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
        with torch.cuda.graph(self.graph, pool=pool), no_cast_cache:
            self.out = fn()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


def decode_static(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor | None, max_new_tokens: int,
                  pick: Callable[[torch.Tensor], torch.Tensor],
                  take: Callable[[int, torch.Tensor, torch.Tensor], bool], *, cuda_graph: bool,
                  pick_in_graph: bool, sync_every: int, kept_logits: list | None = None) -> str:
    """Prefill `ids` [B, W] (left padded; `mask` [B, W] or None) in one eager forward, then decode up to
    max_new_tokens picks per row on the static cache. `pick(logits [B, V]) -> ids [B]` on the device (no
    host sync); `take(first, tokens [B, m], bad [B, m])` gets the picks first..first+m-1 on the host every
    `sync_every` steps and returns whether any row goes on. `cuda_graph`: replay the step as a CUDA graph
    (with the pick when `pick_in_graph`). `kept_logits` receives each pick's logits [B, V] (fp32, on the
    device). Returns the decoder that ran: "cuda_graph" (a graph was captured and replayed) or "static"."""
    B, W = ids.shape
    device = ids.device
    max_len = W + max_new_tokens - 1  # the last pick is never fed back
    cache = StaticKVCache(model.cfg.num_layers, max_len)
    valid = torch.ones(B, max_len, dtype=torch.bool, device=device)
    if mask is not None:
        valid[:, :W] = mask
        positions = padded_positions(mask)
    else:
        positions = torch.arange(W, device=device).expand(B, W)
    cache.at, cache.attend = torch.arange(W, device=device), W
    cache.mask = None if mask is None else padding_mask(mask, W)
    logits = last_logits(model, ids, cache, position_ids=positions)
    buf = DecodeBuffers(ids=torch.zeros(B, 1, dtype=torch.long, device=device),
                        position=positions[:, -1:].clone(),
                        at=torch.full((1,), W - 1, dtype=torch.long, device=device),
                        n_out=torch.zeros(1, dtype=torch.long, device=device),
                        tokens=torch.zeros(B, max_new_tokens, dtype=torch.long, device=device),
                        bad=torch.zeros(B, max_new_tokens, dtype=torch.bool, device=device),
                        valid=valid, key_index=torch.arange(max_len, device=device))
    record(buf, logits, pick(logits))
    if kept_logits is not None:
        kept_logits.append(logits.float().clone())
    cache.at, cache.attend = buf.at, max_len

    def forward() -> torch.Tensor:
        return decode_logits(model, cache, buf)

    def step() -> torch.Tensor:
        logits = forward()
        record(buf, logits, pick(logits))
        return logits

    graph: GraphStep | None = None
    use_graph = cuda_graph and can_capture(device)
    picked, seen = 1, 0  # picks made on the device, picks handed to `take`
    while True:
        if picked - seen >= sync_every or picked == max_new_tokens:
            going = take(seen, buf.tokens[:, seen:picked].cpu(), buf.bad[:, seen:picked].cpu())
            seen = picked
            if not going or picked == max_new_tokens:
                break
        if use_graph and picked == 1 + WARMUP_STEPS and graph is None:
            try:
                graph = GraphStep(step if pick_in_graph else forward)
            except RuntimeError as e:  # an op that cannot be captured (a host sync): the same step, eagerly
                warnings.warn(f"CUDA graph capture of the decode step failed, decoding eagerly: {e}",
                              RuntimeWarning, stacklevel=2)
                use_graph = False
        if graph is not None:
            logits = graph.replay()
            if not pick_in_graph:
                record(buf, logits, pick(logits))
        elif use_graph:
            logits = warmup_step(step, device)
        else:
            logits = step()
        picked += 1
        if kept_logits is not None:
            kept_logits.append(logits.float().clone())
    return "cuda_graph" if graph is not None else "static"


# one eager step on a side stream before the capture (a seam: the CPU tests replace it)
warmup_step = on_side_stream
