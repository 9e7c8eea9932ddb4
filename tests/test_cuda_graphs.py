"""CUDA graphs of the training step (train/cuda_graphs.py), on the CPU under ReplayedStep (tests/helpers/graphs.py:
torch.cuda.CUDAGraph's contract: the capture records the forward+backward's aten ops, each replay re-runs them on
the recorded tensors, Python values read at capture stay frozen, host reads fail the capture). A run whose
micro-batches replay captured graphs gives the eager run's losses, gradient norms and weights bit for bit, with
gradient accumulation, a loss-token total that changes every step, evals between steps and several batch shapes;
and --cuda-graphs resolves as documented (auto: on only where the step can be captured; on: exit 2 elsewhere)."""

from __future__ import annotations

import pytest
import torch

from entrenar.errors import InputError
from entrenar.model import CausalLM
from entrenar.train import cuda_graphs as cg
from entrenar.train.metrics import read_jsonl
from entrenar.train.objective import CausalLMLoss
from tests.helpers.graphs import ReplayedStep
from tests.test_train_loop import make_samples, run, tiny_model


@pytest.fixture
def cpu_step_graphs(monkeypatch):
    """StepGraphs captures with ReplayedStep on the CPU. The token-id range check is a host read that the
    model makes only for CPU inputs (on CUDA it is skipped), so it is off here."""
    monkeypatch.setattr(cg, "capture", lambda fn, pool: ReplayedStep(fn))
    monkeypatch.setattr(cg, "warmup", lambda fn, device: fn())
    monkeypatch.setattr(CausalLM, "_check_ids", lambda self, ids: None)
    # the eager references apply the head at every position, as a run with graphs does (tests/test_head_at.py)
    monkeypatch.setattr(CausalLMLoss, "head_at", False)
    made: list[cg.StepGraphs] = []
    original = cg.StepGraphs.__init__

    def remember(self, *a, **kw):
        original(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(cg.StepGraphs, "__init__", remember)
    return made


def _trained(tmp_path, name, graphs: str, **kw):
    model = tiny_model()
    run(tmp_path / name, model=model, cuda_graphs=graphs, cuda_graphs_reason="as the test sets it", **kw)
    rows = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r and "step" in r]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows], model.state_dict()


# lengths 9..12 in batches of 4: T is 12 in almost every batch, while the loss-token total changes each step
SAME_T = {"train_samples": make_samples(32, seed=4, min_len=9, max_len=12), "batch_size": 4}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_replayed_steps_equal_the_eager_run_bit_for_bit(tmp_path, cpu_step_graphs, grad_accum):
    eager_rows, eager_weights = _trained(tmp_path, "eager", "off", steps=8, grad_accum=grad_accum, eval_every=3,
                                         **SAME_T)
    graph_rows, graph_weights = _trained(tmp_path, "graphs", "on", steps=8, grad_accum=grad_accum, eval_every=3,
                                         **SAME_T)
    (graphs,) = cpu_step_graphs
    assert graphs.static_grads and graphs.captured, "no graph was captured: the comparison would be eager vs eager"
    assert graphs.released and not graphs.graphs  # freed when fit() returned (before a process group is left)
    assert graphs.replays >= (8 - cg.WARMUP_STEPS - 1) * grad_accum - 2, graphs.state()
    assert graph_rows == eager_rows
    for k, v in eager_weights.items():
        assert torch.equal(graph_weights[k], v), k


def test_each_batch_shape_gets_its_graph_and_shapes_past_the_limit_run_eagerly(tmp_path, cpu_step_graphs,
                                                                                monkeypatch):
    monkeypatch.setattr(cg, "MAX_SHAPES", 2)
    ragged = {"train_samples": make_samples(32, seed=2, min_len=3, max_len=17), "batch_size": 2}
    eager_rows, eager_weights = _trained(tmp_path, "eager", "off", steps=10, **ragged)
    graph_rows, graph_weights = _trained(tmp_path, "graphs", "on", steps=10, **ragged)
    (graphs,) = cpu_step_graphs
    assert graphs.captured == 2 and graphs.refused, graphs.state()  # more than two shapes in 10 steps
    assert graph_rows == eager_rows
    for k, v in eager_weights.items():
        assert torch.equal(graph_weights[k], v), k


def test_a_loss_scale_frozen_at_capture_would_be_caught(tmp_path, cpu_step_graphs, monkeypatch):
    """The scale is a device scalar filled before each replay: left at the capture step's 1 / total, the replayed
    steps' gradients are scaled by another step's token count (the loss-token total changes every step here)."""
    eager_rows, _ = _trained(tmp_path, "eager", "off", steps=6, **SAME_T)
    graph_rows, _ = _trained(tmp_path, "graphs", "on", steps=6, **SAME_T)
    assert graph_rows == eager_rows
    calls = []
    monkeypatch.setattr(cg.StepGraphs, "set_scale", staticmethod(
        lambda t, inv: calls.append(inv) or (t.fill_(inv) if len(calls) == 1 else None)))  # the capture's only
    frozen_rows, _ = _trained(tmp_path, "frozen", "on", steps=6, **SAME_T)
    assert len(set(calls)) > 1 and cpu_step_graphs[-1].replays > 0
    assert frozen_rows[:cg.WARMUP_STEPS + 1] == eager_rows[:cg.WARMUP_STEPS + 1]
    assert frozen_rows != eager_rows


def test_gradients_set_to_none_after_a_capture_break_the_replays(tmp_path, cpu_step_graphs, monkeypatch):
    """Why static_grads: the captured backward adds into the gradient tensors it was recorded with."""
    eager_rows, _ = _trained(tmp_path, "eager", "off", steps=6, **SAME_T)
    monkeypatch.setattr(cg.StepGraphs, "static_grads", property(lambda self: False, lambda self, v: None),
                        raising=False)
    graph_rows, _ = _trained(tmp_path, "graphs", "on", steps=6, **SAME_T)
    assert cpu_step_graphs[0].replays > 0
    assert graph_rows[:cg.WARMUP_STEPS + 1] == eager_rows[:cg.WARMUP_STEPS + 1]
    assert graph_rows != eager_rows


# ---- --cuda-graphs resolution -----------------------------------------------------------------------------
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(("kw", "why"), [
    ({"device": torch.device("cpu")}, "not CUDA"),
    ({"world_size": 2, "parallel": "fsdp"}, "2 processes under FSDP"),
    ({"world_size": 4, "parallel": "hsdp"}, "4 processes under HSDP"),
    ({"objective": "dpo"}, "objective dpo"),
    ({"dtype": "bf16-weights"}, "--dtype bf16-weights"),
    ({"dtype": "fp8"}, "--dtype fp8"),
    ({"offload": True}, "--offload-activations"),
    ({"dropout": 0.1}, "dropout in"),
])
def test_auto_is_off_with_the_reason_where_the_step_cannot_be_captured_and_on_is_exit_2(kw, why):
    from entrenar.peft import apply_lora

    model = tiny_model()
    if kw.pop("dropout", 0):
        apply_lora(model, rank=2, alpha=4, dropout=0.1)
    args = {"device": CUDA, "world_size": 1, "dtype": "bf16", "objective": "causal-lm", "model": model,
            "offload": False, **kw}
    on, reason = cg.graph_decision("auto", **args)
    assert not on and why in reason and reason.startswith("--cuda-graphs auto")
    with pytest.raises(InputError, match="--cuda-graphs on: cannot capture.*" + why.replace("-", r"\-")[:8]):
        cg.graph_decision("on", **args)
    assert cg.graph_decision("off", **args) == (False, "--cuda-graphs off as given")


@pytest.mark.parametrize("dtype", cg.GRAPHABLE_DTYPES)
def test_auto_is_on_for_one_cuda_process_training_a_causal_lm(dtype):
    on, reason = cg.graph_decision("auto", CUDA, 1, dtype, "causal-lm", tiny_model(), False)
    assert on and "one CUDA process" in reason
    assert cg.graph_decision("on", CUDA, 1, dtype, "causal-lm", tiny_model(), False)[0]


def test_auto_is_on_for_replicas_under_torchrun():
    """--parallel ddp (or auto resolving to it) under torchrun: the step is captured, the replicas' gradients are
    all-reduced after the replay (ReplicaStrategy)."""
    on, reason = cg.graph_decision("auto", CUDA, 4, "bf16", "causal-lm", tiny_model(), False, parallel="ddp")
    assert on and "4 replicas, gradients all-reduced in buckets by the replayed backward" in reason


def test_a_library_trainer_on_the_cpu_resolves_auto_to_off_and_records_why(tmp_path):
    from entrenar.train.loop import TrainConfig, build_trainer
    from tests.test_train_loop import ListLoader

    cfg = TrainConfig(steps=2, batch_size=2, seq_len=32, device="cpu")
    trainer = build_trainer(tiny_model(), ListLoader(make_samples(8), 2), ListLoader(make_samples(4), 2), cfg,
                            tmp_path / "r", log=lambda text: None)
    assert trainer.graphs is None and cfg.cuda_graphs == "off"
    assert trainer.run_config["cuda_graphs_reason"] == "--cuda-graphs auto: device cpu is not CUDA"


def test_auto_is_off_for_batches_of_ever_new_shapes_and_on_still_captures_them():
    """finetune without --pad-buckets pads each batch to its longest row: auto says so and stays off; on captures
    (the first MAX_SHAPES shapes, the rest eagerly)."""
    varying = cg.varying_shapes("finetune", 0)
    assert "longest row" in varying and cg.varying_shapes("finetune", 4) is None
    assert cg.varying_shapes("pretrain", 0) is None
    # padding-free rows are padded to a few lengths for the graphs in one process whose attention is the varlen
    # kernel's; under torchrun (each rank's own row) and in fp32 (spans attended one by one) they vary
    assert cg.varying_shapes("finetune", 0, padding_free=True) is None
    assert "torchrun" in cg.varying_shapes("finetune", 0, padding_free=True, world_size=2)
    assert "fp32" in cg.varying_shapes("finetune", 0, padding_free=True, dtype="fp32")
    on, reason = cg.graph_decision("auto", CUDA, 1, "bf16", "causal-lm", tiny_model(), False, varying)
    assert not on and reason == f"--cuda-graphs auto: {varying}"
    assert cg.graph_decision("on", CUDA, 1, "bf16", "causal-lm", tiny_model(), False, varying)[0]
    # a reason the step cannot be captured at all comes first
    assert "not CUDA" in cg.graph_decision("auto", torch.device("cpu"), 1, "bf16", "causal-lm", tiny_model(), False,
                                           varying)[1]


def test_lora_finetune_with_pad_buckets_replays_and_equals_the_eager_run(tmp_path, cpu_step_graphs, monkeypatch,
                                                                          capsys):
    """The finetune command's path: LoRA adapters (frozen base), SFT batches padded to --pad-buckets lengths, the
    step captured per bucket (graph_decision forced on: the CPU is never on by itself)."""
    import json

    from entrenar.cli.main import main
    from tests.test_peft_seed import tiny_base_and_data

    base, data = tiny_base_and_data(tmp_path / "base")

    def losses(name: str, graphs: str) -> list[tuple[float, float]]:
        out = tmp_path / name
        code = main(["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--mode", "lora",
                     "--steps", "6", "--batch-size", "2", "--max-seq-len", "128", "--pad-buckets", "2",
                     "--cuda-graphs", graphs, "--no-preflight", "--json"])
        assert code == 0, capsys.readouterr().err[-2000:]
        run_json = json.loads((out / "run.json").read_text())["config"]
        assert run_json["cuda_graphs"] == graphs
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r and "step" in r]

    eager = losses("eager", "off")
    monkeypatch.setattr(cg, "graph_decision", lambda requested, *a, **k: (requested == "on", "forced by the test"))
    replayed = losses("graphs", "on")
    (graphs,) = cpu_step_graphs[-1:]
    assert graphs.replays > 0 and graphs.captured >= 1, graphs.state()
    assert replayed == eager


def test_padding_free_finetune_pads_rows_for_the_graphs_and_equals_the_eager_run(tmp_path, cpu_step_graphs,
                                                                                  monkeypatch, capsys):
    """finetune --padding-free with the step in graphs: rows padded to graph_row_length (a span of padding), a
    graph per row length, max_seqlen handed to each replay; the losses, gradient norms and counted tokens of the
    eager run of exact rows. (The stand-in fails a capture on a host read: each span's causal SDPA reads the
    spans' bounds, so attention here is the doc-id mask, the varlen kernel's result without a host read.)"""
    import json

    import torch.nn.functional as F

    from entrenar import varlen
    from entrenar.cli.main import main
    from tests.test_peft_seed import WORDS, tiny_base_and_data

    base, data = tiny_base_and_data(tmp_path / "base")
    rows = [{"prompt": " ".join([f"Say {w}."] * (1 + i % 3)), "completion": f"{w}!"} for i, w in enumerate(WORDS)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: list[int] = []

    def attend(self, q, k, v):
        seen.append(self.max_seqlen)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense(), enable_gqa=q.shape[1] != k.shape[1])
        return y.transpose(1, 2)

    monkeypatch.setattr(varlen.VarlenSpans, "attend", attend)
    monkeypatch.setattr(varlen.VarlenSpans, "attend_per_span", attend)

    def run_losses(name: str, graphs: str) -> tuple[list[tuple[float, float]], dict]:
        out = tmp_path / name
        code = main(["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--mode", "lora",
                     "--steps", "8", "--batch-size", "3", "--max-seq-len", "128", "--padding-free", "--val-fraction",
                     "0", "--cuda-graphs", graphs, "--no-preflight", "--json"])
        assert code == 0, capsys.readouterr().err[-2000:]
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in recs if "loss" in r and "step" in r]
        return [(r["loss"], r["grad_norm"]) for r in steps], {"tokens": sum(r["tokens"] for r in steps)}

    eager, eager_counts = run_losses("eager", "off")
    assert cpu_step_graphs == [] or not cpu_step_graphs[-1].captured
    monkeypatch.setattr(cg, "graph_decision", lambda requested, *a, **k: (requested == "on", "forced by the test"))
    seen.clear()
    replayed, counts = run_losses("graphs", "on")
    graphs = cpu_step_graphs[-1]
    assert graphs.captured >= 1 and graphs.replays >= 1, graphs.state()
    assert graphs.captured + len(graphs.refused) <= 3  # 8 steps of 3 short rows: a row length or two, not 8
    assert all(m >= 128 for m in seen)  # the max_seqlen of rows padded for graphs: max(max_seq_len, T // 4)
    assert counts == eager_counts  # the real tokens: the padding span is not counted
    assert len(replayed) == len(eager) == 8
    for (a, ga), (b, gb) in zip(replayed, eager):
        assert abs(a - b) <= 1e-5 * abs(b) and abs(ga - gb) <= 1e-4 * abs(gb), (replayed, eager)
