"""Parity bisection: the path under test against an oracle, logits -> layer -> op.

The path under test is our model on the run's device, dtype and kernels. The oracle is either
our eager model in float64 on the CPU with the torch reference ops (``reference``: same
weights, so any difference comes from the compute path) or Hugging Face ``transformers``
(``hf``: a separately written implementation that also loads the weights itself, so it catches
loader bugs such as BF16 bits decoded as F16).

Every comparison is relL2 = ||test - ref|| / ||ref|| in float64. Each probe sequence runs on
its own. Pass 1 keeps only the layer-level hidden states (embedding, each block, final norm);
if one is over its bound, pass 2 re-runs both paths keeping the ops of the first such block,
and the first op over its bound is the answer. One backward pass compares gradients per
parameter group.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..devices import DTYPES as COMMAND_DTYPES
from ..errors import InputError
from ..families import eps_defaults
from ..model import CausalLM
from ..tensors import IGNORE_INDEX, rel_l2
from .probe import ProbeSequence
from .quiet import quiet_third_party
from .trace import (
    ALL_OPS,
    OP_ORDER,
    FilteredTrace,
    block_ops,
    keep_block,
    keep_layers,
    record_hf,
    record_ours,
)


@dataclass(frozen=True)
class Bounds:
    """relL2 bounds (and CE difference in nats) for one dtype of the path under test.

    fp32: docs/design.md's 1e-5 on logits; hidden states and ops get the same 1e-5 (fp32 rounding
    is ~1e-7 per op, so a defect is orders of magnitude above it); gradients 1e-4, since the
    backward sums over tokens and amplifies cancellation.
    bf16: docs/design.md's 2e-2 on logits and 0.05 nats of CE. bf16 rounds each op to ~4e-3 relative,
    and the error compounds over blocks, so hidden states and ops get 5e-2; gradients 1e-1.
    A seeded defect (wrong RoPE pairing, dropped bias, eps, causality) is >= 0.1 at its op.

    These are floors. `bounds_for` grows them with depth (`per_depth` * sqrt(blocks + 1)): rounding that
    every block adds to the residual stream accumulates, and a 28-layer model's logits inherit 28 blocks
    of it (docs/design.md, "Numerics", has the derivation and the measurements).
    """

    dtype: str
    logits: float
    ce: float
    hidden: float
    op: float
    grad: float
    per_depth: float = 0.0  # c * (one op's relative rounding) of the depth-grown bound; 0 = none
    num_layers: int = 0

    def grown(self, depth: int) -> float:
        """The depth-grown bound after `depth` blocks (0 = the embedding)."""
        return self.per_depth * math.sqrt(depth + 1)

    def at_layer(self, depth: int, floor: float) -> float:
        return max(floor, self.grown(depth))

    def layer_bound(self, name: str) -> float:
        """The bound of a hidden state or op by its trace name (embed, layers.i[.op], norm)."""
        m = re.match(r"layers\.(\d+)", name)
        depth = int(m.group(1)) + 1 if m else (0 if name == "embed" else self.num_layers)
        return self.at_layer(depth, self.op if name.count(".") >= 2 else self.hidden)


BOUNDS: dict[str, Bounds] = {
    "fp64": Bounds("fp64", logits=1e-10, ce=1e-9, hidden=1e-10, op=1e-10, grad=1e-9),
    "fp32": Bounds("fp32", logits=1e-5, ce=1e-4, hidden=1e-5, op=1e-5, grad=1e-4),
    "bf16": Bounds("bf16", logits=2e-2, ce=5e-2, hidden=5e-2, op=5e-2, grad=1e-1),
    "fp16": Bounds("fp16", logits=2e-2, ce=5e-2, hidden=5e-2, op=5e-2, grad=1e-1),
    # --dtype fp8 (train/fp8.py): the blocks' linears in e4m3, the rest bf16; floors at 4 u of e4m3
    "fp8": Bounds("fp8", logits=0.25, ce=0.5, hidden=0.25, op=0.25, grad=1.0),
}

# The depth-grown bound is DEPTH_C x (one block's relative rounding) x sqrt(blocks + 1): independent rounding
# added by each block sums in quadrature. One block's rounding, measured with random init at real widths
# (bench/parity/bf16_depth.py, the CPU; docs/design.md has the table): bf16 1.7-1.8 u at Qwen2.5-Coder-7B's
# width (u = 2^-8; 28 layers on 4x H200 gave 3.96e-2 = 1.8 u sqrt(29)), <= 1.4 u at Qwen2.5-0.5B's; fp32
# 10-11 u at either (the matmuls' fp32 accumulation over thousands of terms). DEPTH_C = 4 leaves >= 2x margin.
# fp8 (e4m3, u = 2^-4): k = relL2 / (u sqrt(depth + 1)) measured 0.52-0.72 (train/fp8.py), so C = 2.
DEPTH_C = 4.0
DEPTH_C_OF = {"fp8": 2.0}
BLOCK_ROUNDING = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 12 * 2.0 ** -24, "fp8": 2.0 ** -4}


def bounds_for(dtype: str, cfg: Any) -> Bounds:
    """The bounds of `dtype` for a model of `cfg`'s depth and widths: each floor of BOUNDS[dtype], raised
    where rounding accumulated over cfg.num_layers blocks reaches it. Logits, CE and gradients scale with
    the last block's grown bound (the logits inherit the final norm's error), hidden states and ops with
    their own block's."""
    base = BOUNDS[dtype]
    if dtype not in BLOCK_ROUNDING:
        return base
    per_depth = DEPTH_C_OF.get(dtype, DEPTH_C) * BLOCK_ROUNDING[dtype]
    final = per_depth * math.sqrt(cfg.num_layers + 2)  # the blocks, the final norm and the head
    scale = max(1.0, final / base.logits)
    return Bounds(dtype, logits=base.logits * scale, ce=base.ce * scale, hidden=base.hidden, op=base.op,
                  grad=base.grad * scale, per_depth=per_depth, num_layers=cfg.num_layers)


DTYPES = {**COMMAND_DTYPES, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp64": torch.float64, "float64": torch.float64}  # the --dtype names (devices.py) and torch's names
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}

# What a divergence first seen at an op most likely means: the defects earlier fast paths shipped (RoPE pairs
# swapped, Q/K/V bias dropped, eps hard-coded to 1e-5, non-causal attention, BF16 bits read as F16), named.
HINTS = {
    "embed": "weights decoded wrongly at load (dtype tag, dequantization, transposition); compare with "
             "`entrenar verify --against hf`",
    "input_norm": f"RMSNorm eps or the rmsnorm kernel (defaults {eps_defaults()}: read it from the config)",
    "q_proj": "Q/K/V projection: a dropped Q/K/V bias or wrong projection weights",
    "k_proj": "Q/K/V projection: a dropped Q/K/V bias or wrong projection weights",
    "v_proj": "Q/K/V projection: a dropped Q/K/V bias or wrong projection weights",
    "q_norm": "qk-norm (Qwen3): the per-head RMSNorm of q over head_dim, before RoPE (its eps, weights, or applied "
              "after RoPE)",
    "k_norm": "qk-norm (Qwen3): the per-head RMSNorm of k over head_dim, before RoPE (its eps, weights, or applied "
              "after RoPE)",
    "q_rope": "RoPE: pairing (neox split-half vs gptj adjacent), theta, scaling or positions",
    "k_rope": "RoPE: pairing (neox split-half vs gptj adjacent), theta, scaling or positions",
    "attn_probs": "attention probabilities: the mask (causality, document mask) or the softmax reduction",
    "attn_out": "attention output: softmax-weighted sum of V (GQA head mapping, attention kernel)",
    "o_proj": "o_proj weights or an extra/missing bias",
    "attn_residual": "the attention residual connection",
    "post_attention_norm": "RMSNorm eps or the rmsnorm kernel",
    "gate_proj": "MLP gate projection weights",
    "up_proj": "MLP up projection weights",
    "act": "the SwiGLU activation kernel (silu(gate) * up)",
    "down_proj": "MLP down projection weights",
    "mlp_residual": "the MLP residual connection",
    "norm": "the final RMSNorm",
    "logits": "the LM head (tied vs untied embedding, head weights)",
    "ce": "the cross-entropy of the logits (labels shift, ignore index)",
}




UNRECORDED_HINT = ("the bisection's hooks never saw this op (a module layout the tracing does not know, or a "
                   "forward that bypasses the named modules): the op is unchecked, fix the tracing in "
                   "entrenar/verify/trace.py")


def hint(name: str) -> str:
    key = name.rsplit(".", 1)[-1] if name.startswith("layers.") else name.split(":")[0]
    return HINTS.get(key, HINTS.get(name.split(".")[0], "a difference in the compute path"))


# ---- traces --------------------------------------------------------------------------------
def layer_names(num_layers: int) -> list[str]:
    return ["embed", *(f"layers.{i}" for i in range(num_layers)), "norm"]


def _targets(ids: torch.Tensor) -> torch.Tensor:
    """Shifted labels for one sequence: labels[:, t] = ids[:, t + 1], last position ignored."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    return labels


def _grad_group(name: str) -> str:
    """Parameter name -> group: embed, layers.i.attn, layers.i.mlp, layers.i.norms, norm, lm_head."""
    name = name.removeprefix("base_model.model.")
    m = re.match(r"model\.layers\.(\d+)\.(self_attn|mlp|input_layernorm|post_attention_layernorm)", name)
    if m:
        kind = {"self_attn": "attn", "mlp": "mlp"}.get(m.group(2), "norms")
        return f"layers.{m.group(1)}.{kind}"
    if name.startswith("model.embed_tokens"):
        return "embed"
    if name.startswith("model.norm"):
        return "norm"
    if name.startswith("lm_head"):
        return "lm_head"
    return name


class OurPath:
    """Our CausalLM on some device/dtype/kernels (the path under test, or the float64 reference)."""

    def __init__(self, model: CausalLM, autocast_dtype: torch.dtype | None = None, label: str = ""):
        self.model = model
        self.device = next(model.parameters()).device
        self.autocast_dtype = autocast_dtype
        self.label = label or f"{self.device.type} {DTYPE_NAMES.get(self.param_dtype, self.param_dtype)} " \
                              f"kernels={model.kernels}"

    @property
    def param_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _autocast(self):
        if self.autocast_dtype is None or self.autocast_dtype == self.param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward(self, ids: torch.Tensor, keep: Callable[[str], bool]) -> tuple[torch.Tensor, dict]:
        trace = FilteredTrace(keep)
        with torch.no_grad(), self._autocast(), record_ours(self.model, trace, keep):
            logits = self.model(ids.to(self.device))
        return logits[0].to("cpu", torch.float64), dict(trace)

    def grads(self, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        """One backward of the training loss (forward with labels: the kernel path training uses)."""
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        saved = {n: p.grad for n, p in params.items()}
        for p in params.values():
            p.grad = None
        try:
            ids = ids.to(self.device)
            with torch.enable_grad(), self._autocast():
                loss_sum, n = self.model(ids, labels=_targets(ids))
                loss = loss_sum / n
            loss.backward()
            grads = {n: p.grad.detach().to("cpu", torch.float64) for n, p in params.items()
                     if p.grad is not None}
        finally:
            for n, p in params.items():
                p.grad = saved[n]
        return float(loss.detach()), grads


class CachedPath:
    """An oracle whose forwards are computed once per (sequence, filter): the preflight compares the run's
    bf16 path and its fp32 twin against one float64 reference without running it twice."""

    def __init__(self, path: Any):
        self.path, self.label, self._seen = path, path.label, {}

    def forward(self, ids: torch.Tensor, keep: Callable[[str], bool]) -> tuple[torch.Tensor, dict]:
        key = (tuple(ids.reshape(-1).tolist()), getattr(keep, "cache_key", keep))
        if key not in self._seen:
            self._seen[key] = self.path.forward(ids, keep)
        return self._seen[key]

    def grads(self, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        return self.path.grads(ids)


class HFPath:
    """A transformers model as the oracle; hooks record the same names our trace uses."""

    def __init__(self, hf_model: Any, label: str = "transformers"):
        self.model = hf_model
        self.label = label
        self.device = next(hf_model.parameters()).device
        if hasattr(hf_model, "set_attn_implementation"):
            hf_model.set_attn_implementation("eager")  # attention probabilities come back only from eager
        else:
            hf_model.config._attn_implementation = "eager"
        cfg = hf_model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def forward(self, ids: torch.Tensor, keep: Callable[[str], bool]) -> tuple[torch.Tensor, dict]:
        trace = FilteredTrace(keep)
        with torch.no_grad(), record_hf(self.model, trace, self.head_dim):
            logits = self.model(input_ids=ids.to(self.device), use_cache=False).logits
        return logits[0].to("cpu", torch.float64), dict(trace)

    def grads(self, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        for p in params.values():
            p.grad = None
        ids = ids.to(self.device)
        with torch.enable_grad():
            logits = self.model(input_ids=ids, use_cache=False).logits
            loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="mean")
        loss.backward()
        grads = {n: p.grad.detach().to("cpu", torch.float64) for n, p in params.items() if p.grad is not None}
        for p in params.values():
            p.grad = None
        return float(loss.detach()), grads


# ---- building the oracles --------------------------------------------------------------------
def reference_model(model: CausalLM) -> CausalLM:
    """Same weights as ``model`` in float64 on the CPU with the torch reference ops."""
    sd = model.state_dict()
    with torch.device("meta"):
        ref = CausalLM(model.cfg, kernels="torch")
    ref_keys = set(ref.state_dict())
    if set(sd) == ref_keys:
        ref.load_state_dict({k: v.detach().to("cpu", torch.float64) for k, v in sd.items()}, assign=True)
    else:  # a wrapped model (LoRA adapters): copy the whole module tree instead
        import copy

        ref = copy.deepcopy(model).to("cpu", torch.float64)
        ref.kernels = "torch"
    ref.eval()
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():  # the same trainable set (LoRA: adapters only)
        p.requires_grad_(trainable.get(n, True))
    return ref


@quiet_third_party()
def hf_from_model(model: CausalLM) -> Any:
    """A transformers model holding ``model``'s weights (fp32): checks compute, not loading."""
    import transformers

    cfg_dict = model.cfg.to_hf_dict()
    if "entrenar_rope_style" in cfg_dict or "entrenar_qk_norm" in cfg_dict:
        raise ValueError("transformers cannot express this config (gptj RoPE or qk-norm): use --against reference")
    fam = model.cfg.family
    cls, conf_cls = getattr(transformers, fam.hf_architecture), getattr(transformers, fam.hf_config_class)
    hf_cfg = conf_cls(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    hf = cls(hf_cfg)
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.cfg.tie_word_embeddings)]
    assert not missing and not unexpected, f"weights do not map onto transformers: {missing} {unexpected}"
    if model.cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.float().eval()


@quiet_third_party()
def hf_from_source(path: Any) -> Any:
    """transformers loading the model file itself (fp32, CPU): an independent loader."""
    from pathlib import Path

    import transformers

    path = Path(path)
    if path.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return hf.eval()  # GGUF: transformers dequantized to float32 itself (and refuses .float())


@quiet_third_party()
def hf_with_adapter(hf_model: Any, adapter: Any) -> Any:
    """``hf_model`` with a PEFT-format LoRA adapter merged by peft itself (an independent implementation)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model, str(adapter)).merge_and_unload().eval()


# ---- comparisons -----------------------------------------------------------------------------
def _entries(names: list[str], test: dict, ref: dict, bounds: Bounds) -> list[dict]:
    """relL2 per name against its own (depth-grown) bound. A name one side never recorded is a failure: its
    parity is unknown, and an unchecked op must never pass as a checked one."""
    out = []
    for name in names:
        bound = bounds.layer_bound(name)
        missing = [side for side, trace in (("the path under test", test), ("the reference", ref))
                   if name not in trace]
        if missing:
            out.append({"name": name, "rel_l2": None, "bound": bound, "ok": False,
                        "note": f"never recorded by {' and '.join(missing)}"})
            continue
        r = rel_l2(test[name], ref[name])
        out.append({"name": name, "rel_l2": r, "bound": bound, "ok": r <= bound})
    return out


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> float:
    if logits.shape[0] < 2:
        return float("nan")
    return float(F.cross_entropy(logits[:-1], ids[0, 1:].to(logits.device), reduction="mean"))


def compare_sequence(test: Any, ref: Any, seq: ProbeSequence, num_layers: int, bounds: Bounds,
                     ops: tuple[str, ...] = OP_ORDER) -> dict:
    """Logits, CE, per-layer hidden states and (if a layer breaks) per-op relL2 for one sequence.
    `ops`: the block's ops (trace.block_ops of the model's config)."""
    t_logits, t_trace = test.forward(seq.input_ids, keep_layers)
    r_logits, r_trace = ref.forward(seq.input_ids, keep_layers)
    ce_t, ce_r = _ce(t_logits, seq.input_ids), _ce(r_logits, seq.input_ids)
    logits_rel = rel_l2(t_logits, r_logits)
    max_abs = float((t_logits - r_logits).abs().max()) if t_logits.numel() else 0.0
    ce_diff = abs(ce_t - ce_r)
    layers = _entries(layer_names(num_layers), t_trace, r_trace, bounds)
    del t_trace, r_trace
    res: dict[str, Any] = {
        "name": seq.name, "tokens": seq.length,
        "logits_rel_l2": logits_rel, "logits_max_abs": max_abs,
        "ce_test": ce_t, "ce_ref": ce_r, "ce_diff": ce_diff,
        "logits_ok": logits_rel <= bounds.logits and math.isfinite(max_abs),
        "ce_ok": ce_diff <= bounds.ce if math.isfinite(ce_diff) else seq.length < 2,
        "layers": layers, "first_bad_layer": None, "ops": [], "first_divergent": None,
    }
    bad = next((e for e in layers if not e["ok"]), None)
    if bad is not None:
        res["first_bad_layer"] = bad["name"]
        if bad["name"].startswith("layers."):
            li = int(bad["name"].split(".")[1])
            _, t_ops = test.forward(seq.input_ids, keep_block(li))
            _, r_ops = ref.forward(seq.input_ids, keep_block(li))
            res["ops"] = _entries([f"layers.{li}.{op}" for op in ops], t_ops, r_ops, bounds)
            first_op = next((e for e in res["ops"] if not e["ok"]), None)
            res["first_divergent"] = dict(first_op or bad)
        else:
            res["first_divergent"] = dict(bad)
    elif not res["logits_ok"]:
        res["first_divergent"] = {"name": "logits", "rel_l2": logits_rel, "bound": bounds.logits}
        norm = next((e["rel_l2"] for e in layers if e["name"] == "norm"), None)
        if norm is not None and math.isfinite(logits_rel) and logits_rel - norm <= bounds.op:
            # the head (a linear map) adds less than one op's own bound: the logits carry the stream's error
            res["first_divergent"]["hint"] = (
                f"no op breaks its own bound: the logits carry the rounding accumulated over {num_layers} blocks "
                f"(final norm relL2 {norm:.3e}, every layer inside its bound), not an LM-head defect; the "
                f"depth-grown bound (docs/design.md, Numerics) is too tight for this model: please report it "
                f"with this table")
    elif not res["ce_ok"]:
        res["first_divergent"] = {"name": "ce", "rel_l2": ce_diff, "bound": bounds.ce}
    res["ok"] = res["first_divergent"] is None
    return res


def compare_grads(test: Any, ref: Any, seq: ProbeSequence, bounds: Bounds) -> dict:
    loss_t, g_t = test.grads(seq.input_ids)
    loss_r, g_r = ref.grads(seq.input_ids)
    groups: dict[str, tuple[list, list]] = {}
    for name, g in g_t.items():
        if name in g_r:
            t_list, r_list = groups.setdefault(_grad_group(name), ([], []))
            t_list.append(g.reshape(-1))
            r_list.append(g_r[name].reshape(-1))
    entries = []
    for group, (t_list, r_list) in groups.items():
        r = rel_l2(torch.cat(t_list), torch.cat(r_list))
        entries.append({"name": group, "rel_l2": r, "bound": bounds.grad, "ok": r <= bounds.grad})
    missing = sorted(set(g_r) - set(g_t))
    worst = max(entries, key=lambda e: e["rel_l2"]) if entries else None
    return {"sequence": seq.name, "loss_test": loss_t, "loss_ref": loss_r, "groups": entries,
            "missing_in_test": missing, "worst": worst,
            "ok": bool(entries) and all(e["ok"] for e in entries) and not missing}


def _position(name: str, num_layers: int) -> tuple[int, int]:
    """Order of a divergence point in the forward: embed < layer 0 ops < layer 1 ... < norm < logits."""
    if name == "embed":
        return (0, 0)
    m = re.fullmatch(r"layers\.(\d+)(?:\.(\w+))?", name)
    if m:
        op = m.group(2)
        return (1 + int(m.group(1)), ALL_OPS.index(op) if op in ALL_OPS else len(ALL_OPS))
    order = {"norm": 1, "logits": 2, "ce": 3}
    return (1 + num_layers + order.get(name, 4), 0)


def verify_paths(test: Any, ref: Any, probe: list[ProbeSequence], num_layers: int, bounds: Bounds,
                 grads: bool = True, meta: dict | None = None, ops: tuple[str, ...] = OP_ORDER) -> dict:
    """Run the whole comparison; ``first_divergent`` names the earliest op over its bound."""
    t0 = time.time()
    seqs = [compare_sequence(test, ref, s, num_layers, bounds, ops) for s in probe]
    grad_report = compare_grads(test, ref, probe[-1], bounds) if grads else None
    first = None
    for s in seqs:
        fd = s["first_divergent"]
        if fd is not None:
            cand = {**fd, "sequence": s["name"]}
            if first is None or _position(fd["name"], num_layers) < _position(first["name"], num_layers):
                first = cand
    if first is None and grad_report is not None and not grad_report["ok"]:
        bad = next((e for e in grad_report["groups"] if not e["ok"]), None)
        first = ({"name": f"grad:{bad['name']}", "rel_l2": bad["rel_l2"], "bound": bad["bound"]} if bad else
                 {"name": "grad:missing", "rel_l2": None, "bound": bounds.grad,
                  "note": f"no gradient for {grad_report['missing_in_test'][:5]}"})
        first["sequence"] = grad_report["sequence"]
    if first is not None and "hint" not in first:
        first["hint"] = (UNRECORDED_HINT if first.get("rel_l2") is None and "never recorded" in first.get("note", "")
                         else hint(first["name"]))
    ok = first is None
    return {**(meta or {}), "test_path": test.label, "reference_path": ref.label,
            "bounds": asdict(bounds), "sequences": seqs, "grads": grad_report,
            "first_divergent": first, "ok": ok, "exit_code": 0 if ok else 1,
            "seconds": round(time.time() - t0, 2)}


_SUM_DTYPE = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float32,
              torch.float16: torch.float32}


def check_finite_weights(model: torch.nn.Module) -> None:
    """InputError naming the tensors that hold NaN/Inf. Non-finite weights make every op diverge from the
    reference, and a table blaming the first op would send the user to fix a kernel that is fine."""
    bad = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():
            t = t.detach()
            # one read and no temporaries first: a NaN/Inf anywhere makes the sum NaN/Inf, so a finite sum clears
            # the tensor (the elementwise count below is ~40x slower: 6 s a check on 7B-wide layers on the CPU)
            if t.dtype in _SUM_DTYPE and bool(torch.isfinite(t.sum(dtype=_SUM_DTYPE[t.dtype]))):
                continue
            n_bad = int((~torch.isfinite(t)).sum())
            if n_bad:
                bad.append(f"{name} ({n_bad} of {t.numel()} values)")
    if bad:
        more = f"; {len(bad) - 3} more tensors too" if len(bad) > 3 else ""
        raise InputError(f"weights contain NaN/Inf in {', '.join(bad[:3])}{more}: the model itself is broken (saved "
                         f"from a diverged run, or a corrupt file), not the compute path. Use an earlier checkpoint or "
                         f"re-download / re-convert the model; `entrenar inspect MODEL` lists its tensors.")


def verify_model(model: CausalLM, tokenizer: Any = None, *, probe: list[ProbeSequence] | None = None,
                 dtype: torch.dtype | str | None = None, against: str = "reference", hf_model: Any = None,
                 seq_len: int = 512, grads: bool = True, meta: dict | None = None, oracle: Any = None,
                 bounds: str | None = None) -> dict:
    """Verify ``model`` as it stands (its device, dtype, kernels) against an oracle.

    ``dtype`` (default: the weights' dtype) picks the bounds and, if it differs from the
    weights, runs the model under autocast; ``bounds`` names other bounds (a path whose matmuls round
    coarser than its autocast dtype: "fp8"). ``against="hf"`` uses ``hf_model`` if given (e.g.
    transformers loading the same file), else builds one from ``model``'s weights.
    """
    from .probe import build_probe

    check_finite_weights(model)
    if probe is None:
        probe = build_probe(tokenizer, seq_len)
    param_dtype = next(model.parameters()).dtype
    run_dtype = DTYPES[dtype] if isinstance(dtype, str) else (dtype or param_dtype)
    was_training = model.training
    model.eval()
    try:
        test = OurPath(model, autocast_dtype=run_dtype)
        test.label = f"{test.device.type} {bounds or DTYPE_NAMES[run_dtype]} kernels={model.kernels}"
        if oracle is not None:  # given by the caller (the preflight's one cached float64 reference)
            ref = oracle
        elif against == "reference":
            ref = OurPath(reference_model(model), label="cpu fp64 kernels=torch (reference)")
        elif against == "hf":
            ref = HFPath(hf_model if hf_model is not None else hf_from_model(model),
                         label="transformers cpu fp32 (eager attention)")
        else:
            raise ValueError(f"against {against!r} not in ('reference', 'hf')")
        checked = bounds_for(bounds or DTYPE_NAMES[run_dtype], model.cfg)
        return verify_paths(test, ref, probe, model.cfg.num_layers, checked, grads=grads, ops=block_ops(model.cfg),
                            meta={"against": against, "dtype": DTYPE_NAMES[run_dtype], **(meta or {})})
    finally:
        model.train(was_training)


# ---- the table -------------------------------------------------------------------------------
def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.3e}"
    return str(x)


def format_report(rep: dict) -> str:
    lines = [f"verify: {rep.get('model', '')}  test: {rep['test_path']}  vs  reference: {rep['reference_path']}"]
    b = rep["bounds"]
    lines.append(f"bounds ({b['dtype']}): logits relL2 <= {b['logits']:g}, CE diff <= {b['ce']:g} nats, "
                 f"hidden <= {b['hidden']:g}, op <= {b['op']:g}, grad <= {b['grad']:g}"
                 + (f"; hidden and ops grow as {b['per_depth']:.3g} x sqrt(depth + 1) where larger "
                    f"({b['num_layers']} blocks)" if b.get("per_depth") else ""))
    for s in rep["sequences"]:
        lines.append("")
        lines.append(f"[{s['name']}: {s['tokens']} tokens]  logits relL2 {_fmt(s['logits_rel_l2'])}  "
                     f"max|diff| {_fmt(s['logits_max_abs'])}  CE test {s['ce_test']:.5f}  ref {s['ce_ref']:.5f}  "
                     f"diff {_fmt(s['ce_diff'])}  {'ok' if s['ok'] else 'FAIL'}")
        lines.append(f"  {'hidden state':<34} {'relL2':>10}  bound")
        for e in s["layers"]:
            lines.append(f"  {e['name']:<34} {_fmt(e['rel_l2']):>10}  {e['bound']:g}{'' if e['ok'] else '  <-- over'}")
        if s["ops"]:
            lines.append(f"  ops of {s['first_bad_layer']}:")
            for e in s["ops"]:
                lines.append(f"    {e['name']:<32} {_fmt(e['rel_l2']):>10}  {e['bound']:g}"
                             f"{'' if e['ok'] else '  <-- over'}{'  (' + e['note'] + ')' if e.get('note') else ''}")
    g = rep.get("grads")
    if g:
        lines.append("")
        lines.append(f"gradients ({g['sequence']}): loss test {g['loss_test']:.5f} ref {g['loss_ref']:.5f}")
        for e in g["groups"]:
            lines.append(f"  {e['name']:<34} {_fmt(e['rel_l2']):>10}  {e['bound']:g}{'' if e['ok'] else '  <-- over'}")
        if g["missing_in_test"]:
            lines.append(f"  no gradient in the path under test for: {', '.join(g['missing_in_test'][:8])}")
    lines.append("")
    fd = rep["first_divergent"]
    if fd is None:
        lines.append("PASS: every bound holds")
    else:
        what = (fd["note"] if fd.get("rel_l2") is None and fd.get("note")
                else f"relL2 {_fmt(fd['rel_l2'])} > {fd['bound']:g}")
        lines.append(f"FAIL: first divergence at {fd['name']} ({fd['sequence']} probe): {what}. "
                     f"Likely cause: {fd['hint']}")
    return "\n".join(lines)
