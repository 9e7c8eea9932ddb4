"""The peers' rows, each measured in a child process of its own (`python -m bench.peers KIND PARAMS`), so
one peer's patches (Liger patches transformers' classes, Unsloth patches everything it imports) and GPU
memory never reach the next row.

A peer that is not importable is a "skipped" row carrying the import error; a peer that needs CUDA on a
machine without it is "skipped" saying so; anything else that goes wrong is a "failed" row with the error.
The child prints `ROW {json}` (the measured fields) or `SKIP reason` as its last line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.cli_run import child_env, run_command

# what the child needs importable, per kind (a missing one makes the row "skipped")
NEEDS = {"liger": ("transformers", "liger_kernel"), "long-liger": ("transformers", "liger_kernel"),
         "qlora-entrenar": (), "qlora-bnb": ("transformers", "bitsandbytes", "peft"),
         "qlora-unsloth": ("unsloth", "transformers", "peft"), "titan": ("torchtitan", "torchao")}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Skip(Exception):
    """The peer cannot run here (not importable, no CUDA): a skipped row, not a failure."""


# ---- parent side ---------------------------------------------------------------------------------------
def run_peer(sc: Any, ctx: Any) -> list[dict[str, Any]]:
    params = {"kind": sc.kind, "model": sc.model, "batch": sc.batch, "seq": sc.seq, "steps": sc.steps,
              "warmup": sc.warmup, "work": str(ctx.work), **sc.params}
    cmd = [sys.executable, "-m", "bench.peers", sc.kind, json.dumps(params, sort_keys=True)]
    t0 = time.perf_counter()
    code, out, err = run_command(cmd, sc.timeout_s, child_env())
    values: dict[str, Any] = {"command": shlex.join(cmd), "wall_s": time.perf_counter() - t0,
                              "steps": sc.steps, "warmup": sc.warmup}
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if code == 0 and last.startswith("ROW "):
        values.update(json.loads(last[4:]), status="ok")
    elif code == 0 and last.startswith("SKIP "):
        values.update(status="skipped", reason=last[5:])
    else:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-6:]
        values.update(status="failed", reason=f"exit {code}: " + " | ".join(tail)[-900:])
    return [ctx.row(sc, **values)]


GEN_SMOKE_SHAPE = "qwen2.5-0.5b"  # --tiny builds a tiny model of this shape's family


def speed_rows(out: str, shape: str, batch: int) -> list[dict[str, Any]]:
    """The speed rows of `shape` at `batch` in bench/generate_throughput.py's stdout: JSON lines with
    entrenar_tok_s at the top level. Its last line, the summary, holds every row again under "rows": the
    substring match this replaced took that line and failed with KeyError 'entrenar_tok_s' (issue 36 item 6)."""
    found = []
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:  # a line of other output that starts with a brace: not a row
            continue
        if isinstance(obj, dict) and "entrenar_tok_s" in obj and obj.get("shape") == shape \
                and obj.get("batch") == batch:
            found.append(obj)
    return found


def generate_command(sc: Any, smoke: bool) -> tuple[list[str], int]:
    """The child command of a generation scenario and its batch: the scenario's model shape, prompt and new
    tokens (seq = 128 + 128), on tiny shapes on the CPU in --smoke (batch as the smoke scenario's)."""
    b = sc.batch if smoke else sc.params["batch"]
    half = str(sc.seq // 2)
    cmd = [sys.executable, "-m", "bench.generate_throughput", "--shapes", sc.model if not smoke else GEN_SMOKE_SHAPE,
           "--batches", str(b), "--timeout-s", str(max(30.0, sc.timeout_s - 20)),
           *(["--tiny"] if smoke else ["--prompt-len", half, "--new-tokens", half])]
    return cmd, b



def run_generate(sc: Any, ctx: Any) -> list[dict[str, Any]]:
    """bench/generate_throughput.py as it is (a child process), one shape and batch size: two rows, entrenar's
    generate_batch (baseline: the transformers row) and transformers' generate. --smoke runs the same parsing."""
    cmd, b = generate_command(sc, ctx.smoke)
    t0 = time.perf_counter()
    code, out, err = run_command(cmd, sc.timeout_s, child_env())
    common = {"command": shlex.join(cmd), "wall_s": time.perf_counter() - t0}
    shape = cmd[cmd.index("--shapes") + 1]
    found = speed_rows(out, shape, b)
    ours, theirs = f"{sc.name}", f"{sc.name}-transformers"
    if code != 0 or not found:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-6:]
        reason = (f"exit {code}: " + " | ".join(tail)[-900:] if code != 0 else
                  f"no speed row of {shape} at batch {b} (a JSON line with entrenar_tok_s) in its output")
        return [ctx.row(sc, row=r, runner=n, status="failed", reason=reason, **common)
                for r, n in ((ours, "entrenar-generate"), (theirs, "transformers-generate"))]
    g = found[-1]
    seq = g.get("prompt_len", 0) + g.get("new_tokens", 0)
    extra = {k: v for k, v in g.items() if k not in ("entrenar_tok_s", "transformers_tok_s")}
    dtype = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}.get(g.get("dtype"), str(g.get("dtype", sc.dtype)))
    common.update(dtype=dtype, seq=seq or sc.seq, batch=g.get("batch", b), extra=extra)
    return [ctx.row(sc, row=ours, runner="entrenar-generate", status="ok", tokens_per_s=g["entrenar_tok_s"],
                    tokens_per_s_per_gpu=g["entrenar_tok_s"], baseline=theirs, **common),
            ctx.row(sc, row=theirs, runner="transformers-generate", status="ok", tokens_per_s=g["transformers_tok_s"],
                    tokens_per_s_per_gpu=g["transformers_tok_s"], baseline=None, **common)]


def run_engine(sc: Any, ctx: Any) -> list[dict[str, Any]]:
    """bench/engine_throughput.py on one shape and workload (a child process): two rows, the engine's (baseline:
    the transformers row) and transformers' generate at its best batch, from the script's last JSON line; --smoke
    runs it with --tiny (tiny shapes and workloads on the CPU)."""
    shape = sc.model if not ctx.smoke else "smollm2-135m"
    cmd = [sys.executable, "-m", "bench.engine_throughput", "--shapes", shape, "--workloads", sc.params["workload"],
           "--timeout-s", str(max(30.0, sc.timeout_s - 20)), *(["--tiny", "--no-checks"] if ctx.smoke else [])]
    t0 = time.perf_counter()
    code, out, err = run_command(cmd, sc.timeout_s, child_env())
    common = {"command": shlex.join(cmd), "wall_s": time.perf_counter() - t0}
    ours, theirs = sc.name, f"{sc.name}-transformers"
    summary = next((json.loads(ln) for ln in reversed(out.strip().splitlines())
                    if ln.startswith("{") and '"rows"' in ln), None)
    rows = (summary or {}).get("rows") or []
    if code != 0 or not rows:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-6:]
        reason = f"exit {code}: " + " | ".join(tail)[-900:] if code != 0 else "no summary line with rows"
        return [ctx.row(sc, row=r, runner=n, status="failed", reason=reason, **common)
                for r, n in ((ours, "entrenar-engine"), (theirs, "transformers-generate"))]
    r = rows[-1]
    extra = {k: v for k, v in r.items() if k not in ("entrenar_tok_s", "transformers_tok_s")}
    return [ctx.row(sc, row=ours, runner="entrenar-engine", status="ok", tokens_per_s=r["entrenar_tok_s"],
                    tokens_per_s_per_gpu=r["entrenar_tok_s"], batch=r["slots"], baseline=theirs, extra=extra, **common),
            ctx.row(sc, row=theirs, runner="transformers-generate", status="ok", tokens_per_s=r["transformers_tok_s"],
                    tokens_per_s_per_gpu=r["transformers_tok_s"], batch=r["transformers_best_batch"], baseline=None,
                    extra=extra, **common)]


# ---- child side: one measurement -----------------------------------------------------------------------
def _need(kind: str) -> Any:
    for module in NEEDS[kind]:
        try:
            importlib.import_module(module)
        except Exception as e:  # an import that fails in any way (not only ImportError) is the skip's reason
            raise Skip(f"{module} not importable: {type(e).__name__}: {e}"[:500]) from e
    import torch

    if not torch.cuda.is_available():
        raise Skip(f"{kind} needs a CUDA GPU (torch {torch.__version__} sees none)")
    return torch


def liger(p: dict[str, Any]) -> dict[str, Any]:
    """transformers + Liger (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy), bf16 weights, fused AdamW,
    the same random weights as entrenar's init (bench/train_throughput.py's step loop)."""
    torch = _need("liger")
    from bench import train_throughput as tt
    from entrenar.config import preset

    cfg, device = preset(p["model"]), torch.device("cuda")
    input_ids, labels = (t.to(device) for t in tt.make_batch(cfg, p["batch"], p["seq"]))
    hf_labels = torch.cat([input_ids[:, :1], labels], dim=1)[:, :p["seq"]].clone()  # HF shifts inside
    tt.apply_liger(cfg)
    model = tt.build_hf(cfg, tt.reference_state(cfg), torch.bfloat16, device)
    r = tt.run_training("liger", model, lambda: model(input_ids=input_ids, labels=hf_labels, use_cache=False).loss,
                        cfg, p["batch"], p["seq"], p["steps"] - p["warmup"], p["warmup"], device, False,
                        profile_steps=p.get("profile_steps", 0))
    return {"tokens_per_s": r["tok_s"], "tokens_per_s_per_gpu": r["tok_s"], "seconds_per_step": r["step_s"],
            "peak_gib": r["peak_gib"], "mfu": r["mfu"],
            "extra": {"loss_first": r["loss0"], "loss_last": r["loss_last"], "mfu_peak_tflops": tt.PEAK_BF16_TFLOPS,
                      **({"profile": r["profile"]} if r["profile"] else {})}}


def long_liger(p: dict[str, Any]) -> dict[str, Any]:
    """transformers + Liger at one long length, batch 1 (bench/long_context_memory.py's run and step)."""
    torch = _need("long-liger")
    from bench import long_context_memory as lcm

    device = torch.device("cuda")
    cfg = lcm.model_config(quick=False)
    model, step_loss = lcm.build_hf(cfg, device, use_liger=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    for q in model.parameters():  # AdamW state allocated before the measured steps, as in a real run
        q.grad = torch.zeros_like(q)
    opt.step()
    opt.zero_grad(set_to_none=True)

    def step(inputs: Any, labels: Any) -> float:
        loss = step_loss(inputs, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    r = lcm.measure(step, device, p["seq"], cfg.vocab_size, p["warmup"], p["steps"] - p["warmup"], None)
    return {"tokens_per_s": r["tokens_per_s"], "tokens_per_s_per_gpu": r["tokens_per_s"],
            "seconds_per_step": r["step_s"], "peak_gib": r["peak_gib"],
            "extra": {"peak_reserved_gib": r.get("peak_reserved_gib"), "loss_last": r["loss"]}}


def _qlora_args(p: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(preset=p["model"], batch=p["batch"], seq=p["seq"], rank=p["rank"],
                           steps=p["steps"] - p["warmup"], warmup=p["warmup"], checkpointing=p["checkpointing"],
                           profile=False, lora_unfused=False)


def _qlora_values(r: dict[str, Any]) -> dict[str, Any]:
    return {"tokens_per_s": r["tok_s"], "tokens_per_s_per_gpu": r["tok_s"], "seconds_per_step": r["step_s"],
            "peak_gib": r["peak_mem_gib"],
            "extra": {k: v for k, v in r.items() if k not in ("tok_s", "step_s", "peak_mem_gib", "profile")}}


def qlora_entrenar(p: dict[str, Any]) -> dict[str, Any]:
    _need("qlora-entrenar")
    from bench import qlora_throughput as qt

    return _qlora_values(qt.run_entrenar(_qlora_args(p)))


def qlora_bnb(p: dict[str, Any]) -> dict[str, Any]:
    _need("qlora-bnb")
    from bench import qlora_throughput as qt

    return _qlora_values(qt.run_peer(_qlora_args(p)))


def _random_hf_dir(p: dict[str, Any], torch: Any) -> Path:
    """An HF directory of the preset's shapes with random bf16 weights (N(0, 0.02), unit norms) and a small
    word-level tokenizer (random ids never need it; loaders do): what Unsloth's from_pretrained reads."""
    import transformers
    from tokenizers import Tokenizer, models

    from bench.qlora_throughput import init_normal_
    from entrenar.config import preset

    out = Path(p["work"]) / f"hf-random-{p['model']}"
    if (out / "config.json").is_file():
        return out
    cfg = preset(p["model"])
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    config_cls = transformers.Qwen2Config if cfg.architecture == "qwen2" else transformers.LlamaConfig
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**d), torch_dtype=torch.bfloat16)
    init_normal_(model)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(1000)} | {"<unk>": 1000, "<pad>": 1001, "<eos>": 1002}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                               unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def qlora_unsloth(p: dict[str, Any]) -> dict[str, Any]:
    """Unsloth's FastLanguageModel (its 4-bit NF4 load, its LoRA and checkpointing) on random weights of the
    same shapes, rank, batch and sequence length; its own loss on HF-shifted labels."""
    torch = _need("qlora-unsloth")  # unsloth first: it must patch transformers before anything else imports it
    from unsloth import FastLanguageModel

    from bench import qlora_throughput as qt

    path = _random_hf_dir(p, torch)
    model, _ = FastLanguageModel.from_pretrained(model_name=str(path), max_seq_length=p["seq"],
                                                 dtype=torch.bfloat16, load_in_4bit=True)
    model = FastLanguageModel.get_peft_model(model, r=p["rank"], lora_alpha=2 * p["rank"], target_modules=TARGETS,
                                             lora_dropout=0.0, bias="none", random_state=0,
                                             use_gradient_checkpointing=p["checkpointing"] == "full")
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    input_ids, _ = qt.make_batch(model.config.vocab_size, p["batch"], p["seq"], "cuda")

    def step() -> float:
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss)

    import unsloth

    r = qt._time(step, _qlora_args(p), {"trainable": sum(q.numel() for q in params), "unsloth": unsloth.__version__,
                                        "use_gradient_checkpointing": p["checkpointing"] == "full"})
    return _qlora_values(r)


def _titan_model_v03(cfg: Any, torch: Any) -> Any:
    """torchtitan >= 0.3: the model is built from a Config tree (llama3's own layer builder, its inits), its
    default attention backend (FlexAttention, block-causal over positions), fused QKV as its flavors use."""
    from torchtitan.models import llama3 as t
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim = cfg.hidden_size
    layers = t._build_llama3_layers(
        fuse_qkv=True, n_layers=cfg.num_layers, dim=dim, n_heads=cfg.num_heads, n_kv_heads=cfg.num_kv_heads,
        hidden_dim=cfg.intermediate_size, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=dim // cfg.num_heads, max_seq_len=cfg.max_position_embeddings,
                                theta=cfg.rope_theta, scaling="none"))
    mc = t.Llama3Model.Config(
        dim=dim, vocab_size=cfg.vocab_size, enable_weight_tying=cfg.tie_word_embeddings, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=dim, param_init=t._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=t._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=cfg.vocab_size, param_init=t._output_linear_init(dim)))
    with torch.device("cuda"):
        model = mc.build()
    with torch.no_grad():  # as torchtitan's trainer initialises (in-place inits of leaf parameters)
        model.init_states(buffer_device=torch.device("cuda"))
    return model


def _titan_model(cfg: Any, torch: Any) -> Any:
    """torchtitan's Llama-3 Transformer with the preset's widths (the import path moved between releases)."""
    if hasattr(importlib.import_module("torchtitan.models.llama3"), "Llama3Model"):
        return _titan_model_v03(cfg, torch)
    errors = []
    for mod, cls, args in (("torchtitan.models.llama3", "Transformer", "TransformerModelArgs"),
                           ("torchtitan.models.llama3.model.model", "Transformer", None),
                           ("torchtitan.models.llama", "Transformer", "ModelArgs")):
        try:
            m = importlib.import_module(mod)
            transformer = getattr(m, cls)
            args_cls = (getattr(m, args) if args
                        else importlib.import_module("torchtitan.models.llama3.model.args").TransformerModelArgs)
            break
        except (ImportError, AttributeError) as e:
            errors.append(f"{mod}: {e}")
    else:
        raise RuntimeError("no torchtitan Llama Transformer found: " + "; ".join(errors))
    # torchtitan's FFN width: multiple_of-rounded int(2/3 * 4 * dim * ffn_dim_multiplier): pick the multiplier
    # that gives the preset's intermediate_size
    mult = cfg.intermediate_size / int(2 * 4 * cfg.hidden_size / 3)
    margs = args_cls(dim=cfg.hidden_size, n_layers=cfg.num_layers, n_heads=cfg.num_heads,
                     n_kv_heads=cfg.num_kv_heads, vocab_size=cfg.vocab_size, multiple_of=256, ffn_dim_multiplier=mult,
                     norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, max_seq_len=cfg.max_position_embeddings)
    with torch.device("cuda"):
        model = transformer(margs)
    with torch.no_grad():  # as torchtitan's trainer initialises (in-place inits of leaf parameters)
        try:
            model.init_weights(buffer_device=torch.device("cuda"))
        except TypeError:
            model.init_weights()
    return model


def titan(p: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's Llama-3 model as its trainer builds it on one GPU: fp32 weights, bf16 autocast, fused
    AdamW (bench/train_throughput.py's step loop), torch.compile of every block; with float8, torchao's float8 training (tensorwise scaling) on every
    linear but the output head (torchtitan's Float8 converter's choice). Not torchtitan's trainer loop."""
    torch = _need("titan")
    import torch.nn.functional as F

    from entrenar.config import preset

    cfg = preset(p["model"])
    model = _titan_model(cfg, torch)
    if p["float8"]:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda mod, fqn: fqn not in ("output", "lm_head"))
    layers = model.layers
    for name, block in list(layers.named_children()):
        layers.register_module(name, torch.compile(block, fullgraph=True))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (p["batch"], p["seq"] + 1), generator=gen).cuda()
    inputs, labels = ids[:, :-1], ids[:, 1:]

    if type(model).__name__ == "Llama3Model":  # torchtitan >= 0.3: positions and block-causal masks per call
        positions = torch.arange(p["seq"], device="cuda").expand(p["batch"], p["seq"])
        masks = model.get_attention_masks(positions)

        def forward() -> Any:
            return model(inputs, positions, masks)
    else:
        def forward() -> Any:
            return model(inputs)

    def loss() -> Any:  # run under bf16 autocast by run_training; the loss over fp32 logits as torchtitan's
        return F.cross_entropy(forward().flatten(0, 1).float(), labels.flatten())

    from importlib.metadata import version

    from bench import train_throughput as tt

    r = tt.run_training("titan", model, loss, cfg, p["batch"], p["seq"], p["steps"] - p["warmup"], p["warmup"],
                        torch.device("cuda"), True)
    return {"tokens_per_s": r["tok_s"], "tokens_per_s_per_gpu": r["tok_s"], "seconds_per_step": r["step_s"],
            "peak_gib": r["peak_gib"], "mfu": r["mfu"],
            "extra": {"loss_first": r["loss0"], "loss_last": r["loss_last"], "first_step_s": r["first_step_s"],
                      "parameters": sum(q.numel() for q in model.parameters()), "torchtitan": version("torchtitan"),
                      "mfu_peak_tflops": tt.PEAK_BF16_TFLOPS}}


KINDS = {"liger": liger, "long-liger": long_liger, "qlora-entrenar": qlora_entrenar, "qlora-bnb": qlora_bnb,
         "qlora-unsloth": qlora_unsloth, "titan": titan}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description="one peer measurement (the suite's child process)")
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("params", help="JSON of the scenario's settings")
    args = ap.parse_args(argv)
    try:
        values = KINDS[args.kind](json.loads(args.params))
    except Skip as e:
        print(f"SKIP {e}", flush=True)
        return 0
    print("ROW " + json.dumps(values), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
