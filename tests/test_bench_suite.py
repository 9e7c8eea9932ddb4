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
    assert cli["extra"]["end_save_s"] > 0  # the CLI's summary: the end-of-run checkpoint and final/
    assert cli["extra"]["end_log"].startswith("end of run: checkpoint and final/ held the run")

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


def test_repeat_runs_rounds_and_the_table_gives_each_scenarios_median():
    """--repeat 3: round after round (a drift touches every scenario alike), later rounds' rows named -r2/-r3 and
    compared with their own round's baseline in the rows' table; the medians' table takes the ok rounds only."""
    from bench.suite import repeated

    one, four = SCENARIOS["l370-ddp-1gpu"], SCENARIOS["l370-ddp-4gpu-bf16-b4096"]
    assert [(sc.name, suffix) for sc, suffix in repeated([one, four], 3)] == [
        ("l370-ddp-1gpu", ""), ("l370-ddp-4gpu-bf16-b4096", ""), ("l370-ddp-1gpu", "-r2"),
        ("l370-ddp-4gpu-bf16-b4096", "-r2"), ("l370-ddp-1gpu", "-r3"), ("l370-ddp-4gpu-bf16-b4096", "-r3")]
    flags = [sc.flags for sc, _ in repeated([four], 2)]  # the profile in the first round only
    assert "--profile" in flags[0] and flags[1] == ("--grad-reduce", "bf16", "--ddp-bucket-mb", "4096", "--cuda-graphs",
                                                    "off")
    env = {"device": "cpu", "gpus": 4, "versions": {"torch": "x"}, "commit": "c", "smoke": False,
           "started_utc": "t"}
    rows = []
    for suffix, base, per_gpu in (("", 100.0, 90.0), ("-r2", 120.0, 96.0), ("-r3", 110.0, None)):
        a = R.new_row(one, env, row="l370-ddp-1gpu" + suffix, status="ok", tokens_per_s=base,
                      tokens_per_s_per_gpu=base)
        b = R.new_row(four, env, row="l370-ddp-4gpu-bf16-b4096" + suffix, status="ok" if per_gpu else "failed",
                      reason="" if per_gpu else "exit 1: boom", tokens_per_s=4 * per_gpu if per_gpu else None,
                      tokens_per_s_per_gpu=per_gpu)
        b["baseline"] = b["baseline"] + suffix
        rows += [a, b]
    table = R.table(rows, env)
    line = next(ln for ln in table.splitlines() if ln.startswith("| l370-ddp-4gpu-bf16-b4096-r2 "))
    assert "| 3.20x entrenar-cli |" in line  # 384 / 120: its own round's baseline
    medians = {ln.split("|")[1].strip(): ln for ln in table.split("Median of the rounds")[1].splitlines()
               if ln.startswith("| l370")}
    assert medians["l370-ddp-1gpu"].split("|")[2:5] == [" 3/3 ", " 110 ", " 100, 120, 110 "]
    # median of the ok rounds 90, 96 = 93 over the baseline's median 110
    assert medians["l370-ddp-4gpu-bf16-b4096"].split("|")[2:6] == [" 2/3 ", " 93 ", " 90, 96 ",
                                                                   f" {93 / 110:.3f} of l370-ddp-1gpu "]
    assert "Median of the rounds" not in R.table(rows[:2], env)  # one round: no medians' table


def test_a_row_that_stops_once_measured_kills_the_job_after_its_last_step(tmp_path):
    """stop_after_steps: the job is killed once metrics.jsonl logs the scenario's last step (a 7B speed row does
    not wait minutes for an end-of-run save it does not measure); without it the job runs to its end."""
    import time
    from types import SimpleNamespace

    from bench.cli_run import STOPPED, _measured, run_command

    metrics = tmp_path / "metrics.jsonl"
    job = [sys.executable, "-c", ("import json, sys, time\nprint('started', file=sys.stderr, flush=True)\n"
           f"for s in (1, 2, 3):\n    open({str(metrics)!r}, 'a').write(json.dumps({{'step': s}}) + '\\n')\n"
           "    time.sleep(0.2)\ntime.sleep(60)")]
    t0 = time.monotonic()
    code, _, err = run_command(job, 50, done=_measured(metrics, tmp_path, SimpleNamespace(steps=3, flags=())),
                               poll_s=0.2)
    assert code == STOPPED and time.monotonic() - t0 < 20 and "started" in err  # its stderr kept
    metrics.unlink()
    code, _, _ = run_command(job, 3, done=_measured(metrics, tmp_path, SimpleNamespace(steps=4, flags=())),
                             poll_s=0.2)
    assert code == "timeout after 3 s"  # step 4 never came: the timeout still applies
    assert SCENARIOS["q7b-cli-fp8-b4"].params.get("stop_after_steps") is True


def test_a_peer_row_is_never_a_round_of_our_scenario():
    """gen-b16 writes two rows per call, ours and transformers': one call has no medians' table (nothing repeated;
    the two rows were taken as two rounds of gen-b16, 'median per GPU' the mean of ours and the peer's), and with
    --repeat 2 each row has its own series and the ratio is our median over the peer's."""
    sc = SCENARIOS["gen-b16"]
    env = {"device": "cpu", "gpus": 1, "versions": {"torch": "x"}, "commit": "c", "smoke": False,
           "started_utc": "t"}

    def call(suffix: str, ours: float, peer: float) -> list[dict]:
        a = R.new_row(sc, env, row="gen-b16" + suffix, runner="entrenar-generate", status="ok", tokens_per_s=ours,
                      tokens_per_s_per_gpu=ours, baseline="gen-b16-transformers" + suffix)
        b = R.new_row(sc, env, row="gen-b16-transformers" + suffix, runner="transformers-generate", status="ok",
                      tokens_per_s=peer, tokens_per_s_per_gpu=peer, baseline=None)
        return [a, b]

    one = call("", 5336.0, 980.0)
    table = R.table(one, env)
    assert "Median of the rounds" not in table
    line = next(ln for ln in table.splitlines() if ln.startswith("| gen-b16 "))
    assert "| 5.44x transformers-generate |" in line
    two = one + call("-r2", 5000.0, 1000.0)
    medians = {ln.split("|")[1].strip(): ln for ln in R.table(two, env).split("Median of the rounds")[1].splitlines()
               if ln.startswith("| gen-b16")}
    assert set(medians) == {"gen-b16", "gen-b16-transformers"}
    assert medians["gen-b16"].split("|")[2:6] == [" 2/2 ", " 5,168 ", " 5,336, 5,000 ",
                                                  f" {5168 / 990:.3f} of gen-b16-transformers "]
    assert medians["gen-b16-transformers"].split("|")[2:5] == [" 2/2 ", " 990 ", " 980, 1,000 "]
