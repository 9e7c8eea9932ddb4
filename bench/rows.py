"""The one JSON row schema of the benchmark suite, the environment every row records, and the table.

A row is a flat dict (`new_row` builds it, `check_row` states what it must hold). Every scenario,
entrenar's CLI or a peer, ok, failed or skipped, writes the same keys; numbers a row cannot have are
`null` (MFU of a peer that does not report FLOPs, tokens/s of a skipped row) and `reason` says why a row
is not `ok`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

SCHEMA = "entrenar-bench/1"
STATUSES = ("ok", "failed", "skipped")
REPO = Path(__file__).resolve().parents[1]

# the packages a row's numbers depend on (their versions are recorded in every row)
PACKAGES = ("torch", "triton", "transformers", "liger-kernel", "bitsandbytes", "peft", "unsloth", "torchtitan",
            "torchao")

# key -> type(s) of its value; None allowed where the tuple has type(None)
FIELDS: dict[str, tuple[type, ...]] = {
    "schema": (str,), "row": (str,), "scenario": (str,), "title": (str,), "runner": (str,),
    "model": (str,), "dtype": (str,), "batch": (int,), "seq": (int,), "gpus": (int,),
    "steps": (int, type(None)), "warmup": (int, type(None)),
    "tokens_per_s": (float, int, type(None)), "tokens_per_s_per_gpu": (float, int, type(None)),
    "seconds_per_step": (float, int, type(None)), "peak_gib": (float, int, type(None)),
    "mfu": (float, int, type(None)), "device": (str,), "versions": (dict,), "commit": (str,),
    "command": (str,), "status": (str,), "reason": (str,), "baseline": (str, type(None)),
    "smoke": (bool,), "started_utc": (str,), "wall_s": (float, int), "extra": (dict,),
}


def package_versions() -> dict[str, str | None]:
    """Installed versions (no import: a peer that is installed but breaks on import still shows here)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str:
    """The checkout's commit (+ "-dirty" when the working tree differs), or ENTRENAR_COMMIT where the
    checkout has no .git (a copied working tree on the device machine)."""
    env = os.environ.get("ENTRENAR_COMMIT")
    if env:
        return env
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=False)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True, check=False).stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def probe_device() -> dict[str, Any]:
    """The card's name and count, asked in a child process: a CUDA context in the suite's own process
    would hold device memory through every scenario."""
    code = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'device': "
            "torch.cuda.get_device_name(0) if c else 'cpu', 'gpus': torch.cuda.device_count() if c else 0}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120)
    if proc.returncode != 0:
        return {"device": "unknown", "gpus": 0, "error": proc.stderr.strip()[-300:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_folder(root: Path, device: str) -> Path:
    """bench/results/<UTC date and time>-<host>-<card>/ (a new folder per suite run)."""
    card = "".join(c if c.isalnum() else "-" for c in device.lower().replace("nvidia ", "")).strip("-") or "cpu"
    host = socket.gethostname().split(".")[0] or "host"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return root / f"{stamp}-{host}-{card}"


def new_row(scenario: Any, env: dict[str, Any], *, row: str | None = None, runner: str | None = None,
            **values: Any) -> dict[str, Any]:
    """A row of `scenario` (a scenarios.Scenario) with the run's environment; `values` override fields."""
    base: dict[str, Any] = {
        "schema": SCHEMA, "row": row or scenario.name, "scenario": scenario.name, "title": scenario.title,
        "runner": runner or scenario.runner, "model": scenario.model, "dtype": scenario.dtype,
        "batch": scenario.batch, "seq": scenario.seq, "gpus": scenario.gpus, "steps": None, "warmup": None,
        "tokens_per_s": None, "tokens_per_s_per_gpu": None, "seconds_per_step": None, "peak_gib": None,
        "mfu": None, "device": env["device"], "versions": env["versions"], "commit": env["commit"],
        "command": "", "status": "failed", "reason": "", "baseline": scenario.baseline, "smoke": env["smoke"],
        "started_utc": utc_now(), "wall_s": 0.0, "extra": {},
    }
    unknown = set(values) - set(FIELDS)
    assert not unknown, f"not row fields: {sorted(unknown)}"
    base.update(values)
    return base


def check_row(row: dict[str, Any]) -> list[str]:
    """What is wrong with a row ([] when it follows the schema)."""
    problems = [f"missing {k}" for k in FIELDS if k not in row]
    problems += [f"unknown {k}" for k in row if k not in FIELDS]
    for key, types in FIELDS.items():
        if key in row and not isinstance(row[key], types):
            problems.append(f"{key}={row[key]!r} is not {'/'.join(t.__name__ for t in types)}")
    if row.get("status") not in STATUSES:
        problems.append(f"status {row.get('status')!r} not in {STATUSES}")
    elif row["status"] == "ok" and row.get("tokens_per_s") is None and row.get("seconds_per_step") is None:
        problems.append("status ok without tokens_per_s or seconds_per_step")
    elif row["status"] != "ok" and not row.get("reason"):
        problems.append(f"status {row['status']} without a reason")
    return problems


def write_row(folder: Path, row: dict[str, Any]) -> Path:
    problems = check_row(row)
    assert not problems, f"row {row.get('row')}: {problems}"
    path = folder / f"{row['row']}.json"
    path.write_text(json.dumps(row, indent=1) + "\n")
    return path


def read_rows(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if p.name != "run.json"]


# ---- the table ---------------------------------------------------------------------------------------
def _num(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def round_of(row_id: str) -> str:
    """A row id without the round suffix suite --repeat gives later rounds (NAME-r2 -> NAME)."""
    return re.sub(r"-r\d+$", "", row_id)


def repeats_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where a row ran more than once (suite --repeat): the median per-GPU tokens/s of its ok rounds, every
    round's value, and the ratio of the medians to its baseline row's (e.g. ours / the peer's of the same
    scenario); [] when nothing repeated. Rounds are the rows of one row id (its -rN suffix dropped): a scenario
    that writes two rows (ours and a peer's, as gen-bN) has two series, never one of two rounds."""
    per: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        per.setdefault(round_of(r["row"]), []).append(r)
    if all(len(v) < 2 for v in per.values()):
        return []

    def values(name: str) -> list[float]:
        return [r["tokens_per_s_per_gpu"] for r in per.get(name, []) if r["status"] == "ok"
                and r["tokens_per_s_per_gpu"]]

    out = ["", "Median of the rounds (per GPU tokens/s; every ok round listed in run order):", "",
           "| row | rounds ok | median per GPU | rounds | vs baseline (medians) |", "|---|---:|---:|---|---:|"]
    for name, group in per.items():
        mine, base_name = values(name), group[0]["baseline"] and round_of(group[0]["baseline"])
        base = values(base_name) if base_name else []
        ratio = f"{statistics.median(mine) / statistics.median(base):.3f} of {base_name}" if mine and base else "-"
        out.append(f"| {name} | {len(mine)}/{len(group)} | {_num(statistics.median(mine) if mine else None, ',.0f')}"
                   f" | {', '.join(format(v, ',.0f') for v in mine)} | {ratio} |")
    return out


def table(rows: list[dict[str, Any]], run: dict[str, Any]) -> str:
    """table.md of one suite run: one line per row, a ratio against its baseline row (a row id: the
    scenario's name for one-row scenarios) where both ran in this folder, then why each row that is not ok is not."""
    by_row = {r["row"]: r for r in rows}
    head = (f"device **{run['device']}** x {run['gpus']}, commit `{run['commit']}`, "
            + ", ".join(f"{k} {v}" for k, v in run["versions"].items() if v) + f"; started {run['started_utc']}"
            + (" (**smoke**: tiny shapes on the CPU, the numbers mean nothing)" if run["smoke"] else ""))
    out = [head, "",
           ("| row | runner | model | dtype | batch x seq | GPUs | tokens/s | per GPU | s/step | peak GiB | MFU "
            "| vs baseline | status |"),
           "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        base = by_row.get(r["baseline"] or "")
        ratio = "-"
        if base and base is not r and r["tokens_per_s"] and base.get("tokens_per_s"):
            ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x {base['runner']}"
        mfu = f"{100 * r['mfu']:.1f}%" if isinstance(r["mfu"], (int, float)) else "-"
        out.append(f"| {r['row']} | {r['runner']} | {r['model']} | {r['dtype']} | {r['batch']} x {r['seq']} | "
                   f"{r['gpus']} | {_num(r['tokens_per_s'], ',.0f')} | {_num(r['tokens_per_s_per_gpu'], ',.0f')} | "
                   f"{_num(r['seconds_per_step'], '.3f')} | {_num(r['peak_gib'], '.2f')} | {mfu} | {ratio} | "
                   f"{r['status']} |")
    out += repeats_table(rows)
    notes = [f"- `{r['row']}` {r['status']}: {r['reason'][:400]}".replace("\n", " ") for r in rows
             if r["status"] != "ok"]
    commands = [f"- `{r['row']}`: `{r['command']}`" for r in rows if r["command"]]
    return "\n".join(out + ([""] + notes if notes else []) + ["", "Commands:", ""] + commands) + "\n"
