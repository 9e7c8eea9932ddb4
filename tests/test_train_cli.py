"""`entrenar pretrain | finetune | eval | plot` end to end on tiny models (byte-level shards).

Bad input exits 2 before anything is written; a SIGKILLed CLI run resumes bit-identically through
the real PretrainLoader; the run directory has every docs/design.md file; `eval` reproduces the loop's
eval loss; final/ loads in transformers; a corrupted start trips GUARD-INIT-LOSS (exit 3).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entrenar.config import ModelConfig
from entrenar.data.corpus import pack
from entrenar.formats import save_hf_dir
from entrenar.model import CausalLM
from entrenar.train.metrics import read_jsonl
from tests.helpers.cli import run_cli as main
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.helpers.tokenizers import STDLIB, ByteTokenizer


@pytest.fixture(scope="module")
def byte_shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "json"
    pack([str(STDLIB)], ByteTokenizer(), out, val_fraction=0.3, seed=1)
    return out


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory) -> Path:
    """An HF dir whose architecture `pretrain --model DIR` trains from a random init."""
    m = tiny_causal_lm(tiny_config(vocab_size=258, hidden_size=32, intermediate_size=64, tie_word_embeddings=True,
                                   max_position_embeddings=256), 0)
    return save_hf_dir(m, tmp_path_factory.mktemp("bytemodel") / "m")


def pretrain_args(model: Path, data: Path, out: Path, steps: int = 8, extra: tuple = ()) -> list[str]:
    return ["pretrain", "--model", str(model), "--data", str(data), "--out", str(out), "--steps", str(steps),
            "--seq-len", "32", "--batch-size", "2", "--grad-accum", "2", "--lr", "3e-3", "--warmup", "2",
            "--eval-every", "4", "--eval-batches", "3", "--save-every", "3", "--seed", "4", "--json", *extra]


# ---- bad input: exit 2, nothing written -------------------------------------------------------------
@pytest.mark.parametrize("case", ["missing-data", "no-such-model", "resume-incomplete", "batch-size-0",
                                  "sft-missing-data"])
def test_bad_input_exits_2_and_writes_nothing(case, tmp_path, byte_model_dir, byte_shards, capsys):
    out = tmp_path / "run"
    if case == "missing-data":
        argv = pretrain_args(byte_model_dir, tmp_path / "nope", out)
    elif case == "no-such-model":
        argv = pretrain_args(tmp_path / "no-model", byte_shards, out)
    elif case == "batch-size-0":
        argv = pretrain_args(byte_model_dir, byte_shards, out)
        argv[argv.index("--batch-size") + 1] = "0"
    elif case == "sft-missing-data":
        argv = ["finetune", "--model", str(byte_model_dir), "--data", str(tmp_path / "x.jsonl"), "--out", str(out),
                "--json"]
    else:  # a checkpoint directory interrupted before its COMPLETE marker
        bad = tmp_path / "elsewhere" / "checkpoints" / "step-0000003.tmp"
        bad.mkdir(parents=True)
        (bad / "model.safetensors").write_bytes(b"partial")
        argv = pretrain_args(byte_model_dir, byte_shards, out, extra=("--resume", str(bad)))
    code, result, err = main(argv, capsys)
    assert code == 2, err
    assert result is not None and result["ok"] is False and result["exit_code"] == 2
    assert not out.exists(), "bad input must not create the run directory"
    expect = {"missing-data": "index.json", "no-such-model": "no such file", "batch-size-0": "--batch-size",
              "resume-incomplete": "COMPLETE", "sft-missing-data": "no such file"}[case]
    assert expect in err


def test_out_not_empty_without_resume_is_refused(tmp_path, byte_model_dir, byte_shards, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "something").write_text("x")
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out), capsys)
    # issue 38 item 4: --resume auto is advised only for a run directory of ours; this folder is none
    assert code == 2 and "not a run directory" in err and "--resume auto" not in err
    assert (out / "something").read_text() == "x"


# ---- a full CLI run, SIGKILL, resume -----------------------------------------------------------------
KILL = """
import os, signal, sys, threading
from entrenar.train import loop
orig = loop.Progress.update
def update(self, step, *a, **k):
    orig(self, step, *a, **k)
    if step == {kill}:
        for t in threading.enumerate():  # the step-3 checkpoint, written in the background, is complete
            if t.name.startswith("entrenar-checkpoint-"):
                t.join()
        os.kill(os.getpid(), signal.SIGKILL)
loop.Progress.update = update
from entrenar import cli
sys.exit(cli.main({argv!r}))
"""


def test_cli_pretrain_sigkill_resume_is_exact_and_run_dir_complete(tmp_path, byte_model_dir, byte_shards, capsys):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    code, result, _ = main(pretrain_args(byte_model_dir, byte_shards, straight, steps=8), capsys)
    assert code == 0 and result["ok"]
    argv = pretrain_args(byte_model_dir, byte_shards, killed, steps=8)
    proc = subprocess.run([sys.executable, "-c", KILL.format(kill=5, argv=argv)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(killed / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    code, result, err = main(argv + ["--resume", "auto"], capsys)
    assert code == 0, err
    assert "resume: continuing from" in err and "step-0000003" in err
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(killed / "metrics.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    assert [r["loss"] for r in read_jsonl(straight / "eval.jsonl")] == \
        [r["loss"] for r in read_jsonl(killed / "eval.jsonl")]

    # the run directory of docs/design.md
    for name in ("run.json", "data_report.json", "preflight.json", "metrics.jsonl", "eval.jsonl",
                 "final/config.json", "final/model.safetensors", "checkpoints/latest/COMPLETE"):
        assert (straight / name).exists(), name
    run = json.loads((straight / "run.json").read_text())
    assert run["seed"] == 4 and run["config"]["grad_accum"] == 2 and run["versions"]["torch"]
    assert "git_commit" in run
    assert json.loads((killed / "run.json").read_text())["resumed"]
    row = a[0]
    assert set(row) >= {"step", "loss", "lr", "grad_norm", "tokens", "tok_s", "mfu", "mem_mb"}
    assert row["loss_tokens"] == 2 * 2 * 32  # batch 2 x accumulation 2 x seq 32, every label counted

    # `entrenar eval` on the finished run reproduces the loop's last eval (the same loss function)
    last_eval = read_jsonl(straight / "eval.jsonl")[-1]
    code, ev, err = main(["eval", "--model", str(straight), "--data", str(byte_shards), "--seq-len", "32",
                          "--batch-size", "2", "--max-batches", "3", "--json"], capsys)
    assert code == 0, err
    assert ev["loss"] == pytest.approx(last_eval["loss"], rel=1e-6) and ev["tokens"] == last_eval["tokens"]
    assert ev["ppl"] == pytest.approx(math.exp(ev["loss"]))

    # `entrenar plot`
    code, pl, err = main(["plot", str(straight), "--json"], capsys)
    assert code == 0, err
    png = (straight / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000 and pl["steps"] == 8


def test_final_dir_loads_in_transformers(tmp_path, byte_model_dir, byte_shards, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=2, extra=("--no-preflight",)), capsys)
    assert code == 0, err
    assert "SKIPPED (--no-preflight)" in err
    assert json.loads((out / "preflight.json").read_text())["verify"] == {"skipped": "--no-preflight"}
    from entrenar.formats import load_model

    ours = load_model(out / "final", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out / "final"), torch_dtype=torch.float32).eval()
    ids = torch.randint(0, 258, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), hf(ids).logits
    assert float((a - b).norm() / b.norm()) < 1e-5


def test_cli_finetune_corrupted_model_trips_init_loss(tmp_path, capsys):
    """A 'pretrained' model whose weights are garbage: step-0 eval loss >= ln V -> exit 3, named."""
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=256)
    m = CausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    model_dir = save_hf_dir(m, tmp_path / "corrupt", tok)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "completion": f"{w}!"}) + "\n"
                            for w in ("one", "two", "three", "four", "five", "six")))
    out = tmp_path / "run"
    code, result, err = main(["finetune", "--model", str(model_dir), "--data", str(data), "--out", str(out),
                              "--steps", "2", "--batch-size", "2", "--max-seq-len", "64", "--val-fraction", "0.34",
                              "--no-preflight", "--json"], capsys)
    assert code == 3, err
    assert result["guard"] == "GUARD-INIT-LOSS" and "no better than uniform" in err
    assert not (out / "metrics.jsonl").exists() and not (out / "final").exists()
    assert json.loads((out / "data_report.json").read_text())["val_examples"] == 2


def test_cli_bf16_pure_checks_fp32_then_trains_and_saves_bf16(tmp_path, byte_model_dir, byte_shards, capsys):
    """--dtype bf16-pure through the CLI: the step-0 preflight runs (on the fp32 weights, as bf16), then the
    weights, checkpoints and final/ are bf16 (config dtype bfloat16) and final/ loads in transformers."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    out = tmp_path / "run"
    code, summary, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=3, extra=("--dtype", "bf16-pure")),
                              capsys)
    assert code == 0, err
    assert "verify" in json.loads((out / "preflight.json").read_text())
    assert {t.dtype for t in load_file(str(out / "final" / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    ckpt = load_file(str(out / "checkpoints" / "latest" / "model.safetensors"))
    assert {t.dtype for t in ckpt.values()} == {torch.bfloat16}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out / "final"))
    assert next(hf.parameters()).dtype == torch.bfloat16 and summary["final_train_loss"] is not None


def test_cli_profile_writes_the_profiled_steps_and_marks_them(tmp_path, byte_model_dir, byte_shards, capsys):
    """--profile 2:2 profiles steps 2 and 3 of the real CLI run: RUN/profile.json has per-step wall time and
    operator time by class (matmuls among them), metrics.jsonl marks exactly those steps profiled."""
    out = tmp_path / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=4, extra=("--profile", "2:2")),
                              capsys)
    assert code == 0, err
    prof = json.loads((out / "profile.json").read_text())
    assert prof["steps"] == [2, 3] and prof["device"] == "cpu"
    assert prof["wall_ms_per_step"] > 0 and prof["kernel_ms_per_step"] > 0
    assert prof["by_class_ms"].get("matmul", 0) > 0 and prof["top_kernels_ms"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r.get("profiled")] == [2, 3]
    assert "profile of steps 2-3" in err


@pytest.mark.parametrize("spec, message", [("3:4", "past --steps 4"), ("0", "must be >= 1"), ("a:b", "START")])
def test_cli_profile_outside_the_run_or_malformed_exits_2(spec, message, tmp_path, byte_model_dir, byte_shards,
                                                           capsys):
    out = tmp_path / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=4, extra=("--profile", spec)), capsys)
    assert code == 2 and message in err, err
    assert not (out / "profile.json").exists()


def test_profile_summary_on_cuda_counts_kernels_once():
    """On a GPU the profiler's table holds CPU operators whose device total repeats their kernels' time
    (aten::mm 10 ms over its gemm kernel's 10 ms): only kernel rows count, else ms/step is inflated several-fold
    (seen on an H200: 5,248 'kernel ms' in a 179 ms step)."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    from entrenar.train.profiling import summarize

    events = [E(key="aten::mm", device_type=DeviceType.CPU, device_time_total=10_000.0, self_cpu_time_total=50.0),
              E(key="nvjet_sm90_tst_256x128", device_type=DeviceType.CUDA, device_time_total=10_000.0,
                self_cpu_time_total=0.0),
              E(key="Optimizer.step#AdamW.step", device_type=DeviceType.CPU, device_time_total=4_000.0,
                self_cpu_time_total=900.0),
              E(key="void multi_tensor_apply_kernel<FusedAdam>", device_type=DeviceType.CUDA,
                device_time_total=4_000.0, self_cpu_time_total=0.0)]
    s = summarize(events, steps=2, wall_s=0.016, on_cuda=True)
    assert s["kernel_ms_per_step"] == 7.0 and s["by_class_ms"] == {"matmul": 5.0, "optimizer": 2.0}
    assert s["idle_ms_per_step"] == 1.0 and [k for k, _ in s["top_kernels_ms"]] == [
        "nvjet_sm90_tst_256x128", "void multi_tensor_apply_kernel<FusedAdam>"]
    # NCCL kernels (another stream, overlapping compute) are their own class, outside the compute total; their
    # names hold "Gather"/"Reduce", which must not make them embedding or reduction kernels (a 4-GPU FSDP run)
    nccl = [E(key="ncclDevKernel_AllGather_RING_LL", device_type=DeviceType.CUDA, device_time_total=6_000.0,
              self_cpu_time_total=0.0),
            E(key="ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", device_type=DeviceType.CUDA,
              device_time_total=2_000.0, self_cpu_time_total=0.0)]
    s = summarize(events + nccl, steps=2, wall_s=0.016, on_cuda=True)
    assert s["by_class_ms"]["communication (nccl)"] == 4.0 and s["communication_ms_per_step"] == 4.0
    assert s["kernel_ms_per_step"] == 7.0 and s["idle_ms_per_step"] == 1.0 and "embedding" not in s["by_class_ms"]
