"""`merge` keeps the chat template the adapter was trained with (issue 38 item 9): a fine-tune saves its tokenizer
and any --chat-template into the adapter directory; merge took the base's tokenizer instead, so a tool-call
fine-tune's merged model said "does not support tools". `export gguf` keeps it already."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from entrenar import peft as ep
from entrenar.formats import load_model
from entrenar.tokenizer import load_tokenizer, save_tokenizer_files
from tests.helpers.cli import run_cli as main
from tests.test_peft import randomize_adapters
from tests.test_peft_seed import tiny_base_and_data


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A tiny base with SmolLM2's tokenizer and chat template (shared: building it is most of the cost)."""
    return tiny_base_and_data(tmp_path_factory.mktemp("base"))[0]


def _adapter_with_template(base: Path, adapter: Path) -> tuple[str, Path]:
    """A LoRA adapter of `base` saved with the tokenizer files of a fine-tune under a --chat-template of its own
    (what train/model_files.py writes into final/); returns (that template, the adapter directory)."""
    tok = load_tokenizer(base)
    trained = "{{ 'Trained template. ' }}" + tok.chat_template
    tok.set_chat_template(trained, "--chat-template trained.jinja")
    model = load_model(base, dtype=torch.float32)
    ep.apply_lora(model, rank=2, alpha=4)
    randomize_adapters(model, 1)
    ep.save_adapter(model, adapter, str(base))
    save_tokenizer_files(tok, adapter)
    return trained, adapter


def test_merged_dir_has_the_adapters_chat_template(tmp_path, base, capsys):
    trained, adapter = _adapter_with_template(base, tmp_path / "adapter")
    code, result, err = main(["merge", "--base", str(base), "--adapter", str(adapter), "--out",
                              str(tmp_path / "merged"), "--json"], capsys)
    assert code == 0, err
    merged = load_tokenizer(tmp_path / "merged")
    assert merged.chat_template == trained
    assert load_tokenizer(base).chat_template != trained  # the base's own: what merge wrote before
    assert result["tokenizer"] and result["tokenizer_from"] == str(adapter)


def test_export_gguf_with_adapter_has_the_adapters_chat_template(tmp_path, base, capsys):
    """`export gguf BASE OUT --adapter DIR` writes the adapter's template into the file, as merge does (it took the
    base's before, like merge)."""
    trained, adapter = _adapter_with_template(base, tmp_path / "adapter")
    out = tmp_path / "m.gguf"
    code, _, err = main(["export", "gguf", str(base), str(out), "--adapter", str(adapter), "--type", "f32",
                         "--json"], capsys)
    assert code == 0, err
    assert load_tokenizer(out).chat_template == trained
