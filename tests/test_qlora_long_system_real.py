"""Issue 24 part 4 (bench/qlora_e2e.py) at small size: QLoRA with the seeds' setup on the packaged SmolLM2.

The sample carries bench/qlora_system_prompt.txt (> 1,500 tokens: the setup an earlier trainer's 512-token
loss window silently trained nothing on) at --max-seq-len 2048, --rank 256 (above k/v_proj's 192: trains, with a
warning) and --lr auto. Checked: the step trains all of the sample's assistant tokens, as `data check` counts
them, on a sequence holding the whole system prompt; the loss is finite; and `export gguf` of the QLoRA run (the
adapter merged onto its NF4 weights) gives llama.cpp the greedy tokens `entrenar generate` gives of the run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from entrenar.tokenizer import load_tokenizer
from tests.test_export_gguf import llama_cpp, llama_cpp_greedy
from tests.test_peft_real import run_json as run_cli

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
SYSTEM_PROMPT = Path(__file__).resolve().parents[1] / "bench" / "qlora_system_prompt.txt"
SOURCE = '''def mean(values):
    """Return the arithmetic mean of a non-empty list of numbers."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)
'''


def test_qlora_long_system_prompt_trains_every_answer_and_exports_to_llama_cpp(tmp_path, capsys):
    tok = load_tokenizer(MODEL)
    system_tokens = len(tok.encode(SYSTEM_PROMPT.read_text()))
    assert system_tokens >= 1500, system_tokens
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "stats.py").write_text(SOURCE)
    data = tmp_path / "sft.jsonl"
    code, _ = run_cli(["data", "sft-from-code", "--out", str(data), "--system-prompt-file", str(SYSTEM_PROMPT),
                       str(tmp_path / "src")], capsys)
    assert code == 0
    code, check = run_cli(["data", "check", "--model", MODEL, "--data", str(data), "--max-seq-len", "2048"], capsys)
    report = check["report"]
    assert code == 0 and report["kept"] == 1 and report["eot_trained"] == 1, report

    run = tmp_path / "run"
    # q/k/v only: rank 256 on every linear is 78M adapter parameters (more than half the model) for nothing the
    # test needs; k/v_proj (576 -> 192) are what the rank check is about
    argv = ["finetune", "--model", MODEL, "--mode", "qlora", "--rank", "256", "--lr", "auto", "--data", str(data),
            "--targets", "q_proj,k_proj,v_proj", "--val-fraction", "0", "--max-seq-len", "2048", "--batch-size", "1",
            "--steps", "1", "--seed", "0", "--no-preflight", "--out", str(run)]
    code = __import__("entrenar.cli", fromlist=["main"]).main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "warning: --rank 256 is above the smaller dimension of k_proj (192), v_proj (192)" in captured.err
    steps = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and math.isfinite(steps[0]["loss"])
    assert steps[0]["tokens"] > system_tokens, "the system prompt was cut from the sequence"
    # the step trains every assistant token of the sample (the 512-token window trained none)
    assert steps[0]["loss_tokens"] == report["loss_tokens"]["total"] > 20
    assert steps[0]["lr"] > 0 and json.loads((run / "final" / "entrenar_adapter.json").read_text())[
        "trained_against"] == "nf4"

    gguf = tmp_path / "run.gguf"
    code, exported = run_cli(["export", "gguf", str(run), str(gguf), "--type", "f32"], capsys)
    assert code == 0 and exported["adapters_merged"] > 0, exported
    prompt = "Write a Python function that returns the larger of two numbers."
    code, ours = run_cli(["generate", "--model", str(run), "--prompt", prompt, "--chat", "--max-new-tokens", "24"],
                         capsys)
    assert code == 0
    ids = tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True).ids
    theirs = llama_cpp_greedy(llama_cpp(gguf, n_ctx=len(ids) + 32, f32_cache=True), ids, 24, set(tok.stop_ids))
    assert theirs == ours["token_ids"], (tok.decode(theirs), ours["text"])
