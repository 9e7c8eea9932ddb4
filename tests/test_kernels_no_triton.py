"""Where Triton is absent, the model, the CLI and the torch kernels still work; asking for Triton kernels
there is an InputError (exit 2) naming the remedy. Each check runs in a fresh interpreter in which
``import triton`` fails as it does when the package is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# sys.modules[name] = None is what a missing package looks like to `import` (ModuleNotFoundError) and to
# importlib.util.find_spec (None); torch's own "is triton there?" probes see the same.
BLOCK_TRITON = """
import sys
for name in ("triton", "triton.language", "triton.testing"):
    sys.modules[name] = None
"""


def run_without_triton(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    env.pop("TRITON_INTERPRET", None)
    code = BLOCK_TRITON + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                          timeout=300)


def test_model_imports_builds_and_trains_without_triton():
    proc = run_without_triton("""
        import json
        import torch
        import entrenar.model, entrenar.cli, entrenar.verify
        from entrenar.config import ModelConfig
        from entrenar.kernels import resolve_kernels, triton_available
        from entrenar.model import CausalLM

        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2)
        model = CausalLM(cfg, kernels="torch")
        model.init_weights(0)
        ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
        logits = model(ids)
        loss, n = model(ids, labels=ids)
        loss.backward()
        print(json.dumps({"logits": list(logits.shape), "n": int(n), "finite": bool(torch.isfinite(loss)),
                          "grad": model.model.embed_tokens.weight.grad is not None,
                          "triton_loaded": sys.modules.get("triton") is not None,
                          "available": triton_available(), "auto_cuda": resolve_kernels("auto", "cuda")}))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"logits": [2, 9, 64], "n": 18, "finite": True, "grad": True, "triton_loaded": False,
                   "available": False, "auto_cuda": "torch"}


def test_triton_kernels_requested_without_triton_is_input_error_naming_the_remedy():
    proc = run_without_triton("""
        from entrenar.config import ModelConfig
        from entrenar.errors import InputError
        from entrenar.model import CausalLM

        cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                          num_kv_heads=2)
        try:
            CausalLM(cfg, kernels="triton")
        except InputError as e:
            print("INPUT-ERROR", e.exit_code, e)
    """)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("INPUT-ERROR 2 ")
    assert "triton" in line and "pip install triton" in line and "--kernels torch" in line


def test_cli_kernels_triton_without_triton_exits_2(tmp_path):
    """The whole command: `verify --kernels triton` on a tiny model directory -> exit 2, remedy on stderr."""
    proc = run_without_triton(f"""
        import torch
        from entrenar import cli
        from entrenar.config import ModelConfig
        from entrenar.formats import save_hf_dir
        from entrenar.model import CausalLM
        from entrenar.tokenizer import load_tokenizer

        tok = load_tokenizer("smollm2-135m-instruct")
        cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                          num_kv_heads=2)
        model = CausalLM(cfg)
        model.init_weights(0)
        path = save_hf_dir(model, {str(tmp_path / "tiny")!r}, tok)
        code = cli.main(["verify", "--model", str(path), "--kernels", "triton", "--seq-len", "32", "--no-grads"])
        torch_code = cli.main(["verify", "--model", str(path), "--kernels", "torch", "--seq-len", "32",
                               "--no-grads", "--json"])
        print("CODES", code, torch_code)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "CODES 2 0", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "pip install triton" in proc.stderr and "--kernels torch" in proc.stderr
