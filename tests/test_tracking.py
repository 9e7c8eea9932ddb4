"""`pretrain|finetune --report-to tensorboard,mlflow,wandb` (train/reporting.py): every metrics.jsonl and
eval.jsonl number reaches each tracker, read back by the tracker's own reader (TensorBoard's EventAccumulator, the
MLflow client on the run's sqlite store, W&B's offline .wandb records parsed with wandb's protobuf classes) and
equal to the logs; the config goes as params, curves.png and samples.jsonl as artifacts; a missing package is exit
2 naming its extra before anything is written.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from entrenar.train.metrics import read_jsonl
from entrenar.train.reporting import TRACKERS, flat_params, scalars, tracker_key
from tests import test_distributed, test_train_cli
from tests.helpers.cli import run_cli as main
from tests.test_eval_task import GOOD
from tests.test_train_cli import pretrain_args

byte_shards, byte_model_dir = test_train_cli.byte_shards, test_train_cli.byte_model_dir
# the tiny pretrained model and SFT rows of test_distributed (module-scoped there)
base_model, sft_data = test_distributed.base_model, test_distributed.sft_data


def expected_series(run: Path) -> dict[str, dict[int, float]]:
    """{tracker key: {step: value}} from metrics.jsonl and eval.jsonl, by the documented key rule."""
    out: dict[str, dict[int, float]] = {}
    for kind in ("metrics", "eval"):
        for row in read_jsonl(run / f"{kind}.jsonl"):
            prefix = f"task/{row['task']}" if "task" in row else ("train" if kind == "metrics" else "eval")
            for key, value in scalars(row, prefix).items():
                out.setdefault(key, {})[row["step"]] = value
    return out


# ---- W&B's offline run file: a LevelDB-style log of wandb's protobuf Records ---------------------------------
def wandb_records(path: Path) -> list:
    """The Records of a .wandb file: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each
    with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, buf, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # the zero padding of a block's end
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
    return records


def wandb_history(run: Path) -> tuple[dict[str, dict[int, float]], dict, set[str]]:
    """({key: {step: value}} of the history records' numbers, the run's config, every history key) of RUN/wandb's
    one offline run."""
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    series: dict[str, dict[int, float]] = {}
    config: dict = {}
    keys: set[str] = set()
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = int(items.pop("_step"))
            keys.update(items)
            for key, value in items.items():
                if not key.startswith("_") and isinstance(value, (int, float)):
                    series.setdefault(key, {})[step] = float(value)
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return series, config, keys


def test_scalars_flatten_rows_by_the_documented_key_rule():
    row = {"step": 3, "task": "bfcl:simple_python", "metric": "accuracy", "accuracy": 0.5, "passed": 1,
           "categories": {"simple_python": {"accuracy": 0.5}}, "pass@1": 0.25, "skipped": False, "x": None}
    got = scalars(row, "task/bfcl:simple_python")
    assert got == {"task/bfcl_simple_python/accuracy": 0.5, "task/bfcl_simple_python/passed": 1.0,
                   "task/bfcl_simple_python/categories/simple_python/accuracy": 0.5,
                   "task/bfcl_simple_python/pass_1": 0.25, "task/bfcl_simple_python/skipped": 0.0}
    assert tracker_key("rewards/chosen") == "rewards/chosen"
    assert flat_params({"config": {"lr": 0.001, "report_to": ["wandb"]}, "lora": {"rank": 4}}) == {
        "config.lr": "0.001", "config.report_to": '["wandb"]', "lora.rank": "4"}


def test_report_to_all_three_trackers_read_back_equal_to_the_logs(tmp_path, byte_model_dir, byte_shards, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({**GOOD, "task_id": f"t{i}"}) + "\n" for i in range(2)))
    out = tmp_path / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, steps=4, extra=(
        "--no-preflight", "--report-to", "tensorboard,mlflow", "--report-to", "wandb", "--sample-prompts",
        str(prompts), "--sample-max-new-tokens", "4", "--eval-task", str(tasks), "--eval-task-max-new-tokens",
        "4")), capsys)
    assert code == 0, err
    assert "reporting to tensorboard" in err and "mlflow (sqlite:///" in err and "wandb (" in err
    want = expected_series(out)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tok_s", "eval/loss", "eval/ppl"} <= set(want)
    assert sorted(want["train/loss"]) == [1, 2, 3, 4] and sorted(want["eval/loss"]) == [0, 4]
    assert sorted(want["task/tasks.jsonl/pass_1"]) == [0, 4] and "task/tasks.jsonl/problems" in want

    # TensorBoard: its own event reader on RUN/tb (values stored as float32)
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(want) <= tags, set(want) - tags
    for key, series in want.items():
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got.keys() == series.keys(), key
        assert all(math.isclose(got[s], v, rel_tol=1e-6, abs_tol=1e-30) for s, v in series.items()), key
    text_tags = set(acc.Tags()["tensors"])
    assert {"config/text_summary", "samples/text_summary"} <= text_tags, text_tags

    # MLflow: the client on the run's local sqlite store
    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    [run] = client.search_runs([client.get_experiment_by_name("entrenar").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    for key, series in want.items():
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} == series, key
    saved = json.loads((out / "run.json").read_text())
    assert run.data.params["config.lr"] == json.dumps(saved["config"]["lr"])
    assert run.data.params["config.report_to"] == '["tensorboard", "mlflow", "wandb"]'
    assert run.data.params["data.data"] == str(byte_shards)
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"curves.png", "samples.jsonl", "samples", "step-0000000.jsonl", "step-0000004.jsonl"} <= artifacts, \
        artifacts  # the task tables too
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # W&B: the offline run's records, through wandb's own protobuf classes
    history, config, keys = wandb_history(out)
    for key, series in want.items():
        assert history.get(key) == series, key
    assert config["config"]["lr"] == saved["config"]["lr"] and config["data"]["data"] == str(byte_shards)
    assert "samples/_type" in keys  # the step's completions, as an HTML text


@pytest.mark.parametrize("tracker", TRACKERS)
def test_a_missing_tracker_package_is_exit_2_naming_its_extra(tracker, tmp_path, byte_model_dir, byte_shards,
                                                              capsys, monkeypatch):
    from entrenar.train import reporting

    monkeypatch.setattr(reporting, "_checked", set())
    monkeypatch.setitem(sys.modules, tracker, None)  # `import tracker` raises ImportError
    out = tmp_path / "run"
    code, js, err = main(pretrain_args(byte_model_dir, byte_shards, out, extra=("--report-to", tracker)), capsys)
    assert code == 2 and js["exit_code"] == 2
    assert f"pip install 'entrenar[{tracker}]'" in err and f"--report-to {tracker}" in err
    assert not out.exists()  # refused before the run directory is made


@pytest.mark.parametrize("flags, expect", [
    (("--report-to", "comet"), "--report-to 'comet' is not a tracker: use tensorboard, mlflow, wandb"),
    (("--mlflow-uri", "sqlite:///x.db"), "--mlflow-uri sqlite:///x.db applies to --report-to mlflow"),
])
def test_bad_report_flags_are_exit_2(flags, expect, tmp_path, byte_model_dir, byte_shards, capsys):
    out = tmp_path / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, extra=flags), capsys)
    assert code == 2 and expect in err, err
    assert not out.exists()


def test_only_rank_0_opens_trackers(tmp_path):
    pytest.importorskip("tensorboard")
    from types import SimpleNamespace

    from entrenar.train.metrics import JsonlLog, NullLog
    from entrenar.train.reporting import start_reporting

    def trainer(is_main: bool, run_dir: Path) -> SimpleNamespace:
        run_dir.mkdir()
        log = JsonlLog(run_dir / "metrics.jsonl") if is_main else NullLog()
        return SimpleNamespace(strategy=SimpleNamespace(kind="ddp"), ctx=SimpleNamespace(is_main=is_main),
                               cfg=SimpleNamespace(report_to=["tensorboard"], mlflow_uri=None), run_dir=run_dir,
                               run_config={"lr": 0.1}, log=lambda text: None, metrics_log=log, eval_log=log,
                               message=lambda text: None)
    other = trainer(False, tmp_path / "rank1")
    assert start_reporting(other, None) == (None, None) and not (other.run_dir / "tb").exists()
    main_rank = trainer(True, tmp_path / "rank0")
    tracking, _ = start_reporting(main_rank, None)
    assert tracking is not None and main_rank.metrics_log.tracking is tracking and (main_rank.run_dir / "tb").is_dir()
    tracking.close(True)


def test_a_failing_tracker_is_named_once_and_dropped(tmp_path):
    from entrenar.train.reporting import Tracking

    class Broken:
        name = "mlflow"

        def log_scalars(self, step, values):
            raise OSError("disk full")

    class Kept:
        name = "tensorboard"

        def __init__(self):
            self.rows: list = []

        def log_scalars(self, step, values):
            self.rows.append((step, values))

        def log_artifact(self, path):
            pass

        def close(self, ok):
            self.ok = ok

    said: list[str] = []
    kept = Kept()
    tracking = Tracking([Broken(), kept], tmp_path, said.append)
    for step in (1, 2):
        tracking.log_row("train", {"step": step, "loss": 1.0 / step})
    tracking.close(False)
    assert kept.rows == [(1, {"train/loss": 1.0}), (2, {"train/loss": 0.5})] and kept.ok is False
    assert len(said) == 1 and "--report-to mlflow: logging failed (OSError: disk full)" in said[0]


def test_a_run_stopped_at_step_0_with_trackers_can_be_started_again(tmp_path, capsys):
    """The trackers' files of a run that never reached step 1 (GUARD-INIT-LOSS: a random model is no better than
    uniform) do not block a retry in the same --out: they go with the run's other pre-step files."""
    pytest.importorskip("tensorboard")
    from entrenar.formats import save_hf_dir
    from tests.helpers.models import tiny_causal_lm, tiny_config
    from tests.helpers.tokenizers import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    cfg = tiny_config("qwen2", vocab_size=len(tokenizer), max_position_embeddings=1024, tie_word_embeddings=False)
    model = save_hf_dir(tiny_causal_lm(cfg, 0), tmp_path / "m", tokenizer=tokenizer)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"add {i} and {i}"},
                                                     {"role": "assistant", "content": f"{2 * i}"}]}) + "\n"
                            for i in range(4)))
    out = tmp_path / "run"
    argv = ["finetune", "--model", str(model), "--data", str(rows), "--out", str(out), "--mode", "full", "--steps",
            "2", "--batch-size", "2", "--val-fraction", "0", "--no-preflight", "--report-to", "tensorboard", "--json"]
    code, js, err = main(argv, capsys)
    assert code == 3 and js["guard"] == "GUARD-INIT-LOSS", err
    assert (out / "tb").is_dir() and not (out / "curves.png").exists()  # no step row: nothing drawn
    code, js, err = main(argv, capsys)
    assert code == 3 and "holds a run that never reached step 1" in err, err


def test_under_torchrun_only_rank_0_reports_and_samples(tmp_path, base_model, sft_data):
    """Two ranks (DDP on gloo): one TensorBoard event file, its train/loss the job's metrics.jsonl; each prompt
    sampled once per sampled step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_distributed import finetune_args, ok

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Count to 3 in words.\nCount to 2 in words.\n")
    out = tmp_path / "ddp"
    ok(test_distributed.run_cli(finetune_args(base_model, sft_data, out, 2, (
        "--parallel", "ddp", "--report-to", "tensorboard", "--sample-prompts", str(prompts), "--sample-every", "5",
        "--sample-max-new-tokens", "3")), nproc=2))
    assert len(list((out / "tb").glob("events.out.tfevents.*"))) == 1
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    rows = read_jsonl(out / "metrics.jsonl")
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [r["step"] for r in rows] == list(range(1, 11))
    assert [e.value for e in events] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    samples = read_jsonl(out / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in samples] == [(s, p) for s in (0, 5, 10) for p in (
        "Count to 3 in words.", "Count to 2 in words.")]
