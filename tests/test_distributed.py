"""`torchrun --nproc-per-node 2 -m entrenar finetune ...` on CPU (gloo) against one process.

Each run is the real CLI in a subprocess (with a timeout, on a free port). The global batch is
the same in every comparison: 2 ranks x --batch-size 2 == 1 process x --batch-size 4, both with
--grad-accum 2, on SFT samples of unequal length (so averaging per rank instead of by the global
token count would show). fp32 throughout.

  - FSDP and DDP: per-step losses within 1e-5 relative, final/ within 1e-5 relL2 after 10 steps,
    final/ of the 2-rank run loads in transformers;
  - resume across world sizes (2 -> 1, 1 -> 2) continues within 1e-5; a changed global batch is
    refused (exit 2);
  - SIGKILL of the whole job, then --resume auto: bit-identical losses;
  - NaN on rank 1 only: every rank exits 3 with one message naming rank 1, no half checkpoint;
  - LoRA under DDP == one process (adapter weights relL2 <= 1e-5), one PEFT adapter saved.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from entrenar.fileio import read_jsonl
from entrenar.formats import save_hf_dir
from entrenar.tensors import IGNORE_INDEX, rel_l2
from tests.helpers.cli import PROCESS_TIMEOUT, child_env
from tests.helpers.cli import run_cli_process as run_cli
from tests.helpers.models import tiny_causal_lm, tiny_config

TIMEOUT = PROCESS_TIMEOUT  # seconds for one CLI run; a hang (a rank waiting on a dead peer) fails instead of blocking CI
STEPS = 10


def _env() -> dict[str, str]:
    return child_env(OMP_NUM_THREADS="1", ENTRENAR_DIST_TIMEOUT="90")


def losses(run: Path) -> list[float]:
    return [r["loss"] for _, r in read_jsonl(run / "metrics.jsonl")]


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def worst_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(rel_l2(a[n], b[n]) for n in a)


def close(a: list[float], b: list[float], rel: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b, strict=True))


# ---- data and a tiny "pretrained" model ------------------------------------------------------------
WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve")


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> Path:
    """Answers of 1 to 12 words: loss-token counts differ a lot between samples and ranks."""
    path = tmp_path_factory.mktemp("sft") / "train.jsonl"
    rows = [{"prompt": f"Count to {i % 12 + 1} in words, starting at {WORDS[i % 5]}.",
             "completion": " ".join(WORDS[(i % 5 + k) % 12] for k in range(i % 12 + 1)) + "."}
            for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, sft_data) -> Path:
    """A tiny untied model (the embedding in its own FSDP group) with the SmolLM2 tokenizer whose
    step-0 loss is far below ln(vocab), as finetune's GUARD-INIT-LOSS requires of a pretrained start:
    every embedding shares a large component u and the head rows of the data's tokens point along u."""
    from entrenar.data.sft import load_sft
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    examples, _ = load_sft(sft_data, tok, 64)
    used = sorted({int(t) for e in examples for t in e.labels if t != IGNORE_INDEX})
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, tie_word_embeddings=False,
                      max_position_embeddings=128)
    m = tiny_causal_lm(cfg, 1)
    g = torch.Generator().manual_seed(2)
    u = torch.randn(cfg.hidden_size, generator=g)
    u = u / u.norm()
    with torch.no_grad():
        m.model.embed_tokens.weight.add_(u)
        m.lm_head.weight[used] += 2.0 * u
    return save_hf_dir(m, tmp_path_factory.mktemp("base") / "tiny", tok)


def finetune_args(model: Path, data: Path, out: Path, batch: int, extra: tuple = ()) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", str(STEPS),
            "--batch-size", str(batch), "--grad-accum", "2", "--max-seq-len", "64", "--lr", "1e-3",
            "--warmup", "2", "--val-fraction", "0.2", "--eval-every", "5", "--eval-batches", "0",
            "--save-every", "5", "--seed", "3", "--device", "cpu", "--no-preflight", "--json", *extra]


def ok(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout  # one JSON line per job, whatever the number of ranks
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def single(tmp_path_factory, base_model, sft_data) -> Path:
    """The reference: one process, batch 4 x accumulation 2."""
    out = tmp_path_factory.mktemp("single") / "run"
    ok(run_cli(finetune_args(base_model, sft_data, out, 4)))
    return out


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, base_model, sft_data) -> Path:
    out = tmp_path_factory.mktemp("fsdp") / "run"
    ok(run_cli(finetune_args(base_model, sft_data, out, 2), nproc=2))
    return out


# ---- the same math as one process ------------------------------------------------------------------
def test_fsdp_two_ranks_equal_one_process(single, fsdp):
    a, b = losses(fsdp), losses(single)
    assert len(b) == STEPS and close(a, b), (a, b)
    ev_a = [r["loss"] for _, r in read_jsonl(fsdp / "eval.jsonl")]
    ev_b = [r["loss"] for _, r in read_jsonl(single / "eval.jsonl")]
    assert close(ev_a, ev_b)
    tok_a = [r["loss_tokens"] for _, r in read_jsonl(fsdp / "metrics.jsonl")]
    assert tok_a == [r["loss_tokens"] for _, r in read_jsonl(single / "metrics.jsonl")]  # global totals
    assert len(set(tok_a)) > 1  # unequal samples: the counts differ between steps
    assert worst_rel(weights(fsdp / "final/model.safetensors"), weights(single / "final/model.safetensors")) <= 1e-5
    # only rank 0 wrote the run directory's files: one line per step and eval
    assert [r["step"] for _, r in read_jsonl(fsdp / "metrics.jsonl")] == list(range(1, STEPS + 1))
    run = json.loads((fsdp / "run.json").read_text())
    assert run["config"]["parallel"] == "auto"
    assert run["distributed"] == {"world_size": 2, "parallel": "fsdp", "global_batch": 8}
    ckpt = fsdp / "checkpoints" / "latest"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["sharded"] and meta["world_size"] == 2 and (ckpt / "dcp" / ".metadata").is_file()
    # every file is in meta.json with its true sha256 (each rank hashed the shard files it wrote)
    from entrenar.fileio import sha256_file

    files = sorted(str(f.relative_to(ckpt)) for f in ckpt.rglob("*") if f.is_file() and f.name != "meta.json")
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(files)
    assert meta["sha256"] == {name: sha256_file(ckpt / name) for name in files if name != "COMPLETE"}
    assert len(json.loads((ckpt / "trainer_state.json").read_text())["rng"]["ranks"]) == 2


def test_final_of_two_ranks_loads_in_transformers(fsdp):
    transformers = pytest.importorskip("transformers")
    from entrenar.formats import load_model

    ours = load_model(fsdp / "final", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(fsdp / "final"), torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(ours(ids), hf(ids).logits) < 1e-5
    assert (fsdp / "final" / "tokenizer.json").is_file()


def test_ddp_two_ranks_equal_one_process(tmp_path, single, base_model, sft_data):
    out = tmp_path / "ddp"
    ok(run_cli(finetune_args(base_model, sft_data, out, 2, ("--parallel", "ddp")), nproc=2))
    assert close(losses(out), losses(single))
    assert worst_rel(weights(out / "final/model.safetensors"), weights(single / "final/model.safetensors")) <= 1e-5


@pytest.mark.parametrize("extra", [("--activation-checkpointing",), ("--mode", "lora", "--rank", "4", "--lr", "2e-3"),
                                   ("--mode", "lora", "--rank", "4", "--lr", "2e-3", "--padding-free")],
                         ids=["full-checkpointing", "lora", "lora-padding-free"])
def test_ddp_static_graph_one_micro_batch_equals_one_process(tmp_path, base_model, sft_data, extra):
    """A step of one micro-batch: DDP declares its graph static (parallel.DDP_OPTIONS). With the blocks
    recomputed in the backward, or only the adapters trainable (frozen parameters never reduced), two
    ranks still train what one process does with the whole batch, evals and checkpoints included. With
    --padding-free each rank trains its samples of the global batch as one row of their own (slice_spans)."""
    one, two = tmp_path / "one", tmp_path / "two"
    ok(run_cli(finetune_args(base_model, sft_data, one, 8, (*extra, "--grad-accum", "1"))))
    ok(run_cli(finetune_args(base_model, sft_data, two, 4, (*extra, "--grad-accum", "1", "--parallel", "ddp")),
               nproc=2))
    assert len(losses(one)) == STEPS and close(losses(two), losses(one))
    ev = [[r["loss"] for _, r in read_jsonl(run / "eval.jsonl")] for run in (two, one)]
    assert len(ev[0]) > 1 and close(*ev)


# ---- resume across world sizes -----------------------------------------------------------------------
def _rewind(src: Path, dst: Path, step: int) -> None:
    """A copy of a finished run as it was right after checkpoint `step`."""
    shutil.copytree(src, dst, symlinks=True)
    shutil.rmtree(dst / "final")
    for d in (dst / "checkpoints").iterdir():
        if d.name.startswith("step-") and int(d.name.split("-")[1]) > step:
            shutil.rmtree(d)
    (dst / "checkpoints" / "latest").unlink()
    (dst / "checkpoints" / "latest").symlink_to(f"step-{step:07d}")


def test_resume_two_ranks_on_one_and_one_on_two(tmp_path, single, fsdp, base_model, sft_data):
    two_to_one, one_to_two = tmp_path / "2to1", tmp_path / "1to2"
    _rewind(fsdp, two_to_one, 5)
    _rewind(single, one_to_two, 5)
    res = ok(run_cli(finetune_args(base_model, sft_data, two_to_one, 4, ("--resume", "auto"))))
    assert res["start_step"] == 5
    ok(run_cli(finetune_args(base_model, sft_data, one_to_two, 2, ("--resume", "auto")), nproc=2))
    for run in (two_to_one, one_to_two):
        assert close(losses(run), losses(single)), run
        assert worst_rel(weights(run / "final/model.safetensors"),
                         weights(single / "final/model.safetensors")) <= 1e-5
    # a different global batch does not continue the same run: refused, nothing written
    bad = tmp_path / "bad"
    _rewind(fsdp, bad, 5)
    proc = run_cli(finetune_args(base_model, sft_data, bad, 2, ("--resume", "auto")))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "global batch of 8" in proc.stderr and "--batch-size 4" in proc.stderr
    assert not (bad / "final").exists()


def test_a_shard_corrupted_on_one_ranks_share_makes_every_rank_fall_back(tmp_path, fsdp, base_model, sft_data):
    """Each rank hashes only its share of a sharded checkpoint's files; a corrupt shard that one rank finds
    is every rank's verdict: all fall back to the previous checkpoint together (none hangs in a collective,
    none resumes from the corrupt one)."""
    run = tmp_path / "run"
    _rewind(fsdp, run, STEPS)
    shard = run / "checkpoints" / f"step-{STEPS:07d}" / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = ok(run_cli(finetune_args(base_model, sft_data, run, 2, ("--resume", "auto", "--steps", str(STEPS + 2))),
                     nproc=2))
    assert res["start_step"] == 5


def test_hash_shares_split_the_files_and_share_the_verdict(tmp_path, monkeypatch):
    """verify_hashes with (rank, world, gather): this rank hashes names[rank::world] only, and a mismatch
    that another rank reports through gather is raised here too."""
    from entrenar.errors import InputError
    from entrenar.train import checkpoint as C

    names = [f"f{i}" for i in range(5)]
    for n in names:
        (tmp_path / n).write_text(n)
    meta = {"sha256": {n: C.sha256_file(tmp_path / n) for n in names}}
    hashed = []
    real = C.sha256_file
    monkeypatch.setattr(C, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    C.verify_hashes(tmp_path, names, meta, (1, 2, lambda found: [None, found]))
    assert hashed == ["f1", "f3"]
    with pytest.raises(InputError, match="f0: sha256"):
        C.verify_hashes(tmp_path, names, meta, (1, 2, lambda found: ["f0: sha256 .. corrupt", found]))
    (tmp_path / "f3").write_text("changed")
    seen = []
    with pytest.raises(InputError, match="f3: sha256"):
        C.verify_hashes(tmp_path, names, meta, (1, 2, lambda found: seen.append(found) or [None, found]))
    assert "f3" in seen[0]  # what this rank found went to the others
    hashed.clear()
    with pytest.raises(InputError, match="f3: sha256"):  # one process: every file
        C.verify_hashes(tmp_path, names, meta)
    assert hashed == ["f0", "f1", "f2", "f3"]


KILL = """
import os, signal, sys, threading, time
from entrenar.train import metrics
orig = metrics.Progress.update
def update(self, step, *a, **k):
    orig(self, step, *a, **k)
    if step == 7:  # the whole job dies at once: both ranks, no cleanup (checkpoint 5 complete)
        for t in threading.enumerate():  # the checkpoint written in the background is complete first
            if t.name.startswith("entrenar-checkpoint-"):
                t.join()
        if os.environ.get("RANK", "0") != "0":  # rank 0 writes step 7's row: a rank dying first had it lost
            rows = os.path.join(sys.argv[sys.argv.index("--out") + 1], "metrics.jsonl")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and '"step": 7,' not in open(rows).read():
                time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
metrics.Progress.update = update
from entrenar import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigkill_then_resume_auto_is_bit_identical(tmp_path, fsdp, base_model, sft_data):
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    out = tmp_path / "killed"
    argv = finetune_args(base_model, sft_data, out, 2)
    proc = run_cli(argv, nproc=2, script=str(script))
    assert proc.returncode != 0
    assert [r["step"] for _, r in read_jsonl(out / "metrics.jsonl")] == list(range(1, 8))
    assert not (out / "final").exists()
    proc = run_cli([*argv, "--resume", "auto"], nproc=2)
    assert ok(proc)["start_step"] == 5, proc.stderr[-2000:]
    assert "resume: continuing from" in proc.stderr and "step-0000005" in proc.stderr
    assert losses(out) == losses(fsdp)  # bit-identical
    assert weights(out / "final/model.safetensors").keys() == weights(fsdp / "final/model.safetensors").keys()
    a, b = weights(out / "final/model.safetensors"), weights(fsdp / "final/model.safetensors")
    assert all(torch.equal(a[n], b[n]) for n in a)


NAN = """
import os, sys
from entrenar.train.objective import CausalLMLoss
orig = CausalLMLoss.loss
calls = {"n": 0}
def loss(self, model, batch, device):
    s, n, metrics = orig(self, model, batch, device)
    if model.training and os.environ.get("RANK") == "1":
        calls["n"] += 1
        if calls["n"] == 13:  # step 7, micro-batch 1, on rank 1 only
            return s * float("nan"), n, metrics
    return s, n, metrics
CausalLMLoss.loss = loss
from pathlib import Path
from entrenar import cli
code = cli.main(sys.argv[1:])
Path(__file__).with_name(f"exit-rank{os.environ['RANK']}").write_text(str(code))  # what each rank returned
sys.exit(code)
"""


def test_nan_on_one_rank_stops_every_rank_with_exit_3(tmp_path, base_model, sft_data):
    script = tmp_path / "nan.py"
    script.write_text(NAN)
    out = tmp_path / "nan"
    proc = run_cli(finetune_args(base_model, sft_data, out, 2, ("--save-every", "4")), nproc=2, script=str(script))
    # every rank returned the guard's exit code 3 itself (not a crash, not torchrun's SIGTERM, no hang)
    assert proc.returncode == 1 and "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]
    assert [(tmp_path / f"exit-rank{r}").read_text() for r in (0, 1)] == ["3", "3"], proc.stderr[-3000:]
    assert proc.stderr.count("GUARD-NONFINITE: loss is non-finite at step 7") == 1  # one message, by rank 0
    assert "'rank 1': [" in proc.stderr and "'rank 0'" not in proc.stderr  # names the rank and its samples
    result = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert result["guard"] == "GUARD-NONFINITE" and result["exit_code"] == 3
    assert [r["step"] for _, r in read_jsonl(out / "metrics.jsonl")] == list(range(1, 7))
    # the last good state (step 6) was saved by every rank together; nothing half-written remains
    ckpts = sorted(d.name for d in (out / "checkpoints").iterdir())
    assert ckpts == ["latest", "step-0000004", "step-0000006"], ckpts
    assert all((out / "checkpoints" / d / "COMPLETE").is_file() for d in ckpts[1:])
    assert not (out / "final").exists()


PREFLIGHT = """
import os, sys
from pathlib import Path
from entrenar.errors import GuardError
from entrenar.train import commands
def preflight(args, model, tokenizer, seq_len, dtype):
    Path(args.out, "..", f"preflight-ran-on-rank-{os.environ['RANK']}").touch()
    raise GuardError("GUARD-PARITY", "planted: the probe disagrees with the reference", "none")
commands._run_preflight = preflight
from entrenar import cli
code = cli.main(sys.argv[1:])
Path(__file__).with_name(f"exit-rank{os.environ['RANK']}").write_text(str(code))  # what each rank returned
sys.exit(code)
"""


def test_preflight_runs_once_and_its_verdict_stops_every_rank(tmp_path, base_model, sft_data):
    script = tmp_path / "preflight.py"
    script.write_text(PREFLIGHT)
    out = tmp_path / "runs" / "run"
    argv = [a for a in finetune_args(base_model, sft_data, out, 2) if a != "--no-preflight"]
    proc = run_cli(argv, nproc=2, script=str(script))
    assert proc.returncode == 1 and "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]
    assert [(tmp_path / f"exit-rank{r}").read_text() for r in (0, 1)] == ["3", "3"]
    assert sorted(p.name for p in (tmp_path / "runs").glob("preflight-ran-*")) == ["preflight-ran-on-rank-0"]
    assert proc.stderr.count("GUARD-PARITY: planted") == 1
    assert not (out / "metrics.jsonl").exists()


# ---- adapters ---------------------------------------------------------------------------------------
def test_lora_ddp_two_ranks_equal_one_process(tmp_path, base_model, sft_data):
    lora = ("--mode", "lora", "--rank", "4", "--lr", "2e-3")
    one, two = tmp_path / "one", tmp_path / "two"
    ok(run_cli(finetune_args(base_model, sft_data, one, 4, lora)))
    proc = run_cli(finetune_args(base_model, sft_data, two, 2, lora), nproc=2)
    ok(proc)
    assert close(losses(two), losses(one))
    a, b = weights(two / "final/adapter_model.safetensors"), weights(one / "final/adapter_model.safetensors")
    # Not the 1e-5 of full weights: B starts at 0 and is nothing but 10 Adam updates, and Adam divides each
    # element's gradient by its own running RMS, so an element whose gradient cancels to the rounding level
    # moves by up to lr whatever the sign fp32 gave it. Two ranks sum the gradient in another order, so
    # such elements differ (1.2e-5 on an AVX2 CPU, below 1e-5 on AVX-512); a wrong reduction (per-rank
    # mean, one rank's tokens dropped) moves the losses above by > 1e-3 and these weights by > 1e-2.
    assert len(a) > 0 and worst_rel(a, b) <= 1e-4
    assert (two / "final/adapter_config.json").is_file() and not (two / "final/model.safetensors").exists()


def test_bad_parallel_choice_is_exit_2(tmp_path, base_model, sft_data):
    proc = run_cli(finetune_args(base_model, sft_data, tmp_path / "x", 4, ("--parallel", "zero")))
    assert proc.returncode == 2 and "--parallel" in proc.stderr
    assert not (tmp_path / "x").exists()


# ---- --dtype: what the matmuls see is what run.json records (issue 23) ---------------------------------
MATMUL_DTYPES = """
import os, sys
from pathlib import Path
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from entrenar import model as model_module

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
seen = set()

class Record(TorchDispatchMode):  # below autocast: sees the dtypes the kernels really get
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            seen.update(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))

forward = model_module.CausalLM.forward
def recorded(self, *a, **kw):
    with Record():
        return forward(self, *a, **kw)
model_module.CausalLM.forward = recorded
from entrenar import cli
code = cli.main(sys.argv[1:])
Path(__file__).with_name(f"matmul-dtypes-rank{os.environ.get('RANK', '0')}").write_text(" ".join(sorted(seen)))
sys.exit(code)
"""


# bf16 once per parallel kind (FSDP2 here, DDP through bf16-pure): a launch of 2 ranks costs CI ~30 s
@pytest.mark.parametrize("dtype, parallel, expect", [
    ("fp32", "fsdp", "torch.float32"), ("bf16", "fsdp", "torch.bfloat16"), ("bf16-pure", "ddp", "torch.bfloat16")])
def test_matmuls_run_in_the_dtype_run_json_records(tmp_path, base_model, sft_data, dtype, parallel, expect):
    """Two gloo ranks: every forward matmul (train and eval) gets the dtype run.json records, on each rank."""
    script = tmp_path / "record.py"
    script.write_text(MATMUL_DTYPES)
    out = tmp_path / "run"
    args = finetune_args(base_model, sft_data, out, 2, ("--dtype", dtype, "--parallel", parallel))
    args[args.index("--steps") + 1] = "2"
    ok(run_cli(args, nproc=2, script=str(script)))
    recorded = json.loads((out / "run.json").read_text())["config"]["dtype"]
    assert recorded == dtype
    for rank in (0, 1):
        assert (tmp_path / f"matmul-dtypes-rank{rank}").read_text() == expect, (dtype, parallel, rank)


def test_bf16_weights_under_torchrun_is_refused_naming_the_flag(tmp_path, base_model, sft_data):
    """bf16-weights' copies exist in the one-process step only: under torchrun the run would be a bf16
    run recorded as bf16-weights (issue 23), so it is exit 2 before anything is written."""
    out = tmp_path / "run"
    proc = run_cli(finetune_args(base_model, sft_data, out, 2, ("--dtype", "bf16-weights")), nproc=2)
    assert proc.returncode == 1 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]  # torchrun: 1; ranks: 2
    assert "--dtype bf16-weights" in proc.stderr and "--dtype bf16" in proc.stderr
    assert not out.exists()


GRAD_REDUCE = """
import os, sys
from pathlib import Path
from entrenar.train import parallel, precision

seen = []
bf16_hook = parallel._bf16_sum_hook
def spy_hook(process_group, bucket):
    seen.append("ddp-bf16:" + str(bucket.buffer().dtype))
    return bf16_hook(process_group, bucket)
parallel._bf16_sum_hook = spy_hook
policy = precision.Precision.fsdp_policy
def spy_policy(self, reduce_bf16=False):
    mp = policy(self, reduce_bf16=reduce_bf16)
    seen.append("fsdp-reduce:" + str(mp.reduce_dtype))
    return mp
precision.Precision.fsdp_policy = spy_policy
apply_ddp = parallel.apply_ddp
def spy_ddp(*args, **kwargs):
    ddp = apply_ddp(*args, **kwargs)
    seen.append(f"bucket-bytes:{ddp.bucket_bytes_cap}")
    return ddp
parallel.apply_ddp = spy_ddp
from entrenar import cli
code = cli.main(sys.argv[1:])
Path(__file__).with_name(f"reduce-rank{os.environ.get('RANK', '0')}").write_text(" ".join(sorted(set(seen))))
sys.exit(code)
"""


@pytest.mark.parametrize("parallel, expect", [("ddp", f"bucket-bytes:{3 << 20} ddp-bf16:torch.float32"),
                                              ("fsdp", "fsdp-reduce:torch.bfloat16")])
def test_grad_reduce_bf16_reaches_the_reduction(tmp_path, base_model, sft_data, parallel, expect):
    """`finetune --grad-reduce bf16 --ddp-bucket-mb 3` on two gloo ranks: DDP's buckets (fp32 gradients, --dtype
    bf16) go through the bf16 hook and are 3 MB, FSDP2's policy reduces in bf16 (no DDP), on each rank; run.json
    records both flags."""
    script = tmp_path / "record.py"
    script.write_text(GRAD_REDUCE)
    out = tmp_path / "run"
    args = finetune_args(base_model, sft_data, out, 2, ("--dtype", "bf16", "--parallel", parallel,
                                                        "--grad-reduce", "bf16", "--ddp-bucket-mb", "3"))
    args[args.index("--steps") + 1] = "2"
    ok(run_cli(args, nproc=2, script=str(script)))
    config = json.loads((out / "run.json").read_text())["config"]
    assert config["grad_reduce"] == "bf16" and config["ddp_bucket_mb"] == 3
    for rank in (0, 1):
        assert (tmp_path / f"reduce-rank{rank}").read_text() == expect, (parallel, rank)
