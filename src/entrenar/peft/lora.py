"""LoRA as a module wrapper: ``LoRALinear`` around a frozen linear, injection into a model, merge math.

``apply_lora`` replaces target ``nn.Linear`` modules of a ``CausalLM`` *by composition*: each becomes a
``LoRALinear`` holding the frozen original as ``base_layer`` (PEFT's name), so the module path, and
therefore the PEFT key ``base_model.model.<path>.lora_A.weight``, is the model's own HF path.

    y = base(x) + lora_B(lora_A(dropout(x))) * scale,   scale = alpha / r   (alpha / sqrt(r) with rslora)

A is Kaiming-uniform (a=sqrt(5), as PEFT) drawn from a generator seeded by ``seed`` (the run's
``--seed``: the same command gives the same adapter init), B is zero, so at step 0 the output equals
the base's exactly. With ``quantize_nf4`` (QLoRA) every linear of the decoder layers is stored as NF4
(``NF4Linear``), adapters or not, and dequantized to the compute dtype for each matmul; biases stay
full precision.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..errors import InputError
from .identity import base_fingerprint
from .nf4_linear import NF4Linear

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ONTO = ("trained", "original")


class LoRALinear(nn.Module):
    """Frozen ``base_layer`` (nn.Linear or NF4Linear) plus a trainable rank-r update."""

    def __init__(self, base_layer: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False, *, generator: torch.Generator | None = None):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.rank, self.alpha, self.rslora = rank, alpha, rslora
        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        device = next(itertools.chain(base_layer.parameters(), base_layer.buffers())).device
        # fp32 whatever the base dtype: adapters are the master weights AdamW updates. Initialised on the
        # CPU so a CPU generator seeds them wherever the base lives (CUDA init would use the CUDA RNG);
        # skip_init: nn.Linear's own init would draw from the global RNG (and be overwritten anyway).
        self.lora_A = nn.utils.skip_init(nn.Linear, self.in_features, rank, bias=False, device="cpu",
                                         dtype=torch.float32)
        self.lora_B = nn.utils.skip_init(nn.Linear, rank, self.out_features, bias=False, device="cpu",
                                         dtype=torch.float32)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False  # adapters_disabled(): the base layer alone (DPO's reference forward)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
        nn.init.zeros_(self.lora_B.weight)
        self.lora_A.to(device)
        self.lora_B.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if self.disabled:
            return y
        a = self.lora_A.weight
        h = self.lora_dropout(x)
        autocast = torch.is_autocast_enabled(x.device.type)
        if not autocast:
            h = h.to(a.dtype)
        down = self.lora_A(h)  # [..., rank]
        if autocast or down.dtype == y.dtype:
            # y + scaling * down @ B^T as ONE matmul: the scale and the add run in the GEMM's epilogue
            # (alpha, beta = 1), so neither makes its own pass over the [tokens, out] output (18,944 wide
            # for Qwen2.5-7B's gate/up), in the forward, its recompute, and the backward's scale. Under
            # autocast addmm computes in bf16 with fp32 accumulation and rounds once.
            out = torch.addmm(y.reshape(-1, y.shape[-1]), down.reshape(-1, down.shape[-1]),
                              self.lora_B.weight.t(), alpha=self.scaling)
            return out.view(y.shape)
        return y + (self.lora_B(down) * self.scaling).to(y.dtype)  # adapters fp32 on a 16-bit base, no autocast

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in fp32: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def base_weight(self) -> torch.Tensor:
        b = self.base_layer
        return b.dequantized_weight(torch.float32) if isinstance(b, NF4Linear) else b.weight.detach().float()


# ---- injection ------------------------------------------------------------------------------
def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last-component names of the linear layers inside the decoder layers (q_proj, ...).

    The LM head is not a target: the loss reads ``model.head_weight`` directly (fused cross-entropy)."""
    names: list[str] = []
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, NF4Linear)) and ".layers." in f".{path}" and not path.endswith(
                ("lora_A", "lora_B")):
            leaf = path.rsplit(".", 1)[-1]
            if leaf == "base_layer":
                leaf = path.rsplit(".", 2)[-2]
            if leaf not in names:
                names.append(leaf)
    return names


def parse_targets(targets: str | Iterable[str] | None) -> list[str]:
    """``--targets`` as a list of linear-layer names (None: the attention and MLP projections)."""
    if targets is None:
        return list(DEFAULT_TARGETS)
    if isinstance(targets, str):
        targets = [t for t in targets.split(",")]
    out = [t.strip() for t in targets if t.strip()]
    if not out:
        raise InputError("--targets is empty; give comma-separated linear layer names, e.g. q_proj,v_proj")
    return out


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    """Replace the submodule at dotted ``path`` by ``module``."""
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, module)


def _decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Linears inside the decoder layers (never the LM head: QLoRA keeps it 16-bit, as bitsandbytes)."""
    return [(p, m) for p, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".layers." in f".{p}" and ".lora_" not in p]


def _check_hyperparameters(rank: int, alpha: float, dropout: float) -> None:
    if not isinstance(rank, int) or rank <= 0:
        raise InputError(f"--rank must be a positive integer, got {rank!r}")
    if not (isinstance(alpha, (int, float)) and alpha > 0 and math.isfinite(alpha)):
        raise InputError(f"--alpha must be a positive number, got {alpha!r}")
    if not (0.0 <= dropout < 1.0):
        raise InputError(f"--dropout must be in [0, 1), got {dropout!r}")


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
               targets: str | Iterable[str] | None = None, quantize_nf4: bool = False,
               seed: int | None = None) -> nn.Module:
    """Wrap the target linears of ``model`` in place (and return it); only adapters stay trainable.

    ``seed`` seeds the A matrices' Kaiming init through one generator, in module order, so one seed
    gives one init; ``None`` draws from torch's global RNG. The base's identity (``base_fingerprint``,
    taken before anything is wrapped or quantized) is kept in ``model.peft_config`` for the adapter note.
    """
    _check_hyperparameters(rank, alpha, dropout)
    if getattr(model, "peft_config", None) is not None:
        raise InputError("the model already has LoRA adapters; merge them first (entrenar merge)")
    wanted = parse_targets(targets)
    available = linear_layer_names(model)
    unknown = [t for t in wanted if t not in available]
    if unknown:
        raise InputError(f"unknown LoRA target(s) {', '.join(unknown)}; this model's linear layers are: "
                         f"{', '.join(available)}")
    fingerprint = base_fingerprint(model)
    generator = None if seed is None else torch.Generator().manual_seed(int(seed))
    for p in model.parameters():
        p.requires_grad_(False)
    decoder = dict(_decoder_linears(model))
    wrapped = []
    for path, mod in list(model.named_modules()):
        if path not in decoder or path.rsplit(".", 1)[-1] not in wanted:
            continue
        base: nn.Module = NF4Linear(mod) if quantize_nf4 else mod
        set_module(model, path, LoRALinear(base, rank, alpha, dropout, rslora, generator=generator))
        wrapped.append(path)
    if quantize_nf4:
        for path, mod in decoder.items():
            if path not in wrapped:
                set_module(model, path, NF4Linear(mod))
    assert wrapped, "targets matched names but no module was wrapped"
    model.peft_config = {"r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": rslora,
                         "target_modules": wanted, "quantize_nf4": quantize_nf4, "init_seed": seed,
                         "base_fingerprint": fingerprint}
    return model


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[int]:
    """Inside, every LoRALinear of ``model`` (found through wrappers: DDP, FSDP2) computes its frozen base
    layer alone: the model is its base, with no second copy of the weights (DPO's reference forward; PEFT's
    ``disable_adapter``). Yields the number of adapters switched off; restored on exit, also on error."""
    mods = [m for m in model.modules() if isinstance(m, LoRALinear)]
    before = [m.disabled for m in mods]
    for m in mods:
        m.disabled = True
    try:
        yield len(mods)
    finally:
        for m, was in zip(mods, before, strict=True):
            m.disabled = was


def count_parameters(model: nn.Module) -> dict[str, int]:
    """trainable / total parameters; NF4 weights count as the parameters they stand for."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, NF4Linear))
    return {"trainable": trainable, "total": total}


def describe_parameters(model: nn.Module) -> str:
    c = count_parameters(model)
    return f"trainable params: {c['trainable']:,} / total {c['total']:,} " \
           f"({100.0 * c['trainable'] / max(c['total'], 1):.3f}%)"


# ---- merge math -----------------------------------------------------------------------------
def base_weight(base: nn.Module, path: str, onto: str, original: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """The fp32 weight a merge adds the update to: as trained (NF4-dequantized), or the 16-bit original."""
    if onto == "original" and isinstance(base, NF4Linear):
        if original is None or f"{path}.weight" not in original:
            raise InputError(f"--onto original needs the 16-bit weight of {path}")
        return original[f"{path}.weight"].float()
    if isinstance(base, NF4Linear):
        return base.dequantized_weight(torch.float32)
    return base.weight.detach().float()


@torch.no_grad()
def merge_in_place(model: nn.Module, onto: str = "trained",
                   original: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> int:
    """Replace every LoRALinear / NF4Linear by a plain nn.Linear; returns the number of adapters merged.

    onto="trained": base weight = what the forward used (NF4-dequantized where the base is NF4).
    onto="original": base weight = ``original[path + '.weight']`` (the 16-bit weights before NF4).
    """
    if onto not in ONTO:
        raise InputError(f"--onto must be one of {ONTO}, got {onto!r}")
    merged = 0
    for path, mod in list(model.named_modules()):
        if isinstance(mod, LoRALinear):
            base = mod.base_layer
            w = base_weight(base, path, onto, original) + mod.delta_weight()
            merged += 1
        elif isinstance(mod, NF4Linear) and not path.endswith(".base_layer"):
            base = mod
            w = base_weight(base, path, onto, original)
        else:
            continue
        out_dtype = dtype or (base.weight_dtype if isinstance(base, NF4Linear) else base.weight.dtype)
        lin = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                        device=w.device, dtype=out_dtype)
        lin.weight.copy_(w.to(out_dtype))
        if base.bias is not None:
            lin.bias.copy_(base.bias.to(out_dtype))
        lin.requires_grad_(False)
        set_module(model, path, lin)
    model.peft_config = None
    return merged
