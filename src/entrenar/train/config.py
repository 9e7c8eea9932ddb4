"""Typed configuration of a run: the one source of its defaults, its validation and its --help.

Three dataclasses describe a run: `TrainConfig` (what is trained, how: the loop's settings and the
model/mode identity), `LoRAConfig` (the adapter of `finetune --mode lora|qlora`) and `DataConfig`
(where the examples come from and how they are read). Every field carries its command-line face in
`field(metadata=...)` (built by `option()`): help text, choices, the commands that offer it, and,
where one command differs, that command's flag name or default. `cli/train.py`'s `add_options` turns the
fields into argparse options and `from_args` turns parsed arguments back into the dataclass, so a default is
written once (issue 11: lr 3e-4 was written in three places and TrainConfig's steps/eval_batches
disagreed with the CLI's). `run.json` is `asdict` of these plus provenance (train/commands.py).
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, TypeVar

from ..config import PRESETS
from ..data.sft import CHAT_TEMPLATE_HELP, DEFAULT_MAX_SKIP_FRACTION, TRUNCATION_POLICIES
from ..data.tabular import COLUMNS_HELP, SOURCES_HELP
from ..devices import (
    DEFAULT_DEVICE,
    DEVICE_CHOICES_HELP,
    TRAIN_DTYPES,
    resolve_device,
    resolve_device_reason,
    resolve_dtype,
)
from ..errors import InputError
from ..kernels import KERNELS
from . import guards
from .checkpoint import SAVE_MODES
from .grpo import DEFAULT_GRPO_BETA, DEFAULT_MAX_KL
from .grpo import LOSS_TYPES as GRPO_LOSS_TYPES
from .grpo import SCALE_REWARDS as GRPO_SCALE_REWARDS
from .objective import DEFAULT_BETA, OBJECTIVES
from .optim import SCHEDULES
from .periodic import DEFAULT_SAVE_EVERY_MINUTES
from .profiling import parse_profile

DTYPES = TRAIN_DTYPES  # --dtype; what each means: train/precision.py

# --dtype: one line in each command's --help; what each choice trades is DTYPE_GUIDE (`entrenar help dtype`)
DTYPE_HELP = ("compute dtype: auto = bf16 on a CUDA device with native bf16, fp32 on the CPU and older GPUs "
              "(logged, in run.json); bf16-weights, bf16-pure and fp8 trade accuracy for speed or memory: "
              "`entrenar help dtype`")
DTYPE_GUIDE = {  # choice -> what it does and what it costs
    "auto": "bf16 on a CUDA device with native bf16 (compute capability 8.0+), fp32 on the CPU and older GPUs; "
            "the choice and why are logged and recorded in run.json",
    "fp32": "everything in float32",
    "bf16": "autocast: fp32 master weights, AdamW state and residual stream, bf16 matmuls (holds the 2e-2 logits "
            "parity bound)",
    "bf16-weights": "the step runs on bf16 copies of the fp32 master weights (refreshed once per step) with a bf16 "
                    "residual stream, as a bf16 model (AdamW and checkpoints stay fp32): +7% tokens/s and 2.4 GiB "
                    "less peak than bf16 (Qwen2.5-0.5B, batch 8x2048, H200), but logits ~2.5e-2 relL2 from fp32, "
                    "outside bf16's bound",
    "bf16-pure": "(--mode full) weights, gradients and AdamW state in bf16, 8 bytes per parameter instead of 16 "
                 "(e.g. long context), at the price of bf16 updates: a step smaller than ~2^-8 of a weight is "
                 "rounded away",
    "fp8": "(--mode full, NVIDIA compute capability 8.9+: H100/H200/Ada; needs torchao) bf16-pure with the blocks' "
           "linears in float8 (torchao, tensorwise scaling) and each block compiled; pays from ~4k hidden on "
           "(1.19x bf16-pure at 7B widths, 0.78-1.01x at 0.4-0.5B on an H200); checked by the preflight with its "
           "own, looser bound",
}

# Resuming with any of these changed would not continue the same run (refused unless allowed).
RESUME_SENSITIVE = ("batch_size", "grad_accum", "seq_len")

TRAIN_COMMANDS = ("pretrain", "finetune")
# DDP's gradient bucket (MB; --ddp-bucket-mb): measured on 4x H200, bench/RESULTS.md ("Several GPUs")
DDP_BUCKET_MB = 100
GRAD_REDUCE_DTYPES = ("fp32", "bf16")  # the data-parallel gradient reduction's precision (train/parallel.py)
PARALLEL_MODES = ("auto", "fsdp", "ddp", "hsdp")  # train/parallel.py (not imported here: it loads torch.distributed)
MODES = ("full", "lora", "qlora")
KEEP_BEST = ("last", "task", "eval")  # --keep-best: what final/ holds (task: task_tracking.py, eval: early_stop.py)
EVAL_BATCHES = 20  # --eval-batches' default on a GPU; on the CPU default_eval_batches caps it


def default_eval_batches(device: str, steps: Any) -> tuple[int, str]:
    """--eval-batches when not given: 20, or on the CPU steps/10 (1 to 20), so the run's two default evals
    (start and end) cost about a fifteenth of its steps (a 2-step CPU run spent 475 s in 40 eval batches)."""
    if str(device) != "cpu" or not isinstance(steps, int):
        return EVAL_BATCHES, ""
    n = min(EVAL_BATCHES, max(1, steps // 10))
    if n == EVAL_BATCHES:
        return n, ""
    return n, (f"--eval-batches {n}: the CPU default for --steps {steps} (steps/10, 1 to {EVAL_BATCHES}; "
               f"{EVAL_BATCHES} on a GPU), so evals stay a small share of the run; give --eval-batches to choose")
_EVERY = ("pretrain", "finetune", "eval")


def option(default: Any = MISSING, help: str = "", *, commands: tuple[str, ...] = TRAIN_COMMANDS,
           choices: tuple | None = None, flag: str | None = None, default_help: str | None = None,
           per_command: dict[str, dict[str, Any]] | None = None, required: bool = False,
           parse: typing.Callable[[str], Any] | None = None, metavar: str | None = None,
           default_factory: Any = MISSING, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field with its command-line face.

    commands: the commands that offer it as a flag (others get the default). flag: the option's name
    when it is not `--field-name`. default_help: how --help shows the default (else the value).
    per_command: {command: {"default"|"help"|"flag"|"default_help"|"required"|"parse": ...}} where one
    command differs. parse: argparse `type=` (else from the field's type). aliases: other option strings that
    still work (an older name), shown after the flag."""
    meta = {"help": help, "commands": commands, "choices": choices, "flag": flag, "default_help": default_help,
            "per_command": per_command or {}, "required": required, "parse": parse, "metavar": metavar,
            "aliases": aliases}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={"cli": meta})
    return field(default=default, metadata={"cli": meta})


def _lr_or_auto(text: str) -> float | str:
    """--lr: a positive number, or 'auto' (finetune: chosen by mode and adapter shape)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"must be a number or 'auto', got {text!r}") from None  # the CLI shows this message


def _int_or_auto(text: str) -> int | str:
    """eval --batch-size: a positive integer, or 'auto' (the task eval's slots from free memory; loss: 8)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"must be a positive integer or 'auto', got {text!r}") from None


# ---- the three configs ------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """How a run trains. Field defaults are the command line's defaults (pretrain's where the two
    training commands differ; finetune's differences are in `per_command`)."""

    # identity of the run (recorded in run.json; was the untyped `extra` dict)
    command: str = "pretrain"  # which command built it: pretrain | finetune (not a flag)
    model: str | None = option(None, f"PRESET ({', '.join(PRESETS)}) or MODEL (its architecture)", commands=_EVERY,
                               required=True,
                               metavar="MODEL", per_command={
                                   "finetune": {"help": "MODEL to fine-tune"},
                                   "eval": {"help": "MODEL or RUN directory (its final model or adapter)"}})
    init: str | None = option(None, "MODEL whose weights to start from", commands=("pretrain",),
                              metavar="MODEL", default_help="random init")
    mode: str = option("full", "what is trained: all weights, or LoRA / QLoRA adapters", commands=("finetune",),
                       choices=MODES)
    objective: str = option("sft", "what a step minimises: sft (cross-entropy on the responses of SFT rows), or a "
                                   "preference objective on prompt/chosen/rejected rows: dpo (the sigmoid DPO loss), ipo "
                                   "(IPO, per-token averaged log-ratios), dpo-norm (length-normalised DPO); or grpo on prompt "
                                   "rows (completions sampled from the policy, scored by --reward). The reference "
                                   "is the starting model: adapters switched off (lora/qlora) or a frozen copy (full)",
                            commands=("finetune",), choices=OBJECTIVES)
    beta: float = option(None, "preference objectives and grpo: the KL strength (DPO's beta; IPO's tau; GRPO's KL "
                               "penalty to the reference, 0 = none and no reference forward)", commands=("finetune",),
                         default_help=f"{DEFAULT_BETA} (dpo, ipo, dpo-norm), {DEFAULT_GRPO_BETA} (grpo)")
    # --objective grpo (train/grpo.py, train/rewards.py; design.md "GRPO")
    # (RUF009: the default is None, not a shared list; argparse appends each --reward to a new one)
    reward: list[str] | None = option(None, "grpo: a reward, NAME[:WEIGHT], repeatable (summed with the weights): "  # noqa: RUF009
                                            "bfcl (BFCL's AST verdict on the row's ground truth), bfcl-graded (format, "
                                            "names, argument names and values, weighted), tests (share of the row's "
                                            "tests passed in the sandbox), tests-all (1 iff all pass), "
                                            "python:FILE.py:FUNC (FUNC(prompt, completion, row) -> float, in its own "
                                            "process)", commands=("finetune",), metavar="SPEC", default_help="none")
    num_generations: int = option(4, "grpo: completions sampled per prompt (the group)", commands=("finetune",))
    temperature: float = option(1.0, "grpo: sampling temperature of the completions (the log-probs are those of "
                                     "logits / temperature)", commands=("finetune",))
    top_p: float = option(1.0, "grpo: nucleus of the sampling", commands=("finetune",))
    max_new_tokens: int = option(256, "grpo: tokens per completion at most", commands=("finetune",))
    epsilon: float = option(0.2, "grpo: the ratio's clip below 1 (and above, unless --epsilon-high)",
                            commands=("finetune",))
    epsilon_high: float | None = option(None, "grpo: the ratio's clip above 1 (DAPO's clip-higher)",
                                        commands=("finetune",), default_help="--epsilon")
    grpo_iterations: int = option(1, "grpo: optimizer steps on each rollout batch (TRL's num_iterations; the old "
                                     "log-probs of the rollout kept)", commands=("finetune",))
    loss_type: str = option("dapo", "grpo: the loss normalisation, TRL's names: dapo (tokens of the step), bnpo "
                                    "(tokens of each micro-batch), grpo (per sequence, then the mean), dr_grpo "
                                    "(sequences x --max-new-tokens)", commands=("finetune",), choices=GRPO_LOSS_TYPES)
    scale_rewards: str = option("group", "grpo: advantages divided by the group's reward std (group), the "
                                         "micro-batch's (batch: its --batch-size groups), or not (none: Dr. GRPO)",
                                commands=("finetune",), choices=GRPO_SCALE_REWARDS)
    max_kl: float = option(DEFAULT_MAX_KL, "grpo: GUARD-GRPO-KL stops the run (exit 3) when the mean KL per completion "
                                           "token to the reference passes this; 0 = off", commands=("finetune",))
    grpo_dynamic_sampling: int = option(0, "grpo: DAPO's dynamic sampling: groups whose G rewards are all equal (no "
                                           "signal) are dropped and replaced by fresh prompts, rolled out in up to "
                                           "this many extra generation calls per step; 0 = off",
                                        commands=("finetune",), metavar="N")
    # the optimisation
    steps: int = option(1000, "optimizer steps")
    batch_size: int = option(8, "samples per micro-batch", commands=_EVERY,
                             per_command={"eval": {"help": "--task loss: rows per batch (auto: 8). --task humaneval|"
                                                           "bfcl: sequences decoded at once (continuous batching's "
                                                           "slots); auto: on CUDA as many as the free memory holds "
                                                           "for the model and prompts (logged with the reason), 8 "
                                                           "on the CPU",
                                                   "default": "auto", "parse": _int_or_auto}})
    grad_accum: int = option(1, "micro-batches per optimizer step")
    # one name for the sequence length of every command: --max-seq-len (finetune's, the peers'), --seq-len its alias
    seq_len: int = option(512, "tokens per training window", commands=("pretrain", "eval"),
                          flag="--max-seq-len", aliases=("--seq-len",), metavar="N", per_command={
                              "eval": {"help": "tokens per window of token shards; the longest SFT sample or pair of "
                                               "a .jsonl", "default": None,
                                       "default_help": "512 for token shards, 2048 for a .jsonl"}})
    lr: float = option(3e-4, "peak learning rate", parse=_lr_or_auto, per_command={
        "finetune": {"default": "auto", "default_help": "auto: by mode and adapter shape, logged"}})
    warmup: int | None = option(None, "warmup steps", default_help="min(100, steps/10)")
    schedule: str = option("cosine", "decay after warmup, to min_lr_ratio of the peak",
                           choices=SCHEDULES)
    min_lr_ratio: float = option(0.1, "the schedule's floor as a fraction of the peak --lr, where cosine/linear "
                                      "decay ends (0 = decay to zero, 1 = constant after warmup)", metavar="RATIO")
    weight_decay: float = option(0.1, "AdamW weight decay on >=2-D weights",
                                 per_command={"finetune": {"default": 0.0}})
    clip: float = option(1.0, "clip the global L2 grad norm; 0 = off (the norm is still logged)")
    device: str = option(DEFAULT_DEVICE, DEVICE_CHOICES_HELP, commands=_EVERY, metavar="DEVICE")
    device_reason: str = ""  # how --device was chosen ("--device auto: NVIDIA H100 ..."): logged, in run.json
    dtype: str = option("auto", DTYPE_HELP, commands=_EVERY, choices=("auto", *DTYPES))
    dtype_reason: str = ""  # how --dtype was chosen ("--dtype auto: bf16 on cuda ..."): logged, in run.json
    kernels: str = option("auto", "op implementations: auto = triton on cuda, torch elsewhere", commands=_EVERY,
                          choices=("auto", *KERNELS))
    # eval, checkpoints
    eval_every: int = option(0, "eval period in steps; 0 = at start and end")
    # None from the command line (not given): default_eval_batches decides (the CPU cap); a TrainConfig built in
    # code keeps 20 unless it says otherwise
    eval_batches: int | None = option(EVAL_BATCHES, "batches per eval; 0 = all", commands=_EVERY,
                                      default_help=f"{EVAL_BATCHES}; on the CPU steps/10, 1 to {EVAL_BATCHES}",
                                      per_command={"pretrain": {"default": None}, "finetune": {"default": None},
                                                   "eval": {"flag": "--max-batches", "default": 0,
                                                            "help": "stop after this many batches; 0 = all"}})
    eval_batches_reason: str = ""  # how the default --eval-batches was chosen (the CPU cap): logged, in run.json
    early_stop: int = option(0, "stop after PATIENCE evals in a row without a new lowest eval loss (step 0's eval "
                                "included): the last step is checkpointed, final/ holds its weights, the summary "
                                "says why and at which step; 0 = off", metavar="PATIENCE")
    save_every: int = option(0, "checkpoint period in steps; 0 = at the end only (and by --save-every-minutes)")
    save_every_minutes: float = option(DEFAULT_SAVE_EVERY_MINUTES, "also checkpoint when this many minutes of "
                                       "wall clock passed since the start or the last checkpoint, so a long run "
                                       "always has a recent one (a run shorter than this writes no extra "
                                       "checkpoint); 0 = off", metavar="MINUTES")
    keep: int = option(3, "newest complete checkpoints kept; 0 = keep all")
    save_mode: str = option("async", "how a checkpoint is written: async = a snapshot (weights, optimizer state, RNG, "
                                     "data position) copied to host memory at the save step, written and fsynced by "
                                     "a background thread while training goes on, COMPLETE last (one write at a "
                                     "time; the end of the run and Ctrl-C wait for it); sync = written in the step, "
                                     "training waits", choices=SAVE_MODES)
    seed: int = option(0, "seed for init (weights and LoRA adapters), data order and RNG")
    # the task the run is judged by (evaluate/in_loop.py; design.md "Task metrics inside the run")
    eval_task: list[str] = option(  # noqa: RUF009 (a field with a default_factory)
        help="a target task, measured at step 0 (the base) and every --eval-task-every "
                                       "steps; give it several times for several: humaneval, bfcl[:CATEGORIES] "
                                       "(e.g. bfcl:simple_python,multiple), chat (ordinary requests, evaluate/"
                                       "chat_task.py) or FILE.jsonl (task rows: prompt, test, entry_point); "
                                       "generated with the run's chat template and system prompt, scored as `eval "
                                       "--task` scores; each task and each BFCL category tested on its own against "
                                       "step 0 (exact McNemar, Holm over the panel): rows in metrics.jsonl, "
                                       "per-problem results in RUN/task_eval/, the changes in the summary "
                                       "(GUARD-TASK-REGRESSION)",
                                  metavar="TASK", default_help="none", default_factory=list)
    retain_task: list[str] = option(  # noqa: RUF009 (a field with a default_factory)
        help="a task that must not get worse (the same specs as --eval-task; several "
                                         "allowed), e.g. humaneval, bfcl:irrelevance, chat: measured with the "
                                         "targets, a significant drop is GUARD-TASK-REGRESSION, and --keep-best task "
                                         "never picks a step where one dropped",
                                    metavar="TASK", default_help="none", default_factory=list)
    eval_task_every: int = option(0, "--eval-task period in steps; 0 = at step 0 and the end")
    eval_task_limit: int = option(0, "--eval-task: the first N problems only (per category for bfcl); 0 = all")
    eval_task_max_new_tokens: int = option(0, "--eval-task: tokens generated per problem at most; 0 = the task's "
                                              "default (humaneval and task files 512, bfcl 256)")
    on_task_regression: str = option("warn", "GUARD-TASK-REGRESSION policy when the task metric dropped from "
                                             "step 0 with exact McNemar p < 0.05: warn, or stop (exit 3, naming the "
                                             "problems lost and the best checkpoint)",
                                     choices=guards.TASK_REGRESSION_POLICIES)
    keep_best: str = option("last", "which weights final/ holds: last (the last step's), task (those of the task "
                                    "eval with the most --eval-task problems passed among the steps where no "
                                    "--retain-task dropped significantly; ties: the later step) or eval (those of "
                                    "the eval with the lowest eval loss; ties: the earlier step)",
                            choices=KEEP_BEST)
    kl_to_base: float = option(0.0, "SFT with a pull to the base: BETA x the KL(base || model) of the next-token "
                                     "distributions on the --kl-rows rows' response tokens, added to the "
                                     "cross-entropy (train/kl_to_base.py); the base is the adapters switched off "
                                     "(lora, qlora) or a frozen copy of the start (full); 0 = off",
                               commands=("finetune",), metavar="BETA")
    kl_rows: str = option("mix", "the rows --kl-to-base applies to: mix (the rows --mix added, e.g. replay rows) or all",
                          commands=("finetune",), choices=("mix", "all"))
    on_qa_fail: str = option("warn", "GUARD-QA: qa's golden prompts on the base before the fine-tune and on the final "
                                     "model after it (seconds); a gate that passed on the base and fails at the end "
                                     "is a warning (warn), exit 3 after final/ is written (stop), or not checked (off)",
                             commands=("finetune",), choices=("warn", "stop", "off"))
    # experiment tracking and sample generations (train/reporting.py, train/samples.py)
    report_to: list[str] = option(  # noqa: RUF009 -- a fresh list per config (default_factory)
        help="send every metrics.jsonl/eval.jsonl scalar, the config, curves.png and the "
                                       "task tables to tensorboard (RUN/tb), mlflow (--mlflow-uri) and/or wandb "
                                       "(offline, RUN/wandb); comma list or repeated; each needs its extra "
                                       "(pip install 'entrenar[tensorboard]')", metavar="TRACKER",
                                  default_factory=list, default_help="none")
    mlflow_uri: str | None = option(None, "--report-to mlflow: the tracking URI (a server's http(s)://..., or "
                                          "sqlite:///FILE)", metavar="URI",
                                    default_help="sqlite:///RUN/mlflow.db, artifacts in RUN/mlartifacts")
    sample_prompts: str | None = option(None, "generate greedily from each prompt of FILE at step 0, every "
                                              "--sample-every steps and at the end: RUN/samples.jsonl (step, prompt, "
                                              "completion), a line on stderr, text to the --report-to trackers. "
                                              "FILE: one prompt per line, or JSONL rows of prompt (rendered as a "
                                              "user turn where finetune has a chat template) or messages",
                                        metavar="FILE", default_help="none")
    sample_every: int = option(0, "--sample-prompts period in steps; 0 = at step 0 and the end")
    sample_max_new_tokens: int = option(64, "--sample-prompts: tokens generated per prompt at most")
    # guards
    on_nonfinite: str = option("stop", "GUARD-NONFINITE policy: stop (exit 3) or skip the step and count it",
                               choices=guards.NONFINITE_POLICIES)
    on_spike: str = option("warn", "GUARD-SPIKE policy for loss/grad-norm spikes > spike_sigma over "
                                   "spike_window steps", choices=guards.SPIKE_POLICIES)
    spike_window: int = 128  # steps of history of GUARD-SPIKE (not a flag)
    spike_sigma: float = 6.0  # GUARD-SPIKE threshold in standard deviations (not a flag)
    check_init_loss: bool = False  # pretrained start (--init, finetune): GUARD-INIT-LOSS (set by the command)
    allow_config_change: bool = option(False, "resume even if batch size, accumulation or sequence length "
                                              "changed")
    no_preflight: bool = option(False, "skip the step-0 parity check (logged)")
    log_every: int | None = None  # plain-line progress period (None: steps/20)
    profile: tuple[int, int] | None = option(
        None, "profile steps START .. START+COUNT-1 (COUNT default 2) with torch.profiler: per step wall ms, "
              "kernel (CUDA) or operator (CPU) ms by class and the top kernels, host idle, in RUN/profile.json; "
              "those steps run slower (metrics.jsonl marks them profiled)", parse=parse_profile,
        metavar="START[:COUNT]", default_help="off")
    # several processes (torchrun; train/parallel.py)
    parallel: str = option("auto", "data parallelism under torchrun: auto = DDP for LoRA/QLoRA and for full "
                                   "training when weights + gradients + AdamW state (20 B per parameter) fit "
                                   "a quarter of one GPU's memory, else FSDP2 (sharded), or HSDP with more than "
                                   "one node (torchrun --nnodes: sharded inside a node, replicated across nodes); "
                                   "one process: ignored", choices=PARALLEL_MODES)
    grad_reduce: str = option("fp32", "precision of the gradient all-reduce (DDP) / reduce-scatter (FSDP2) under "
                                      "torchrun: fp32 (exact sums of the ranks' fp32 gradients) or bf16 (half the "
                                      "bytes on the wire; each rank's gradient rounded to bf16, 8 mantissa bits, "
                                      "before the sum). Gradients already bf16 (--dtype bf16-pure) are reduced "
                                      "in bf16 either way; one process: ignored", choices=GRAD_REDUCE_DTYPES)
    ddp_bucket_mb: int = option(DDP_BUCKET_MB, "gradient bucket size in MB of DDP and of the replicas of a "
                                               "captured step (--cuda-graphs) under torchrun: a bucket's "
                                               "all-reduce starts once all its gradients exist; larger buckets "
                                               "start later in the backward (fewer all-reduces beside the "
                                               "matmuls, more of the last one after it); FSDP2 and one "
                                               "process: ignored", metavar="MB")
    cuda_graphs: str = option("auto", "capture each micro-batch's forward+backward as a CUDA graph per batch shape "
                                      "and replay it (one launch instead of thousands: the GPU no longer waits "
                                      "for Python between kernels). auto: on for one CUDA process training a "
                                      "causal LM in fp32/bf16/bf16-pure without dropout or activation offload, "
                                      "else off (the reason is logged and in run.json); on: the same, exit 2 "
                                      "where it cannot; the first steps and each new shape's first micro-batch "
                                      "run eagerly", choices=("auto", "on", "off"))
    cuda_graphs_reason: str = ""  # how --cuda-graphs was resolved: logged, in run.json
    activation_checkpointing: bool = option(False, "recompute each decoder block in the backward: activation "
                                                   "memory of one block instead of all, ~1/3 more compute")
    save_attention: bool = option(False, "with --activation-checkpointing (or --offload-activations): keep each "
                                         "block's attention output and softmax statistics on the GPU (tokens x "
                                         "hidden x 2 bytes + tokens x heads x 4 bytes per layer: 5.6 GiB for "
                                         "Qwen2.5-0.5B at 131k tokens) so the backward does not run the attention "
                                         "forward again: at long context, where attention is most of the step, "
                                         "about a fifth less time")
    # long sequences (entrenar/long_context.py; docs/design.md)
    offload_activations: bool = option(False, "implies --activation-checkpointing; each block's saved input "
                                              "(tokens x hidden x 2 bytes per layer: 5.3 GiB for Qwen2.5-0.5B at "
                                              "131k tokens) waits in pinned host memory instead of GPU memory, "
                                              "copied on a side stream and fetched back one block ahead. Costs "
                                              "that much host RAM and PCIe traffic: a few % of step time at long "
                                              "context, more on short sequences")
    mlp_chunk: int = option(0, "when a micro-batch has more tokens than this, compute each MLP in pieces of this "
                               "many tokens, each recomputed in the backward: the gate/up/SwiGLU intermediates (3 x "
                               "tokens x intermediate_size) exist for one piece at a time (Qwen2.5-0.5B at 131k "
                               "tokens: 3.8 GB -> 0.5 GB with 16384). Costs one more MLP forward per step, a few "
                               "% at long context; 0 = off", metavar="TOKENS")

    def __post_init__(self) -> None:
        self.report_to = report_names(self.report_to)
        if self.beta is None:  # the objective's own default
            self.beta = DEFAULT_GRPO_BETA if self.objective == "grpo" else DEFAULT_BETA
        if self.warmup is None and isinstance(self.steps, int):
            self.warmup = min(100, self.steps // 10)
        if self.device == "auto":  # resolved at once (as --dtype below, which reads it): no reader sees "auto"
            self.device, self.device_reason = resolve_device_reason("auto")
        elif not self.device_reason:
            self.device_reason = f"--device {self.device} as given"
        if self.dtype == "auto":  # resolved at once, so every later reader sees a concrete dtype
            self.dtype, self.dtype_reason = resolve_dtype("auto", resolve_device(self.device))
        elif not self.dtype_reason:
            self.dtype_reason = f"--dtype {self.dtype} as given"
        if self.eval_batches is None:
            self.eval_batches, self.eval_batches_reason = default_eval_batches(self.device, self.steps)

    def validate(self) -> None:
        """InputError (exit 2) naming the flag as the user typed it for this command."""
        def name(f: str) -> str:
            return flag_of(TrainConfig, f, self.command)

        for f in ("steps", "batch_size", "grad_accum", "seq_len", "ddp_bucket_mb"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise InputError(f"{name(f)} must be a positive integer, got {getattr(self, f)}")
        for f in ("eval_every", "eval_batches", "save_every", "keep", "warmup", "mlp_chunk", "eval_task_every",
                  "eval_task_limit", "eval_task_max_new_tokens"):
            if int(getattr(self, f)) < 0:
                raise InputError(f"{name(f)} must be >= 0, got {getattr(self, f)}")
        self.validate_tracking()
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"--lr must be a finite number > 0, got {self.lr}")
        for f in ("eval_task", "retain_task"):  # a library caller's single task: a panel of one
            if isinstance(getattr(self, f), str):
                setattr(self, f, [getattr(self, f)])
        if not self.eval_task and not self.retain_task:
            for f, default in (("eval_task_every", 0), ("eval_task_limit", 0), ("eval_task_max_new_tokens", 0),
                               ("on_task_regression", "warn")):
                if getattr(self, f) != default:
                    raise InputError(f"{name(f)} {getattr(self, f)} needs --eval-task (the task it applies to)")
        if self.keep_best == "task" and not self.eval_task:
            raise InputError(f"{name('keep_best')} task needs --eval-task: it picks the step with the best target "
                             f"result (--retain-task only guards what must not get worse)")
        for spec in (*self.eval_task, *self.retain_task):
            if not isinstance(spec, str) or not spec.strip():
                raise InputError(f"--eval-task/--retain-task: an empty task spec {spec!r}")
        both = set(self.eval_task) & set(self.retain_task)
        if both or len(set(self.eval_task)) < len(self.eval_task) or len(set(self.retain_task)) < len(self.retain_task):
            raise InputError(f"--eval-task/--retain-task: a task given twice ({', '.join(sorted(both)) or 'repeated'}); "
                             f"each task is a target or retained, once")
        if self.save_attention and not (self.activation_checkpointing or self.offload_activations):
            raise InputError("--save-attention keeps the attention outputs of checkpointed blocks; without "
                             "--activation-checkpointing nothing is recomputed: add it, or drop --save-attention")
        if not (isinstance(self.save_every_minutes, (int, float)) and math.isfinite(self.save_every_minutes)
                and self.save_every_minutes >= 0):
            raise InputError(f"{name('save_every_minutes')} must be a number of minutes >= 0 (0 = off), got "
                             f"{self.save_every_minutes}")
        if not (math.isfinite(self.clip) and self.clip >= 0):
            raise InputError(f"--clip must be a finite number >= 0 (0 = off), got {self.clip}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise InputError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        for f, allowed in (("dtype", DTYPES), ("mode", MODES), ("schedule", SCHEDULES),
                           ("on_nonfinite", guards.NONFINITE_POLICIES), ("on_spike", guards.SPIKE_POLICIES),
                           ("on_task_regression", guards.TASK_REGRESSION_POLICIES), ("keep_best", KEEP_BEST),
                           ("parallel", PARALLEL_MODES)):
            if getattr(self, f) not in allowed:
                raise InputError(f"{name(f)} {getattr(self, f)!r} not in {'|'.join(allowed)}")
        if not (isinstance(self.kl_to_base, (int, float)) and math.isfinite(self.kl_to_base) and self.kl_to_base >= 0):
            raise InputError(f"--kl-to-base must be a finite number >= 0 (0 = off), got {self.kl_to_base}")
        if self.kl_to_base and self.objective != "sft":
            raise InputError(f"--kl-to-base pulls SFT towards the base; --objective {self.objective} has its own "
                             f"reference term (--beta): drop --kl-to-base")
        if self.objective not in OBJECTIVES:
            raise InputError(f"--objective {self.objective!r} not in {'|'.join(OBJECTIVES)}")
        grpo = self.objective == "grpo"
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and (self.beta >= 0 if grpo
                                                                                       else self.beta > 0)):
            raise InputError(f"--beta must be a finite number {'>= 0' if grpo else '> 0'}, got {self.beta}")
        self.validate_grpo()
        if self.objective != "sft" and self.mode == "full" and self.dtype in ("bf16-weights", "fp8"):
            # the frozen reference copy would not compute as the policy does (bf16 step copies, float8 swap)
            raise InputError(f"--objective {self.objective} --mode full: {name('dtype')} {self.dtype} is not supported "
                             f"(the reference copy must compute exactly as the policy at step 0); use "
                             f"{name('dtype')} bf16 or fp32, or --mode lora")
        if self.dtype == "bf16-pure" and self.mode != "full":
            raise InputError(f"{name('dtype')} bf16-pure trains every weight in bf16 (--mode full); with "
                             f"--mode {self.mode} the adapters are a few MB: use {name('dtype')} bf16")
        if self.profile is not None and self.profile[0] + self.profile[1] - 1 > self.steps:
            raise InputError(f"{name('profile')} {self.profile[0]}:{self.profile[1]} profiles steps "
                             f"{self.profile[0]}..{self.profile[0] + self.profile[1] - 1}, past {name('steps')} "
                             f"{self.steps}: profile later steps or train more")
        self.device = resolve_device(self.device)  # the one --device rule (entrenar.devices)
        if self.dtype == "fp8":
            from .fp8 import require_fp8

            require_fp8(self.device, self.mode)  # exit 2 off a float8 GPU, outside --mode full, without torchao

    def validate_tracking(self) -> None:
        """--min-lr-ratio, --early-stop, --report-to (each tracker's package importable: exit 2 naming its extra
        before anything is built) and --sample-* (the prompts file read now)."""
        def name(f: str) -> str:
            return flag_of(TrainConfig, f, self.command)

        if not (isinstance(self.min_lr_ratio, (int, float)) and 0.0 <= self.min_lr_ratio <= 1.0):
            raise InputError(f"{name('min_lr_ratio')} must be in [0, 1] (a fraction of the peak --lr), got "
                             f"{self.min_lr_ratio}")
        for f in ("early_stop", "sample_every"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 0:
                raise InputError(f"{name(f)} must be an integer >= 0 (0 = off), got {getattr(self, f)}")
        if not isinstance(self.sample_max_new_tokens, int) or self.sample_max_new_tokens <= 0:
            raise InputError(f"{name('sample_max_new_tokens')} must be a positive integer, got "
                             f"{self.sample_max_new_tokens}")
        if self.sample_prompts is None:
            for f, default in (("sample_every", 0), ("sample_max_new_tokens", 64)):
                if getattr(self, f) != default:
                    raise InputError(f"{name(f)} {getattr(self, f)} needs --sample-prompts FILE (the prompts it "
                                     f"applies to)")
        else:
            from .samples import read_prompts

            read_prompts(self.sample_prompts)  # exit 2 naming FILE:LINE now, not at step 0
        from .reporting import require_trackers

        require_trackers(self.report_to)
        if self.mlflow_uri is not None and "mlflow" not in self.report_to:
            raise InputError(f"--mlflow-uri {self.mlflow_uri} applies to --report-to mlflow: add it, or drop "
                             f"--mlflow-uri")

    def validate_grpo(self) -> None:
        """--objective grpo's flags (exit 2 naming the flag); --reward without it is refused."""
        if self.objective != "grpo":
            if self.reward:
                raise InputError(f"--reward {self.reward[0]} scores completions of --objective grpo; add "
                                 f"--objective grpo, or drop --reward")
            if self.grpo_dynamic_sampling:
                raise InputError(f"--grpo-dynamic-sampling {self.grpo_dynamic_sampling} replaces GRPO groups without "
                                 f"reward spread; add --objective grpo, or drop --grpo-dynamic-sampling")
            return
        if not self.reward:
            raise InputError("--objective grpo needs at least one --reward (bfcl, bfcl-graded, tests, tests-all or "
                             "python:FILE.py:FUNC, each optionally :WEIGHT)")
        for f, low in (("num_generations", 2), ("max_new_tokens", 1), ("grpo_iterations", 1),
                       ("grpo_dynamic_sampling", 0)):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < low:
                raise InputError(f"--{f.replace('_', '-')} must be an integer >= {low}, got {getattr(self, f)}"
                                 + (" (a group of one has no spread: no advantage)" if f == "num_generations" else ""))
        for f in ("temperature", "epsilon", "max_kl") + (("epsilon_high",) if self.epsilon_high is not None else ()):
            v = getattr(self, f)
            if not (math.isfinite(v) and (v >= 0 if f == "max_kl" else v > 0)):
                raise InputError(f"--{f.replace('_', '-')} must be a finite number {'>= 0' if f == 'max_kl' else '> 0'}"
                                 f", got {v}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.epsilon >= 1:
            raise InputError(f"--epsilon {self.epsilon}: the ratio's clip 1 - epsilon must stay above 0")
        from .rewards import parse_rewards

        parse_rewards(self.reward)  # each SPEC known, a python: file defining its FUNC

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoRAConfig:
    """The adapter of `finetune --mode lora|qlora` (unused in full mode, still recorded)."""

    rank: int = option(16, "LoRA rank", commands=("finetune",))
    alpha: float | None = option(None, "LoRA alpha (scale = alpha/rank)", commands=("finetune",),
                                 default_help="2 x rank")
    dropout: float = option(0.0, "LoRA dropout", commands=("finetune",))
    rslora: bool = option(False, "rank-stabilised scaling alpha/sqrt(rank)", commands=("finetune",))
    targets: str | None = option(None, "LoRA target linears, comma-separated", commands=("finetune",),
                                 default_help="the attention and MLP projections")
    adapter: str | None = option(None, "LoRA/QLoRA adapter directory applied on --model unmerged",
                                 commands=("eval",), metavar="DIR", default_help="none")
    force_base: bool = option(False, "apply --adapter even if MODEL is not the base it recorded (exit 2 otherwise)",
                              commands=("eval",))

    @property
    def effective_alpha(self) -> float:
        return float(2 * self.rank if self.alpha is None else self.alpha)

    def validate(self) -> None:
        """Checked before --lr auto uses alpha (issue 18: --alpha -16 was reported as a bad --lr)."""
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise InputError(f"--rank must be a positive integer, got {self.rank}")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise InputError(f"--alpha must be a finite number > 0 (the LoRA scale is alpha/rank), got "
                             f"{self.alpha:g}; omit --alpha for the default 2 x --rank")
        if not (math.isfinite(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise InputError(f"--dropout must be in [0, 1), got {self.dropout}")


@dataclass
class DataConfig:
    """Where the examples come from and how they are read."""

    data: str | None = option(None, "token shards directory (`entrenar data pack`)", commands=_EVERY,
                              required=True, metavar="PATH", per_command={
                                  "finetune": {"help": "training rows: " + SOURCES_HELP},
                                  "eval": {"help": "token shards directory or SFT .jsonl (--task loss); a task "
                                                   "JSONL (--task humaneval)", "required": False,
                                           "default_help": "none"}})
    val: str | None = option(None, "validation rows (as --data)", commands=("finetune",), metavar="PATH",
                             default_help="--val-fraction of --data")
    val_fraction: float = option(0.05, "held-out fraction of --data when no --val", commands=("finetune",))
    split: str | None = option(None, "token shards split", commands=("eval",), choices=("train", "val"),
                               default_help="val if present")
    max_seq_len: int = option(2048, "longest SFT sample in tokens", commands=("finetune",), aliases=("--seq-len",),
                              metavar="N")
    truncation: str = option("skip", "a response cut by --max-seq-len: skip the sample or train it cut",
                             commands=("finetune", "eval"), choices=TRUNCATION_POLICIES)
    skip_invalid: bool = option(False, "skip and count invalid rows instead of exit 2", commands=("finetune",))
    max_skip_fraction: float = option(DEFAULT_MAX_SKIP_FRACTION, "GUARD-DATA (exit 2) above this fraction of "
                                      "skipped rows", commands=("finetune", "eval"))
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP + "; saved with the trained model",
                                       commands=("finetune", "eval"), metavar="FILE",
                                       default_help="the model's",
                                       per_command={"eval": {"help": CHAT_TEMPLATE_HELP + ": for SFT .jsonl rows "
                                                             "(--task loss) and --task humaneval's chat prompts"}})
    mix: list[str] = option(  # noqa: RUF009 (a field with a default_factory)
        help="FILE:FRACTION: rows of another SFT file (e.g. `data replay`'s), or with --objective grpo "
                                 "of another prompt file (e.g. no-call prompts), making FRACTION of the training rows "
                                 "(data/mixing.py); several allowed", commands=("finetune",),
                            metavar="FILE:FRACTION", default_help="none", default_factory=list)
    columns: str | None = option(None, COLUMNS_HELP, commands=("finetune", "eval"), metavar="MAP",
                                 default_help="the rows' own keys")
    pack: bool = option(False, "pack several samples per row of --max-seq-len tokens (attention kept apart); "
                               "--batch-size then counts rows, not samples", commands=("finetune",))
    pad_buckets: int = option(0, "pad each batch to the smallest of N lengths evenly spaced up to --max-seq-len "
                                 "(multiples of 64, the last --max-seq-len) instead of its longest row, so the "
                                 "training step sees N shapes (e.g. for CUDA graphs); 0 = pad to the longest row",
                              commands=("finetune",), metavar="N")
    padding_free: bool = option(False, "each batch's samples end to end in one row of exactly their tokens (no "
                                       "padding; varlen flash attention on CUDA), the same samples and loss as "
                                       "padded batches (under torchrun: each rank its samples as one row); SFT only, not with "
                                       "--pack or --pad-buckets",
                                commands=("finetune",))

    def validate(self) -> None:
        if not (math.isfinite(self.val_fraction) and 0.0 <= self.val_fraction < 1.0):
            raise InputError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if not isinstance(self.max_seq_len, int) or self.max_seq_len <= 0:
            raise InputError(f"--max-seq-len must be a positive integer, got {self.max_seq_len}")
        if not (math.isfinite(self.max_skip_fraction) and 0.0 <= self.max_skip_fraction <= 1.0):
            raise InputError(f"--max-skip-fraction must be in [0, 1], got {self.max_skip_fraction}")
        if self.truncation not in TRUNCATION_POLICIES:
            raise InputError(f"--truncation {self.truncation!r} not in {'|'.join(TRUNCATION_POLICIES)}")
        if not isinstance(self.pad_buckets, int) or self.pad_buckets < 0:
            raise InputError(f"--pad-buckets must be an integer >= 0 (0 = pad to the longest row), got "
                             f"{self.pad_buckets}")


CONFIGS = (TrainConfig, LoRAConfig, DataConfig)


def report_names(value: Any) -> list[str]:
    """--report-to as given (None, a comma list, or the list of a repeated flag) -> tracker names, in order, once
    each; unknown names are exit 2 listing the valid ones."""
    from .reporting import TRACKERS

    items = [value] if isinstance(value, str) else list(value or [])
    names: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip().lower()
            if not part or part in names:
                continue
            if part not in TRACKERS:
                raise InputError(f"--report-to {part!r} is not a tracker: use {', '.join(TRACKERS)} (a comma list, "
                                 f"or the flag repeated)")
            names.append(part)
    return names
C = TypeVar("C")


# ---- dataclass fields <-> the command line (argparse itself: cli/train.py) ------------------------------
def _cli(f: Any, command: str) -> dict[str, Any] | None:
    """The field's command-line spec for `command` (per-command overrides applied), or None."""
    meta = f.metadata.get("cli")
    if meta is None or command not in meta["commands"]:
        return None
    return {**meta, **meta["per_command"].get(command, {})}


def _field_default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def default_of(cls: type, name: str, command: str) -> Any:
    """The default of field `name` for `command` (its per-command default where it has one)."""
    f = next(f for f in fields(cls) if f.name == name)
    spec = _cli(f, command)
    return spec["default"] if spec and "default" in spec else _field_default(f)


def flag_of(cls: type, name: str, command: str) -> str:
    """The option string of field `name` in `command` ('--max-batches' for eval's eval_batches)."""
    f = next(f for f in fields(cls) if f.name == name)
    spec = _cli(f, command) or {}
    if name == "seq_len" and command == "finetune":
        return "--max-seq-len"  # finetune's windows are its longest sample (DataConfig.max_seq_len)
    return spec.get("flag") or "--" + name.replace("_", "-")


def from_args(cls: type[C], args: Any, command: str, /, **overrides: Any) -> C:
    """The dataclass from parsed arguments: offered fields from `args`, the rest at their defaults
    for this command, then `overrides`."""
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        if _cli(f, command) is not None and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
            if values[f.name] is None and f.default_factory is not MISSING:  # a repeatable flag never given
                values[f.name] = f.default_factory()
        elif _cli(f, command) is not None or f.metadata.get("cli"):
            values[f.name] = default_of(cls, f.name, command)
    values.update(overrides)
    return cls(**values)
