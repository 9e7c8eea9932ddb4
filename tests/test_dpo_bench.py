"""bench/dpo_throughput.py --smoke on the CPU (the GPU run is the lead's): the real CLI and TRL's DPOTrainer on the
same tiny random weights and rows, full and LoRA, so the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.cli import ROOT, child_env

pytest.importorskip("trl")


def test_smoke_rows_for_both_runners_and_modes(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "dpo_throughput.py"), "--smoke", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=400, env=child_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    runs = {(r["runner"], r["mode"]): r for r in rows if "runner" in r}
    assert set(runs) == {(a, m) for a in ("entrenar-cli", "trl-dpotrainer") for m in ("full", "lora")}
    for r in runs.values():
        assert r["tokens_per_s"] > 0 and r["smoke"] is True and r["preset"] == "tiny", r
    for mode in ("full", "lora"):
        ours, trl = runs[("entrenar-cli", mode)], runs[("trl-dpotrainer", mode)]
        assert ours["padding_free"] is True
        # the same rows through the same chat template: TRL's completion adds the template's newline only
        assert abs(ours["tokens_per_pair"] - trl["tokens_per_pair"]) <= 0.05 * trl["tokens_per_pair"]
    assert sorted(r["mode"] for r in rows if r.get("ratio") == "entrenar/trl") == ["full", "lora"]
