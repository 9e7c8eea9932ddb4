"""Every command that writes an --out/OUT creates its missing parent directories (CLI-OUT-PARENTS): the README's
`entrenar convert qwen2.5-coder-0.5b-instruct out/qwen-hf` was exit 2 ("parent directory of OUT_DIR does not exist")
in a fresh clone. One row per command, through the CLI, in a tmp directory where `new/deeper/` does not exist.
(`eval --out`: tests/test_bfcl.py::test_cli_bfcl_rows_are_kept_as_questions_finish_and_resume_continues.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import run_cli as main
from tests.test_bad_inputs import World, finetune, pretrain, world  # noqa: F401  (world: the module's fixture)

STDLIB_JSON = Path(json.__file__).parent


def _argv(name: str, w: World, out: Path) -> list[str]:
    return {
        "convert": ["convert", str(w.model), str(out / "hf"), "--json"],
        "convert-gguf": ["convert", str(w.model), str(out / "m.gguf"), "--json"],
        "export-gguf": ["export", "gguf", str(w.model), str(out / "e.gguf"), "--json"],
        "merge": ["merge", "--base", str(w.model), "--adapter", str(w.adapter), "--out", str(out / "merged"),
                  "--force-base", "--json"],
        "finetune": finetune(w, out / "run"),
        "pretrain": pretrain(w, out / "run"),
        "data-pack": ["data", "pack", "--model", str(w.model), "--out", str(out / "shards"), str(STDLIB_JSON / "decoder.py"),
                      "--json"],
        "sft-from-code": ["data", "sft-from-code", "--out", str(out / "rows.jsonl"), str(STDLIB_JSON), "--json"],
        "tokenizer-train": ["tokenizer", "train", "--vocab-size", "300", "--out", str(out / "tok"),
                            str(STDLIB_JSON / "decoder.py"), "--json"],
    }[name]


WRITTEN = {"convert": "hf/config.json", "convert-gguf": "m.gguf", "export-gguf": "e.gguf", "merge": "merged/config.json",
           "finetune": "run/final", "pretrain": "run/final", "data-pack": "shards/index.json",
           "sft-from-code": "rows.jsonl", "tokenizer-train": "tok/tokenizer.json"}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_missing_parent_of_the_output_is_created(name, world, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "new" / "deeper"
    code, js, err = main(_argv(name, world, out), capsys)
    assert code == 0, (name, js, err)
    assert (out / WRITTEN[name]).exists(), (name, sorted(p.name for p in out.rglob("*")))


def test_plot_out_in_a_missing_directory(world, tmp_path, capsys):  # noqa: F811
    code, js, err = main(finetune(world, tmp_path / "run"), capsys)
    assert code == 0, err
    png = tmp_path / "figs" / "new" / "curves.png"
    code, js, err = main(["plot", str(tmp_path / "run"), "--out", str(png), "--json"], capsys)
    assert code == 0 and png.is_file(), (js, err)
