"""Experiment tracking (`pretrain|finetune --report-to tensorboard,mlflow,wandb`): the one place a run's numbers
reach TensorBoard, MLflow and Weights & Biases.

`Tracking` is fed where the logs are written: `JsonlLog.write` (train/metrics.py) hands it every metrics.jsonl
and eval.jsonl row as written (non-finite values already None), so whatever a row carries (loss, lr, grad_norm,
tok_s, mfu, rewards/..., a task eval's metric and per-category counts) reaches every tracker under one key:

    train/<key>  a step's row        eval/<key>  an eval.jsonl row        task/<task>/<key>  an --eval-task row

nested dicts flattened with "/" (task/bfcl/categories/simple_python/accuracy), booleans as 0/1, `None` (a
non-finite value) and strings left out; any character outside letters, digits and `_-./ ` becomes `_` (MLflow's
key rule, applied to every tracker so one name means one series everywhere: pass@1 -> pass_1). At the start the
run's configuration (run.json's config, lora and data) goes as params; at the end curves.png (drawn then),
the task tables (RUN/task_eval/*.jsonl) and samples.jsonl go as artifacts, and the tracker runs are closed.

One class per backend, each with `log_scalars(step, values)`, `log_params(params)`, `log_text(step, key, text)`,
`log_artifact(path)` and `close(ok)`; each package is an optional extra, checked before training
(`require_trackers`: exit 2 naming the extra). Only rank 0 of a torchrun job reports. A tracker that fails
mid-run is said once on stderr and dropped: the training is worth more than its chart.
"""

from __future__ import annotations

import html
import importlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..errors import InputError

TRACKERS = ("tensorboard", "mlflow", "wandb")
# tracker -> (modules it imports, the extra of pyproject.toml that installs them)
_NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "torch.utils.tensorboard"), "tensorboard"),
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow"),  # sqlalchemy/alembic: the default sqlite store
    "wandb": (("wandb",), "wandb"),
}
TB_DIR, WANDB_DIR, MLFLOW_DB, MLFLOW_ARTIFACTS = "tb", "wandb", "mlflow.db", "mlartifacts"
EXPERIMENT = "entrenar"  # the MLflow experiment / W&B project runs are reported under
_KEY_CHARS = re.compile(r"[^A-Za-z0-9_\-./ ]")
_PARAM_VALUE_MAX = 6000  # MLflow's limit on a param's value
_checked: set[str] = set()


def require_trackers(names: list[str]) -> None:
    """Each tracker's packages import, else exit 2 naming the extra that installs them (before the run starts)."""
    for name in names:
        if name in _checked:
            continue
        modules, extra = _NEEDS[name]
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise InputError(f"--report-to {name} needs the {module} package ({type(e).__name__}: {e}): "
                                 f"pip install 'entrenar[{extra}]'") from None
        _checked.add(name)


def tracker_key(key: str) -> str:
    return _KEY_CHARS.sub("_", key)


def scalars(record: dict[str, Any], prefix: str) -> dict[str, float]:
    """The numbers of a metrics/eval row under `prefix` (see the module docstring); "step" is the step."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or key == "nonfinite":
            continue
        name = f"{prefix}/{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name))
        elif isinstance(value, (bool, int, float)):  # a bool as 0/1
            out[tracker_key(name)] = float(value)
    return out


def row_prefix(kind: str, record: dict[str, Any]) -> str:
    """train | eval | task/<task> (a metrics.jsonl row with a "task" key is an --eval-task row)."""
    if "task" in record:
        return f"task/{record['task']}"
    return kind


def flat_params(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {"lora.rank": "16", ...}: strings (JSON for lists), at most MLflow's value length."""
    out: dict[str, str] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, name + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[tracker_key(name)] = text[:_PARAM_VALUE_MAX]
    return out


class Tracker(Protocol):
    name: str

    def log_scalars(self, step: int, values: dict[str, float]) -> None: ...
    def log_params(self, params: dict[str, str]) -> None: ...
    def log_text(self, step: int, key: str, text: str) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def close(self, ok: bool) -> None: ...


# ---- the backends ---------------------------------------------------------------------------------------
class TensorBoardTracker:
    """Event files in RUN/tb (torch.utils.tensorboard): scalars, the config and samples as text, curves.png
    as an image, the task tables as text."""

    name = "tensorboard"

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / TB_DIR))

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def log_params(self, params: dict[str, str]) -> None:
        table = "| param | value |\n|---|---|\n" + "".join(f"| {k} | {v.replace('|', '/')} |\n"
                                                          for k, v in params.items())
        self.writer.add_text("config", table, 0)

    def log_text(self, step: int, key: str, text: str) -> None:
        self.writer.add_text(key, text, step)

    def log_artifact(self, path: Path) -> None:
        if path.suffix == ".png":
            from matplotlib.image import imread

            self.writer.add_image(f"files/{path.name}", imread(str(path)), 0, dataformats="HWC")
        else:  # a task table: its lines as text (TensorBoard has no file store)
            self.writer.add_text(f"files/{path.name}", "    " + path.read_text().replace("\n", "\n    "), 0)

    def close(self, ok: bool) -> None:
        self.writer.close()


class MLflowTracker:
    """One MLflow run (MlflowClient: no global state) in --mlflow-uri, by default a sqlite store RUN/mlflow.db
    with its artifacts in RUN/mlartifacts (MLflow 3 refuses a new ./mlruns file store)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, uri: str | None):
        import logging

        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their INFO lines on creating the sqlite store's tables
            logging.getLogger(name).setLevel(logging.WARNING)
        artifacts = None
        if uri is None:
            uri = f"sqlite:///{(run_dir / MLFLOW_DB).resolve()}"
            artifacts = (run_dir / MLFLOW_ARTIFACTS).resolve().as_uri()
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment is not None else \
            self.client.create_experiment(EXPERIMENT, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.resolve().name,
                                             tags={"entrenar.run_dir": str(run_dir.resolve())}).info.run_id

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in values.items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # and at most 100 params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_text(self, step: int, key: str, text: str) -> None:
        self.client.log_text(self.run_id, text, f"{key}/step-{step:07d}.txt")

    def log_artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class WandbTracker:
    """A W&B run in offline mode (no network: `wandb sync RUN/wandb/offline-run-*` uploads it later), its files
    in RUN/wandb; the end's files as one artifact."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=EXPERIMENT, name=run_dir.resolve().name, dir=str(run_dir), mode="offline",
                              config=config, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        self.files: list[Path] = []

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_params(self, params: dict[str, str]) -> None:
        pass  # the config went to wandb.init (W&B's params)

    def log_text(self, step: int, key: str, text: str) -> None:
        self.run.log({key: self.wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def log_artifact(self, path: Path) -> None:
        self.files.append(path)

    def close(self, ok: bool) -> None:
        if self.files:
            artifact = self.wandb.Artifact(f"run-{self.run.id}-files", type="run-files")
            for path in self.files:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if ok else 1)


# ---- the hub ------------------------------------------------------------------------------------------------
class Tracking:
    """The run's trackers: rows from the logs, texts from the sample generations, the end's artifacts."""

    def __init__(self, trackers: list[Any], run_dir: Path, say: Callable[[str], None]):
        self.trackers, self.run_dir, self.say = trackers, Path(run_dir), say
        self.closed = False

    def _each(self, what: str, call: Callable[[Any], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 -- said, and that tracker dropped: the run goes on
                self.trackers.remove(tracker)
                self.say(f"warning: --report-to {tracker.name}: {what} failed ({type(e).__name__}: {e}); "
                         f"no more reports to {tracker.name} this run (metrics.jsonl has everything)")

    def log_row(self, kind: str, record: dict[str, Any]) -> None:
        """A metrics.jsonl (kind "train") or eval.jsonl (kind "eval") row, as written."""
        values = scalars(record, row_prefix(kind, record))
        if values and "step" in record:
            self._each("logging", lambda t: t.log_scalars(int(record["step"]), values))

    def log_params(self, params: dict[str, str]) -> None:
        self._each("logging the config", lambda t: t.log_params(params))

    def log_text(self, step: int, key: str, text: str) -> None:
        self._each("logging text", lambda t: t.log_text(step, key, text))

    def artifacts(self) -> list[Path]:
        """What the end sends: curves.png (drawn now), the task tables, samples.jsonl."""
        found: list[Path] = []
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size > 0:
            from ..plot import plot_run

            try:
                found.append(Path(plot_run(self.run_dir)["out"]))
            except Exception as e:  # noqa: BLE001 -- said; the other artifacts still go (a stop at step 0: no row)
                self.say(f"--report-to: no curves.png ({type(e).__name__}: {e})")
        found += sorted((self.run_dir / "task_eval").glob("*.jsonl"))
        samples = self.run_dir / "samples.jsonl"
        if samples.is_file():
            found.append(samples)
        return found

    def close(self, ok: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if self.trackers:
            for path in self.artifacts():
                self._each(f"sending {path.name}", lambda t, path=path: t.log_artifact(path))
        self._each("closing", lambda t: t.close(ok))


def run_params(run_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The configuration to report: run.json's config, lora and data (the command wrote it), else `config`."""
    path = run_dir / "run.json"
    if path.is_file():
        run = json.loads(path.read_text())
        return {"config": run.get("config", config), **{k: run[k] for k in ("lora", "data") if run.get(k)}}
    return {"config": config}


def open_tracking(names: list[str], run_dir: Path, config: dict[str, Any], mlflow_uri: str | None,
                  say: Callable[[str], None]) -> Tracking | None:
    """The trackers of --report-to, opened and given the run's configuration; None without any. Rank 0 only."""
    if not names:
        return None
    require_trackers(names)
    run_dir = Path(run_dir)
    params = run_params(run_dir, config)
    trackers: list[Any] = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir))
        elif name == "mlflow":
            trackers.append(MLflowTracker(run_dir, mlflow_uri))
        else:
            trackers.append(WandbTracker(run_dir, params))
    where = {"tensorboard": f"{run_dir / TB_DIR}", "wandb": f"{run_dir / WANDB_DIR} (offline)",
             "mlflow": next((t.uri for t in trackers if t.name == "mlflow"), "")}
    say("reporting to " + ", ".join(f"{n} ({where[n]})" for n in names))
    tracking = Tracking(trackers, run_dir, say)
    tracking.log_params(flat_params(params))
    return tracking


def start_reporting(trainer: Any, samples: Any | None) -> tuple[Tracking | None, Any | None]:
    """The Trainer's trackers (rank 0, --report-to) fed by its metrics/eval logs, and its sample generator bound
    to the run; the last step of building a Trainer, so nothing after it can leave tracker runs open."""
    if samples is not None and trainer.strategy.kind == "fsdp":
        raise InputError("--sample-prompts is not supported under FSDP2 (generating from sharded weights would need "
                         "every rank to decode in lock step): use --parallel ddp where the model fits, or generate "
                         "from the checkpoints with `entrenar generate`")
    tracking = None
    if trainer.ctx.is_main:
        tracking = open_tracking(trainer.cfg.report_to, trainer.run_dir, trainer.run_config, trainer.cfg.mlflow_uri,
                                 trainer.log)
        trainer.metrics_log.tracking = trainer.eval_log.tracking = tracking
    if samples is not None:
        samples.bind(trainer.run_dir, trainer.ctx.is_main, tracking, trainer.message)
    return tracking, samples
