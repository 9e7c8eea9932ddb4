"""`finetune --objective grpo`: Group Relative Policy Optimization with verifiable rewards, as a part of the one
training loop (an objective and a loader; train/loop.py is unchanged).

Each micro-batch is a rollout: `--batch-size` prompts of the prompt file, each completed `--num-generations` (G)
times by the policy itself (`sample_completions`, the one place generation is called: the generation engine, under
the run's autocast), scored by the rewards of `--reward` (train/rewards.py, summed with their
weights), turned into group-normalised advantages (`group_advantages`), and its reference log-probs taken with the
adapters switched off (LoRA/QLoRA) or from a frozen copy of the starting model (--mode full) when --beta > 0. A
round of `--grpo-iterations` optimizer steps reuses the same rollouts (old log-probs kept from the rollout); its
first step draws them (GRPOLoader).

The loss is TRL's GRPOTrainer._compute_loss (its `loss_type` names; tests/test_grpo_parity.py calls TRL's own code
on the same inputs): per completion token t of sequence i,

    r = exp(logp - old_logp)        (old_logp = logp.detach() when --grpo-iterations 1: r = 1, gradient A)
    l_it = -min(r A_i, clip(r, 1 - eps_low, 1 + eps_high) A_i) + beta * (exp(ref - logp) - (ref - logp) - 1)

(the KL term is the k3 estimator of KL(policy || reference)), normalised by --loss-type:
  grpo     mean over sequences of each sequence's mean over its tokens
  bnpo     sum over the micro-batch's tokens / its token count (then the mean over micro-batches and ranks)
  dr_grpo  sum over tokens / (sequences x --max-new-tokens)
  dapo     sum over tokens / the step's token count over every micro-batch and rank (the default, TRL's too)
In the loop's terms (objective.py: loss sum and units, each micro-batch's sum divided by the step's units):
`grpo_loss_sum` gives each micro-batch's sum and units. The log-probs are those of the tempered distribution the
completions were sampled from: log_softmax(logits / --temperature), as TRL's.

--grpo-dynamic-sampling N (DAPO's dynamic sampling, dynamic_refill): a round's groups whose G rewards are all equal are
dropped and replaced by further prompts of the loader's cursor, rolled out in up to N extra engine calls.

Under torchrun (GRPOLoader.shard; DDP replicas, or FSDP2 for --mode full with rollouts from a plain replica:
rollout_policy): W ranks x --batch-size B train as one process x --batch-size B*W.
Each rank draws the job's micro-batch from the shared cursor and rolls out its own B prompts, each request with the
seed the one process gives it, so the ranks' rollouts together are that process's; the loop all-reduces the loss
units and the metric sums (docs/design.md, "GRPO").

Per-step metrics (metrics.jsonl): reward (mean), reward_std (the mean of the groups' std), frac_reward_zero_std
(share of groups whose G rewards are all equal: no signal), reward/NAME (each reward's mean, unweighted),
completion_length (mean tokens, the stop token included), truncated_share (completions cut by --max-new-tokens),
kl (mean per token, --beta > 0), entropy (the policy's mean per token), clip_ratio (tokens whose ratio was
clipped), rollout_tok_s (tokens generated per second of rollout), frac_groups_dropped (--grpo-dynamic-sampling).
Guards: GUARD-GRPO-KL (exit 3), GUARD-GRPO-ENTROPY (a warning); GUARD-REWARD-HACKING judges --eval-task results
(GRPOWatch.task_result).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..data.sft import SFTLoader
from ..errors import GuardError, InputError
from ..tensors import IGNORE_INDEX
from .objective import format_fields, takes_head_at, to_device

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")  # TRL's GRPOConfig.loss_type names
SCALE_REWARDS = ("group", "batch", "none")  # TRL's GRPOConfig.scale_rewards
DEFAULT_GRPO_BETA = 0.04  # DeepSeekMath's GRPO; --beta 0 drops the reference
STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)
DEFAULT_MAX_KL = 1.0  # GUARD-GRPO-KL: mean k3 KL per completion token above this stops the run
ENTROPY_COLLAPSE_RATIO = 0.1  # GUARD-GRPO-ENTROPY: entropy below this share of its first step's ...
ENTROPY_COLLAPSE_FLOOR = 0.05  # ... and below this many nats per token
ENTROPY_COLLAPSE_STEPS = 3  # ... for this many steps in a row

# the progress line's fields: (label, metrics.jsonl key, format); a key missing from the step's record is left out
PROGRESS_FIELDS = (("reward", "reward", ".3f"), ("std", "reward_std", ".3f"),
                   ("no-spread", "frac_reward_zero_std", ".0%"), ("dropped", "frac_groups_dropped", ".0%"),
                   ("kl", "kl", ".4f"), ("entropy", "entropy", ".3f"), ("len", "completion_length", ".0f"),
                   ("cut", "truncated_share", ".0%"))

# the rollout's statistics carried in each micro-batch (summed over micro-batches and ranks by the loop)
ROLLOUT_SUMS = ("reward", "reward_std", "zero_std_groups", "groups", "sequences", "completion_tokens",
                "truncated", "rollout_seconds",
                # --grpo-dynamic-sampling: groups sampled, of them not trained on (no spread), the tokens generated
                # (those of dropped groups too: rollout_tok_s), groups a micro-batch still lacked after the refills
                "drawn_groups", "dropped_groups", "generated_tokens", "short_groups")


# ---- the math (TRL's; tests/test_grpo_parity.py) --------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N], each group's std [N / group]) of rewards [N] in groups of `group` consecutive completions:
    reward - its group's mean, divided by (std + 1e-4) where scale is "group" (the group's std) or "batch" (the std
    of all N), not divided where "none" (Dr. GRPO). Std is unbiased, as TRL's nanstd."""
    assert scale in SCALE_REWARDS, scale
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    group_std = grouped.std(dim=1) if group > 1 else torch.zeros(grouped.shape[0], dtype=rewards.dtype)
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (group_std.repeat_interleave(group) + STD_EPS)
    elif scale == "batch":
        advantages = advantages / ((rewards.std() if rewards.numel() > 1 else torch.zeros(())) + STD_EPS)
    return advantages, group_std


def without_spread(group_std: torch.Tensor) -> torch.Tensor:
    """Which groups [groups] have all their G rewards equal (std ~ 0): advantage 0 everywhere, no policy gradient."""
    return torch.isclose(group_std, torch.zeros_like(group_std))


def per_token_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(policy || reference) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    return torch.exp(ref_logps - logps) - (ref_logps - logps) - 1


def grpo_per_token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                        ref_logps: torch.Tensor | None, beta: float, eps_low: float, eps_high: float
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(per-token loss [N, T], per-token KL or None, ratio [N, T]): the clipped surrogate of the ratio
    exp(logp - old_logp) with advantages [N], plus beta x the k3 KL to the reference (beta 0: no KL term)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    adv = advantages.unsqueeze(1)
    loss = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probs"
        kl = per_token_kl(logps, ref_logps)
        loss = loss + beta * kl
    return loss, kl, ratio


def grpo_loss_sum(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int
                  ) -> tuple[torch.Tensor, int]:
    """(loss sum, units) of one micro-batch, whose quotient is TRL's loss of that batch for `loss_type`; over a
    step the loop divides the sum of the sums by the sum of the units (see the module docstring)."""
    mask = mask.to(per_token.dtype)
    n = per_token.shape[0]
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), n
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0), 1
    if loss_type == "dr_grpo":
        return (per_token * mask).sum(), n * int(max_completion_length)
    assert loss_type == "dapo", loss_type
    return (per_token * mask).sum(), int(mask.sum())


def units_of(loss_type: str, labels: torch.Tensor, max_completion_length: int) -> int:
    """grpo_loss_sum's units from the labels alone (the loader's CPU tensors: no device sync)."""
    n = labels.shape[0]
    return {"grpo": n, "bnpo": 1, "dr_grpo": n * int(max_completion_length)}.get(
        loss_type, int((labels != IGNORE_INDEX).sum()))


def token_logps(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, temperature: float,
                entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob [N, T] of each label token under softmax(logits / temperature), 0 where ignored; the entropy
    [N, T] of that distribution, without gradient, 0 where ignored, when asked). Our CausalLM: its forward applies
    the head at the label positions only (`head_at`, the completion's): the logits of a long prompt are never built,
    and a DDP/FSDP wrapper sees its forward. Another module: its forward's logits."""
    mask = labels != IGNORE_INDEX
    if takes_head_at(model):  # DDP's wrapped model (torchrun) too; FSDP2 shards in place
        # through the wrapper's forward: DDP prepares the step's gradient reduction there, FSDP2's hooks gather
        logits = model(input_ids, head_at=mask.reshape(-1).nonzero().squeeze(1)).float()
    else:
        logits = model(input_ids).float()[mask]
    if temperature != 1.0:
        logits = logits / temperature
    picked = -F.cross_entropy(logits, labels[mask], reduction="none")
    logps = torch.zeros(labels.shape, dtype=picked.dtype, device=picked.device).masked_scatter(mask, picked)
    ent = None
    if entropy:
        with torch.no_grad():
            lp = torch.log_softmax(logits, dim=-1)
            ent = torch.zeros_like(logps).masked_scatter(mask, -(lp.exp() * lp).sum(-1))
    return logps, ent


# ---- generation: the one call (another decoder may replace it) ------------------------------------------------
@dataclass
class Sampled:
    token_ids: list[int]  # the completion's ids, the stop token included when one ended it
    text: str  # without the stop token
    truncated: bool  # cut by max_new_tokens


def sample_completions(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       temperature: float, top_p: float, seed: int, seeds: Sequence[int] | None = None
                       ) -> list[Sampled]:
    """One completion per prompt id list (repeat a prompt for several), sampled through the generation engine
    (engine.generate_many: continuous batching over `--batch-size auto` slots, CUDA-graph decode steps). Request i
    of the call samples with seed * len(prompts) + i (or `seeds[i]` when given), so the copies of a prompt differ,
    and no two rollouts of a run (seed: the run's seed and the step) share a request's draws."""
    from ..engine import GenerationSettings, generate_many, resolve_slots

    n = len(prompts)
    seeds = [seed * n + i for i in range(n)] if seeds is None else list(seeds)
    slots, _ = resolve_slots("auto", model, [len(p) for p in prompts], max_new_tokens, sampling=temperature > 0)
    settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  max_slots=slots)
    results = generate_many(model, tokenizer, prompts, settings, seeds=seeds)
    return [Sampled(list(r.token_ids), r.text, r.stop_reason == "max_new_tokens") for r in results]


# ---- prompts ----------------------------------------------------------------------------------------------
@dataclass
class PromptExample:
    """One prompt row: its rendered ids (the generation prompt included), its text, the row (ground truth for
    the rewards) and its line. input_ids / labels / line / len(): what SFTLoader's cursor and fingerprint use."""

    input_ids: np.ndarray
    text: str
    row: dict[str, Any]
    line: int
    room: int  # --max-new-tokens: len() is the longest sequence the prompt can grow to

    @property
    def labels(self) -> np.ndarray:
        return np.zeros(0, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.input_ids) + self.room


# ---- the loader: rollouts ----------------------------------------------------------------------------------------
class GRPOLoader(SFTLoader):
    """SFT's loader (the epoch cursor over prompts, its state and resume checks) whose micro-batches are rollouts of
    `batch_size` prompts (GRPOObjective.rollout). Round r of --grpo-iterations steps: its first step draws
    grad_accum fresh micro-batches, the later steps replay them (old log-probs from the rollout). A rollout
    re-requested at the same cursor (step 0's check on the first batch, then step 1) is replayed, not drawn again. A
    resume inside a round draws fresh rollouts for its remaining steps."""

    kind = "grpo-prompts"

    def __init__(self, examples: Sequence[PromptExample], batch_size: int, seed: int = 0, pack: bool = False,
                 max_seq_len: int | None = None, pad_id: int | None = 0, **_: Any):
        assert not pack, "GRPO prompts are never packed (cmd_finetune refuses --pack)"
        super().__init__(examples, batch_size, seed=seed, pack=False, max_seq_len=max_seq_len, pad_id=pad_id)
        self.objective: GRPOObjective | None = None  # set by GRPOObjective(loader=...)
        self.calls = 0  # next_batch calls so far: the round and the micro-batch within it
        self.buffer: list[tuple[dict, dict, dict]] = []  # (cursor before, batch, cursor after) of this round
        self.buffer_round = -1
        self.ctx: Any = None  # under torchrun (shard): the job's DistContext; this rank's share of each micro-batch
        self.rank, self.world = 0, 1

    def shard(self, ctx: Any) -> GRPOLoader:
        """This loader as rank ctx.rank of ctx.world (distributed.shard_loader, in place of SFT's RankSlice): every
        rank draws the job's micro-batch of world x batch_size prompts from the same cursor and rolls out only its
        own contiguous share (a prompt's G completions stay on one rank, so group advantages are local), each request
        with the seed one process drawing the whole micro-batch gives it: the union of the ranks' rollouts is that
        process's rollout (docs/design.md, "GRPO")."""
        self.ctx, self.rank, self.world = ctx, int(ctx.rank), int(ctx.world)
        return self

    def next_batch(self) -> dict[str, Any]:
        obj = self.objective
        assert obj is not None, "a GRPOLoader draws rollouts through its GRPOObjective"
        per_round = obj.grad_accum * obj.iterations
        rnd, k = divmod(self.calls, per_round)
        j = k % obj.grad_accum
        if self.buffer_round != rnd:
            self.buffer, self.buffer_round = [], rnd
        entry = self.buffer[j] if j < len(self.buffer) else None
        before = self.cursor.state_dict()
        if entry is None or (k < obj.grad_accum and entry[0] != before):
            # the round's first micro-batch: every micro-batch of its first step in one generation call
            js = range(j, obj.grad_accum) if k == 0 else range(j, j + 1)
            drawn = []
            for jj in js:
                start, chosen = self.cursor.state_dict(), []
                for _ in range(self.batch_size * self.world):  # the job's micro-batch; this rank rolls out its share
                    chosen.append(self._peek())
                    self._advance()
                mine = chosen[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
                drawn.append((start, mine, self.cursor.state_dict(), self._seed(rnd, jj)))
            share = {"shard": (self.rank, self.world)} if self.world > 1 else {}
            batches = obj.rollouts([d[1] for d in drawn], [d[3] for d in drawn], draw=self._draw_refills, **share)
            # --grpo-dynamic-sampling's refills come after the call's micro-batches: the last one's cursor is after them
            ends = [d[2] for d in drawn[:-1]] + [self.cursor.state_dict()]
            self.buffer[j:] = [(d[0], batch, end) for d, batch, end in zip(drawn, batches, ends, strict=True)]
            entry = self.buffer[j]
            self.cursor.load_state_dict(entry[2], "GRPO prompt")
        elif k < obj.grad_accum:  # the same rollout asked for again at the same cursor: replayed
            self.cursor.load_state_dict(entry[2], "GRPO prompt")
        self.calls += 1
        return entry[1]

    def _draw(self, n: int) -> list[PromptExample]:
        """The next n prompts of the epoch cursor (--grpo-dynamic-sampling's refills)."""
        out = []
        for _ in range(n):
            out.append(self._peek())
            self._advance()
        return out

    def _draw_refills(self, needs: Sequence[int]) -> tuple[list[list[PromptExample]], list[int], list[int]]:
        """One extra call's refills (dynamic_refill): needs[j] fresh prompts for this rank's micro-batch j ->
        (each micro-batch's prompts, how many of micro-batch j's refills the lower ranks took, the job's refills of
        micro-batch j). In one process the next needs[j] prompts of the cursor, j in order. Under torchrun every rank
        learns every rank's needs (one all_gather) and draws them all from the shared cursor, micro-batch by
        micro-batch and rank by rank, keeping its own: the cursor stays the same on every rank, and the job draws
        what one process refilling the whole micro-batch draws."""
        every = [list(needs)] if self.ctx is None else self.ctx.all_gather_object(list(needs))
        mine: list[list[PromptExample]] = []
        before, total = [], []
        for j in range(len(needs)):
            for r, theirs in enumerate(every):
                got = self._draw(int(theirs[j]))
                if r == self.rank:
                    mine.append(got)
                    before.append(sum(int(t[j]) for t in every[:r]))
            total.append(sum(int(t[j]) for t in every))
        return mine, before, total

    def _seed(self, rnd: int, j: int) -> int:
        """Micro-batch j of round rnd's sampling seed."""
        return (self.seed * 1_000_003 + rnd * 1009 + j) % 2**62

    def iter_epoch(self) -> Any:
        raise InputError("GRPO has no eval set of prompts (its rewards are logged per step); drop --val")

    def state_dict(self) -> dict[str, Any]:
        # batch_size: the job's micro-batch (as RankSlice's SFT loader records it); the cursor is the same on every rank
        return {**super().state_dict(), "batch_size": self.batch_size * self.world, "calls": self.calls}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        self.calls = int(sd.get("calls", 0))


# ---- the objective -----------------------------------------------------------------------------------------------
class GRPOObjective:
    """`--objective grpo` (see the module docstring): the Objective interface of train/objective.py plus `rollout`,
    which GRPOLoader calls to make each micro-batch."""

    name = "grpo"
    unit = "loss units"  # per --loss-type: sequences, micro-batches, sequences x max-new-tokens, tokens
    uniform_name = "the loss at zero advantage"
    eval_anomaly = False
    lm_key, lm_name = "nll/none", "no language-model loss (GRPO)"  # no NLL series: TrainWatch stays idle
    perplexity = False
    diverged = ("the policy moved far from where it started", "lower --lr or raise --beta")
    # the clipped surrogate sits near 0 and changes sign with each batch's advantages: "2.8x the starting loss"
    # fired at every other step of a healthy Qwen run (starting loss 0.025); its gradient norm is still watched
    loss_spikes = False

    def __init__(self, tokenizer: Any, rewards: Any, *, mode: str = "lora", beta: float = DEFAULT_GRPO_BETA,
                 num_generations: int = 4, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 256, epsilon: float = 0.2, epsilon_high: float | None = None,
                 iterations: int = 1, grad_accum: int = 1, loss_type: str = "dapo", scale_rewards: str = "group",
                 max_kl: float = DEFAULT_MAX_KL, dtype: str = "fp32", loader: GRPOLoader | None = None,
                 dynamic_sampling: int = 0):
        if loss_type not in LOSS_TYPES:
            raise InputError(f"--loss-type {loss_type!r} not in {'|'.join(LOSS_TYPES)}")
        if scale_rewards not in SCALE_REWARDS:
            raise InputError(f"--scale-rewards {scale_rewards!r} not in {'|'.join(SCALE_REWARDS)}")
        self.tokenizer, self.rewards = tokenizer, rewards
        self.reference = "frozen-copy" if mode == "full" else "adapters-off"
        self.beta, self.G, self.temperature, self.top_p = float(beta), int(num_generations), float(temperature), top_p
        self.max_new_tokens, self.iterations, self.grad_accum = int(max_new_tokens), int(iterations), int(grad_accum)
        self.eps_low = float(epsilon)
        self.eps_high = float(epsilon if epsilon_high is None else epsilon_high)
        self.loss_type, self.scale_rewards = loss_type, scale_rewards
        self.dtype = dtype
        self.dynamic_sampling = int(dynamic_sampling)  # --grpo-dynamic-sampling: extra rollout calls at most
        self.policy: torch.nn.Module | None = None
        self.replica: torch.nn.Module | None = None  # --mode full under torchrun: what an FSDP2 policy rolls out with
        self.sampler: torch.nn.Module | None = None  # the module this rollout samples from (rollout_policy)
        self.reference_model: torch.nn.Module | None = None
        self.watcher = GRPOWatch(max_kl)
        if loader is not None:
            loader.objective = self

    # -- the reference and the policy used for rollouts
    def bind(self, model: torch.nn.Module) -> None:
        """Before parallelism wraps `model` (build_trainer): the policy rollouts sample from, and a full fine-tune's
        frozen copy of it as the reference (none when --beta 0); LoRA/QLoRA switch their adapters off. A full
        fine-tune under torchrun also keeps a plain replica, for FSDP2 (rollout_policy; dropped under DDP)."""
        from .distributed import env_world

        self.policy = model
        if self.reference == "frozen-copy" and env_world()[1] > 1:
            # torchrun may shard the weights (FSDP2): rollouts then sample from this plain replica (rollout_policy)
            self.replica = copy.deepcopy(model).requires_grad_(False).eval()
        if self.beta == 0.0:
            return
        if self.reference == "frozen-copy":
            self.reference_model = copy.deepcopy(model).requires_grad_(False).eval()
            return
        from ..peft import lora_modules

        if not lora_modules(model):
            raise InputError("--objective grpo with the adapters-off reference needs a LoRA/QLoRA model "
                             "(--mode lora|qlora); --mode full uses a frozen copy")

    def rollout_policy(self) -> torch.nn.Module:
        """The module a rollout samples from: the policy itself, or, when FSDP2 sharded it (--mode full under
        torchrun), the plain replica given the policy's current full weights: a rank generates for as many tokens as
        its own completions take, which sharded weights (gathered by every rank's forward in step) cannot do. The
        weights are gathered once per rollout call, on every rank at once (the loader's calls are in step)."""
        from torch.distributed.fsdp import FSDPModule

        assert self.policy is not None, "GRPOObjective.bind(model) comes first (build_trainer)"
        if not isinstance(self.policy, FSDPModule):
            self.replica = None  # replicas (DDP) or one process: the policy samples itself
            return self.policy
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.replica is not None, "bind() keeps a replica of a full fine-tune under torchrun"
        full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True))
        self.replica.load_state_dict(full)
        return self.replica

    def _autocast(self, device: torch.device) -> Any:
        from .precision import precision_policy

        return precision_policy(self.dtype).autocast(device)

    def reference_logps(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from ..peft import adapters_disabled

        assert self.policy is not None
        if self.reference_model is not None:
            return token_logps(self.reference_model, ids, labels, self.temperature)[0]
        with adapters_disabled(self.policy):
            return token_logps(self.policy, ids, labels, self.temperature)[0]

    # -- the rollout (a micro-batch)
    def rollout(self, prompts: Sequence[PromptExample], seed: int) -> dict[str, Any]:
        """G completions of each prompt from the policy, their rewards and advantages, the batch the loss reads:
        input_ids / labels [N, T] (prompt + completion, right-padded; labels on the completion tokens, shifted),
        advantages [N], old_logps (--grpo-iterations > 1) and ref_logps (--beta > 0) [N, T], the rollout's sums."""
        return self.rollouts([prompts], [seed])[0]

    def rollouts(self, micro_batches: Sequence[Sequence[PromptExample]], seeds: Sequence[int],
                 draw: Callable[[Sequence[int]], tuple[list[list[PromptExample]], list[int], list[int]]] | None = None,
                 shard: tuple[int, int] = (0, 1)) -> list[dict[str, Any]]:
        """rollout() of several micro-batches (a step's --grad-accum) from ONE generation call: a short call pays
        its prefill, graph warm-ups and captures whatever it generates (on an H200 a 32-completion micro-batch's
        rollout ran at ~1,000 tokens/s), so the step's micro-batches share them. Micro-batch j samples with seed j
        as rollout() would alone (request i: seeds[j] * its requests + i), so its batch is the same. Each one's
        rollout_seconds is the call's, shared by its generated tokens. With --grpo-dynamic-sampling N > 0 and
        `draw` (the loader's _draw_refills), groups without reward spread are replaced (dynamic_refill). `shard`
        (rank, world): these micro-batches are rank's share of the job's, whose request i is that of one process's
        micro-batch of world x as many prompts: seed * (world x len) + rank x len + i."""
        rank, world = shard
        self.sampler = self.rollout_policy()
        ids = [[p.input_ids.tolist() for p in prompts for _ in range(self.G)] for prompts in micro_batches]
        request_seeds = [[seed * len(x) * world + rank * len(x) + i for i in range(len(x))]
                         for seed, x in zip(seeds, ids, strict=True)]
        parts, seconds = self._generate(ids, request_seeds)
        if draw is None or self.dynamic_sampling == 0:
            return [self._batch(prompts, x, part, s) for prompts, x, part, s in
                    zip(micro_batches, ids, parts, seconds, strict=True)]
        return dynamic_refill(self, micro_batches, ids, parts, seconds, seeds, draw)

    def _generate(self, ids: Sequence[list[list[int]]], request_seeds: Sequence[list[int]]
                  ) -> tuple[list[list[Sampled]], list[float]]:
        """(each part's completions, each part's share of the call's seconds by its generated tokens) of the
        request lists `ids` (one part each) sampled in ONE engine call, request r of part j with request_seeds[j][r]."""
        model = self.sampler
        assert model is not None, "rollouts() chooses the module that samples (rollout_policy)"
        device = next(model.parameters()).device
        t0 = time.perf_counter()
        with self._autocast(device):
            flat = sample_completions(model, self.tokenizer, [x for part in ids for x in part], self.max_new_tokens,
                                      self.temperature, self.top_p, 0, seeds=[s for part in request_seeds for s in part])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        parts, at = [], 0
        for x in ids:
            parts.append(flat[at:at + len(x)])
            at += len(x)
        tokens = [sum(len(s.token_ids) for s in part) for part in parts]
        total = sum(tokens)
        return parts, [seconds * (n / total if total else 1 / len(parts)) for n in tokens]

    def score(self, prompts: Sequence[PromptExample], sampled: Sequence[Sampled]) -> torch.Tensor:
        """Each reward function's value of each completion [N, rewards] (float64), G completions per prompt."""
        rows = [p for p in prompts for _ in range(self.G)]
        per_func = self.rewards([p.text for p in rows], [s.text for s in sampled], [p.row for p in rows])
        return torch.tensor(per_func, dtype=torch.float64).reshape(len(rows), len(self.rewards.weights))

    def weighted_rewards(self, per_func: torch.Tensor) -> torch.Tensor:
        """The rewards [N] (float64): each completion's rewards summed with their --reward weights."""
        return per_func @ torch.tensor(self.rewards.weights, dtype=torch.float64)

    def _batch(self, prompts: Sequence[PromptExample], ids: list[list[int]], sampled: list[Sampled],
               seconds: float, per_func: torch.Tensor | None = None, dynamic: dict[str, float] | None = None
               ) -> dict[str, Any]:
        """One micro-batch's rollout batch (rollout()'s) from its sampled completions (their rewards `per_func` when
        already scored; `dynamic`: dynamic_refill's sums of the groups drawn and dropped for it)."""
        model = self.sampler  # the policy, or its plain replica under FSDP2 (rollout_policy)
        device = next(model.parameters()).device
        per_func = self.score(prompts, sampled) if per_func is None else per_func
        weighted = self.weighted_rewards(per_func)
        rewards = weighted.float()
        advantages, group_std = group_advantages(rewards, self.G, self.scale_rewards)
        N = len(ids)
        T = max(len(i) + len(s.token_ids) for i, s in zip(ids, sampled, strict=True))
        pad = self.pad_id
        input_ids = torch.full((N, T), pad, dtype=torch.long)
        labels = torch.full((N, T), IGNORE_INDEX, dtype=torch.long)
        for r, (p, s) in enumerate(zip(ids, sampled, strict=True)):
            seq = p + s.token_ids
            input_ids[r, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            labels[r, len(p) - 1:len(seq) - 1] = torch.tensor(s.token_ids, dtype=torch.long)
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels, "advantages": advantages,
                                 "sample_ids": [p.line for p in prompts]}
        if self.iterations > 1 or self.beta != 0.0:
            was = model.training
            model.eval()
            try:
                with torch.no_grad(), self._autocast(device):
                    d_ids, d_labels = input_ids.to(device), labels.to(device)
                    if self.iterations > 1:  # the policy before this round's updates
                        batch["old_logps"] = token_logps(model, d_ids, d_labels, self.temperature)[0].cpu()
                    if self.beta != 0.0:
                        batch["ref_logps"] = self.reference_logps(d_ids, d_labels).float().cpu()
            finally:
                model.train(was)
        zero = without_spread(group_std)
        completion_tokens = float(sum(len(s.token_ids) for s in sampled))
        sums = {"reward": float(weighted.sum()), "reward_std": float(group_std.double().sum()),
                "zero_std_groups": float(zero.sum()), "groups": float(len(prompts)), "sequences": float(N),
                "completion_tokens": completion_tokens,
                "truncated": float(sum(s.truncated for s in sampled)), "rollout_seconds": seconds,
                "drawn_groups": float(len(prompts)), "dropped_groups": 0.0, "generated_tokens": completion_tokens,
                "short_groups": 0.0, **(dynamic or {})}
        batch["rollout"] = torch.tensor([sums[k] for k in ROLLOUT_SUMS] + per_func.sum(dim=0).tolist(),
                                        dtype=torch.float64)
        return batch

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        return int(tok.pad_id if tok.pad_id is not None else tok.eos_id)

    # -- the loss
    def loss(self, model: torch.nn.Module, batch: dict, device: torch.device
             ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        units = self.count(batch)
        b = to_device(batch, device)
        labels = b["labels"]
        mask = labels != IGNORE_INDEX
        logps, entropy = token_logps(model, b["input_ids"], labels, self.temperature, entropy=True)
        old = b.get("old_logps")
        per_token, kl, ratio = grpo_per_token_loss(logps, logps.detach() if old is None else old, b["advantages"],
                                                   b.get("ref_logps"), self.beta, self.eps_low, self.eps_high)
        loss_sum, _ = grpo_loss_sum(per_token, mask, self.loss_type, self.max_new_tokens)
        with torch.no_grad():
            m = mask.double()
            adv = b["advantages"].unsqueeze(1)
            clipped = ((ratio < 1 - self.eps_low) & (adv < 0)) | ((ratio > 1 + self.eps_high) & (adv > 0))
            metrics = {"_tokens": m.sum(), "_entropy": (entropy.double() * m).sum(),
                       "_clipped": (clipped.double() * m).sum()}
            if kl is not None:
                metrics["_kl"] = (kl.double() * m).sum()
            rollout = b["rollout"]
            for i, k in enumerate(ROLLOUT_SUMS):
                metrics["_" + k] = rollout[i]
            for i, name in enumerate(self.rewards.names):
                metrics["_reward/" + name] = rollout[len(ROLLOUT_SUMS) + i]
        return loss_sum, units, metrics

    def count(self, batch: dict) -> int:
        return units_of(self.loss_type, batch["labels"], self.max_new_tokens)

    def counts(self, batch: dict) -> tuple[int, int, int]:
        """(loss units of --loss-type, 0 samples without any: a completion has its stop token or max tokens,
        tokens of the rows incl. padding)."""
        return self.count(batch), 0, int(batch["input_ids"].numel())

    def uniform_loss(self, vocab_size: int) -> float:
        return 0.0  # the loss at ratio 1 with zero advantages and the policy at its reference

    def step_metrics(self, sums: dict[str, float], loss_tokens: int) -> dict[str, Any]:
        """The step's means from its sums (over micro-batches and ranks): see the module docstring."""
        seqs, groups, tokens = max(sums.get("_sequences", 0.0), 1.0), max(sums.get("_groups", 0.0), 1.0), \
            max(sums.get("_tokens", 0.0), 1.0)
        out: dict[str, Any] = {
            "reward": sums["_reward"] / seqs, "reward_std": sums["_reward_std"] / groups,
            "frac_reward_zero_std": sums["_zero_std_groups"] / groups,
            "completion_length": sums["_completion_tokens"] / seqs, "truncated_share": sums["_truncated"] / seqs,
            "entropy": sums["_entropy"] / tokens, "clip_ratio": sums["_clipped"] / tokens,
            "rollout_tok_s": sums.get("_generated_tokens", sums["_completion_tokens"]) / sums["_rollout_seconds"]
            if sums.get("_rollout_seconds") else None}
        if self.dynamic_sampling:
            out["frac_groups_dropped"] = sums.get("_dropped_groups", 0.0) / max(sums.get("_drawn_groups", 0.0), 1.0)
            short = int(sums.get("_short_groups", 0.0))
            if short:
                out["dynamic_sampling_note"] = (
                    f"{short} group(s) with reward spread still missing after --grpo-dynamic-sampling "
                    f"{self.dynamic_sampling} extra rollout calls: the step trained on {int(groups)} groups, "
                    f"{int(sums['_zero_std_groups'])} of them without spread")
        if "_kl" in sums:
            out["kl"] = sums["_kl"] / tokens
        for k, v in sums.items():
            if k.startswith("_reward/"):
                out[k[1:]] = v / seqs
        return out

    # -- guards
    def check_start(self, loss: float, uniform: float, metrics: dict[str, Any], source: str) -> str:
        """GUARD-INIT-LOSS for GRPO: at step 0 the policy IS the reference, so the KL to it is exactly 0."""
        kl = metrics.get("kl")
        if kl is not None and kl != 0.0:
            raise GuardError("GUARD-INIT-LOSS", f"the step-0 KL of the policy ({source}) to its reference is {kl:.3e}, "
                                                f"not 0: the reference is not the starting policy.",
                             "LoRA/QLoRA adapters must start at zero (B = 0); a full fine-tune's reference is a copy "
                             "of the starting weights: report this as a bug")
        text = f"step-0 KL {kl:.1f} (the reference is the start); " if kl is not None else ""
        return f"GUARD-INIT-LOSS ok: {text}step-0 reward {metrics.get('reward', float('nan')):.4f}"

    def check_first_gradient(self, grad_norm: float, trainable: int, eps: float) -> None:
        pass  # a first step of groups without spread has no policy gradient by design: frac_reward_zero_std says so

    def watch(self, record: dict[str, Any]) -> list[str]:
        return self.watcher.update(record)

    def progress_fields(self, record: dict[str, Any]) -> str:
        """The progress line's GRPO fields (the step's means, as in metrics.jsonl): the reward and its spread within
        groups, the share of trained groups without spread (no signal) and, with --grpo-dynamic-sampling, of drawn
        groups dropped for it, the KL to the reference, the entropy, the completion length and the share cut at
        --max-new-tokens."""
        return format_fields(record, PROGRESS_FIELDS)

    def watch_task(self, step: int, task: Any) -> list[str]:
        """After an --eval-task eval (Trainer.task_evaluate, `task` its TaskTracker): GUARD-REWARD-HACKING for each
        unit of the panel (a task, or a BFCL category) whose paired test against step 0 says it fell."""
        out = []
        for unit, change in task.changes(step).items():
            warning = reward_hacking(self.watcher, step, change, unit)
            if warning is not None:
                task.warnings.append({"guard": "GUARD-REWARD-HACKING", "step": step, "task": unit})
                out.append(warning)
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.watcher.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.watcher.load_state_dict(sd)


# ---- dynamic sampling (DAPO's): groups without reward spread replaced by fresh prompts ------------------------------
REQUESTS_PER_CALL_MAX = 2**20  # extra_request_seeds' room for a micro-batch's requests in one extra call


def extra_request_seeds(seed: int, extra: int, calls: int, n: int) -> list[int]:
    """The n request seeds of extra call `extra` (1..calls) of the micro-batch whose first call sampled with `seed`
    (request i: seed * n + i >= 0): negative, so none is a first call's, and distinct over (seed, extra, i)."""
    assert 1 <= extra <= calls and n <= REQUESTS_PER_CALL_MAX, (extra, calls, n)
    return [-(1 + i + REQUESTS_PER_CALL_MAX * (seed * calls + extra - 1)) for i in range(n)]


def dynamic_refill(obj: GRPOObjective, micro_batches: Sequence[Sequence[PromptExample]], ids: list[list[list[int]]],
                   parts: list[list[Sampled]], seconds: list[float], seeds: Sequence[int],
                   draw: Callable[[Sequence[int]], tuple[list[list[PromptExample]], list[int], list[int]]]
                   ) -> list[dict[str, Any]]:
    """--grpo-dynamic-sampling N (DAPO's dynamic sampling): of each micro-batch's first-call groups (`parts`), those
    whose G rewards are all equal are dropped and as many fresh prompts drawn (`draw`: the loader's cursor) and
    rolled out, every micro-batch's refills in one engine call, up to N calls; then each micro-batch trains on the
    groups with spread it has (in draw order), or, when it found none, on its last drawn groups (never empty)."""
    G = obj.G
    want = [len(prompts) for prompts in micro_batches]
    kept: list[list[tuple]] = [[] for _ in micro_batches]  # (prompt, its G ids, G completions, G x rewards)
    last: list[list[tuple]] = [[] for _ in micro_batches]
    drawn, spent, generated = [0] * len(want), [0.0] * len(want), [0] * len(want)

    def take(j: int, prompts: Sequence[PromptExample], x: list[list[int]], part: list[Sampled], secs: float) -> None:
        per_func = obj.score(prompts, part)
        _, group_std = group_advantages(obj.weighted_rewards(per_func).float(), G, "none")
        groups = [(p, x[g * G:(g + 1) * G], part[g * G:(g + 1) * G], per_func[g * G:(g + 1) * G])
                  for g, p in enumerate(prompts)]
        kept[j] += [grp for grp, flat in zip(groups, without_spread(group_std).tolist(), strict=True) if not flat]
        last[j] = groups
        drawn[j] += len(prompts)
        spent[j] += secs
        generated[j] += sum(len(s.token_ids) for s in part)

    for j, prompts in enumerate(micro_batches):
        take(j, prompts, ids[j], parts[j], seconds[j])
    for extra in range(1, obj.dynamic_sampling + 1):
        needs = [max(0, want[j] - len(kept[j])) for j in range(len(want))]
        drawn_now, before, total = draw(needs)  # under torchrun every rank's needs: the job stops refilling together
        if not any(total):
            break
        js = [j for j in range(len(want)) if needs[j]]
        fresh = [drawn_now[j] for j in js]
        xs = [[p.input_ids.tolist() for p in prompts for _ in range(G)] for prompts in fresh]
        if not js:
            continue  # this rank's groups are full; another rank's still refill
        # micro-batch j's requests numbered as in one process refilling the job's micro-batch (lower ranks first)
        new_parts, secs = obj._generate(xs, [extra_request_seeds(seeds[j], extra, obj.dynamic_sampling,
                                                                 total[j] * G)[before[j] * G:before[j] * G + len(x)]
                                             for j, x in zip(js, xs, strict=True)])
        for j, prompts, x, part, s in zip(js, fresh, xs, new_parts, secs, strict=True):
            take(j, prompts, x, part, s)
    batches = []
    for j in range(len(want)):
        groups = kept[j] or last[j]
        dynamic = {"drawn_groups": float(drawn[j]), "dropped_groups": float(drawn[j] - len(groups)),
                   "generated_tokens": float(generated[j]), "short_groups": float(want[j] - len(kept[j]))}
        batches.append(obj._batch([g[0] for g in groups], [i for g in groups for i in g[1]],
                                  [s for g in groups for s in g[2]], spent[j], torch.cat([g[3] for g in groups]),
                                  dynamic))
    return batches


# ---- guards ------------------------------------------------------------------------------------------------------
class GRPOWatch:
    """The per-step guards of GRPO (after each step's record): GUARD-GRPO-KL (the mean KL per completion token to
    the reference above --max-kl: exit 3), GUARD-GRPO-ENTROPY (the policy's entropy per token below
    ENTROPY_COLLAPSE_RATIO of its first step's and below ENTROPY_COLLAPSE_FLOOR nats, ENTROPY_COLLAPSE_STEPS steps
    in a row: a warning, once per collapse), and the rewards seen, for GUARD-REWARD-HACKING (`hacking`)."""

    def __init__(self, max_kl: float = DEFAULT_MAX_KL):
        self.max_kl = float(max_kl)
        self.first_entropy: float | None = None
        self.low_steps = 0
        self.warned = False
        self.rewards: list[tuple[int, float]] = []

    def update(self, record: dict[str, Any]) -> list[str]:
        step = int(record["step"])
        if record.get("reward") is not None:
            self.rewards.append((step, float(record["reward"])))
        kl = record.get("kl")
        if self.max_kl > 0 and kl is not None and (not math.isfinite(kl) or kl > self.max_kl):
            raise GuardError("GUARD-GRPO-KL", f"step {step}: the policy's mean KL to the reference is {kl:.4f} nats "
                                              f"per completion token, above --max-kl {self.max_kl:g}: it has moved "
                                              f"far from the model it started from (its rewards may be hacked and "
                                              f"its other skills lost).",
                             "lower --lr, raise --beta (the KL penalty), or use fewer --grpo-iterations; resume from "
                             "an earlier checkpoint with --resume PATH. --max-kl 0 turns this guard off")
        ent = record.get("entropy")
        if ent is None or not math.isfinite(ent):
            return []
        if self.first_entropy is None:
            self.first_entropy = float(ent)
            return []
        low = ent < ENTROPY_COLLAPSE_RATIO * self.first_entropy and ent < ENTROPY_COLLAPSE_FLOOR
        self.low_steps = self.low_steps + 1 if low else 0
        if not low:
            self.warned = False
        if self.low_steps >= ENTROPY_COLLAPSE_STEPS and not self.warned:
            self.warned = True
            return [(f"GUARD-GRPO-ENTROPY (warning): step {step}: the policy's entropy is {ent:.4f} nats per token, "
                    f"below {ENTROPY_COLLAPSE_RATIO:g} x its first step's {self.first_entropy:.4f} for "
                    f"{self.low_steps} steps: its completions have collapsed to (nearly) one answer per prompt, so "
                    f"the groups lose their spread and GRPO its signal. Remedy: raise --temperature, lower --lr, "
                    f"raise --beta, or stop at an earlier checkpoint")]
        return []

    def reward_trend(self, step: int) -> tuple[float, float] | None:
        """(mean reward of the first steps, of the steps just before `step`), or None with too few steps."""
        seen = [r for s, r in self.rewards if s <= step]
        if len(seen) < 2:
            return None
        k = max(1, len(seen) // 4)
        return float(np.mean(seen[:k])), float(np.mean(seen[-k:]))

    def state_dict(self) -> dict[str, Any]:
        return {"first_entropy": self.first_entropy, "low_steps": self.low_steps, "warned": self.warned,
                "rewards": self.rewards}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.first_entropy = sd.get("first_entropy")
        self.low_steps, self.warned = int(sd.get("low_steps", 0)), bool(sd.get("warned", False))
        self.rewards = [(int(s), float(r)) for s, r in sd.get("rewards", [])]


def reward_hacking(watch: GRPOWatch, step: int, change: dict[str, Any], task: str) -> str | None:
    """GUARD-REWARD-HACKING (a warning): at an --eval-task eval, the task fell significantly from step 0 (`change`:
    evaluate.paired.paired_change, GUARD-TASK-REGRESSION's exact McNemar test, verdict "regressed": p < 0.05, fewer
    problems passed) while the mean reward of the last quarter of the steps so far is above that of the first
    quarter: the policy learned the reward, not the task. None when not so."""
    trend = watch.reward_trend(step)
    if trend is None or change.get("verdict") != "regressed":
        return None
    first, last = trend
    if not last > first:
        return None
    return (f"GUARD-REWARD-HACKING (warning): step {step}: the mean reward rose from {first:.4f} (first steps) to "
            f"{last:.4f} while {task} fell from {change['passed_before']}/{change['problems']} at step 0 to "
            f"{change['passed_after']}/{change['problems']} (exact McNemar p = {change['p_value']:.3g}): the policy "
            f"is learning the reward, not the task. Remedy: check the reward for a shortcut (a format it pays for "
            f"without a right answer), raise --beta, or keep the best task checkpoint (--keep-best task)")


# ---- prompt rows -> PromptExample ---------------------------------------------------------------------------------
def prompt_messages(row: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(chat messages of the prompt, or None; a plain text prompt, or None) of a prompt row:
    {"messages": [...]} (a trailing assistant turn is the answer, not shown: `data sft-from-bfcl` rows),
    {"prompt": "text" | [messages]}, or a task row {"prompt", "test", "entry_point"} (chat-rendered as `eval --task
    humaneval` renders it, by the caller)."""
    msgs = row.get("messages")
    if isinstance(msgs, list) and msgs:
        cut = len(msgs) - 1 if isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant" else len(msgs)
        return [dict(m) for m in msgs[:cut]], None
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt:
        return prompt, None
    if isinstance(prompt, str) and prompt.strip():
        return None, prompt
    return None, None


def load_prompts(path: str | Path, tokenizer: Any, max_seq_len: int, max_new_tokens: int,
                 system: str | None = None) -> tuple[list[PromptExample], dict[str, Any]]:
    """The prompt rows of a JSONL file rendered with the chat template (tools shown where the row has "tools"),
    the generation prompt appended. Rows whose prompt leaves fewer than --max-new-tokens of --max-seq-len are skipped
    and counted; a row with no prompt is exit 2 naming file:line; none kept is exit 2."""
    from ..evaluate.tasks import problem_from_row, prompt_ids
    from ..fileio import read_jsonl

    path = Path(path)
    examples: list[PromptExample] = []
    report: dict[str, Any] = {"kind": "grpo-prompts", "path": str(path), "rows": 0, "kept": 0, "too_long": 0,
                              "max_new_tokens": max_new_tokens}
    for lineno, row in read_jsonl(path):
        report["rows"] += 1
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise InputError(f"{where}: a prompt row must be a JSON object, got {type(row).__name__}")
        try:
            if "entry_point" in row and "test" in row and isinstance(row.get("prompt"), str):
                ids = prompt_ids(problem_from_row(row, where, lineno), tokenizer, True, system)
                text = row["prompt"]
            else:
                messages, text_prompt = prompt_messages(row)
                if messages is None and text_prompt is None:
                    raise InputError(f"{where}: no prompt: a GRPO prompt row has \"messages\" (a trailing "
                                     f"assistant turn is its answer, not shown) or \"prompt\" (text or messages)")
                if messages is None:
                    messages = [{"role": "user", "content": text_prompt}]
                if row.get("tools") and not tokenizer.supports_tools():
                    raise InputError(f"the row has \"tools\" but the chat template of "
                                     f"{getattr(tokenizer, 'chat_template_source', 'the model')} does not render them, "
                                     f"so the model would never see the functions; give one that does with "
                                     f"--chat-template FILE (e.g. the packaged chatml_tools.jinja, or Qwen2.5's)")
                if system is not None and messages[0].get("role") != "system":
                    messages = [{"role": "system", "content": system}, *messages]
                ids = tokenizer.encode_chat(messages, add_generation_prompt=True, tools=row.get("tools")).ids
                text = json.dumps(messages, ensure_ascii=False) if text_prompt is None else text_prompt
        except InputError as e:
            raise InputError(str(e) if str(e).startswith(str(path)) else f"{where}: {e}") from e
        if len(ids) + max_new_tokens > max_seq_len:
            report["too_long"] += 1
            continue
        examples.append(PromptExample(np.asarray(ids, dtype=np.int32), text, row, lineno, max_new_tokens))
    report["kept"] = len(examples)
    if not examples:
        raise InputError(f"--data {path}: no prompt fits: {report['rows']} rows read, {report['too_long']} longer "
                         f"than --max-seq-len {max_seq_len} less --max-new-tokens {max_new_tokens}; raise "
                         f"--max-seq-len or lower --max-new-tokens")
    return examples, report


class PromptReport:
    """load_prompts' counts in the shape the finetune command logs and records (data_report)."""

    def __init__(self, counts: dict[str, Any]):
        self.counts = counts

    def summary_lines(self) -> list[str]:
        c = self.counts
        return [(f"data: {c['path']}: {c['kept']} prompts of {c['rows']} rows kept ({c['too_long']} skipped: prompt + "
                 f"--max-new-tokens {c['max_new_tokens']} longer than --max-seq-len)")]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.counts)


def check_grpo_run(args: Any, cfg: Any) -> Callable[..., tuple[list[PromptExample], PromptReport]]:
    """`finetune --objective grpo`'s refusals before anything loads (exit 2), and its prompt loader in the shape of
    load_sft's. No --val (rewards are logged per step; --eval-task judges held-out problems). Under torchrun
    (each rank rolls out its share of a micro-batch's prompts: GRPOLoader.shard) --scale-rewards batch (a std over
    the whole micro-batch, every rank's groups) is refused."""
    from .distributed import env_world

    world = env_world()[1]
    if world > 1 and cfg.scale_rewards == "batch":
        raise InputError(f"--scale-rewards batch under torchrun ({world} processes): each rank scales its own "
                         f"groups' advantages, and the std of the whole micro-batch would need every rank's rewards; "
                         f"use --scale-rewards group (the default) or none, or run without torchrun")
    if args.val:
        raise InputError(f"--val {args.val}: --objective grpo has no eval set (its rewards are logged per step); "
                         f"judge held-out problems with --eval-task")
    args.val_fraction = 0.0  # every prompt trains

    def load(path: str, tokenizer: Any, max_seq_len: int, **_: Any) -> tuple[list[PromptExample], PromptReport]:
        examples, counts = load_prompts(path, tokenizer, max_seq_len, cfg.max_new_tokens)
        return examples, PromptReport(counts)
    return load


def build_grpo(cfg: Any, tokenizer: Any, loader: GRPOLoader, mode: str, log: Callable[[str], None]) -> GRPOObjective:
    """The objective of `finetune --objective grpo` from the run's TrainConfig, attached to its loader."""
    from .rewards import parse_rewards

    rewards = parse_rewards(cfg.reward)
    log(f"grpo: rewards {', '.join(f'{n} x {w:g}' for n, w in zip(rewards.names, rewards.weights, strict=True))}; "
        f"{cfg.num_generations} completions per prompt, loss {cfg.loss_type}, beta {cfg.beta:g}")
    return GRPOObjective(tokenizer, rewards, mode=mode, beta=cfg.beta, num_generations=cfg.num_generations,
                         temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                         epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, iterations=cfg.grpo_iterations,
                         grad_accum=cfg.grad_accum, loss_type=cfg.loss_type, scale_rewards=cfg.scale_rewards,
                         max_kl=cfg.max_kl, dtype=cfg.dtype, loader=loader,
                         dynamic_sampling=getattr(cfg, "grpo_dynamic_sampling", 0))


__all__ = ["DEFAULT_GRPO_BETA", "LOSS_TYPES", "SCALE_REWARDS", "GRPOLoader", "GRPOObjective", "GRPOWatch",
           "PromptExample", "PromptReport", "build_grpo", "check_grpo_run", "group_advantages", "grpo_loss_sum", "grpo_per_token_loss", "load_prompts",
           "per_token_kl", "reward_hacking", "sample_completions", "token_logps"]
