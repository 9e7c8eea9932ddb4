"""SFT data with the packaged models' real tokenizers and chat templates: the loss window, loud
skips, GUARD-DATA, end-of-turn labels when pad = eos, validation through the CLI.

Only tokenizers are loaded (GGUF metadata, no weights); each loads once per module.
"""

from __future__ import annotations

import json
import logging

import pytest

from entrenar.cli import main
from entrenar.data import sft
from entrenar.data.sft import IGNORE_INDEX, SFTLoader, load_sft
from entrenar.errors import GuardError, InputError

SMOLLM = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
WORDS = ["the", "cat", "sat", "on", "the", "mat", "and", "then", "it", "went", "to", "the", "shop", "to", "buy",
         "some", "milk", "for", "the", "small", "dog", "who", "was", "very", "happy", "about", "that"]

pytestmark = pytest.mark.real_model  # needs the packaged GGUF files (tokenizer metadata only)


@pytest.fixture(scope="module")
def tokenizers_cache():
    return {}


@pytest.fixture(scope="module", params=[SMOLLM, QWEN])
def tok(request, tokenizers_cache):
    from entrenar.tokenizer import load_tokenizer

    if request.param not in tokenizers_cache:
        tokenizers_cache[request.param] = load_tokenizer(request.param)
    return tokenizers_cache[request.param]


@pytest.fixture(scope="module")
def smol(tokenizers_cache):
    from entrenar.tokenizer import load_tokenizer

    if SMOLLM not in tokenizers_cache:
        tokenizers_cache[SMOLLM] = load_tokenizer(SMOLLM)
    return tokenizers_cache[SMOLLM]


@pytest.fixture(scope="module")
def smol_dir(smol, tmp_path_factory):
    """The real SmolLM2 tokenizer + chat template as an HF directory: a MODEL spec the CLI loads fast."""
    return str(smol.save_hf(tmp_path_factory.mktemp("smol-tokenizer")))


def text_of_tokens(tok, n: int, offset: int = 0) -> str:
    """Plain text that the tokenizer encodes to exactly n tokens."""
    def count(words):
        return len(tok.encode(" ".join(words), add_special=False))

    words = [WORDS[(offset + i) % len(WORDS)] for i in range(n)]
    while count(words) > n:
        words.pop()
    i = offset + len(words)
    while count(words) < n:
        words.append(WORDS[i % len(WORDS)])
        i += 1
        if count(words) > n:
            words[-1] = "a"  # a word that adds two tokens: a one-token word instead
    text = " ".join(words)
    assert count(words) == n
    return text


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def chat(user: str, answer: str, system: str | None = None) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"messages": msgs}


def batch_loss_tokens(batch) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


def loss_tokens_through_pipeline(tok, path: str, max_seq_len: int) -> int:
    """Loss tokens of the data after load_sft and both batchings; all three must agree."""
    examples, report = load_sft(path, tok, max_seq_len)
    padded = list(SFTLoader(examples, 4, seed=0, pad_id=tok.pad_id).iter_epoch())
    packed = list(SFTLoader(examples, 4, seed=0, pack=True, max_seq_len=max_seq_len,
                            pad_id=tok.pad_id).iter_epoch())
    n_padded, n_packed = sum(map(batch_loss_tokens, padded)), sum(map(batch_loss_tokens, packed))
    assert n_padded == n_packed == report.loss_tokens_total
    return report.loss_tokens_total


# ---- the seed failure ------------------------------------------------------------------------------
def test_seed_failure_long_system_prompt_trains_every_answer_token(tok, tmp_path, monkeypatch):
    """1,500-token system prompt + 40-token answer at --max-seq-len 2048: exactly 40 + 1 loss tokens.

    The system we re-create clamped sequences to 512 tokens somewhere on the way, so every answer
    fell outside the loss window. A 512 clamp re-introduced in the tokenizer output or in batching
    must make this test fail (shown below with monkeypatches).
    """
    system = text_of_tokens(tok, 1500)
    answer = text_of_tokens(tok, 40, offset=7)
    path = write_jsonl(tmp_path / "seed.jsonl", [chat("Please answer.", answer, system)])
    examples, report = load_sft(path, tok, 2048)
    assert report.kept == 1 and report.longest_prompt_tokens > 1500
    assert examples[0].loss_tokens == 41
    trained = [int(t) for t in examples[0].labels if t != IGNORE_INDEX]
    assert trained[-1] == tok.eot_id
    assert tok.decode(trained[:-1]) == answer
    assert loss_tokens_through_pipeline(tok, path, 2048) == 41

    # Mutation 1: a 512 clamp in tokenization -> nothing trainable, GUARD-DATA (exit 2).
    real_encode_chat = type(tok).encode_chat

    def clamped_encode_chat(self, messages, add_generation_prompt=False):
        enc = real_encode_chat(self, messages, add_generation_prompt)
        return type(enc)(enc.ids[:512], enc.assistant_mask[:512])

    with monkeypatch.context() as m:
        m.setattr(type(tok), "encode_chat", clamped_encode_chat)
        with pytest.raises(GuardError) as err:
            loss_tokens_through_pipeline(tok, path, 2048)
        assert err.value.guard_id == "GUARD-DATA" and err.value.exit_code == 2

    # Mutation 2: a 512 clamp in batching -> the batch carries 0 loss tokens, not 41.
    real_collate = sft.collate_padded

    def clamped_collate(examples, pad_id, pad_to=()):
        batch = real_collate(examples, pad_id, pad_to)
        return {**batch, "input_ids": batch["input_ids"][:, :512], "labels": batch["labels"][:, :512]}

    with monkeypatch.context() as m:
        m.setattr(sft, "collate_padded", clamped_collate)
        with pytest.raises(AssertionError):
            loss_tokens_through_pipeline(tok, path, 2048)


# ---- prompt overflow, GUARD-DATA ---------------------------------------------------------------------
def test_prompt_longer_than_max_seq_len_is_skipped_loudly_and_counted(smol, tmp_path, caplog):
    long_system = text_of_tokens(smol, 300)
    path = write_jsonl(tmp_path / "d.jsonl", [
        chat("hi", "hello"), "", chat("hi", "hello", long_system), chat("what?", "that"),
    ])
    with caplog.at_level(logging.WARNING, logger="entrenar.data"):
        examples, report = load_sft(path, smol, 64)
    assert [e.line for e in examples] == [1, 4]
    assert report.rows_read == 3 and report.kept == 2
    assert report.skipped == {"prompt_too_long": 1}
    assert report.longest_prompt_line == 3 and report.longest_prompt_tokens > 300
    warning = [r.getMessage() for r in caplog.records if "prompt_too_long" in r.getMessage()
               or "SKIPPED" in r.getMessage()]
    assert len(warning) == 1
    assert f"{path}:3" in warning[0] and "--max-seq-len" in warning[0] and "Remedy" in warning[0]
    assert report.to_dict()["skipped"] == {"prompt_too_long": 1}


def test_all_prompts_too_long_is_guard_data_exit_2(smol, smol_dir, tmp_path, monkeypatch, capsys):
    long_system = text_of_tokens(smol, 100)
    path = write_jsonl(tmp_path / "d.jsonl", [chat("hi", "hello", long_system)] * 3)
    with pytest.raises(GuardError) as err:
        load_sft(path, smol, 64)
    assert err.value.guard_id == "GUARD-DATA" and err.value.exit_code == 2
    assert "no loss tokens" in str(err.value) and "--max-seq-len" in str(err.value)
    assert err.value.details["skipped"] == {"prompt_too_long": 3}

    rc = main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "64", "--json"])
    captured = capsys.readouterr()
    assert rc == 2 and "GUARD-DATA" in captured.err
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["ok"] is False and out["guard"] == "GUARD-DATA" and out["exit_code"] == 2

    # Mutation: without the guard the empty data set would "train" on nothing.
    monkeypatch.setattr(sft.DataReport, "check", lambda self, max_skip_fraction=0.5: None)
    examples, report = load_sft(path, smol, 64)
    assert examples == [] and report.loss_tokens_total == 0


def test_too_many_skipped_is_guard_data(smol, tmp_path):
    long_system = text_of_tokens(smol, 100)
    path = write_jsonl(tmp_path / "d.jsonl", [chat("hi", "hello", long_system)] * 2 + [chat("Question?", "Answer.")])
    with pytest.raises(GuardError) as err:
        load_sft(path, smol, 64)
    assert err.value.guard_id == "GUARD-DATA" and "--max-skip-fraction" in str(err.value)
    _, report = load_sft(path, smol, 64, max_skip_fraction=0.7)
    assert report.kept == 1 and report.skip_fraction == pytest.approx(2 / 3)


# ---- end-of-turn labels -----------------------------------------------------------------------------
def test_pad_equals_eos_still_trains_end_of_turn(smol, tmp_path, monkeypatch):
    """SmolLM2 pads with its EOS id, which is also its end-of-turn token: padding must be masked by
    position, so <|im_end|> stays a label in padded and packed batches."""
    assert smol.pad_id == smol.eos_id == smol.eot_id
    rows = [chat("hi", "hello"), chat("Tell me a longer story please", "Once upon a time there was a cat."),
            {"messages": [{"role": "user", "content": "Question one?"},
                          {"role": "assistant", "content": "Answer one."},
                          {"role": "user", "content": "Question two?"},
                          {"role": "assistant", "content": "Answer two, longer."}]}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    examples, report = load_sft(path, smol, 512)
    assert report.eot_trained == report.kept_untruncated == 3
    n_turns = 4

    def eot_labels(batch) -> int:
        return int((batch["labels"] == smol.eot_id).sum())

    padded = SFTLoader(examples, 3, seed=0, pad_id=smol.pad_id)
    packed = SFTLoader(examples, 1, seed=0, pack=True, max_seq_len=512, pad_id=smol.pad_id)
    b_pad, b_pack = next(padded.iter_epoch()), next(packed.iter_epoch())
    assert len(b_pad["sample_ids"]) == len(b_pack["sample_ids"]) == 3
    assert (b_pad["input_ids"] == smol.pad_id).sum() > n_turns  # there is padding to confuse
    assert eot_labels(b_pad) == eot_labels(b_pack) == n_turns
    # The multi-turn sample trains both assistant turns, each with its end-of-turn, and nothing else.
    multi = examples[2]
    trained = [int(t) for t in multi.labels if t != IGNORE_INDEX]
    assert smol.decode(trained) == "Answer one.<|im_end|>Answer two, longer.<|im_end|>"

    # Mutation (the classic bug): mask labels by comparing ids with pad_id.
    real_collate = sft.collate_padded

    def pad_id_masking(examples, pad_id, pad_to=()):
        batch = real_collate(examples, pad_id, pad_to)
        batch["labels"][batch["labels"] == pad_id] = IGNORE_INDEX
        return batch

    monkeypatch.setattr(sft, "collate_padded", pad_id_masking)
    assert eot_labels(next(padded.iter_epoch())) == 0

    # Mutation: labels that drop the end-of-turn token -> GUARD-DATA names it.
    real_shifted = sft.shifted_labels

    def drop_eot(ids, mask):
        labels = real_shifted(ids, mask)
        labels[labels == smol.eot_id] = IGNORE_INDEX
        return labels

    monkeypatch.setattr(sft, "shifted_labels", drop_eot)
    with pytest.raises(GuardError) as err:
        load_sft(path, smol, 512)
    assert err.value.guard_id == "GUARD-DATA" and "end-of-turn" in str(err.value)


def test_assistant_mask_off_the_turns_is_guard_data(smol, tmp_path, monkeypatch):
    """Labels must be exactly the assistant turns, each ending with end-of-turn: a mask that also
    covers a prompt token (a mis-located span) or misses a turn's end is GUARD-DATA."""
    path = write_jsonl(tmp_path / "d.jsonl", [chat("Question one?", "Answer one.")])
    _, report = load_sft(path, smol, 256)
    assert report.eot_trained == 1
    real_encode_chat = type(smol).encode_chat

    def stray_mask(self, messages, add_generation_prompt=False):
        enc = real_encode_chat(self, messages, add_generation_prompt)
        mask = list(enc.assistant_mask)
        mask[3] = True  # a token of the system prompt
        return type(enc)(enc.ids, mask)

    def no_eot(self, messages, add_generation_prompt=False):
        enc = real_encode_chat(self, messages, add_generation_prompt)
        last = max(i for i, m in enumerate(enc.assistant_mask) if m)
        return type(enc)(enc.ids, [m and i != last for i, m in enumerate(enc.assistant_mask)])

    def span_in_system_prompt(self, messages, add_generation_prompt=False):
        # The shape of a real span bug: a short answer "found" inside the system prompt, so the
        # system prompt's tail + its end-of-turn are trained and the answer is not.
        enc = real_encode_chat(self, messages, add_generation_prompt)
        first_eot = enc.ids.index(self.eot_id)
        return type(enc)(enc.ids, [first_eot - 3 <= i <= first_eot for i in range(len(enc.ids))])

    def double_bos(self, messages, add_generation_prompt=False):
        enc = real_encode_chat(self, messages, add_generation_prompt)
        return type(enc)([self.bos_id, self.bos_id] + enc.ids[1:], [False] + enc.assistant_mask)

    with monkeypatch.context() as m:
        m.setattr(type(smol), "encode_chat", double_bos)
        with pytest.raises(GuardError, match="BOS twice"):
            load_sft(path, smol, 256)

    for mutation in (stray_mask, no_eot, span_in_system_prompt):
        monkeypatch.setattr(type(smol), "encode_chat", mutation)
        with pytest.raises(GuardError) as err:
            load_sft(path, smol, 256)
        assert err.value.guard_id == "GUARD-DATA" and "end-of-turn" in str(err.value)


def test_truncation_policy_is_explicit_and_counted(smol, tmp_path):
    answer = text_of_tokens(smol, 60)
    path = write_jsonl(tmp_path / "d.jsonl", [chat("hi", answer), chat("Question?", "Answer.")])
    with pytest.raises(GuardError):  # 1 of 2 skipped is fine, but not with max_skip_fraction 0.4
        load_sft(path, smol, 40, max_skip_fraction=0.4)
    _, report = load_sft(path, smol, 40, truncation="skip")
    assert report.skipped == {"response_truncated": 1} and report.kept == 1
    examples, report = load_sft(path, smol, 40, truncation="keep")
    assert report.kept == 2 and report.truncated_kept == 1 and report.skipped == {}
    cut = examples[0]
    assert cut.truncated and len(cut) == 40 and cut.loss_tokens == 40 - cut.prompt_tokens
    assert report.eot_trained == report.kept_untruncated == 1  # the cut sample is not counted as eot


def test_row_forms_render_like_messages(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        chat("Add 2 and 3.", "5"),
        {"prompt": "Add 2 and 3.", "completion": "5"},
        {"instruction": "Add 2 and 3.", "output": "5"},
        {"instruction": "Add the numbers.", "input": "2 3", "output": "5"},
        chat("Add the numbers.\n\n2 3", "5"),
    ])
    examples, report = load_sft(path, tok, 256)
    assert report.kept == 5
    ids = [e.input_ids.tolist() for e in examples]
    assert ids[0] == ids[1] == ids[2] and ids[3] == ids[4] and ids[0] != ids[3]
    assert all(e.loss_tokens == 2 for e in examples)  # "5" + end-of-turn


# ---- validation: message, line, exit code ------------------------------------------------------------
MALFORMED = [
    ("{not json", "malformed JSON", "malformed_json"),
    ("[1, 2]", "not an object", "not_an_object"),
    ({"foo": 1}, "expected \"messages\"", "unknown_format"),
    ({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "unknown role 'robot'", "unknown_role"),
    ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]},
     "empty content", "empty_content"),
    ({"prompt": "hi", "completion": ""}, "'completion' is empty", "empty_content"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
     "no assistant message", "no_assistant_message"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y"},
                   {"role": "user", "content": "more"}]}, "not an assistant turn", "not_ending_with_assistant"),
]


@pytest.mark.parametrize("row,message,reason", MALFORMED, ids=[m[2] + str(i) for i, m in enumerate(MALFORMED)])
def test_malformed_row_exit_2_with_file_and_line(row, message, reason, smol_dir, tmp_path, capsys, monkeypatch,
                                                 caplog):
    path = write_jsonl(tmp_path / "bad.jsonl", [chat("hi", "hello"), row, chat("Question?", "Answer.")])
    rc = main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "64"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{path}:2: " in err and message in err and "--skip-invalid" in err

    rc = main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "64", "--skip-invalid",
               "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    report = json.loads(captured.out.strip().splitlines()[-1])["report"]
    assert report["skipped"] == {reason: 1} and report["kept"] == 2 and report["rows_read"] == 3
    assert f"{path}:2: " in caplog.text  # skipped rows are still named (a logged warning)
    # finetune's and eval's reader stops at the first invalid row, naming it (data check lists them all)
    from entrenar.errors import InputError
    from entrenar.tokenizer import load_tokenizer

    with pytest.raises(InputError, match=f"{path}:2: "):
        sft.load_sft(path, load_tokenizer(smol_dir), 64)

    # Mutation: silently skipping invalid rows by default would turn exit 2 into success.
    real_load = sft.load_sft
    monkeypatch.setattr(sft, "load_sft", lambda *a, **k: real_load(*a, **{**k, "skip_invalid": True}))
    assert main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "64"]) == 0


def test_missing_and_empty_files_exit_2(smol_dir, tmp_path, capsys):
    assert main(["data", "check", "--model", smol_dir, "--data", str(tmp_path / "nope.jsonl"),
                 "--max-seq-len", "64"]) == 2
    assert "no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert main(["data", "check", "--model", smol_dir, "--data", str(empty), "--max-seq-len", "64"]) == 2
    assert "empty" in capsys.readouterr().err


def test_data_check_report_numbers(smol, smol_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [chat("hi", "hello"), chat("Question?", "b c d")])
    rc = main(["data", "check", "--model", smol_dir, "--data", path, "--max-seq-len", "64", "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    report = json.loads(captured.out.strip().splitlines()[-1])["report"]
    expected = [len(smol.encode(t, add_special=False)) + 1 for t in ("hello", "b c d")]
    assert report["loss_tokens"] == {"total": sum(expected), "min": min(expected),
                                     "mean": sum(expected) / 2, "max": max(expected)}
    assert report["eot_trained"] == report["kept_untruncated"] == 2 and report["skipped"] == {}
    assert "rows read 2, kept 2" in captured.err


def test_load_sft_rejects_bad_arguments(smol, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat("hi", "hello")])
    with pytest.raises(InputError, match="--truncation"):
        load_sft(path, smol, 64, truncation="clip")
    with pytest.raises(InputError, match="--max-seq-len"):
        load_sft(path, smol, 1)


def test_safe_cuts_keep_real_tokenization(tok):
    """pack encodes long texts in pieces cut after a newline followed by a letter; with the real
    byte-level tokenizers that gives exactly the tokens of the whole text."""
    import inspect
    import sysconfig
    from pathlib import Path

    from entrenar.data import corpus

    license_text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    text = inspect.getsource(json.decoder) + license_text + "x')\n\n\nclass A:\n  \n\tpass\n" + license_text
    pieces = corpus.split_safely(text, 500)
    assert len(pieces) > 20 and "".join(pieces) == text
    assert [t for p in pieces for t in tok.encode(p, add_special=False)] == tok.encode(text, add_special=False)


def test_a_utf8_bom_is_accepted(tmp_path):
    """issue 18 item 11: a file saved with a UTF-8 BOM (Windows editors) was rejected with
    "decode using utf-8-sig"; the BOM is an encoding marker, so the rows load as without it."""
    from entrenar.tokenizer import load_tokenizer
    from entrenar.tokenizer_train import train_tokenizer

    (tmp_path / "c.txt").write_text("hello world, the answer is four. " * 20)
    train_tokenizer([str(tmp_path / "c.txt")], 280, tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    rows = "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                            {"role": "assistant", "content": f"a{i}"}]}) + "\n" for i in range(3))
    (tmp_path / "plain.jsonl").write_text(rows, encoding="utf-8")
    (tmp_path / "bom.jsonl").write_text(rows, encoding="utf-8-sig")
    assert (tmp_path / "bom.jsonl").read_bytes().startswith(b"\xef\xbb\xbf")
    plain, _ = load_sft(tmp_path / "plain.jsonl", tok, 64)
    bom, report = load_sft(tmp_path / "bom.jsonl", tok, 64)
    assert report.rows_read == 3 and [e.input_ids.tolist() for e in bom] == [e.input_ids.tolist() for e in plain]
