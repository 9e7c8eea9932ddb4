"""The decoder: one readable file for LLaMA, Qwen2, Qwen3 and SmolLM2.

Parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so loading
an HF checkpoint is a rename-free copy. Every numeric choice (eps, theta, RoPE pairing and
scaling, Q/K/V bias, qk-norm, tied head, head_dim) comes from ``ModelConfig``, whose family
(``families.py``) fixes what the architecture implies; nothing here tests a family's name.

Shapes: B batch, T sequence, H heads, K kv heads, D head_dim, C hidden.
Labels passed to ``forward`` are already shifted: ``labels[:, t]`` is the target of position t.

Verification (``entrenar verify``) reads intermediates with forward hooks on these modules, as it does
on transformers' modules of the same names. The two values no hook can see -- q/k after RoPE and the
attention probabilities, which the fast path never builds -- are kept only inside
``CausalLM.record_internals(trace)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kernels import Ops, get_ops
from .long_context import ActivationOffload, checkpoint_block, chunked_rows
from .tensors import IGNORE_INDEX, positions_from_doc_ids
from .varlen import VarlenSpans, dense_doc_mask, varlen_usable


# ---- RoPE tables --------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (float64), with linear or llama3 scaling from the config."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype = torch.float32,
                inv_freq: torch.Tensor | None = None):
    """cos, sin of shape [B, T, D/2]; computed in float64, returned in fp32 (fp64 for fp64 runs).
    `inv_freq`: rope_inv_freq(cfg) already on positions' device (else it is built and copied here)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(cfg).to(positions.device)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return angles.cos().to(out_dtype), angles.sin().to(out_dtype)


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions [B, Tk] under left padding: each token's count of real tokens before it (as
    transformers'); padding sits at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def padding_mask(attention_mask: torch.Tensor, T: int) -> torch.Tensor:
    """SDPA mask [B, 1, T, Tk] of the last T queries over Tk = attention_mask.shape[1] keys: causal, and
    no padding key. A padding query also sees itself: a row with no key at all would softmax to NaN,
    which reaches the real rows through its keys/values in the next layer (0 weight x NaN = NaN)."""
    Tk = attention_mask.shape[1]
    device = attention_mask.device
    query_at = torch.arange(Tk - T, Tk, device=device)[:, None]  # each query's own key index
    key_at = torch.arange(Tk, device=device)[None, :]
    mask = (key_at <= query_at) & attention_mask.bool()[:, None, :]
    return (mask | (key_at == query_at))[:, None]


# ---- modules ------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops, add: torch.Tensor | None = None):
        """rms_norm(x); with ``add``: (rms_norm(x + add), x + add), the residual add fused into the norm."""
        if add is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.add_rms_norm(x, add, self.weight, self.eps)


@dataclass
class KVCache:
    """Per-layer key/value tensors [B, K, T, D] grown by concatenation during decoding."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


class StaticKVCache:
    """Preallocated per-layer keys/values [B, K, max_len, D]: decoding with the same shapes at every step
    (what a CUDA graph replays). A forward writes its keys/values in place at cache columns ``at`` (a
    device tensor [T], so a captured step reads its column from memory) and attends to columns
    0..``attend``-1 under ``mask`` ([B, 1, T, attend] bool, or None = causal), both set by the caller
    (generate.py): left padding and the columns not yet written are the caller's to mask. Each layer's
    buffers are allocated at the first write (the prefill), in the dtype of its keys."""

    def __init__(self, num_layers: int, max_len: int):
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.at: torch.Tensor | None = None
        self.attend = max_len
        self.mask: torch.Tensor | None = None
        # set by a cache whose one-token steps attend through `attend_spans` instead of SDPA under `mask`
        self.spans: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend_spans(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One query per head over each row's span of columns (engine.SlotKVCache): q [B, K, G, D] -> [B, K, G, D]."""
        raise NotImplementedError("a cache that sets spans attends over them")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[layer] is None:
            B, K, _, D = k.shape
            self.keys[layer] = k.new_zeros(B, K, self.max_len, D)
            self.values[layer] = v.new_zeros(B, K, self.max_len, D)
        self.keys[layer].index_copy_(2, self.at, k)
        self.values[layer].index_copy_(2, self.at, v)
        return self.keys[layer][:, :, :self.attend], self.values[layer][:, :, :self.attend]


class Attention(nn.Module):
    # Where q/k after RoPE and the attention probabilities go while CausalLM.record_internals is on.
    internals: dict | None

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.internals = None
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, ops: Ops, cache: KVCache | StaticKVCache | None = None):
        cfg, B, T = self.cfg, x.shape[0], x.shape[1]
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm over head_dim, before RoPE (the RMSNorm kernel on rows of D)
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        q, k = ops.rope(q, k, cos, sin, cfg.rope_style)
        internals = self.internals
        if internals is not None:
            p = f"layers.{self.layer}."
            internals[p + "q_rope"], internals[p + "k_rope"] = q.detach(), k.detach()
        if isinstance(mask, VarlenSpans):  # a padding-free row (varlen.py): flash or SDPA per span; verify: dense mask
            if internals is None and cache is None:
                return self.o_proj(mask.attend(q, k, v).reshape(B, T, cfg.num_heads * cfg.head_dim))
            mask = mask.dense()
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if internals is not None:
            internals[f"layers.{self.layer}.attn_probs"] = self.attention_probs(q, k, mask)
        if T == 1 and isinstance(cache, StaticKVCache) and (cache.spans is not None or cfg.num_heads != cfg.num_kv_heads):
            # one query per head: the G heads sharing a kv head become G queries of it, so no kernel
            # repeats the whole cache per head (SDPA's GQA with a mask otherwise takes the math path)
            qg = q.reshape(B, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
            if cache.spans is not None:
                y = cache.attend_spans(qg, k, v)
            else:
                y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
            return self.o_proj(y.reshape(B, T, cfg.num_heads * cfg.head_dim))
        gqa = cfg.num_heads != cfg.num_kv_heads
        if gqa and mask is not None and T > 1 and q.is_cuda:
            # SDPA's GQA under a mask takes the math path on CUDA (scores [B, H, T, Tk] in fp32: a padded prefill of
            # many prompts); keys and values repeated per head (T x D each) let the memory-efficient kernel take it
            G = cfg.num_heads // cfg.num_kv_heads
            k, v, gqa = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim)
        return self.o_proj(y)

    def attention_probs(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) with the forward's mask, [B, H, T, Tk]: for verify only (the fused
        attention never builds it). q [B, H, T, D], k [B, K, Tk, D] after RoPE and the cache."""
        cfg, T, Tk = self.cfg, q.shape[2], k.shape[2]
        kk = k.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, dim=1)
        scores = (q @ kk.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
        if mask is None:
            mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)
        scores = scores.masked_fill(~mask, float("-inf"))
        return scores.detach().float().softmax(-1).to(q.dtype)


class MLP(nn.Module):
    # More tokens than this in one call: computed in chunks of this many (long_context.py; 0 = never)
    chunk_tokens: int = 0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, ops: Ops):
        if self.chunk_tokens and x.shape[:-1].numel() > self.chunk_tokens:
            # position-wise: the pieces (each short enough for the plain path below) are the whole
            return chunked_rows(self.forward, x, ops, chunk=self.chunk_tokens)
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, ops: Ops, cache: KVCache | StaticKVCache | None = None):
        attn = self.self_attn(self.input_layernorm(x, ops), cos, sin, mask, ops, cache)
        h, x = self.post_attention_layernorm(x, ops, add=attn)  # x = x + attn; h = its norm (one kernel)
        return x + self.mlp(h, ops)


class Backbone(nn.Module):
    """HF's ``model.`` prefix: embeddings, blocks, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


INIT_THREADS = 8  # init_weights draws this many chunks at once
INIT_CHUNK = 1 << 22  # numbers per generator in init_weights (4M: a 7B model is ~1,800 chunks)


def tensor_seed(seed: int, name: str) -> int:
    """The seed of the generator init_weights draws `name` (a parameter and chunk) from: 63 bits of a hash."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little") >> 1


class CausalLM(nn.Module):
    cfg: ModelConfig
    kernels: str  # "torch" (reference ops) or "triton" (fused kernels), see kernels.get_ops
    source: dict | None  # where the weights came from (formats.load_model): inspect, run.json
    peft_config: dict | None  # LoRA hyper-parameters while adapters are injected (peft), else None
    activation_checkpointing: bool  # recompute each block in backward (training only)
    activation_offload: bool  # with it, the blocks' saved inputs wait in host memory (long_context.py)
    save_attention: bool  # with checkpointing, the attention kernel's outputs are kept, not recomputed

    def __init__(self, cfg: ModelConfig, kernels: str = "torch"):
        super().__init__()
        get_ops(kernels)  # an unknown name, or triton where it cannot be imported, fails here, not mid-run
        self.cfg = cfg
        self.kernels = kernels
        self.source = None
        self.peft_config = None
        self.activation_checkpointing = False
        self.activation_offload = False
        self.save_attention = False  # with checkpointing: the backward reuses the forward's attention output
        self._inv_freq_cache: dict[tuple, torch.Tensor] = {}  # see _inv_freq_on
        self.model = Backbone(cfg)
        # A tied head has no tensor of its own (as in HF safetensors): it reads embed_tokens.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                      bias=False)

    @property
    def ops(self) -> Ops:
        return get_ops(self.kernels)

    @contextlib.contextmanager
    def record_internals(self, trace: dict, layers: Iterable[int] | None = None) -> Iterator[dict]:
        """The one switch for in-model verification records: while on, each forward stores
        ``layers.{i}.q_rope`` / ``k_rope`` [B, T, heads, D] and ``layers.{i}.attn_probs`` [B, H, T, Tk]
        of the given layers (default all) in ``trace``. Everything else verify reads with forward hooks."""
        attns = [self.model.layers[i].self_attn for i in (range(self.cfg.num_layers) if layers is None else layers)]
        for attn in attns:
            attn.internals = trace
        try:
            yield trace
        finally:
            for attn in attns:
                attn.internals = None

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def init_weights(self, seed: int | None = None) -> None:
        """Random init for pretraining: N(0, initializer_range), scaled residual projections, norm weights 1,
        biases 0. Every INIT_CHUNK numbers of a tensor come from their own CPU generator, seeded by (seed, the
        tensor's name, the chunk): the numbers do not depend on which thread draws them or in what order, so
        the chunks are drawn on up to INIT_THREADS threads (one CPU generator is serial, ~90M numbers/s: a 7B
        model's init took minutes on every rank)."""
        base = seed if seed is not None else int(torch.randint(2**62, ()).item())
        std = self.cfg.initializer_range
        chunks = []
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    s = std / math.sqrt(2 * self.cfg.num_layers) if name.endswith(("o_proj.weight",
                                                                                  "down_proj.weight")) else std
                    chunks += [(name, p.detach().view(-1), s, k) for k in range(0, p.numel(), INIT_CHUNK)]

        def draw(chunk: tuple[str, torch.Tensor, float, int]) -> None:
            name, flat, s, k = chunk
            part = flat[k:k + INIT_CHUNK]  # of a detached view: writing it is not recorded by autograd
            gen = torch.Generator().manual_seed(tensor_seed(base, f"{name}/{k}"))
            if part.device.type == "cpu" and part.dtype == torch.float32:
                part.normal_(0.0, s, generator=gen)
            else:  # drawn in fp32 on the CPU whatever the tensor's dtype and device: the same numbers
                part.copy_(torch.empty(part.shape).normal_(0.0, s, generator=gen))

        with ThreadPoolExecutor(max_workers=min(INIT_THREADS, os.cpu_count() or 1)) as pool:
            list(pool.map(draw, chunks))  # list(): a draw's error is raised here

    @classmethod
    def from_scratch(cls, cfg: ModelConfig, seed: int | None, kernels: str = "torch") -> CausalLM:
        """A model to pretrain: built on the meta device (torch's default init of every layer, which init_weights
        overwrites anyway, took ~40% of a 7B model's start on the CPU), allocated on the CPU, then init_weights."""
        with torch.device("meta"):
            model = cls(cfg, kernels)
        model.to_empty(device="cpu")
        model.init_weights(seed)
        return model

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """rope_inv_freq of this config on `device`, built once per device and RoPE setting. It is computed
        on the CPU (the same float64 numbers on every device); copying it in every forward was a blocking
        host-to-device copy, after which torch synchronises the stream: the host waited for all queued GPU
        work (the previous step's update), then the GPU idled while the host queued the forward. Not a
        buffer: model.to(bf16) would round it."""
        cfg = self.cfg
        key = (device, cfg.head_dim, cfg.rope_theta, repr(sorted((cfg.rope_scaling or {}).items())))
        if key not in self._inv_freq_cache:
            self._inv_freq_cache[key] = rope_inv_freq(cfg).to(device)
        return self._inv_freq_cache[key]

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.numel() and (int(input_ids.max()) >= self.cfg.vocab_size or int(input_ids.min()) < 0):
            raise ValueError(f"token id {int(input_ids.max())} out of range for vocab_size "
                             f"{self.cfg.vocab_size} (tokenizer and model disagree?)")

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      doc_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                      attention_mask: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                      max_seqlen: int | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, C].

        doc_ids [B, T]: attention stays inside runs of equal id (packed sequences); positions
        restart at each new document unless position_ids is given.
        cu_seqlens (int32 [n+1]) and max_seqlen with doc_ids and B == 1: a padding-free row of n samples; on CUDA in
        fp16/bf16 the attention is varlen flash attention over those spans (varlen.py), elsewhere the doc-id mask.
        attention_mask [B, past + T] (1/True = a real token, 0 = padding; generation's left padding):
        no query attends to a padding key, and positions count real tokens only, as transformers'.
        """
        B, T = input_ids.shape
        static = isinstance(cache, StaticKVCache)  # brings its own columns and mask (generate.py)
        if not input_ids.is_cuda and not static:  # a host read; generate checked its prompts and picks
            self._check_ids(input_ids)
        assert not static or (position_ids is not None and attention_mask is None and doc_ids is None), \
            "a StaticKVCache forward takes position_ids, and no attention_mask or doc_ids"
        past = cache.length if cache is not None and not static else 0
        assert attention_mask is None or (doc_ids is None and tuple(attention_mask.shape) == (B, past + T)), \
            f"attention_mask {tuple(attention_mask.shape)} must cover past + new tokens {(B, past + T)}, no doc_ids"
        if position_ids is None:
            if doc_ids is not None:
                position_ids = positions_from_doc_ids(doc_ids)
            elif attention_mask is not None:
                position_ids = padded_positions(attention_mask)[:, past:]
            else:
                position_ids = torch.arange(past, past + T, device=input_ids.device).expand(B, T)
        dtype = self.model.embed_tokens.weight.dtype
        if torch.is_autocast_enabled(input_ids.device.type):
            dtype = torch.get_autocast_dtype(input_ids.device.type)
        cos, sin = rope_tables(self.cfg, position_ids, dtype, self._inv_freq_on(position_ids.device))
        mask = None
        if static:
            mask = cache.mask
        elif doc_ids is not None and cu_seqlens is not None and B == 1:
            mask = VarlenSpans(cu_seqlens.to(input_ids.device, torch.int32), int(max_seqlen or T), doc_ids,
                               flash=varlen_usable(input_ids.device, dtype))
        elif doc_ids is not None:
            mask = dense_doc_mask(doc_ids)  # [B, 1, T, T]
        elif attention_mask is not None:
            mask = padding_mask(attention_mask, T)
        elif past and T > 1:
            mask = torch.ones(T, past + T, dtype=torch.bool, device=input_ids.device).tril(past)
        ops = self.ops
        x = self.model.embed_tokens(input_ids)
        offload = ActivationOffload() if self.activation_offload else None  # this forward's block inputs
        for block in self.model.layers:
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint_block(block, x, cos, sin, mask, ops, cache, offload=offload,
                                     save_attention=self.save_attention)
            else:
                x = block(x, cos, sin, mask, ops, cache)
        return self.model.norm(x, ops)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, attention_mask: torch.Tensor | None = None, per_token: bool = False,
                head_at: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None):
        """The one entry point (train, eval, generation, torch.compile, FSDP hooks).

        Without labels: logits [B, T, V]. With labels (already shifted, IGNORE_INDEX ignored):
        (summed cross-entropy over non-ignored labels, number of such labels), computed by the
        fused linear cross-entropy, which never builds the logits on GPU. Callers divide by the
        token count of the whole step (all micro-batches), never per micro-batch.
        With labels and per_token: each token's cross-entropy [B, T] in fp32 (0 where ignored), from fp32
        logits (a preference objective sums them per sequence: train/objective.py). Inside forward, so
        FSDP's hooks have the head gathered.
        head_at: flat positions into B*T (int64, on the device) where the head is applied, the rest never reaching
        it (TRL's logits_to_keep, for any positions): without labels the logits [P, V] of those positions; with
        labels (not per_token) the summed CE and count over those positions, the caller vouching that every label
        elsewhere is IGNORE_INDEX. An SFT batch's labels are its responses: the prompts and padding, most of its
        positions, skip the head's matmuls (forward and backward) at the same loss.
        cu_seqlens, max_seqlen: a padding-free row's spans (hidden_states).
        """
        h = self.hidden_states(input_ids, position_ids, doc_ids, cache, attention_mask, cu_seqlens=cu_seqlens,
                               max_seqlen=max_seqlen)
        if head_at is not None:
            assert not per_token, "head_at with per_token: gather the positions from the logits instead"
            h = h.reshape(-1, h.shape[-1]).index_select(0, head_at)
            if labels is not None:
                labels = labels.reshape(-1).index_select(0, head_at)
        if labels is None:
            return F.linear(h, self.head_weight)
        if per_token:
            logits = F.linear(h, self.head_weight).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="none").view(labels.shape)
        flat_labels = labels.reshape(-1)
        n = (flat_labels != IGNORE_INDEX).sum()
        loss = self.ops.linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.head_weight,
                                             flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, n
