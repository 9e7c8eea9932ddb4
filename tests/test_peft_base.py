"""An adapter applied to the wrong base of the same shape is refused (exit 2) unless --force-base.

The adapter note records the base's name and a weights fingerprint (peft/identity.py). Before the check,
`merge` onto a random-init model of the same shape said "merged 14 adapters" and exited 0.
"""

from __future__ import annotations

import json

import pytest
import torch

from entrenar import peft as ep
from entrenar.errors import InputError
from entrenar.formats import load_model, save_hf_dir
from entrenar.peft import identity
from entrenar.peft.load import load_model_with_adapter
from tests.helpers.cli import run_cli
from tests.test_peft import IDS, randomize_adapters, tiny_model


@pytest.fixture()
def bases(tmp_path):
    """(A: the base the adapter was trained on, B: a random init of the same shape, adapter dir)."""
    a = save_hf_dir(tiny_model(seed=0), tmp_path / "base-A")
    b = save_hf_dir(tiny_model(seed=1), tmp_path / "base-B")
    m = load_model(a, dtype=torch.float32)
    ep.apply_lora(m, rank=4, alpha=8)
    randomize_adapters(m)
    ep.save_adapter(m, tmp_path / "adapter", str(a))
    return a, b, tmp_path / "adapter"


def merge_cli(base, adapter, out, capsys, *extra) -> tuple[int, dict, str]:
    return run_cli(["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--json", *extra], capsys)


def test_merge_onto_wrong_base_exits_2_naming_both(bases, tmp_path, capsys):
    a, b, adapter = bases
    code, out, _ = merge_cli(b, adapter, tmp_path / "m", capsys)
    assert code == 2 and out["ok"] is False
    assert str(a) in out["error"] and str(b) in out["error"] and "--force-base" in out["error"]
    assert not (tmp_path / "m").exists()


def test_merge_onto_wrong_base_with_force_base_warns(bases, tmp_path, capsys):
    _, b, adapter = bases
    code, out, err = merge_cli(b, adapter, tmp_path / "m", capsys, "--force-base")
    assert code == 0 and out["ok"] and out["base_check"] == "mismatch-forced"
    assert "warning: --force-base" in err and (tmp_path / "m" / "config.json").is_file()


def test_merge_onto_the_right_base_succeeds(bases, tmp_path, capsys):
    a, _, adapter = bases
    code, out, err = merge_cli(a, adapter, tmp_path / "m", capsys)
    assert code == 0 and out["base_check"] == "match" and "warning" not in err


def test_base_check_mutation_is_caught(bases, tmp_path, capsys, monkeypatch):
    """Mutation: no identity check (the old behaviour) -> the wrong base merges with exit 0."""
    _, b, adapter = bases
    monkeypatch.setattr(ep.io, "check_base_identity", lambda *a, **kw: {"status": "match", "message": ""})
    code, _, _ = merge_cli(b, adapter, tmp_path / "m", capsys)
    assert code == 0


def test_generate_and_eval_adapter_on_wrong_base(bases, tmp_path):
    a, b, adapter = bases
    with pytest.raises(InputError, match="--force-base"):
        load_model_with_adapter(str(b), adapter)
    m = load_model_with_adapter(str(b), adapter, force_base=True)
    assert m.peft_config["base_check"]["status"] == "mismatch-forced"
    assert load_model_with_adapter(str(a), adapter).peft_config["base_check"]["status"] == "match"


def test_same_base_in_bf16_still_matches(bases):
    """The fingerprint tolerates the dtype the base is loaded in (fp32 file read as bf16)."""
    a, _, adapter = bases
    m = load_model(a, dtype=torch.bfloat16)
    ep.load_adapter(m, adapter)
    assert m.peft_config["base_check"]["status"] == "match"


def test_adapter_without_fingerprint_loads_with_a_note(bases, capsys):
    """Adapters written before the fingerprint (or by peft) load; a note says the base was not checked."""
    _, b, adapter = bases
    note_path = adapter / ep.ADAPTER_NOTE
    note = json.loads(note_path.read_text())
    del note["base_fingerprint"]
    note_path.write_text(json.dumps(note))
    m = ep.load_adapter(load_model(b, dtype=torch.float32), adapter)
    assert m.peft_config["base_check"]["status"] == "unrecorded"
    assert "no base fingerprint" in capsys.readouterr().err
    with torch.no_grad():
        assert torch.isfinite(m(IDS)).all()


def test_fingerprint_records_sample_and_shapes(bases):
    a, _, adapter = bases
    note = json.loads((adapter / ep.ADAPTER_NOTE).read_text())
    fp = note["base_fingerprint"]
    assert fp["method"] == identity.FINGERPRINT_METHOD and len(fp["sample"]) == identity.N_SAMPLE
    assert fp == identity.base_fingerprint(load_model(a, dtype=torch.float32))
    other_shape = tiny_model(hidden_size=32, intermediate_size=48)
    assert "shapes differ" in identity._difference(fp, identity.base_fingerprint(other_shape))


def test_adapter_dir_or_run_dir_as_model_loads_its_base(bases, tmp_path):
    """An adapter directory (or a LoRA run holding one in final/) given as MODEL: its recorded base + it."""
    import shutil

    a, _, adapter = bases
    assert ep.is_adapter_dir(adapter) and not ep.is_adapter_dir(a) and not ep.is_adapter_dir(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(adapter, run / "final")
    assert ep.adapter_path(run) == run / "final"
    for spec in (adapter, run):
        m = load_model_with_adapter(str(spec))
        assert len(ep.lora_modules(m)) == 14 and m.peft_config["base_check"]["status"] == "match"


def test_merge_out_that_cannot_be_created_exits_2(bases, tmp_path, capsys):
    """An --out under a regular file was a NotADirectoryError traceback (issue 18 item 8)."""
    a, _, adapter = bases
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, out, _ = merge_cli(a, adapter, blocker / "merged", capsys)
    assert code == 2 and "--out" in out["error"] and "cannot be created" in out["error"]
