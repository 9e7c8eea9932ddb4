"""The benchmark suite (`python -m bench`, issue 26 part 5) on the CPU in --smoke: one entrenar CLI scenario and
one peer that cannot run here (a skipped row carrying why), each row in the one schema, and the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import rows as R
from bench.scenarios import GROUPS, SCENARIOS, resolve

REPO = Path(__file__).resolve().parents[1]


def run_suite(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_smoke_cli_row_and_skipped_peer_row(tmp_path):
    out = tmp_path / "results"
    proc = run_suite("run", "q05-cli-default", "q05-liger-bf16", "--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["q05-cli-default.json", "q05-liger-bf16.json", "run.json", "table.md"], files
    rows = {r["row"]: r for r in R.read_rows(out)}
    for row in rows.values():
        assert R.check_row(row) == [], row
        assert set(row) == set(R.FIELDS)
        assert row["smoke"] is True and row["device"] == "cpu" and row["model"] == "tiny"
        assert row["versions"]["torch"] and row["commit"]

    cli = rows["q05-cli-default"]
    assert cli["status"] == "ok", cli["reason"]
    assert cli["runner"] == "entrenar-cli"
    assert " -m entrenar pretrain --model tiny " in cli["command"] and "--json" in cli["command"]
    assert "--dtype" not in cli["command"]  # the default path: no flag
    assert cli["tokens_per_s"] > 0 and cli["seconds_per_step"] > 0
    assert cli["batch"] == 2 and cli["seq"] == 64 and cli["steps"] == 3 and cli["warmup"] == 1
    # tokens/s is the median over the steps after the warm-up, read from the run's metrics.jsonl, without the
    # step the CLI's --profile slowed (step 3 in --smoke); its profile.json rides along in the row
    assert cli["extra"]["steps_measured"] == 1
    assert "--profile 3:1" in cli["command"] and cli["extra"]["profile"]["steps"] == [3, 3]
    assert cli["extra"]["dtype_run"] == "fp32"  # --dtype auto on a CPU

    peer = rows["q05-liger-bf16"]
    assert peer["status"] == "skipped" and peer["runner"] == "transformers+liger"
    assert "not importable" in peer["reason"] or "needs a CUDA GPU" in peer["reason"], peer["reason"]
    assert peer["tokens_per_s"] is None and " -m bench.peers liger " in peer["command"]

    table = (out / "table.md").read_text()
    assert "**smoke**" in table
    lines = [ln for ln in table.splitlines() if ln.startswith("| q05-")]
    assert len(lines) == 2 and lines[0].split("|")[1].strip() == "q05-cli-default"
    assert lines[0].rstrip().endswith("| ok |") and lines[1].rstrip().endswith("| skipped |")
    assert f"`q05-liger-bf16` skipped: {peer['reason'][:60]}" in table
    run = json.loads((out / "run.json").read_text())
    assert run["scenarios"] == ["q05-cli-default", "q05-liger-bf16"] and run["smoke"] is True


def test_a_spent_budget_skips_the_rest_and_says_so(tmp_path):
    proc = run_suite("run", "q05-cli-default", "--smoke", "--budget-s", "10", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = R.read_rows(tmp_path)
    assert row["status"] == "skipped" and "--budget-s 10 spent" in row["reason"] and R.check_row(row) == []


def test_unknown_scenario_exits_2_and_list_names_every_scenario_and_group():
    proc = run_suite("run", "no-such-scenario", "--smoke", timeout=60)
    assert proc.returncode == 2 and "no-such-scenario" in proc.stderr
    listing = run_suite("--list", timeout=60).stdout
    for name in [*SCENARIOS, *GROUPS]:
        assert f"  {name} " in listing, name


def test_groups_resolve_to_known_scenarios_once():
    every = resolve(["issue25"])
    assert [s.name for s in every] == list(dict.fromkeys(s.name for s in every))
    assert {s.name for s in every} == set(SCENARIOS)
    for sc in SCENARIOS.values():
        assert sc.baseline is None or sc.baseline in SCENARIOS, sc.name
    with pytest.raises(KeyError):
        resolve(["issue25", "nope"])


def test_check_row_rejects_rows_outside_the_schema():
    sc = SCENARIOS["q05-cli-default"]
    env = {"device": "cpu", "versions": {}, "commit": "x", "smoke": True}
    good = R.new_row(sc, env, status="ok", tokens_per_s=10.0)
    assert R.check_row(good) == []
    assert R.check_row({**good, "status": "done"})  # not a status
    assert R.check_row({**good, "status": "failed"})  # failed without a reason
    assert R.check_row({**good, "tokens_per_s": None, "seconds_per_step": None})  # ok without a number
    assert R.check_row({k: v for k, v in good.items() if k != "command"})  # a field missing
    assert R.check_row({**good, "batch": "8"})  # wrong type
    with pytest.raises(AssertionError):
        R.new_row(sc, env, tok_s=1.0)  # not a field


def test_table_ratio_against_the_baseline_row():
    env = {"device": "cpu", "gpus": 0, "versions": {"torch": "x"}, "commit": "c", "smoke": False,
           "started_utc": "t"}
    peer = R.new_row(SCENARIOS["q05-liger-bf16"], env, status="ok", tokens_per_s=100.0)
    ours = R.new_row(SCENARIOS["q05-cli-bf16-pure"], env, status="ok", tokens_per_s=130.0)
    table = R.table([peer, ours], env)
    line = next(ln for ln in table.splitlines() if ln.startswith("| q05-cli-bf16-pure "))
    assert "| 1.30x transformers+liger |" in line
