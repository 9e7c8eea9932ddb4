"""LoRA and QLoRA: adapter modules wrapped around frozen linears, NF4 base, PEFT-format save/load.

``apply_lora`` replaces target ``nn.Linear`` modules of a ``CausalLM`` *by composition*: each becomes a
``LoRALinear`` holding the frozen original as ``base_layer`` (PEFT's name), so the module path, and
therefore the PEFT key ``base_model.model.<path>.lora_A.weight``, is the model's own HF path.

    y = base(x) + lora_B(lora_A(dropout(x))) * scale,   scale = alpha / r   (alpha / sqrt(r) with rslora)

A is Kaiming-uniform (a=sqrt(5), as PEFT), B is zero, so at step 0 the output equals the base's exactly.
With ``quantize_nf4`` (QLoRA) every linear of the decoder layers is stored as NF4 (``NF4Linear``),
adapters or not, and dequantized to the compute dtype for each matmul; biases stay full precision.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import InputError
from .kernels import nf4

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NOTE = "entrenar_adapter.json"  # what base the adapter needs and whether it was NF4
PEFT_PREFIX = "base_model.model."


# ---- NF4 frozen base ------------------------------------------------------------------------
class _NF4LinearFn(torch.autograd.Function):
    """x @ W^T + b with W dequantized on the fly; backward re-dequantizes instead of keeping W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nf4.NF4Weight, bias: torch.Tensor | None):
        w = nf4.dequantize(weight, x.dtype)
        ctx.weight = weight
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        w = nf4.dequantize(ctx.weight, grad_out.dtype)
        return grad_out @ w, None, None


class NF4Linear(nn.Module):
    """A frozen linear whose weight is stored NF4 (kernels.nf4); the bias, if any, in full precision."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q = nf4.quantize(linear.weight)
        # Not in state_dict: the base is re-quantized from the 16-bit weights (deterministic), never saved.
        for name, t in q.tensors().items():
            self.register_buffer(f"nf4_{name}", t.to(linear.weight.device), persistent=False)
        self.weight_dtype = linear.weight.dtype
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)

    @property
    def nf4_weight(self) -> nf4.NF4Weight:
        return nf4.NF4Weight(self.nf4_packed, self.nf4_qscale, self.nf4_factor, self.nf4_mean,
                             (self.out_features, self.in_features))

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return nf4.dequantize(self.nf4_weight, dtype or self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return _NF4LinearFn.apply(x, self.nf4_weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4, " \
               f"bias={self.bias is not None}"


# ---- LoRA wrapper ---------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """Frozen ``base_layer`` (nn.Linear or NF4Linear) plus a trainable rank-r update."""

    def __init__(self, base_layer: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False):
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.rank, self.alpha, self.rslora = rank, alpha, rslora
        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        device = next(itertools.chain(base_layer.parameters(), base_layer.buffers())).device
        # fp32 whatever the base dtype: adapters are the master weights AdamW updates
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        a = self.lora_A.weight
        h = self.lora_dropout(x)
        if not torch.is_autocast_enabled(x.device.type):
            h = h.to(a.dtype)
        return y + (self.lora_B(self.lora_A(h)) * self.scaling).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A in fp32: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def base_weight(self) -> torch.Tensor:
        b = self.base_layer
        return b.dequantized_weight(torch.float32) if isinstance(b, NF4Linear) else b.weight.detach().float()


# ---- apply ----------------------------------------------------------------------------------
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
    if targets is None:
        return list(DEFAULT_TARGETS)
    if isinstance(targets, str):
        targets = [t for t in targets.split(",")]
    out = [t.strip() for t in targets if t.strip()]
    if not out:
        raise InputError("--targets is empty; give comma-separated linear layer names, e.g. q_proj,v_proj")
    return out


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, module)


def _decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Linears inside the decoder layers (never the LM head: QLoRA keeps it 16-bit, as bitsandbytes)."""
    return [(p, m) for p, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".layers." in f".{p}" and ".lora_" not in p]


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float = 0.0, rslora: bool = False,
               targets: str | Iterable[str] | None = None, quantize_nf4: bool = False) -> nn.Module:
    """Wrap the target linears of ``model`` in place (and return it); only adapters stay trainable."""
    if not isinstance(rank, int) or rank <= 0:
        raise InputError(f"--rank must be a positive integer, got {rank!r}")
    if not (isinstance(alpha, (int, float)) and alpha > 0 and math.isfinite(alpha)):
        raise InputError(f"--alpha must be a positive number, got {alpha!r}")
    if not (0.0 <= dropout < 1.0):
        raise InputError(f"--dropout must be in [0, 1), got {dropout!r}")
    if getattr(model, "peft_config", None) is not None:
        raise InputError("the model already has LoRA adapters; merge them first (entrenar merge)")
    wanted = parse_targets(targets)
    available = linear_layer_names(model)
    unknown = [t for t in wanted if t not in available]
    if unknown:
        raise InputError(f"unknown LoRA target(s) {', '.join(unknown)}; this model's linear layers are: "
                         f"{', '.join(available)}")
    for p in model.parameters():
        p.requires_grad_(False)
    decoder = dict(_decoder_linears(model))
    wrapped = []
    for path, mod in list(model.named_modules()):
        if path not in decoder or path.rsplit(".", 1)[-1] not in wanted:
            continue
        base: nn.Module = NF4Linear(mod) if quantize_nf4 and path in decoder else mod
        _set_module(model, path, LoRALinear(base, rank, alpha, dropout, rslora))
        wrapped.append(path)
    if quantize_nf4:
        for path, mod in decoder.items():
            if path not in wrapped:
                _set_module(model, path, NF4Linear(mod))
    assert wrapped, "targets matched names but no module was wrapped"
    model.peft_config = {"r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": rslora,
                         "target_modules": wanted, "quantize_nf4": quantize_nf4}
    return model


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}


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


# ---- learning rate --------------------------------------------------------------------------
LR_FULL = 2e-5
LR_LORA_REF = 2e-4  # well-tried recipe: r=16, alpha=32 (scale 2), Adam, lr 2e-4
REF_RANK, REF_SCALE = 16, 2.0


def auto_lr(mode: str, rank: int | None = None, rslora: bool = False,
            alpha: float | None = None) -> tuple[float, str]:
    """Learning rate for ``--lr auto`` and the reason, by mode and adapter shape.

    full: 2e-5 (the usual fine-tuning rate of all weights with AdamW).

    lora / qlora: Adam moves every entry of A and B by about ``lr`` per step whatever the gradient's
    size. From B = 0, one step changes the weight by dW = scale * dB @ A, where dB is [out, r] with
    entries ~lr and A's rows are independent Kaiming draws; each entry of dW sums r such terms, so
    |dW| grows like ``scale * lr * sqrt(r)`` (like ``r`` once A and B align). We hold that step size at
    the reference recipe's (r=16, alpha=32, scale 2, lr 2e-4) and never exceed 2e-4:

        lr = 2e-4 * min(1, (2 * sqrt(16)) / (scale * sqrt(r)))

    With alpha = 2r (the default) and standard scaling (scale 2) this is 2e-4 * sqrt(16 / r):
    r=8 -> 2e-4, r=64 -> 1e-4, r=256 -> 5e-5 (2e-4 there took 4x the reference step and diverged in
    the system we replace). With rslora (scale = alpha / sqrt(r)) and alpha = 2r, scale grows as
    2 sqrt(r) and the rate falls as 1/r; with a fixed alpha it is constant in r (rsLoRA's point).
    """
    if mode == "full":
        return LR_FULL, "full fine-tuning: AdamW 2e-5 on all weights"
    if mode not in ("lora", "qlora"):
        raise InputError(f"--mode must be full, lora or qlora, got {mode!r}")
    if not rank or rank <= 0:
        raise InputError(f"--lr auto for {mode} needs a positive --rank, got {rank!r}")
    alpha = float(2 * rank if alpha is None else alpha)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    ratio = (REF_SCALE * math.sqrt(REF_RANK)) / (scale * math.sqrt(rank))
    lr = LR_LORA_REF * min(1.0, ratio)
    how = f"alpha/sqrt(r)={scale:.3g} (rslora)" if rslora else f"alpha/r={scale:.3g}"
    reason = (f"{mode} r={rank} alpha={alpha:g} scale {how}: 2e-4 x min(1, 2*sqrt(16)/(scale*sqrt(r))) "
              f"= {lr:.3g}, which keeps one Adam step's weight change at the r=16/alpha=32/2e-4 "
              f"recipe's size")
    return lr, reason


# ---- PEFT-format save / load -----------------------------------------------------------------
def _peft_key(path: str, which: str) -> str:
    return f"{PEFT_PREFIX}{path}.{which}.weight"


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for path, m in lora_modules(model).items():
        out[_peft_key(path, "lora_A")] = m.lora_A.weight.detach().float().cpu().contiguous()
        out[_peft_key(path, "lora_B")] = m.lora_B.weight.detach().float().cpu().contiguous()
    return out


def save_adapter(model: nn.Module, out_dir: str | Path, base_spec: str | Path | None = None) -> Path:
    """Write a PEFT LoRA directory: adapter_config.json + adapter_model.safetensors (+ our note)."""
    from safetensors.torch import save_file

    cfg = getattr(model, "peft_config", None)
    if cfg is None:
        raise InputError("the model has no LoRA adapters to save (apply_lora was not called)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base_spec is None else str(base_spec),
        "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"],
        "lora_dropout": cfg["lora_dropout"],
        "target_modules": list(cfg["target_modules"]),
        "use_rslora": cfg["use_rslora"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
    }
    model_cfg = getattr(model, "cfg", None)
    note = {
        "base_model": None if base_spec is None else str(base_spec),
        "trained_against": "nf4" if cfg["quantize_nf4"] else "base weights",
        "base_quantization": {"type": "nf4", "block_size": nf4.BLOCK_SIZE,
                              "scale_block_size": nf4.SCALE_BLOCK_SIZE, "double_quant": "int8 + mean",
                              "modules": "all linears of the decoder layers"} if cfg["quantize_nf4"] else None,
        "base_config": model_cfg.to_hf_dict() if model_cfg is not None else None,
        "merge": "entrenar merge --base BASE --adapter DIR --out OUT"
                 + (" (default --onto trained: NF4-dequantized base)" if cfg["quantize_nf4"] else ""),
    }
    tensors = adapter_state_dict(model)
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates it owner-only
    tmp.replace(out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    (out / ADAPTER_NOTE).write_text(json.dumps(note, indent=2, default=str) + "\n")
    return out


def adapter_path(adapter_dir: str | Path) -> Path:
    """An adapter directory, or a LoRA run directory (its final/ adapter)."""
    d = Path(adapter_dir)
    if not (d / ADAPTER_CONFIG).is_file() and (d / "final" / ADAPTER_CONFIG).is_file():
        return d / "final"
    return d


def read_adapter_config(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(adapter_config.json, our note or {}) with the checks that apply to any LoRA adapter."""
    d = adapter_path(adapter_dir)
    cfg_path = d / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise InputError(f"{d}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{cfg_path}: not valid JSON ({e})") from e
    if cfg.get("peft_type", "LORA").upper() != "LORA":
        raise InputError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are supported")
    unsupported = [k for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                               "layers_to_transform") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']}")
    if cfg.get("fan_in_fan_out"):
        unsupported.append("fan_in_fan_out")
    if unsupported:
        raise InputError(f"{cfg_path}: unsupported LoRA options {', '.join(unsupported)}")
    note_path = d / ADAPTER_NOTE
    note = json.loads(note_path.read_text()) if note_path.is_file() else {}
    return cfg, note


def _resolve_targets(model: nn.Module, target_modules: Any, cfg_path: Path) -> list[str]:
    if isinstance(target_modules, str):  # PEFT: a string is a regex matched against full module paths
        pattern = re.compile(target_modules)
        leaves = {p.rsplit(".", 1)[-1] for p, m in model.named_modules()
                  if isinstance(m, nn.Linear) and pattern.fullmatch(p)}
        if not leaves:
            raise InputError(f"{cfg_path}: target_modules regex {target_modules!r} matches no linear layer")
        return sorted(leaves)
    if not isinstance(target_modules, list) or not target_modules:
        raise InputError(f"{cfg_path}: target_modules must be a list of names, got {target_modules!r}")
    return list(target_modules)


def load_model_with_adapter(spec: str, adapter: str | Path | None = None, *, dtype: torch.dtype | None = None,
                            device: str | torch.device = "cpu", kernels: str = "torch") -> nn.Module:
    """The one way commands load a model to run: MODEL, plus an adapter attached unmerged.

    ``spec`` may itself be an adapter directory (a LoRA run's final/): its recorded base is loaded and the
    adapter attached. Returns the model in eval mode on ``device``.
    """
    from .formats import load_model, resolve_model

    if adapter is None:
        path = resolve_model(spec)
        if path.is_dir() and (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
            acfg, _ = read_adapter_config(path)
            base = acfg.get("base_model_name_or_path")
            if not base:
                raise InputError(f"{path}: adapter has no base_model_name_or_path; merge it with `entrenar merge`")
            spec, adapter = base, path
    model = load_model(spec, dtype=dtype, device=device, kernels=kernels)
    if adapter:
        model = load_adapter(model, adapter).to(device)
    return model.eval()


def load_adapter(model: nn.Module, adapter_dir: str | Path, quantize_nf4: bool | None = None) -> nn.Module:
    """Attach an adapter written by us or by ``peft`` to ``model`` (in place, and return it).

    ``quantize_nf4=None`` follows the adapter: NF4 base if it was trained against one (our note).
    """
    d = adapter_path(adapter_dir)
    cfg, note = read_adapter_config(d)
    weights = d / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise InputError(f"{d}: no {ADAPTER_WEIGHTS} (adapter_model.bin is not read; re-save with safetensors)")
    if quantize_nf4 is None:
        quantize_nf4 = note.get("trained_against") == "nf4"
    targets = _resolve_targets(model, cfg.get("target_modules"), d / ADAPTER_CONFIG)
    try:
        apply_lora(model, int(cfg["r"]), float(cfg.get("lora_alpha", 8)), float(cfg.get("lora_dropout", 0.0)),
                   bool(cfg.get("use_rslora", False)), targets, quantize_nf4=quantize_nf4)
    except InputError as e:
        raise InputError(f"{d / ADAPTER_CONFIG}: {e}") from e
    return load_adapter_weights(model, d)


def load_adapter_weights(model: nn.Module, adapter_dir: str | Path) -> nn.Module:
    """Copy an adapter's tensors into the model's existing LoRA modules (same targets and rank)."""
    from safetensors import safe_open

    d = adapter_path(adapter_dir)
    weights = d / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise InputError(f"{d}: no {ADAPTER_WEIGHTS} (adapter_model.bin is not read; re-save with safetensors)")
    mods = lora_modules(model)
    expected = {}
    for path, m in mods.items():
        expected[_peft_key(path, "lora_A")] = m.lora_A.weight
        expected[_peft_key(path, "lora_B")] = m.lora_B.weight
    seen = set()
    with safe_open(str(weights), framework="pt") as f:
        for key in list(f.keys()):
            ours = key.replace(".default.", ".")  # PEFT in-memory names carry the adapter name
            if ours not in expected:
                raise InputError(f"{weights}: tensor {key} has no matching LoRA module in this model "
                                 f"(adapter for a different base or different targets?)")
            t = f.get_tensor(key)
            param = expected[ours]
            if tuple(t.shape) != tuple(param.shape):
                raise InputError(f"{weights}: tensor {key} has shape {list(t.shape)}, this model needs "
                                 f"{list(param.shape)}: the adapter was trained for a different base model")
            with torch.no_grad():
                param.copy_(t.to(param.dtype))
            seen.add(ours)
    missing = sorted(set(expected) - seen)
    if missing:
        raise InputError(f"{weights}: {len(missing)} adapter tensors missing, e.g. {missing[0]}")
    return model


def freeze_for_inference(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
