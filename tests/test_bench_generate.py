"""The suite's generation rows (gen-b1/b16/b64, issue 36 item 6) failed with KeyError 'entrenar_tok_s' on the GPU:
the parent took the script's last JSON line, its summary, which holds the speed rows only under "rows". The smoke
suite ran no generation scenario, so it never met that parsing; both tests below go through run_generate."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from bench import peers
from bench import rows as R
from bench.scenarios import SCENARIOS
from bench.suite import Context
from tests.test_bench_suite import run_suite


def _script_stdout(shape: str, batch: int) -> str:
    """What bench/generate_throughput.py prints for one shape and batch (its format: start line, identity
    check, one speed row per batch, the markdown table, the summary with every row again)."""
    row = {"shape": shape, "batch": batch, "prompt_len": 128, "new_tokens": 128, "device": "NVIDIA H100",
           "dtype": "torch.bfloat16", "decoder": "static+graphs", "entrenar_tok_s": 812.5,
           "transformers_tok_s": 100.0, "ratio": 8.125, "same_greedy_tokens_rows": batch, "rows": batch}
    lines = [json.dumps({"start": True, "card": "NVIDIA H100", "shapes": shape, "batches": [batch]}),
             json.dumps({"check": "identity_fp32", "shape": shape, "identical": True}),
             json.dumps(row), "", "| shape | batch | entrenar tok/s | ...", "|---|",
             json.dumps({"ok": True, "card": "NVIDIA H100", "rows": [row], "checks": [], "errors": []})]
    return "\n".join(lines) + "\n"


def test_generation_rows_parse_the_scripts_output(monkeypatch, tmp_path):
    sc = SCENARIOS["gen-b16"]
    seen = []

    def fake_run(cmd, timeout, env):
        seen.append(cmd)
        return 0, _script_stdout("qwen2.5-0.5b", 16), ""

    monkeypatch.setattr(peers, "run_command", fake_run)
    env = {"device": "NVIDIA H100", "gpus": 1, "versions": {}, "commit": "c", "smoke": False}
    ctx = Context(env=env, work=tmp_path, smoke=False, device="cuda", gpus=1)
    ours, theirs = peers.run_generate(sc, ctx)
    assert (ours["status"], theirs["status"]) == ("ok", "ok"), ours["reason"]
    assert (ours["tokens_per_s"], theirs["tokens_per_s"]) == (812.5, 100.0)
    assert ours["baseline"] == "gen-b16-transformers" and ours["batch"] == 16 and ours["seq"] == 256
    assert R.check_row(ours) == [] and R.check_row(theirs) == []
    command = shlex.join(seen[0])  # the scenario's shape and lengths: 128 prompt + 128 new tokens
    assert "--shapes qwen2.5-0.5b --batches 16" in command and "--prompt-len 128 --new-tokens 128" in command


def test_generation_row_missing_from_the_output_is_a_failed_row_saying_so(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "run_command", lambda cmd, timeout, env: (0, _script_stdout("llama-1b", 16), ""))
    env = {"device": "NVIDIA H100", "gpus": 1, "versions": {}, "commit": "c", "smoke": False}
    ours, theirs = peers.run_generate(SCENARIOS["gen-b16"], Context(env=env, work=tmp_path, smoke=False,
                                                                    device="cuda", gpus=1))
    assert ours["status"] == theirs["status"] == "failed"
    assert "no speed row of qwen2.5-0.5b at batch 16" in ours["reason"] and R.check_row(ours) == []


def test_smoke_generation_scenario_gives_ok_rows(tmp_path):
    """`python -m bench run gen-b1 --smoke`: the script on tiny shapes on the CPU, parsed as the GPU rows are."""
    pytest.importorskip("transformers")  # the script's peer rows are transformers' generate
    out = tmp_path / "results"
    proc = run_suite("run", "gen-b1", "--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["row"]: r for r in R.read_rows(Path(out))}
    assert set(rows) == {"gen-b1", "gen-b1-transformers"}
    for row in rows.values():
        assert row["status"] == "ok", row["reason"]
        assert R.check_row(row) == [] and row["tokens_per_s"] > 0
    assert "--tiny" in rows["gen-b1"]["command"] and rows["gen-b1"]["baseline"] == "gen-b1-transformers"


def test_smoke_engine_scenario_gives_ok_rows(tmp_path):
    """`python -m bench run eng-bfcl840-smol --smoke`: bench/engine_throughput.py --tiny on the CPU, its summary line
    parsed into the engine's row (baseline: the transformers row at its best batch) and the peer's."""
    pytest.importorskip("transformers")
    out = tmp_path / "results"
    proc = run_suite("run", "eng-bfcl840-smol", "--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["row"]: r for r in R.read_rows(Path(out))}
    assert set(rows) == {"eng-bfcl840-smol", "eng-bfcl840-smol-transformers"}
    for row in rows.values():
        assert row["status"] == "ok", row["reason"]
        assert R.check_row(row) == [] and row["tokens_per_s"] > 0
    ours = rows["eng-bfcl840-smol"]
    assert "--tiny" in ours["command"] and ours["baseline"] == "eng-bfcl840-smol-transformers"
    assert ours["extra"]["workload"] == "bfcl840" and ours["extra"]["generated_tokens"] > 0
