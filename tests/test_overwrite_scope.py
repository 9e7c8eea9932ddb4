"""`--overwrite` replaces only what the command itself writes (issue 28 item 1), one test per command
that replaces an existing output: tokenizer train, data pack, data sft-from-code, plot --out, and the
temporary directory of convert.

Seen red before the fix: `tokenizer train --out DIR --overwrite` deleted any directory holding a
tokenizer.json (a run's final/, a checkpoint, an HF model directory, a shard directory); `data pack
--overwrite` deleted a directory with an index.json and anything else in it; `sft-from-code
--overwrite` and `plot --out` replaced any file (a .py source, a model); `convert` deleted a user's
directory named OUT_DIR.tmp.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entrenar.cli import main

PROSE = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n" * 20


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _holder(tmp_path: Path, kind: str) -> Path:
    """A directory that holds a tokenizer.json among things no tokenizer command wrote."""
    d = tmp_path / kind
    d.mkdir()
    (d / "tokenizer.json").write_text('{"model": "theirs"}')
    extra = {"final": ["model.safetensors", "config.json", "generation_config.json"],
             "checkpoint": ["model.safetensors", "optimizer.safetensors", "trainer_state.json", "COMPLETE"],
             "hf": ["config.json", "model.safetensors"],
             "shards": ["index.json", "train-00000.bin", "train.docs.bin"]}[kind]
    for name in extra:
        (d / name).write_bytes(b"precious " + name.encode())
    return d


def _corpus(tmp_path: Path) -> Path:
    c = tmp_path / "corpus"
    c.mkdir(exist_ok=True)
    (c / "a.txt").write_text(PROSE)
    return c


@pytest.mark.parametrize("kind", ["final", "checkpoint", "hf", "shards"])
def test_tokenizer_train_overwrite_never_deletes_a_model_or_shard_directory(tmp_path, capsys, kind):
    target = _holder(tmp_path, kind)
    before = _snapshot(target)
    rc = main(["tokenizer", "train", "--vocab-size", "270", "--out", str(target), "--overwrite",
               str(_corpus(tmp_path))])
    err = capsys.readouterr().err
    assert rc == 2 and "--overwrite will not delete it" in err, err
    assert _snapshot(target) == before


def test_tokenizer_train_overwrite_replaces_its_own_output(tmp_path, capsys):
    c = _corpus(tmp_path)
    assert main(["tokenizer", "train", "--vocab-size", "280", "--out", str(tmp_path / "t"), str(c)]) == 0
    assert main(["tokenizer", "train", "--vocab-size", "270", "--out", str(tmp_path / "t"), "--overwrite",
                 str(c)]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "t" / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def _packed(tmp_path: Path, capsys) -> tuple[Path, Path]:
    c = _corpus(tmp_path)
    assert main(["tokenizer", "train", "--vocab-size", "280", "--out", str(tmp_path / "tok"), str(c)]) == 0
    out = tmp_path / "shards"
    assert main(["data", "pack", "--model", str(tmp_path / "tok"), "--out", str(out), str(c)]) == 0
    capsys.readouterr()
    return c, out


def test_data_pack_overwrite_replaces_a_pack_but_not_a_pack_with_other_files(tmp_path, capsys):
    c, out = _packed(tmp_path, capsys)
    pack = ["data", "pack", "--model", str(tmp_path / "tok"), "--out", str(out), "--overwrite", str(c)]
    assert main(pack) == 0  # a previous pack: replaced
    (out / "model.safetensors").write_bytes(b"precious")  # someone's file in the shard directory
    before = _snapshot(out)
    assert main(pack) == 2
    assert "model.safetensors" in capsys.readouterr().err and _snapshot(out) == before


def test_data_pack_overwrite_refuses_a_model_directory_with_an_index_json(tmp_path, capsys):
    c = _corpus(tmp_path)
    assert main(["tokenizer", "train", "--vocab-size", "280", "--out", str(tmp_path / "tok"), str(c)]) == 0
    model = _holder(tmp_path, "hf")
    (model / "index.json").write_text("{}")  # e.g. a sharded checkpoint's index
    before = _snapshot(model)
    assert main(["data", "pack", "--model", str(tmp_path / "tok"), "--out", str(model), "--overwrite", str(c)]) == 2
    assert "--overwrite will not delete it" in capsys.readouterr().err and _snapshot(model) == before


def test_sft_from_code_overwrite_replaces_jsonl_but_not_source_or_weights(tmp_path, capsys):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text('def f(x):\n    """Double x."""\n    return 2 * x\n')
    for name, content in (("train.py", b"print('my code')\n"), ("model.safetensors", b"\x08\x00\x00\x00{}")):
        victim = tmp_path / name
        victim.write_bytes(content)
        assert main(["data", "sft-from-code", "--out", str(victim), "--overwrite", str(pkg)]) == 2
        assert "will not replace" in capsys.readouterr().err and victim.read_bytes() == content
    rows = tmp_path / "rows.jsonl"
    assert main(["data", "sft-from-code", "--out", str(rows), str(pkg)]) == 0
    assert main(["data", "sft-from-code", "--out", str(rows), "--overwrite", str(pkg)]) == 0


def test_plot_out_replaces_a_png_but_not_another_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 / s, "lr": 1e-3}) + "\n"
                                               for s in (1, 2)))
    victim = tmp_path / "config.json"
    victim.write_text('{"mine": 1}')
    assert main(["plot", str(run), "--out", str(victim)]) == 2
    assert "not a PNG image" in capsys.readouterr().err and victim.read_text() == '{"mine": 1}'
    assert main(["plot", str(run)]) == 0 and main(["plot", str(run)]) == 0  # its own curves.png: replaced


def test_convert_leaves_a_users_directory_named_like_its_temporary(tiny_hf_dir, tmp_path, capsys):
    _, model = tiny_hf_dir()
    out = tmp_path / "converted"
    mine = tmp_path / "converted.tmp"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["convert", str(model), str(out)]) == 0, capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()
