"""SFT and preference rows the way users have them (data/tabular.py): JSON, Parquet and CSV files and
`datasets.save_to_disk` folders besides JSONL, read through `--columns` mappings (KEY=COLUMN, alpaca, sharegpt),
validated as JSONL rows are (FILE:ROW on every error), never looked up on a hub; `data check` lists every invalid
row in one pass. Through the CLI: `data check`, `finetune` (sft and dpo) and `eval --data`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from entrenar.data.tabular import iter_rows, parse_columns
from entrenar.errors import InputError
from tests.helpers.cli import run_cli as main
from tests.helpers.tokenizers import tiny_tokenizer

ALPACA = [{"instruction": f"Say {w}.", "input": "" if i % 2 else "politely", "output": f"{w}!"}
          for i, w in enumerate(["one", "two", "three", "four", "five", "six"])]
SHAREGPT = [{"conversations": [{"from": "human", "value": f"Say {w}."}, {"from": "gpt", "value": f"{w}!"}]}
            for w in ["one", "two", "three", "four"]]


@pytest.fixture()
def tiny_dir(tmp_path) -> Path:
    """A random tiny model with the byte-level ChatML tokenizer: `data check` needs no trained weights."""
    from entrenar.formats import save_hf_dir
    from tests.helpers.models import tiny_causal_lm, tiny_config

    tok = tiny_tokenizer()
    cfg = tiny_config("qwen2", vocab_size=len(tok), max_position_embeddings=1024)
    return save_hf_dir(tiny_causal_lm(cfg, 0), tmp_path / "m", tokenizer=tok)


def check(model: Path, data: Path | str, *extra: str) -> list[str]:
    return ["data", "check", "--model", str(model), "--data", str(data), "--max-seq-len", "512", "--json", *extra]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


# ---- the column mapping --------------------------------------------------------------------------------
def test_columns_spec_errors_name_the_flag_and_the_nearest_key():
    for spec, message in (("alpacca", "did you mean alpaca"),
                          ("promt=question", "unknown key 'promt' (did you mean prompt?)"),
                          ("prompt=", "prompt= names no column"), ("response=a,completion=b", "the same key")):
        with pytest.raises(InputError, match=f"--columns {spec}.*{message}".replace("(", r"\(").replace(")", r"\)")
                           .replace("?", r"\?")):
            parse_columns(spec)
    assert parse_columns(None) is None
    mapped = parse_columns("prompt=question,response=answer,system=sys").apply(
        {"question": "q?", "answer": "a.", "sys": "Be brief.", "id": 7})
    assert mapped == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q?"},
                                   {"role": "assistant", "content": "a."}]}
    alpaca = parse_columns("alpaca")
    assert alpaca.apply(ALPACA[0]) == {"instruction": "Say one.", "input": "politely", "output": "one!"}
    share = parse_columns("sharegpt,conversations=chat").apply(
        {"chat": [{"from": "system", "value": "S"}, *SHAREGPT[0]["conversations"]]})
    assert share == {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Say one."},
                                  {"role": "assistant", "content": "one!"}]}


def test_json_array_and_json_lines_named_json_are_rows_numbered_as_written(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([{"prompt": "p", "completion": "c"}, {"prompt": "q"}], indent=2))
    assert [(n, where) for n, where, _ in iter_rows(arr, on_error=None)] == [(1, f"{arr}:row 1"), (2, f"{arr}:row 2")]
    lines = tmp_path / "l.json"
    lines.write_text('{"prompt": "p", "completion": "c"}\n\n{"prompt": "q", "completion": "d"}\n')
    assert [where for _, where, _ in iter_rows(lines, on_error=None)] == [f"{lines}:1", f"{lines}:3"]


# ---- data check through the CLI ----------------------------------------------------------------------------
def test_data_check_reads_alpaca_json_and_names_file_row_of_a_bad_one(tiny_dir, tmp_path, capsys):
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps(ALPACA))
    code, js, err = main(check(tiny_dir, data, "--columns", "alpaca"), capsys)
    assert code == 0, err
    assert js["report"]["rows_read"] == 6 and js["report"]["kept"] == 6
    # the same rows with the output column renamed: each row lacks it, named FILE:row N, all in one pass
    data.write_text(json.dumps([{**{k: v for k, v in r.items() if k != "output"}, "answer": r["output"]}
                                for r in ALPACA[:3]]))
    code, js, err = main(check(tiny_dir, data, "--columns", "alpaca"), capsys)
    assert code == 2, err
    for n in (1, 2, 3):
        assert f"{data}:row {n}: no 'output' value (--columns alpaca reads it as output)" in js["error"], js
    code, js, err = main(check(tiny_dir, data, "--columns", "alpaca,output=answer"), capsys)
    assert code == 0 and js["report"]["kept"] == 3, err


def test_data_check_lists_every_invalid_row_in_one_pass(tiny_dir, tmp_path, capsys):
    """Without --skip-invalid `data check` used to stop at the first bad row: a user fixed them one run at a time."""
    data = tmp_path / "rows.jsonl"
    good = {"prompt": "Say hi.", "completion": "hi!"}
    data.write_text("\n".join([json.dumps(good), "{not json", json.dumps({"prompt": "x", "completion": ""}),
                               json.dumps(good), json.dumps({"messages": [{"role": "robot", "content": "x"}]})]) + "\n")
    code, js, err = main(check(tiny_dir, data), capsys)
    assert code == 2 and js["guard"] is None, js
    assert "3 invalid rows" in js["error"], js
    for line, what in ((2, "malformed JSON"), (3, "'completion' is empty"), (5, "messages[0] has unknown role 'robot'")):
        assert f"{data}:{line}: {what}" in js["error"], js
    assert "--skip-invalid" in js["error"]
    code, js, err = main(check(tiny_dir, data, "--skip-invalid", "--max-skip-fraction", "1"), capsys)
    assert code == 0 and js["report"]["kept"] == 2 and js["report"]["skipped_total"] == 3, err


def test_data_check_parquet_csv_and_a_save_to_disk_folder(tiny_dir, tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"Say {w}.", "answer": f"{w}!"} for w in ["one", "two", "three"]]
    parquet = write_parquet(tmp_path / "qa.parquet", rows)
    csv = tmp_path / "qa.csv"
    datasets.Dataset.from_list(rows).to_csv(str(csv), index=False)
    folder = tmp_path / "qa_disk"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    for data in (parquet, csv, folder):
        code, js, err = main(check(tiny_dir, data, "--columns", "prompt=question,response=answer"), capsys)
        assert code == 0 and js["report"]["kept"] == 3, (data, err)
    # sharegpt conversations in Parquet (a list of structs): rows read back as the objects they were
    code, js, err = main(check(tiny_dir, write_parquet(tmp_path / "sg.parquet", SHAREGPT), "--columns", "sharegpt"),
                         capsys)
    assert code == 0 and js["report"]["kept"] == 4, err
    # a CSV row with an empty answer: FILE:row N (the header is not a row)
    csv.write_text("question,answer\nSay one.,one!\nSay two.,\n")
    code, js, err = main(check(tiny_dir, csv, "--columns", "prompt=question,response=answer"), capsys)
    assert code == 2 and f"{csv}:row 2: no 'answer' value" in js["error"], js
    # a DatasetDict folder: exit 2 naming its splits and the folder to give
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    code, js, err = main(check(tiny_dir, tmp_path / "dd"), capsys)
    assert code == 2 and "a DatasetDict with splits train" in js["error"] and str(tmp_path / "dd" / "train") in \
        js["error"], js


def test_a_path_that_does_not_exist_is_exit_2_never_a_hub_lookup(tiny_dir, tmp_path, capsys, monkeypatch):
    from entrenar.data import tabular

    def no_datasets(*a, **k):
        raise AssertionError("datasets must not be asked about a path that does not exist")

    monkeypatch.setattr(tabular, "_datasets", no_datasets)
    code, js, _ = main(check(tiny_dir, "tatsu-lab/alpaca", "--columns", "alpaca"), capsys)
    assert code == 2 and "tatsu-lab/alpaca: no such file or directory" in js["error"], js
    assert "never downloads a data set by name" in js["error"]


def test_without_datasets_parquet_is_exit_2_naming_the_extra_and_jsonl_still_works(tiny_dir, tmp_path, capsys,
                                                                                   monkeypatch):
    parquet = tmp_path / "x.parquet"
    parquet.write_bytes(b"PAR1")  # never opened: the import fails first
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Say hi.", "completion": "hi!"}) + "\n")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    code, js, err = main(check(tiny_dir, parquet), capsys)
    assert code == 2 and "the optional extra `datasets`" in js["error"] and "entrenar[datasets]" in js["error"], js
    code, js, err = main(check(tiny_dir, jsonl), capsys)
    assert code == 0 and js["report"]["kept"] == 1, err


# ---- finetune and eval --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_base(tmp_path_factory) -> tuple[Path, Path]:
    from tests.test_peft_seed import tiny_base_and_data

    return tiny_base_and_data(tmp_path_factory.mktemp("tabular-base"))


def test_finetune_and_eval_read_a_mapped_parquet_like_the_jsonl_it_came_from(sft_base, tmp_path, capsys):
    """The same rows as JSONL (prompt/completion) and as Parquet under other names with --columns: the same
    data report and the same losses."""
    base, jsonl = sft_base
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    parquet = write_parquet(tmp_path / "qa.parquet", [{"q": r["prompt"], "a": r["completion"]} for r in rows])
    common = ["--mode", "lora", "--steps", "2", "--batch-size", "2", "--max-seq-len", "64", "--val-fraction", "0",
              "--no-preflight", "--json"]
    code, _, err = main(["finetune", "--model", str(base), "--data", str(jsonl), "--out", str(tmp_path / "a"),
                           *common], capsys)
    assert code == 0, err
    code, _, err = main(["finetune", "--model", str(base), "--data", str(parquet), "--out", str(tmp_path / "b"),
                           "--columns", "prompt=q,response=a", *common], capsys)
    assert code == 0, err

    def losses(run: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    report = json.loads((tmp_path / "b" / "data_report.json").read_text())["train"]
    assert report["kept"] == len(rows) and report["path"] == str(parquet)
    code, js, err = main(["eval", "--model", str(tmp_path / "b"), "--data", str(parquet), "--columns",
                          "prompt=q,response=a", "--max-seq-len", "64", "--json"], capsys)
    assert code == 0 and js["tokens"] > 0, err


def test_finetune_dpo_reads_sharegpt_preference_rows_from_json(sft_base, tmp_path, capsys):
    base, jsonl = sft_base
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()][:8]
    pairs = [{"conversations": [{"from": "human", "value": r["prompt"]}], "chosen": {"from": "gpt", "value": r["completion"]},
              "rejected": {"from": "gpt", "value": "No."}} for r in rows]
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(pairs))
    code, _, err = main(["finetune", "--model", str(base), "--data", str(data), "--out", str(tmp_path / "dpo"),
                          "--columns", "sharegpt", "--objective", "dpo", "--mode", "lora", "--steps", "1",
                          "--batch-size", "2", "--max-seq-len", "64", "--val-fraction", "0", "--no-preflight",
                          "--json"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "dpo" / "data_report.json").read_text())
    assert report["kind"] == "preference" and report["train"]["kept"] == 8
