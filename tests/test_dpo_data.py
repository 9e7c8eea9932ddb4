"""Preference rows (data/preference.py) with the SmolLM2 tokenizer: row forms, response-only labels, the
GUARD-DATA rules shared with SFT, the loader's pair batches and `data check` on a preference file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from entrenar.data.preference import PreferenceLoader, load_preference
from entrenar.errors import GuardError, InputError
from entrenar.tensors import IGNORE_INDEX
from tests.helpers.cli import run_cli


@pytest.fixture(scope="module")
def tok():
    from entrenar.tokenizer import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def trained_text(tok, ex) -> str:
    return tok.decode([int(t) for t in ex.labels if t != IGNORE_INDEX])


def test_the_three_row_forms_train_the_response_only(tmp_path, tok):
    rows = [{"prompt": "Add 2 and 3.", "chosen": "5", "rejected": "6"},
            {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Add 2 and 3."},
                        {"role": "assistant", "content": "Which numbers?"}, {"role": "user", "content": "2, 3."}],
             "chosen": [{"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "23"}]},
            {"messages": [{"role": "user", "content": "Add 2 and 3."}], "chosen": "five", "rejected": "six"}]
    examples, report = load_preference(write(tmp_path / "p.jsonl", rows), tok, 128)
    assert report.kept == 3 and report.eot_trained == 3
    eot = tok.decode([tok.eot_id])
    got = [(trained_text(tok, e.chosen), trained_text(tok, e.rejected)) for e in examples]
    # the earlier assistant turn of row 2 ("Which numbers?") is prompt, never trained
    assert got == [(f"5{eot}", f"6{eot}"), (f"5{eot}", f"23{eot}"), (f"five{eot}", f"six{eot}")]
    a, b = examples[1].chosen, examples[1].rejected
    n = a.prompt_tokens
    assert n == b.prompt_tokens and np.array_equal(a.input_ids[:n], b.input_ids[:n])  # the same prompt


@pytest.mark.parametrize("row,reason", [
    ({"prompt": "x", "chosen": "same", "rejected": "same"}, "chosen and rejected are the same"),
    ({"prompt": "x", "chosen": "a"}, "a preference row has"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "\"prompt\" is empty"),
    ({"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "assistant messages only"),
    ({"chosen": "a", "rejected": "b"}, "needs \"prompt\""),
    ({"prompt": "x", "chosen": "a", "rejected": "b", "tools": []}, "\"tools\" in a preference row"),
], ids=["identical", "no-rejected", "empty-prompt", "user-response", "no-prompt", "tools"])
def test_invalid_rows_exit_2_naming_file_and_line(tmp_path, tok, row, reason):
    path = write(tmp_path / "p.jsonl", [{"prompt": "ok", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(InputError, match=f"{path}:2: .*{reason}".replace("(", r"\(")):
        load_preference(path, tok, 64)
    examples, report = load_preference(path, tok, 64, skip_invalid=True, max_skip_fraction=None)
    assert len(examples) == 1 and report.skipped_total == 1


def test_a_prompt_without_room_for_the_responses_is_guard_data(tmp_path, tok):
    long = " ".join(["word"] * 80)
    path = write(tmp_path / "p.jsonl", [{"prompt": long, "chosen": "a", "rejected": "b"}] * 3
                 + [{"prompt": "short", "chosen": "a", "rejected": "b"}])
    with pytest.raises(GuardError) as e:
        load_preference(path, tok, 48)
    assert e.value.guard_id == "GUARD-DATA" and e.value.exit_code == 2
    assert e.value.details["skipped"] == {"prompt_too_long": 3}
    _, report = load_preference(path, tok, 48, max_skip_fraction=0.9)
    assert report.kept == 1


def test_pairs_identical_after_the_cut_are_skipped_as_identical_tokens(tmp_path, tok):
    """Responses that differ only past --max-seq-len (truncation keep) are the same tokens: no preference left."""
    same_start = " ".join(["alpha"] * 30)
    path = write(tmp_path / "p.jsonl", [{"prompt": "Say it.", "chosen": same_start + " good",
                                         "rejected": same_start + " bad"},
                                        {"prompt": "Say it.", "chosen": "good", "rejected": "bad"}])
    examples, report = load_preference(path, tok, 40, truncation="keep", max_skip_fraction=0.9)
    assert len(examples) == 1 and report.skipped == {"identical_tokens": 1}
    with pytest.raises(GuardError, match="GUARD-DATA|skipped"):
        load_preference(path, tok, 40, truncation="keep", max_skip_fraction=0.1)


def test_loader_batches_pairs_and_resumes_its_order(tmp_path, tok):
    rows = [{"prompt": f"Q{i}", "chosen": "yes " * (i % 4 + 1), "rejected": "no"} for i in range(10)]
    examples, _ = load_preference(write(tmp_path / "p.jsonl", rows), tok, 64)
    loader = PreferenceLoader(examples, 3, seed=5, max_seq_len=64, pad_id=tok.pad_id or 0)
    b = loader.next_batch()
    assert b["input_ids"].shape[:2] == (3, 2) and b["labels"].shape == b["input_ids"].shape
    for i, line in enumerate(b["sample_ids"]):
        ex = examples[line - 1]
        assert b["labels"][i, 0, :len(ex.chosen)].tolist() == ex.chosen.labels.tolist()
        assert (b["labels"][i, 0, len(ex.chosen):] == IGNORE_INDEX).all()  # padding never trained
        assert b["labels"][i, 1, :len(ex.rejected)].tolist() == ex.rejected.labels.tolist()
    state = loader.state_dict()
    after = [loader.next_batch()["sample_ids"] for _ in range(4)]
    again = PreferenceLoader(examples, 3, seed=5, max_seq_len=64, pad_id=0)
    again.load_state_dict(state)
    assert [again.next_batch()["sample_ids"] for _ in range(4)] == after
    assert state["kind"] == "preference"


def test_data_check_reads_a_preference_file(tmp_path, capsys):
    path = write(tmp_path / "p.jsonl", [{"prompt": "Add 2 and 3.", "chosen": "5", "rejected": "6"}] * 4)
    code, result, _ = run_cli(["data", "check", "--model", "smollm2-135m-instruct", "--data", str(path),
                               "--max-seq-len", "64", "--json"], capsys)
    assert code == 0 and result["report"]["kind"] == "preference" and result["report"]["kept"] == 4
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "Add.", "chosen": "5", "rejected": "5"}])
    code, result, _ = run_cli(["data", "check", "--model", "smollm2-135m-instruct", "--data", str(bad),
                               "--max-seq-len", "64", "--json"], capsys)
    assert code == 2 and f"{bad}:1" in result["error"]
