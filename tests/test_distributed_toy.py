"""The distributed building blocks (train/distributed.py, train/parallel.py) on 2 gloo processes.

A worker script runs a few optimizer steps by hand with the same rules the Trainer uses (global
token total summed before the backward, loss_sum / global total, SUM gradient reduction, clip by
the global norm) on unequal-length samples; its parameters must equal a single process's with
the whole global batch. Also: the data split keeps the global sample order, a sharded
torch.distributed.checkpoint written by 2 ranks loads into 1 process, run_on_main carries a
GuardError to every rank, the Trainer's sharded checkpoint written in the background equals the synchronous one.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entrenar.model import CausalLM
from entrenar.tensors import IGNORE_INDEX, rel_l2
from entrenar.train import distributed as D
from entrenar.train import parallel as P
from entrenar.train.config import DDP_BUCKET_MB
from tests.helpers.cli import child_env, run_torchrun
from tests.helpers.models import tiny_causal_lm, tiny_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, args: list[str], nproc: int = 2, timeout: int = 180) -> subprocess.CompletedProcess:
    env = child_env(OMP_NUM_THREADS="1", ENTRENAR_DIST_TIMEOUT="60")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    return run_torchrun(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


class ListLoader:
    """Right-padded token lists in a seeded order (the loaders' interface)."""

    def __init__(self, samples: list[list[int]], batch_size: int, seed: int = 0):
        self.samples, self.batch_size, self.seed = samples, batch_size, seed
        self.epoch, self.pos = 0, 0

    def next_batch(self) -> dict:
        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(self.seed)).tolist()
        idx = [order[(self.pos + i) % len(order)] for i in range(self.batch_size)]
        self.pos += self.batch_size
        seqs = [self.samples[i] for i in idx]
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        labels = torch.full((len(seqs), T), IGNORE_INDEX, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.tensor(s)
            labels[r, :len(s) - 1] = torch.tensor(s[1:])
        return {"input_ids": ids, "labels": labels, "sample_ids": idx}

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


def samples() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (int(n),), generator=g).tolist() for n in
            torch.randint(3, 24, (32,), generator=g)]


def tiny(seed: int = 0, tie: bool = True) -> CausalLM:
    return tiny_causal_lm(tiny_config(vocab_size=64, hidden_size=32, intermediate_size=64, tie_word_embeddings=tie,
                                      max_position_embeddings=128), seed)


def manual_steps(ctx: D.DistContext, parallel: str, per_rank_batch: int, accum: int, steps: int,
                 tie: bool = True, average_per_rank: bool = False,
                 grad_reduce: str = "fp32") -> tuple[P.Parallel, list[float]]:
    """The Trainer's step rules written out: count, all-reduce, backprop loss_sum / global, clip."""
    model = tiny(0, tie)
    par = P.apply_parallel(model, ctx, parallel, grad_accum=accum, grad_reduce=grad_reduce)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loader = D.shard_loader(ListLoader(samples(), per_rank_batch), ctx)
    losses = []
    for _ in range(steps):
        micro = [loader.next_batch() for _ in range(accum)]
        local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro)
        total = local if average_per_rank else ctx.sum_int(local)
        loss_sum = 0.0
        for j, b in enumerate(micro):
            with par.sync_context(j == accum - 1):
                s, _ = par.forward_module(b["input_ids"], labels=b["labels"])
                (s / total).backward()
            loss_sum += float(s.detach())
        norm = par.clip_grad_norm(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(ctx.sum_float(loss_sum) / ctx.sum_int(local))
        assert norm > 0
    return par, losses


WORKER = """
import json, sys, torch
from tests.test_distributed_toy import manual_steps, tiny
from entrenar.train import distributed as D, parallel as P
ctx = D.init_from_env("cpu")
out = sys.argv[1]
results = {{}}
for avg in (False, True):  # the rule, then the mutation: each rank divides by its own token count
    par, losses = manual_steps(ctx, "fsdp", 2, 2, 3, tie=True, average_per_rank=avg)
    results["avg" if avg else "global"] = {{"losses": losses, "params": par.full_state()}}
# DDP with its options (DDP_BUCKET_MB buckets, P.DDP_OPTIONS: gradients as bucket views), with accumulation 2
# under no_sync and without (then also a static graph)
for accum, batch in ((2, 2), (1, 4)):
    dpar, dlosses = manual_steps(ctx, "ddp", batch, accum, 3, tie=True)
    ddp = dpar.forward_module
    results[f"ddp{{accum}}"] = {{"losses": dlosses, "params": dpar.full_state(),
                               "options": {{"static_graph": bool(ddp.static_graph),
                                           "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
                                           "bucket_cap_mb": ddp.bucket_bytes_cap / 1024 ** 2}}}}
# --grad-reduce bf16: DDP's buckets and FSDP2's reduce-scatter in bf16 (one micro-batch of 4 / two of 2),
# three steps; and one backward's reduced gradients under either precision
for kind, accum, batch in (("ddp", 1, 4), ("fsdp", 2, 2)):
    bpar, blosses = manual_steps(ctx, kind, batch, accum, 3, tie=True, grad_reduce="bf16")
    results[f"{{kind}}-bf16"] = {{"losses": blosses}}
    for red in ("fp32", "bf16"):
        gm = tiny(0, True)
        gpar = P.apply_parallel(gm, ctx, kind, grad_reduce=red)
        gids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(ctx.rank))
        gs, _ = gpar.forward_module(gids, labels=gids)
        gs.backward()
        results[f"grads-{{kind}}-{{red}}"] = {{n: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor")
                                              else q.grad).detach().clone() for n, q in gm.named_parameters()}}
# QLoRA under DDP: the gradient buckets hold the adapters only (the frozen NF4 base is never reduced)
from entrenar.peft import apply_lora
reduced = []
orig_hook = P._sum_hook
def spy(process_group, bucket):
    reduced.append(bucket.buffer().numel())
    return orig_hook(process_group, bucket)
P._sum_hook = spy
qlora = apply_lora(tiny(0, True), 4, 8.0, quantize_nf4=True, seed=0)
qpar = P.apply_parallel(qlora, ctx, "auto", adapters=True)
ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(ctx.rank))
s, _ = qpar.forward_module(ids, labels=ids)
s.backward()
results["qlora"] = {{"kind": qpar.kind, "reduced": sum(reduced),
                    "trainable": sum(p.numel() for p in qlora.parameters() if p.requires_grad),
                    "total": sum(p.numel() for p in qlora.parameters())}}
# what the queued update relies on (Trainer.forward_backward -> Trainer.queue_update): the fused
# AdamW on FSDP2's DTensor shards with a plain found_inf skips (weights and step count untouched) or steps
fm = tiny(0, True)
fpar = P.apply_parallel(fm, ctx, "fsdp")
fopt = torch.optim.AdamW(fm.parameters(), lr=1e-2, fused=True)
s, _ = fpar.forward_module(ids, labels=ids)
s.backward()
before = [p.to_local().clone() for p in fm.parameters()]
fopt.found_inf = torch.ones(())
fopt.step()
skipped = all(torch.equal(a, p.to_local()) for a, p in zip(before, fm.parameters()))
step_count = float(next(iter(fopt.state.values()))["step"])
fopt.found_inf = torch.zeros(())
fopt.step()
moved = sum(not torch.equal(a, p.to_local()) for a, p in zip(before, fm.parameters()))
results["queued"] = {{"skipped": skipped, "step_count": step_count, "moved": moved,
                      "params": len(before)}}
if ctx.is_main:
    torch.save(results, out + "/result.pt")
# the Trainer's checkpoints written in the background equal the synchronous ones (tests/test_async_checkpoint.py)
from pathlib import Path
from tests.test_async_checkpoint import sharded_runs
sharded_runs(ctx, Path(out) / "ckpt")
# a sharded checkpoint of model + optimizer, written by both ranks (the per-rank-average model)
opt = torch.optim.AdamW(par.module.parameters(), lr=1e-2)
from entrenar.train import checkpoint as C
C.save_sharded(out + "/dcp", par.module, opt)
try:
    ctx.run_on_main(lambda: (_ for _ in ()).throw(__import__("entrenar.errors").errors.GuardError(
        "GUARD-TEST", "rank 0 says stop", "nothing")))
except Exception as e:
    print(f"rank {{ctx.rank}} got {{type(e).__name__}} {{e.guard_id}} exit {{e.exit_code}}", flush=True)
D.settle_ranks()  # leave together, as the CLI does after a job-wide verdict: a rank that tore the group down
D.shutdown()      # while rank 0 was still in the verdict's broadcast aborted in gloo (SIGABRT) on a loaded CPU
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("worker") / "worker.py"
    path.write_text(WORKER.format())
    return path


def _single(mode: str, tie: bool):
    torch.manual_seed(0)
    par, losses = manual_steps(D.DistContext(), mode, 4, 2, 3, tie=tie)
    return {n: p.detach().clone() for n, p in par.module.state_dict().items()}, losses


@pytest.fixture(scope="module")
def two_ranks(worker, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("toy")
    proc = torchrun(worker, [str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_two_ranks_equal_one_process_on_unequal_samples(two_ranks):
    """FSDP2 with a tied embedding (in the root group), accumulation 2, clipping active."""
    out, proc = two_ranks
    got = torch.load(out / "result.pt")["global"]
    ref_params, ref_losses = _single("fsdp", True)
    for a, b in zip(got["losses"], ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert set(got["params"]) == set(ref_params)
    assert max(rel_l2(got["params"][n], ref_params[n]) for n in ref_params) <= 1e-5
    # the guard verdict of rank 0 reached rank 1 with its id and exit code
    assert proc.stdout.count("got GuardError GUARD-TEST exit 3") == 2, proc.stdout


def test_two_ranks_write_a_sharded_checkpoint_in_the_background(two_ranks):
    """--save-mode async under torchrun: DCP's staged copy of the shards written by each rank's background writer
    (its collectives over the writers' own gloo group) while step 3 runs; every file equals the synchronous save's."""
    from tests.test_async_checkpoint import check_sharded_runs

    check_sharded_runs(two_ranks[0] / "ckpt")


def test_averaging_per_rank_is_detected(two_ranks):
    """The mutation the exactness rule exists for: each rank divides by its own token count."""
    out, _ = two_ranks
    got = torch.load(out / "result.pt")["avg"]
    ref_params, _ = _single("fsdp", True)
    assert max(rel_l2(got["params"][n], ref_params[n]) for n in ref_params) > 1e-4


@pytest.mark.parametrize("accum", [2, 1])
def test_ddp_with_its_options_equals_one_process(two_ranks, accum):
    """DDP as apply_ddp builds it (DDP_BUCKET_MB buckets, gradients as bucket views, a static graph when a step
    is one micro-batch: the options measured fastest on 4 GPUs) trains the same math as one process:
    accumulation under no_sync, the set_to_none zero_grad between steps, clipping on the bucket views."""
    got = torch.load(two_ranks[0] / "result.pt")[f"ddp{accum}"]
    assert got["options"] == {"static_graph": accum == 1, "gradient_as_bucket_view": True,
                               "bucket_cap_mb": float(DDP_BUCKET_MB)}
    torch.manual_seed(0)
    ref_params, ref_losses = _single_ddp_reference(accum)
    for a, b in zip(got["losses"], ref_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert max(rel_l2(got["params"][n], ref_params[n]) for n in ref_params) <= 1e-5


def _single_ddp_reference(accum: int):
    """One process with the global batch (2 ranks x batch 2 x accum 2, or 2 ranks x batch 4)."""
    par, losses = manual_steps(D.DistContext(), "ddp", 4 if accum == 2 else 8, accum, 3, tie=True)
    return {n: p.detach().clone() for n, p in par.module.state_dict().items()}, losses


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_bf16_gradient_reduction_is_close_to_fp32_and_not_it(two_ranks, kind):
    """--grad-reduce bf16: the reduction really runs in bf16 (the reduced gradients differ from the fp32
    reduction's, and are within bf16 rounding of them: relL2 <= 1e-2 per tensor), and three steps' losses stay
    within 1e-3 of one process on the global batch."""
    res = torch.load(two_ranks[0] / "result.pt")
    g32, g16 = res[f"grads-{kind}-fp32"], res[f"grads-{kind}-bf16"]
    assert set(g32) == set(g16) and all(g.dtype == torch.float32 for g in g16.values())
    diffs = {n: rel_l2(g16[n], g32[n]) for n in g32}
    assert max(diffs.values()) > 0, "bf16 reduction gave the fp32 reduction's gradients: it did not run in bf16"
    assert max(diffs.values()) <= 1e-2, diffs
    _, ref_losses = _single_ddp_reference(1) if kind == "ddp" else _single("fsdp", True)
    for a, b in zip(res[f"{kind}-bf16"]["losses"], ref_losses, strict=True):
        assert abs(a - b) <= 1e-3 * abs(b)


def test_qlora_ddp_reduces_only_the_adapters(two_ranks):
    """auto picks DDP for adapters; its buckets carry the LoRA tensors, not the frozen NF4 base."""
    q = torch.load(two_ranks[0] / "result.pt")["qlora"]
    assert q["kind"] == "ddp" and 0 < q["trainable"] < q["total"]
    assert q["reduced"] == q["trainable"]


def test_fused_adamw_on_shards_skips_on_found_inf(two_ranks):
    """The distributed trainer queues the update before its readback, as one process does: a non-finite
    step is skipped on the device by the fused AdamW's found_inf, on DTensor shards too."""
    q = torch.load(two_ranks[0] / "result.pt")["queued"]
    assert q["skipped"] and q["step_count"] == 0.0
    assert q["moved"] == q["params"]  # found_inf 0: every shard updated


def test_sharded_checkpoint_of_two_ranks_loads_in_one_process(two_ranks):
    out, _ = two_ranks
    want = torch.load(out / "result.pt")["avg"]["params"]
    model = tiny(9, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from entrenar.train import checkpoint as C

    C.load_sharded(out / "dcp", P.apply_parallel(model, D.DistContext(), "auto").module, opt)
    assert max(rel_l2(model.state_dict()[n], want[n]) for n in want) == 0.0
    assert len(opt.state) == len(list(model.parameters()))  # the AdamW moments came back too


def test_rank_slice_keeps_the_global_sample_order():
    """Ranks' shares of a global micro-batch, concatenated, are the single-process batch; the
    loader's position is global (the same on every rank)."""
    one = ListLoader(samples(), 6)
    ref = [one.next_batch() for _ in range(3)]
    parts = []
    for rank in range(3):
        ctx = D.DistContext(rank=rank, world=3)
        sl = D.RankSlice(ListLoader(samples(), 2), ctx)
        parts.append([sl.next_batch() for _ in range(3)])
        assert sl.state_dict() == one.state_dict() and sl.batch_size == 2
    for k in range(3):
        assert [i for r in range(3) for i in parts[r][k]["sample_ids"]] == ref[k]["sample_ids"]
        assert torch.equal(torch.cat([parts[r][k]["input_ids"] for r in range(3)]), ref[k]["input_ids"])


def test_rank_slice_counts_the_whole_step_without_a_collective():
    """Every rank's micro-batch carries the counts of the job's global batch (loss tokens, samples
    without loss tokens, tokens), so the Trainer counts a step without an all-reduce: equal to one
    process's counts of the same global batch, on every rank."""
    from entrenar.tensors import JOB_COUNTS, batch_counts
    from entrenar.train.loop import Trainer

    data = samples()
    data[3] = data[3][:1]  # one sample without a loss token (a single token has no next token)
    one = ListLoader(data, 6)
    ref = [batch_counts(one.next_batch()) for _ in range(4)]
    assert any(r[1] for r in ref)  # the empty sample is in one of these batches

    class NoCollective:
        world_size = 3

        def all_reduce_sum(self, value):
            raise AssertionError("a collective was used to count the step")

    for rank in range(3):
        sl = D.RankSlice(ListLoader(data, 2), D.DistContext(rank=rank, world=3))
        trainer = Trainer.__new__(Trainer)  # count_step needs only .reduce
        trainer.reduce = NoCollective()
        got = [sl.next_batch() for _ in range(4)]
        assert [b[JOB_COUNTS] for b in got] == ref
        assert trainer.count_step(got[:2]) == tuple(a + b for a, b in zip(ref[0], ref[1], strict=True))


def test_job_counts_include_the_dummy_row_of_a_rank_left_without_rows():
    """A global batch shorter than world x batch leaves a rank without rows; it runs one dummy row (no loss
    tokens), which the job's counts include exactly as the ranks' own shares would count it."""
    from entrenar.tensors import JOB_COUNTS, batch_counts

    class Short:
        batch_size = 2

        def next_batch(self):
            return ListLoader(samples(), 3).next_batch()  # 3 rows for 3 ranks x 2

    full = Short().next_batch()
    shares = [D.slice_rows(full, 0, 2), D.slice_rows(full, 2, 3), D.slice_rows(full, 3, 3)]
    want = tuple(sum(c) for c in zip(*(batch_counts(s) for s in shares), strict=True))
    for rank in range(3):
        got = D.RankSlice(Short(), D.DistContext(rank=rank, world=3)).next_batch()
        assert got[JOB_COUNTS] == want
    assert want[1] >= 1 and want[2] == 4 * full["input_ids"].shape[1]


def test_packed_rows_split_their_sample_ids():
    batch = {"input_ids": torch.zeros(3, 6, dtype=torch.long), "labels": torch.zeros(3, 6, dtype=torch.long),
             "doc_ids": torch.tensor([[0, 0, 1, 1, 2, -1], [0, 0, 0, 0, 0, 0], [0, 1, -1, -1, -1, -1]]),
             "sample_ids": [10, 11, 12, 13, 14, 15]}
    assert D.row_sample_ids(batch) == [[10, 11, 12], [13], [14, 15]]
    assert D.slice_rows(batch, 1, 3)["sample_ids"] == [13, 14, 15]
    empty = D.slice_rows(batch, 3, 3)  # a rank the last eval batch left without rows
    assert empty["input_ids"].shape == (1, 6) and bool((empty["labels"] == IGNORE_INDEX).all())
    assert empty["sample_ids"] == []


def test_single_process_is_untouched(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ctx = D.init_from_env("cpu")
    assert not ctx.active and ctx.is_main and ctx.all_reduce([1.5, 2.0]) == [1.5, 2.0]
    model = tiny()
    par = P.apply_parallel(model, ctx, "auto")
    assert par.kind == "single" and par.forward_module is model
    loader = ListLoader(samples(), 4)
    assert D.shard_loader(loader, ctx) is loader


def test_parallel_choice():
    assert P.resolve_parallel("auto", adapters=False) == "fsdp"  # no card memory known (CPU): shard
    assert P.resolve_parallel("auto", adapters=True) == "ddp"
    gb = 10**9
    # full training: DDP when 20 B per parameter fit a quarter of the card, FSDP2 above that
    assert P.resolve_parallel("auto", False, trainable_params=494_000_000, device_memory=80 * gb) == "ddp"
    assert P.resolve_parallel("auto", False, trainable_params=1_000_000_000, device_memory=80 * gb) == "ddp"
    assert P.resolve_parallel("auto", False, trainable_params=1_000_000_001, device_memory=80 * gb) == "fsdp"
    assert P.resolve_parallel("auto", False, trainable_params=7_600_000_000, device_memory=141 * gb) == "fsdp"
    assert P.resolve_parallel("fsdp", False, trainable_params=1000, device_memory=80 * gb) == "fsdp"
    assert P.resolve_parallel("auto", False, trainable_params=1000, device_memory=None) == "fsdp"
    from entrenar.errors import InputError

    with pytest.raises(InputError, match="--parallel"):
        P.resolve_parallel("zero3", adapters=False)
    with pytest.raises(InputError, match="ddp"):
        P.resolve_parallel("fsdp", adapters=True)


def test_parallel_for_reads_the_cards_memory_and_the_trainable_count(monkeypatch):
    """auto on CUDA: the model's trainable parameters against the card's total memory; frozen ones do
    not count (an adapter run is DDP anyway); the CPU knows no card memory (FSDP2)."""
    from types import SimpleNamespace

    model = tiny()  # ~10k parameters
    n = sum(p.numel() for p in model.parameters())
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=4 * P.DDP_BYTES_PER_PARAM * n))
    assert P.parallel_for(model, cuda, "auto", adapters=False) == "ddp"  # exactly a quarter of the card
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=4 * P.DDP_BYTES_PER_PARAM * n - 1))
    assert P.parallel_for(model, cuda, "auto", adapters=False) == "fsdp"
    for p in list(model.parameters())[: len(list(model.parameters())) // 2]:
        p.requires_grad_(False)
    assert P.parallel_for(model, cuda, "auto", adapters=False) == "ddp"
    assert P.parallel_for(model, torch.device("cpu"), "auto", adapters=False) == "fsdp"
    assert P.parallel_for(model, cuda, "fsdp", adapters=False) == "fsdp"


def test_bad_torchrun_env_is_input_error(monkeypatch):
    from entrenar.errors import InputError

    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(InputError, match="WORLD_SIZE"):
        D.init_from_env("cpu")


def test_results_are_json_safe():
    # reductions return plain floats (they go into metrics.jsonl)
    assert json.dumps(D.DistContext().all_reduce([1, 2])) == "[1.0, 2.0]"


def test_activation_checkpointing_flag_recomputes_blocks_with_the_same_losses(tmp_path, monkeypatch):
    """--activation-checkpointing (TrainConfig.activation_checkpointing) reaches the model through
    build_trainer: every block runs under torch.utils.checkpoint, and the losses do not change."""
    import torch.utils.checkpoint as ckpt

    from entrenar.train.config import TrainConfig
    from entrenar.train.loop import build_trainer

    calls = {"n": 0}
    orig = ckpt.checkpoint

    def counting(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)

    monkeypatch.setattr(ckpt, "checkpoint", counting)
    runs = {}
    for flag in (False, True):
        cfg = TrainConfig(steps=2, batch_size=4, grad_accum=1, seq_len=32, lr=1e-2, warmup=0, device="cpu",
                          eval_batches=0, activation_checkpointing=flag)
        trainer = build_trainer(tiny(0), ListLoader(samples(), 4), None, cfg, tmp_path / str(flag),
                                  log=lambda text: None)
        assert trainer.model.activation_checkpointing is flag
        runs[flag] = [r["loss"] for r in (trainer.train_step(s) for s in (1, 2))]
    assert calls["n"] == 2 * 2  # 2 steps x 2 blocks, only with the flag
    assert runs[True] == runs[False]

