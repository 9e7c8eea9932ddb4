"""The named scenarios of the benchmark suite and their groups.

A scenario is one measurement: what runs (`kind`: entrenar's CLI, or a peer), on which shapes (a preset of
entrenar.config: random weights of the real widths), in which dtype, batch, sequence length and number of
GPUs. `baseline` names the scenario its tokens/s is compared with in the table. `smoke()` maps any
scenario to tiny CPU shapes (the suite's --smoke: checks the plumbing, measures nothing).

Groups: each `issue25-*` group finishes inside 9 minutes on one H200 (the long-context tail excepted,
where one step is minutes: those lengths are groups of their own); `issue25` is all of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# runner labels (the row's "runner": who produced the numbers)
CLI = "entrenar-cli"
LIB = "entrenar-library-step"  # entrenar's model + optimizer in the bench loop, not the CLI (said so in the row)
LIGER = "transformers+liger"
BNB = "bitsandbytes+peft"
UNSLOTH = "unsloth"
TITAN = "torchtitan"
GENERATE = "generate (entrenar vs transformers)"
ENGINE = "generate many (entrenar's engine vs transformers)"

STEPS, WARMUP = 14, 5  # speed rows: 14 steps, median tokens/s of steps 6..12 (13-14 are profiled: _profiled)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    kind: str  # cli | liger | qlora-entrenar | qlora-bnb | qlora-unsloth | titan | generate | engine | long-liger
    runner: str
    model: str  # a preset name of entrenar.config: the shapes (weights are random)
    dtype: str  # the --dtype passed ("auto" = no flag), or what the peer runs in
    batch: int
    seq: int
    gpus: int = 1
    steps: int | None = STEPS  # None: the runner's own count (generation)
    warmup: int | None = WARMUP
    baseline: str | None = None
    flags: tuple[str, ...] = ()  # extra CLI flags
    params: dict = field(default_factory=dict)  # kind-specific settings (rank, checkpointing, ...)
    timeout_s: float = 300.0

    def smoke(self) -> Scenario:
        """Tiny shapes on the CPU, 3 steps: the same code path, seconds instead of minutes."""
        seq = min(self.seq, 64) if self.kind != "cli" or "--offload-activations" not in self.flags else 128
        flags = tuple("3:1" if i and self.flags[i - 1] == "--profile" else "32" if f.isdigit() else f
                      for i, f in enumerate(self.flags))  # --mlp-chunk N -> 32 tokens; profile step 3
        return dataclasses.replace(self, model="tiny", batch=min(self.batch, 2), seq=seq, steps=3, warmup=1,
                                   flags=flags, timeout_s=180.0,
                                   params={**self.params, "smoke": True})


LONG_FLAGS = ("--activation-checkpointing", "--offload-activations", "--mlp-chunk", "16384")


def _speed() -> list[Scenario]:
    q, l7 = "qwen2.5-0.5b", "llama-370m"
    return [
        Scenario("q05-liger-bf16", "transformers + Liger, bf16 weights, Qwen2.5-0.5B shapes", "liger", LIGER, q,
                 "bf16", 8, 2048, timeout_s=240),
        Scenario("q05-cli-default", "CLI pretrain, no --dtype (the GPU default)", "cli", CLI, q, "auto", 8, 2048,
                 baseline="q05-liger-bf16"),
        Scenario("q05-cli-bf16-pure", "CLI pretrain --dtype bf16-pure", "cli", CLI, q, "bf16-pure", 8, 2048,
                 baseline="q05-liger-bf16"),
        Scenario("q05-cli-fp8", "CLI pretrain --dtype fp8", "cli", CLI, q, "fp8", 8, 2048,
                 baseline="q05-cli-bf16-pure"),
        Scenario("l370-liger-bf16", "transformers + Liger, bf16 weights, llama-370m shapes", "liger", LIGER, l7,
                 "bf16", 8, 2048, timeout_s=240),
        Scenario("l370-cli-bf16-pure", "CLI pretrain --dtype bf16-pure (MFU)", "cli", CLI, l7, "bf16-pure", 8,
                 2048, baseline="l370-liger-bf16"),
        Scenario("l370-cli-fp8", "CLI pretrain --dtype fp8", "cli", CLI, l7, "fp8", 8, 2048,
                 baseline="l370-cli-bf16-pure"),
    ]


def _mfu() -> list[Scenario]:
    """llama-370m at batch 16 x 2048: issue 25's >= 50% MFU goal (batch 8 is launch-bound at ~47%)."""
    l7 = "llama-370m"
    return [
        Scenario("l370-cli-default-b16", "CLI pretrain, no --dtype, batch 16 (MFU)", "cli", CLI, l7, "auto", 16,
                 2048),
        Scenario("l370-cli-bf16-pure-b16", "CLI pretrain --dtype bf16-pure, batch 16 (MFU)", "cli", CLI, l7,
                 "bf16-pure", 16, 2048, baseline="l370-cli-default-b16"),
    ]


def _graphs() -> list[Scenario]:
    """Issue 36 goal 2: the CLI with CUDA graphs of the step (the default where they apply) against the same row
    eager (--cuda-graphs off), the Liger peer before and after; llama-370m's default at batch 8 (55% MFU goal)."""
    q, l7 = "qwen2.5-0.5b", "llama-370m"
    off = ("--cuda-graphs", "off")
    liger = Scenario("q05-liger-bf16", "transformers + Liger, bf16 weights, Qwen2.5-0.5B shapes", "liger", LIGER, q,
                     "bf16", 8, 2048, timeout_s=240)
    return [
        liger,
        Scenario("q05-cli-default-graphs", "CLI pretrain, no --dtype, CUDA graphs (auto)", "cli", CLI, q, "auto", 8,
                 2048, baseline="q05-liger-bf16"),
        Scenario("q05-cli-default-eager", "CLI pretrain, no --dtype, --cuda-graphs off", "cli", CLI, q, "auto", 8,
                 2048, baseline="q05-liger-bf16", flags=off),
        Scenario("q05-cli-bf16-pure-graphs", "CLI pretrain --dtype bf16-pure, CUDA graphs (auto)", "cli", CLI, q,
                 "bf16-pure", 8, 2048, baseline="q05-liger-bf16"),
        Scenario("q05-cli-bf16-pure-eager", "CLI pretrain --dtype bf16-pure, --cuda-graphs off", "cli", CLI, q,
                 "bf16-pure", 8, 2048, baseline="q05-liger-bf16", flags=off),
        Scenario("l370-cli-default-graphs", "CLI pretrain llama-370m, no --dtype, batch 8, CUDA graphs (MFU)", "cli",
                 CLI, l7, "auto", 8, 2048),
        Scenario("l370-cli-default-eager", "CLI pretrain llama-370m, no --dtype, batch 8, --cuda-graphs off", "cli",
                 CLI, l7, "auto", 8, 2048, baseline="l370-cli-default-graphs", flags=off),
        dataclasses.replace(liger, name="q05-liger-bf16-after", title=liger.title + " (after the CLI rows)"),
        # where the step is many small kernels: short batches (SFT-like) and recomputed blocks
        Scenario("l370-cli-b2x512-graphs", "CLI pretrain llama-370m, batch 2 x 512, CUDA graphs (auto)", "cli", CLI,
                 l7, "auto", 2, 512),
        Scenario("l370-cli-b2x512-eager", "CLI pretrain llama-370m, batch 2 x 512, --cuda-graphs off", "cli", CLI,
                 l7, "auto", 2, 512, baseline="l370-cli-b2x512-graphs", flags=off),
        Scenario("q05-cli-ckpt-graphs", "CLI pretrain, no --dtype, --activation-checkpointing, CUDA graphs (auto)",
                 "cli", CLI, q, "auto", 8, 2048, flags=("--activation-checkpointing",)),
        Scenario("q05-cli-ckpt-eager", "CLI pretrain, no --dtype, --activation-checkpointing, --cuda-graphs off",
                 "cli", CLI, q, "auto", 8, 2048, baseline="q05-cli-ckpt-graphs",
                 flags=("--activation-checkpointing", *off)),
    ]


def _fp8() -> list[Scenario]:
    l7, q7 = "llama-370m", "qwen2.5-coder-7b"
    return [
        Scenario("q7b8-cli-bf16-pure", "CLI pretrain --dtype bf16-pure, Qwen2.5-Coder-7B widths, 8 blocks", "cli", CLI,
                 q7, "bf16-pure", 4, 2048, params={"num_layers": 8}),
        Scenario("q7b8-cli-fp8", "CLI pretrain --dtype fp8, Qwen2.5-Coder-7B widths, 8 blocks", "cli", CLI, q7,
                 "fp8", 4, 2048, params={"num_layers": 8}, baseline="q7b8-cli-bf16-pure"),
        # the whole 28-block model on one GPU: the LM head and the loss (bf16 in both rows) are 8% of its matmul
        # FLOPs, against 23% in the 8-block q7b8 rows
        Scenario("q7b-cli-bf16-pure", "CLI pretrain --dtype bf16-pure, Qwen2.5-Coder-7B (all 28 blocks), 1 GPU", "cli",
                 CLI, q7, "bf16-pure", 2, 2048, steps=10, warmup=4, timeout_s=420),
        Scenario("q7b-cli-fp8", "CLI pretrain --dtype fp8, Qwen2.5-Coder-7B (all 28 blocks), 1 GPU", "cli", CLI, q7,
                 "fp8", 2, 2048, steps=10, warmup=4, baseline="q7b-cli-bf16-pure", timeout_s=420),
        Scenario("q7b-cli-bf16-pure-b4", "CLI pretrain --dtype bf16-pure, Qwen2.5-Coder-7B (28 blocks), batch 4, 1 GPU",
                 "cli", CLI, q7, "bf16-pure", 4, 2048, steps=10, warmup=4, timeout_s=420,
                 params={"stop_after_steps": True}),  # the b2 rows time the end of run; these only the steps
        Scenario("q7b-cli-fp8-b4", "CLI pretrain --dtype fp8, Qwen2.5-Coder-7B (28 blocks), batch 4, 1 GPU", "cli", CLI,
                 q7, "fp8", 4, 2048, steps=10, warmup=4, baseline="q7b-cli-bf16-pure-b4", timeout_s=420,
                 params={"stop_after_steps": True}),
        Scenario("l370-titan-bf16", "torchtitan Llama3 model, bf16 autocast + torch.compile per block", "titan",
                 TITAN, l7, "bf16", 8, 2048, params={"float8": False}, timeout_s=300,
                 baseline="l370-cli-bf16-pure"),
        Scenario("l370-titan-fp8", "torchtitan Llama3 model, torchao float8 (tensorwise) + torch.compile per block",
                 "titan", TITAN, l7, "fp8", 8, 2048, params={"float8": True}, timeout_s=300,
                 baseline="l370-cli-bf16-pure"),
    ]


def _qlora() -> list[Scenario]:
    m, p = "qwen2.5-coder-7b", {"rank": 16, "checkpointing": "full"}
    return [
        Scenario("qlora7b-entrenar", "entrenar NF4 + LoRA r16, every linear, checkpointing (library step)",
                 "qlora-entrenar", LIB, m, "bf16", 2, 2048, params=p, timeout_s=200),
        Scenario("qlora7b-bnb-peft", "bitsandbytes NF4 + PEFT LoRA r16, gradient checkpointing", "qlora-bnb", BNB,
                 m, "bf16", 2, 2048, params=p, timeout_s=200, baseline="qlora7b-entrenar"),
        Scenario("qlora7b-unsloth", "Unsloth 4-bit + LoRA r16, gradient checkpointing", "qlora-unsloth", UNSLOTH,
                 m, "bf16", 2, 2048, params=p, timeout_s=300, baseline="qlora7b-entrenar"),
    ]


def _long() -> list[Scenario]:
    out = []
    # one step at 524k is ~2 minutes, at 1M ~7-9: those run one step without warm-up (the first step's
    # kernel compilation is seconds of it)
    for tokens, label, steps, warmup, timeout in ((131072, "131k", 3, 1, 150), (262144, "262k", 2, 1, 200),
                                                  (524288, "524k", 1, 0, 300), (1048576, "1m", 1, 0, 585)):
        out.append(Scenario(f"long-{label}-cli", f"CLI pretrain, batch 1 x {tokens:,}, bf16-pure, offload + MLP "
                            f"chunks", "cli", CLI, "qwen2.5-0.5b", "bf16-pure", 1, tokens, steps=steps,
                            warmup=warmup, flags=LONG_FLAGS, timeout_s=timeout, baseline=f"long-{label}-liger",
                            params={"max_position_embeddings": 1 << 20}))
        out.append(Scenario(f"long-{label}-cli-save", f"CLI pretrain, batch 1 x {tokens:,}, bf16-pure, offload + MLP "
                            f"chunks + --save-attention", "cli", CLI, "qwen2.5-0.5b", "bf16-pure", 1, tokens,
                            steps=steps, warmup=warmup, flags=(*LONG_FLAGS, "--save-attention"), timeout_s=timeout,
                            baseline=f"long-{label}-liger", params={"max_position_embeddings": 1 << 20}))
        out.append(Scenario(f"long-{label}-liger", f"transformers + Liger, batch 1 x {tokens:,}, bf16, gradient "
                            f"checkpointing", "long-liger", LIGER, "qwen2.5-0.5b", "bf16", 1, tokens, steps=steps,
                            warmup=warmup, timeout_s=timeout))
    return out


def _multi() -> list[Scenario]:
    out = []
    for model, short in (("qwen2.5-0.5b", "q05"), ("llama-370m", "l370")):
        for gpus in (1, 2, 4):
            out.append(Scenario(f"{short}-ddp-{gpus}gpu", f"torchrun CLI pretrain --dtype bf16 on {gpus} GPU(s), "
                                f"--parallel auto", "cli", CLI, model, "bf16", 8, 2048, gpus=gpus, timeout_s=200,
                                baseline=f"{short}-ddp-1gpu" if gpus > 1 else None))
        out.append(Scenario(f"{short}-ddp-4gpu-bf16reduce", "torchrun CLI pretrain --dtype bf16 on 4 GPUs, "
                            "--grad-reduce bf16 (the all-reduce in bf16; since issue 36 --cuda-graphs auto captures "
                            "the step: replicas all-reduced in 100 MB buckets by the replayed backward)", "cli", CLI, model, "bf16", 8, 2048,
                            gpus=4, timeout_s=200, flags=("--grad-reduce", "bf16"), baseline=f"{short}-ddp-1gpu"))
        out.append(Scenario(f"{short}-ddp-4gpu-bf16-eager", "torchrun CLI pretrain --dtype bf16 on 4 GPUs, DDP "
                            "--grad-reduce bf16 --cuda-graphs off (the eager DDP step, 100 MB buckets)", "cli", CLI,
                            model, "bf16", 8, 2048, gpus=4, timeout_s=200,
                            flags=("--grad-reduce", "bf16", "--cuda-graphs", "off"), baseline=f"{short}-ddp-1gpu"))
        # issue 36 item 4: buckets launched later in the backward (fewer all-reduces beside the matmuls), bf16 wire
        for mb in (400, 4096):
            out.append(Scenario(f"{short}-ddp-4gpu-bf16-b{mb}", f"torchrun CLI pretrain --dtype bf16 on 4 GPUs, DDP "
                                f"--grad-reduce bf16 --ddp-bucket-mb {mb} --cuda-graphs off", "cli", CLI, model,
                                "bf16", 8, 2048, gpus=4, timeout_s=200,
                                flags=("--grad-reduce", "bf16", "--ddp-bucket-mb", str(mb), "--cuda-graphs", "off"),
                                baseline=f"{short}-ddp-1gpu"))
        out.append(Scenario(f"{short}-ddp-4gpu-bf16-g25", "torchrun CLI pretrain --dtype bf16 on 4 GPUs, "
                            "--grad-reduce bf16 --ddp-bucket-mb 25 (the captured replicas' buckets, all-reduced "
                            "inside the replayed backward)", "cli", CLI, model, "bf16", 8, 2048, gpus=4, timeout_s=200,
                            flags=("--grad-reduce", "bf16", "--ddp-bucket-mb", "25"), baseline=f"{short}-ddp-1gpu"))
        out.append(Scenario(f"{short}-ddp-1gpu-eager", "CLI pretrain --dtype bf16 on 1 GPU, --cuda-graphs off (the "
                            "step the 4-GPU rows run: DDP steps are not captured)", "cli", CLI, model, "bf16", 8, 2048,
                            timeout_s=200, flags=("--cuda-graphs", "off"), baseline=f"{short}-ddp-1gpu"))
    out.append(Scenario("fsdp7b-4gpu-bf16-nockpt", "torchrun CLI pretrain qwen2.5-coder-7b shapes, 4 GPUs FSDP2, "
                        "bf16, --grad-reduce bf16, no activation checkpointing (end_save_s: the end-of-run "
                        "checkpoint and final/, after the measured steps)", "cli", CLI, "qwen2.5-coder-7b", "bf16",
                        2, 2048, gpus=4, steps=8, warmup=3, flags=("--parallel", "fsdp", "--grad-reduce", "bf16"),
                        timeout_s=560))
    out.append(Scenario("fsdp7b-4gpu-bf16-nockpt-b8", "torchrun CLI pretrain qwen2.5-coder-7b shapes, 4 GPUs FSDP2, "
                        "bf16, --grad-reduce bf16, no activation checkpointing, batch 8 x 2048 per GPU (the per-step "
                        "all-gathers, reduce-scatters and AdamW amortized over 4x the tokens of the b2 row)", "cli",
                        CLI, "qwen2.5-coder-7b", "bf16", 8, 2048, gpus=4, steps=8, warmup=3,
                        flags=("--parallel", "fsdp", "--grad-reduce", "bf16"), timeout_s=560))
    out.append(Scenario("fsdp7b-4gpu", "torchrun CLI pretrain qwen2.5-coder-7b shapes, 4 GPUs FSDP2, bf16, "
                        "activation checkpointing (the CLI's end-of-run checkpoint and final/ are written after the "
                        "measured steps)", "cli", CLI, "qwen2.5-coder-7b", "bf16", 2, 2048, gpus=4,
                        steps=8, warmup=3, flags=("--activation-checkpointing", "--parallel", "fsdp"),
                        timeout_s=560))
    return out


def _generate() -> list[Scenario]:
    return [Scenario(f"gen-b{b}", f"greedy generation, batch {b}, 128 prompt + 128 new tokens", "generate", GENERATE,
                     "qwen2.5-0.5b", "bf16", b, 256, steps=None, warmup=None, params={"batch": b}, timeout_s=240,
                     baseline=None) for b in (1, 16, 64)]


def _engine() -> list[Scenario]:
    """Many prompts through the engine (continuous batching, --batch-size auto) vs transformers' generate at its best
    batch: bench/engine_throughput.py's BFCL-840-like and HumanEval-164-like workloads."""
    return [Scenario(f"eng-{workload}-{tag}", f"{n} prompts ({workload}-like lengths) through the engine, --batch-size "
                     f"auto, vs transformers' generate at batch 64 or 256 (the faster)", "engine", ENGINE, model,
                     "bf16", n, 0, steps=None, warmup=None, params={"workload": workload}, timeout_s=420)
            for model, tag in (("smollm2-135m", "smol"), ("qwen2.5-0.5b", "q05"))
            for workload, n in (("bfcl840", 840), ("humaneval164", 164))]


def _profiled(scenarios: list[Scenario]) -> list[Scenario]:
    """The speed rows also say where their step goes: the CLI's --profile of two steps after the measured
    ones, the Liger peer's two profiled steps after its timing (bench/train_throughput.run_training)."""
    out = []
    for sc in scenarios:
        if sc.kind == "cli" and sc.steps and sc.steps >= 8:  # the last two steps, after the measured ones
            sc = dataclasses.replace(sc, flags=(*sc.flags, "--profile", f"{sc.steps - 1}:2"))
        elif sc.kind == "liger":
            sc = dataclasses.replace(sc, params={**sc.params, "profile_steps": 2})
        out.append(sc)
    return out


SCENARIOS: dict[str, Scenario] = {s.name: s for s in
                                  _profiled(_speed() + _mfu() + _fp8() + _multi()) + _qlora() + _long() + _generate()
                                  + _engine()
                                  + [sc for sc in _profiled(_graphs()) if sc.name not in ("q05-liger-bf16",)]}

GROUPS: dict[str, list[str]] = {
    "issue25-speed": [s.name for s in _speed()],
    "issue25-fp8": ["l370-cli-bf16-pure", "l370-cli-fp8", "l370-titan-bf16", "l370-titan-fp8", "q7b8-cli-bf16-pure",
                    "q7b8-cli-fp8"],
    "issue25-mfu": [s.name for s in _mfu()],
    "issue25-qlora": [s.name for s in _qlora()],
    "issue25-long": ["long-131k-cli", "long-131k-cli-save", "long-131k-liger", "long-262k-cli-save",
                     "long-262k-liger", "long-262k-cli"],
    "issue25-long-524k": ["long-524k-cli-save", "long-524k-liger", "long-524k-cli"],
    "issue25-long-1m": ["long-1m-cli-save"],
    "issue25-long-1m-min": ["long-1m-cli"],
    "issue25-long-1m-liger": ["long-1m-liger"],
    "issue25-multi": [s.name for s in _multi() if s.name.split("-")[-1] in ("1gpu", "2gpu", "4gpu")
                      and not s.name.startswith("fsdp7b")],
    "issue25-multi-bf16reduce": ["q05-ddp-1gpu", "q05-ddp-4gpu", "q05-ddp-4gpu-bf16reduce", "l370-ddp-1gpu",
                                 "l370-ddp-4gpu", "l370-ddp-4gpu-bf16reduce"],
    "issue25-7b-fsdp": ["fsdp7b-4gpu"],
    # issue 36 item 4, each with --repeat 3 in one call (~8 min): the 1-GPU row and three bucket sizes, bf16 wire
    "issue36-ddp-l370": ["l370-ddp-1gpu", "l370-ddp-4gpu-bf16reduce", "l370-ddp-4gpu-bf16-b400",
                         "l370-ddp-4gpu-bf16-b4096"],
    "issue36-ddp-q05": ["q05-ddp-1gpu", "q05-ddp-4gpu-bf16reduce", "q05-ddp-4gpu-bf16-b400", "q05-ddp-4gpu-bf16-b4096"],
    "issue36-7b": ["fsdp7b-4gpu-bf16-nockpt", "l370-ddp-1gpu-eager", "q05-ddp-1gpu-eager"],
    "issue36-7b-b8": ["fsdp7b-4gpu-bf16-nockpt-b8"],
    "issue36-fp8-7b": ["q7b-cli-bf16-pure", "q7b-cli-fp8"],
    "issue36-fp8-7b-b4": ["q7b-cli-bf16-pure-b4", "q7b-cli-fp8-b4"],
    # the step captured on 4 GPUs (replicas, all-reduce after the replay): --repeat 3 in one call
    "issue36-graphs-l370": ["l370-ddp-1gpu", "l370-ddp-4gpu-bf16reduce", "l370-ddp-4gpu-bf16-g25"],
    "issue36-graphs-q05": ["q05-ddp-1gpu", "q05-ddp-4gpu-bf16reduce", "q05-ddp-4gpu-bf16-g25"],
    "issue36-ddp-graphs": ["l370-ddp-1gpu", "l370-ddp-4gpu-bf16reduce", "q05-ddp-1gpu", "q05-ddp-4gpu-bf16reduce"],
    # the captured replicas with the default fp32 all-reduce: no bf16 wire copies (session 15: +2.4 ms on llama-370m)
    "issue36-ddp-graphs-fp32": ["l370-ddp-1gpu", "l370-ddp-4gpu", "q05-ddp-1gpu", "q05-ddp-4gpu"],
    "issue36-ddp-once": ["l370-ddp-4gpu-bf16-eager", "q05-ddp-4gpu-bf16-eager", "l370-ddp-4gpu", "q05-ddp-4gpu"],
    "issue25-generate": [s.name for s in _generate()],
    "issue49-generate": [s.name for s in _engine()],
    "issue36-graphs": [s.name for s in _graphs()][:8],
    "issue36-graphs-b": ["q05-liger-bf16", "q05-cli-default-graphs", "q05-cli-bf16-pure-graphs", "l370-cli-b2x512-graphs",
                         "l370-cli-b2x512-eager", "q05-cli-ckpt-graphs", "q05-cli-ckpt-eager", "q05-liger-bf16-after"],
}
GROUPS["issue25"] = list(dict.fromkeys(n for g in list(GROUPS) for n in GROUPS[g]))


def resolve(names: list[str]) -> list[Scenario]:
    """Scenario and group names -> scenarios, in order, each once; KeyError names an unknown one."""
    out: dict[str, Scenario] = {}
    for name in names:
        if name in GROUPS:
            out.update((n, SCENARIOS[n]) for n in GROUPS[name])
        elif name in SCENARIOS:
            out[name] = SCENARIOS[name]
        else:
            raise KeyError(name)
    return list(out.values())
