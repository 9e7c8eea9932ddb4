"""LoRA of smollm2-135m-instruct and QLoRA of qwen2.5-coder-0.5b-instruct through `entrenar finetune`.

Short CPU runs on `data sft-from-code` rows of ten one-line functions, evaluated on four held-out
ones: step-0 eval loss < ln(vocab), eval loss falls, final/ is a PEFT adapter, the adapter changes
greedy output (against the base it was trained on: NF4 for QLoRA), `eval --adapter` reproduces the
run's final eval loss, and (LoRA) resuming from the mid-run checkpoint gives bit-identical adapters
(QLoRA resume: tests/test_peft_lr.py on the tiny preset). Merge is covered on tiny models
(tests/test_peft_merge.py). Run under `flock /tmp/entrenar-real.lock`.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from entrenar import cli
from entrenar import peft as ep
from entrenar.generate import generate
from entrenar.peft.nf4_linear import enable_dequantize_once
from entrenar.tokenizer import load_tokenizer
from tests.helpers.cli import run_cli

pytestmark = pytest.mark.real_model

FUNCTIONS = [("add(a, b)", "Return the sum of a and b.", "a + b"), ("square(x)", "Return x squared.", "x * x"),
             ("is_even(n)", "Return True when n is even.", "n % 2 == 0"),
             ("first(items)", "Return the first element of items.", "items[0]"),
             ("last(items)", "Return the last element of items.", "items[-1]"),
             ("double(x)", "Return two times x.", "2 * x"), ("negate(x)", "Return minus x.", "-x"),
             ("greet(name)", "Return a greeting for name.", '"Hello, " + name'),
             ("count(items)", "Return how many items there are.", "len(items)"),
             ("half(x)", "Return x divided by two.", "x / 2")]
HELD_OUT = [("triple(x)", "Return three times x.", "3 * x"), ("is_odd(n)", "Return True when n is odd.", "n % 2 == 1"),
            ("cube(x)", "Return x cubed.", "x * x * x"), ("second(items)", "Return the second element of items.",
                                                           "items[1]")]


def run_json(argv: list[str], capsys) -> tuple[int, dict]:
    code, result, _ = run_cli([*argv, "--json"], capsys)
    return code, result or {}


def _sft_from_code(root: Path, name: str, functions: list) -> Path:
    src = root / name
    src.mkdir()
    (src / f"{name}.py").write_text("\n\n".join(f'def {sig}:\n    """{doc}"""\n    return {body}\n'
                                               for sig, doc, body in functions))
    out = root / f"{name}.jsonl"
    code = cli.main(["data", "sft-from-code", "--out", str(out), "--system-prompt-file", str(root / "system.txt"),
                     str(src)])
    assert code == 0 and len(out.read_text().splitlines()) == len(functions)
    return out


@pytest.fixture(scope="module")
def code_data(tmp_path_factory) -> tuple[Path, Path]:
    """(train JSONL, held-out JSONL) written by `entrenar data sft-from-code`."""
    root = tmp_path_factory.mktemp("code")
    (root / "system.txt").write_text("Write code.")
    return _sft_from_code(root, "train", FUNCTIONS), _sft_from_code(root, "val", HELD_OUT)


def finetune_args(model: str, data: tuple[Path, Path], out: Path, mode: str, steps: int, lr: str) -> list[str]:
    return ["finetune", "--model", model, "--data", str(data[0]), "--val", str(data[1]), "--out", str(out),
            "--mode", mode, "--rank", "8", "--alpha", "16", "--lr", lr, "--steps", str(steps), "--batch-size", "2",
            "--max-seq-len", "128", "--save-every", str(max(1, steps // 2)), "--seed", "0", "--no-preflight",
            "--eval-batches", "20",  # every val batch, as `eval` reads them (the CPU default caps a short run's)
            # GUARD-QA's decoding of the golden prompts on a real QLoRA run: tests/test_qlora_long_system_real.py
            # (here it was 33 s of Qwen's 150)
            "--on-qa-fail", "off"]


def finetune(model: str, data, run: Path, mode: str, steps: int, lr: str, capsys) -> list[dict]:
    code, result = run_json(finetune_args(model, data, run, mode, steps, lr), capsys)
    assert code == 0, result
    final = run / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    cfg = json.loads((final / "adapter_config.json").read_text())
    note = json.loads((final / "entrenar_adapter.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["base_model_name_or_path"] == model
    assert note["trained_against"] == ("nf4" if mode == "qlora" else "base weights")
    return [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]


def _prompt(sig: str, doc: str) -> list[dict]:
    user = ("Write a Python function with this signature and docstring. Reply with the complete function "
            f'only.\n\n```python\ndef {sig}:\n    """{doc}"""\n```')
    return [{"role": "system", "content": "Write code."}, {"role": "user", "content": user}]


def greedy_before_after(base_model, spec: str, run: Path, nf4_base: bool,
                        new_tokens: int = 12) -> tuple[str, str, float]:
    """Greedy text of the base the adapter was trained against (a fresh adapter: B = 0) and with it, and the
    relL2 change of the next-token logits at the prompt's end. An NF4 base is dequantized once and kept, as
    `generate` / `eval --adapter` do on the CPU (peft.load.load_model_with_adapter): the same values."""
    tok = load_tokenizer(spec)
    model = copy.deepcopy(base_model)
    cfg = json.loads((run / "final" / "adapter_config.json").read_text())
    ep.apply_lora(model, cfg["r"], cfg["lora_alpha"], targets=cfg["target_modules"], quantize_nf4=nf4_base)
    if nf4_base:
        assert enable_dequantize_once(model, budget_bytes=1 << 40) > 0
    model.eval()
    ids = tok.encode_chat(_prompt(*HELD_OUT[0][:2]), add_generation_prompt=True).ids
    with torch.no_grad():
        base_logits = model(torch.tensor([ids]))[0, -1]
    before = generate(model, tok, ids, max_new_tokens=new_tokens).text
    ep.load_adapter_weights(model, run)
    with torch.no_grad():
        tuned_logits = model(torch.tensor([ids]))[0, -1]
    after = generate(model, tok, ids, max_new_tokens=new_tokens).text
    change = ((tuned_logits - base_logits).norm() / base_logits.norm()).item()
    return before, after, change


def test_lora_smollm2_finetune_resume_eval_generate(code_data, smollm_model, tmp_path, capsys):
    spec = "smollm2-135m-instruct"
    run = tmp_path / "run"
    evals = finetune(spec, code_data, run, "lora", 4, "5e-4", capsys)
    assert evals[0]["step"] == 0 and evals[0]["loss"] < math.log(smollm_model.cfg.vocab_size)
    assert evals[-1]["loss"] < 0.8 * evals[0]["loss"]
    print(f"smollm2 LoRA: held-out eval loss {evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f}")

    # resume from the step-2 checkpoint of a copy: same adapter bits, same losses
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed, symlinks=True)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "step-0000004")
    (resumed / "checkpoints" / "latest").unlink()
    code, _ = run_json([*finetune_args(spec, code_data, resumed, "lora", 4, "5e-4"), "--resume", "auto"], capsys)
    assert code == 0
    a = load_file(str(run / "final" / "adapter_model.safetensors"))
    b = load_file(str(resumed / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resume is not bit-exact"
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses == [json.loads(x)["loss"] for x in (resumed / "metrics.jsonl").read_text().splitlines()]

    code, ev = run_json(["eval", "--model", spec, "--adapter", str(run), "--data", str(code_data[1]),
                        "--max-seq-len", "128", "--batch-size", "2"], capsys)
    assert code == 0 and ev["loss"] == pytest.approx(evals[-1]["loss"], rel=1e-5)

    before, after, _ = greedy_before_after(smollm_model, spec, run, nf4_base=False)
    print(f"greedy base: {before!r}\ngreedy +adapter: {after!r}")
    assert before != after


def test_qlora_qwen_coder_finetune_generate(code_data, qwen_model, tmp_path, capsys):
    spec = "qwen2.5-coder-0.5b-instruct"
    run = tmp_path / "run"
    evals = finetune(spec, code_data, run, "qlora", 1, "5e-4", capsys)
    assert evals[0]["loss"] < math.log(qwen_model.cfg.vocab_size)
    assert evals[-1]["loss"] < evals[0]["loss"]
    print(f"qwen2.5-coder QLoRA: held-out eval loss {evals[0]['loss']:.4f} -> {evals[-1]['loss']:.4f}")
    # 4 greedy tokens each way (generate runs on NF4 + adapter), and the adapter's effect measured on the
    # next-token logits
    before, after, change = greedy_before_after(qwen_model, spec, run, nf4_base=True, new_tokens=4)
    print(f"greedy NF4 base: {before!r}\ngreedy +adapter: {after!r}; next-token logits changed by relL2 {change:.3g}")
    assert change > 1e-2 and after.strip()
