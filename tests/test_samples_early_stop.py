"""`--sample-prompts/--sample-every` (train/samples.py), `--early-stop PATIENCE` (train/early_stop.py) and
`--min-lr-ratio` through the CLI on tiny models (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from entrenar.train import loop
from entrenar.train.early_stop import early_stop
from entrenar.train.metrics import read_jsonl
from entrenar.train.optim import Schedule
from tests import test_train_cli
from tests.helpers.cli import run_cli as main
from tests.helpers.models import tiny_causal_lm, tiny_config
from tests.test_eval_task import tiny_tokenizer
from tests.test_train_cli import pretrain_args

byte_shards, byte_model_dir = test_train_cli.byte_shards, test_train_cli.byte_model_dir


# ---- early stopping ---------------------------------------------------------------------------------------
def test_early_stop_counts_evals_since_the_first_lowest():
    assert early_stop({0: 2.0, 4: 1.5, 8: 1.6}, 2) is None  # one eval since the best
    stop = early_stop({0: 2.0, 4: 1.5, 8: 1.6, 12: 1.5}, 2)  # a tie is not a new best
    assert stop is not None and stop["step"] == 12 and stop["best_step"] == 4 and stop["evals_since_best"] == 2
    assert "2 evals without a new lowest eval loss (lowest 1.5000 at step 4)" in stop["reason"]
    assert early_stop({0: 2.0, 4: 1.5, 8: 1.6, 12: 1.4}, 2) is None  # a new best resets the count
    assert early_stop({0: 1.0, 4: 2.0, 8: 3.0}, 0) is None  # 0 = off
    assert early_stop({}, 1) is None


def _worsening_evals(monkeypatch) -> None:
    """Each eval's loss 0.1 above the one before: no eval after step 0's is a new best (and none far enough
    above it for GUARD-EVAL-DIVERGED)."""
    real = loop.evaluate
    calls = []

    def worse(*args, **kwargs):
        ev = real(*args, **kwargs)
        calls.append(1)
        return {**ev, "loss": ev["loss"] + 0.1 * len(calls)}
    monkeypatch.setattr(loop, "evaluate", worse)


def test_early_stop_ends_the_run_checkpointed_with_final_and_says_why(tmp_path, byte_model_dir, byte_shards,
                                                                      capsys, monkeypatch):
    _worsening_evals(monkeypatch)
    out = tmp_path / "run"
    argv = pretrain_args(byte_model_dir, byte_shards, out, steps=8, extra=("--no-preflight", "--early-stop", "2"))
    argv[argv.index("--eval-every") + 1] = "1"
    code, js, err = main(argv, capsys)
    assert code == 0, err
    stop = js["early_stop"]
    assert stop["step"] == 2 and stop["best_step"] == 0 and stop["patience"] == 2, stop
    assert "--early-stop 2: 2 evals without a new lowest eval loss" in err and "stopped early after step 2" in err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert (out / "checkpoints" / "step-0000002" / "COMPLETE").is_file()  # the stop step is checkpointed
    assert (out / "final" / "sha256.json").is_file()
    assert js["steps"] == 8  # what was asked; early_stop.step is where it ended


def test_without_early_stop_the_same_evals_run_to_the_end(tmp_path, byte_model_dir, byte_shards, capsys, monkeypatch):
    _worsening_evals(monkeypatch)
    out = tmp_path / "run"
    argv = pretrain_args(byte_model_dir, byte_shards, out, steps=4, extra=("--no-preflight",))
    argv[argv.index("--eval-every") + 1] = "1"
    code, js, err = main(argv, capsys)
    assert code == 0, err
    assert js["early_stop"] is None and [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]


# ---- --min-lr-ratio ---------------------------------------------------------------------------------------
def test_min_lr_ratio_is_the_schedules_floor(tmp_path, byte_model_dir, byte_shards, capsys):
    out = tmp_path / "run"
    argv = pretrain_args(byte_model_dir, byte_shards, out, steps=4, extra=(
        "--no-preflight", "--min-lr-ratio", "0.5", "--schedule", "linear", "--save-every", "0"))
    argv[argv.index("--warmup") + 1] = "0"
    code, _, err = main(argv, capsys)
    assert code == 0, err
    lrs = [r["lr"] for r in read_jsonl(out / "metrics.jsonl")]
    want = [Schedule(3e-3, 0, 4, "linear", 0.5).lr_at(i) for i in range(4)]
    assert lrs == pytest.approx(want, rel=1e-12)
    assert lrs != pytest.approx([Schedule(3e-3, 0, 4, "linear", 0.1).lr_at(i) for i in range(4)], rel=1e-6)
    assert json.loads((out / "run.json").read_text())["config"]["min_lr_ratio"] == 0.5


@pytest.mark.parametrize("flags, expect", [
    (("--min-lr-ratio", "1.5"), "--min-lr-ratio must be in [0, 1]"),
    (("--min-lr-ratio", "-0.1"), "--min-lr-ratio must be in [0, 1]"),
    (("--early-stop", "-1"), "--early-stop must be an integer >= 0"),
    (("--sample-every", "2"), "--sample-every 2 needs --sample-prompts FILE"),
    (("--sample-max-new-tokens", "8"), "--sample-max-new-tokens 8 needs --sample-prompts FILE"),
    (("--sample-prompts", "MISSING"), "--sample-prompts MISSING: no such file"),
    (("--sample-prompts", "BAD"), "bad.jsonl:2: a --sample-prompts row needs \"prompt\""),
])
def test_bad_flags_are_exit_2_before_the_run(flags, expect, tmp_path, byte_model_dir, byte_shards, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    flags = tuple({"MISSING": str(tmp_path / "MISSING"), "BAD": str(bad)}.get(f, f) for f in flags)
    expect = expect.replace("MISSING", str(tmp_path / "MISSING"))
    out = tmp_path / "run"
    code, _, err = main(pretrain_args(byte_model_dir, byte_shards, out, extra=flags), capsys)
    assert code == 2 and expect in err, err
    assert not out.exists()


# ---- sample generations -----------------------------------------------------------------------------------
CHATS = [[{"role": "user", "content": f"add {i} and {i}"}, {"role": "assistant", "content": f"{2 * i}"}]
         for i in range(6)]


@pytest.fixture()
def chat_model(tmp_path) -> Path:
    """A tiny qwen2-style model with test_eval_task's tokenizer and chat template, its head untied (a tied tiny
    model repeats the prompt's last token whatever came before it), fitted to CHATS' answers for 30 passes so
    that it beats the uniform guess (GUARD-INIT-LOSS) and answers after the generation prompt."""
    import torch

    from entrenar.formats import save_hf_dir

    tokenizer = tiny_tokenizer()
    cfg = tiny_config("qwen2", vocab_size=len(tokenizer), max_position_embeddings=1024, tie_word_embeddings=False)
    model = tiny_causal_lm(cfg, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    encoded = [tokenizer.encode_chat(chat) for chat in CHATS]
    for _ in range(30):
        for chat in encoded:
            ids = torch.tensor([chat.ids])
            labels = torch.tensor(chat.ids[1:]).masked_fill(~torch.tensor(chat.assistant_mask[1:]), -100)
            loss = torch.nn.functional.cross_entropy(model(ids)[0, :-1], labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return save_hf_dir(model, tmp_path / "m", tokenizer=tokenizer)


@pytest.fixture()
def chat_rows(tmp_path) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    return rows


def finetune_args(model: Path, rows: Path, out: Path, *extra: str) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(rows), "--out", str(out), "--mode", "full",
            "--batch-size", "2", "--lr", "1e-3", "--no-preflight", "--json", *extra]


def test_samples_are_the_models_greedy_completions(tmp_path, chat_model, chat_rows, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "add 2 and 2"}) + "\n"
                       + json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "add 3 and 3"}]}) + "\n")
    out = tmp_path / "run"
    code, _, err = main(finetune_args(chat_model, chat_rows, out, "--steps", "3", "--val-fraction", "0",
                                      "--sample-prompts", str(prompts), "--sample-every", "2",
                                      "--sample-max-new-tokens", "5"), capsys)
    assert code == 0, err
    samples = read_jsonl(out / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in samples] == [(s, p) for s in (0, 2, 3) for p in ("add 2 and 2",
                                                                                              "add 3 and 3")]
    assert "step 2: samples (2 prompts" in err and "'add 2 and 2' -> " in err
    # the last step's samples are what `generate` makes from final/: greedy, at most 5 tokens, chat-rendered
    for prompt, system in (("add 2 and 2", None), ("add 3 and 3", "Be brief.")):
        code, gen, err = main(["generate", "--model", str(out / "final"), "--prompt", prompt, "--chat",
                               *(("--system", system) if system else ()), "--max-new-tokens", "5", "--json"], capsys)
        assert code == 0, err
        last = next(r for r in samples if r["step"] == 3 and r["prompt"] == prompt)
        assert last["completion"] == gen["text"] and last["stop_reason"] == gen["stop_reason"]
    # an answer that ends its turn: the prompt ended in the template's generation prompt
    assert all(r["completion"] and r["stop_reason"] == "eos" for r in samples), samples


def test_samples_resume_keeps_the_lines_up_to_the_checkpoint(tmp_path, chat_model, chat_rows, capsys, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text("add 1 and 1\n\nadd 4 and 4\n")
    orig = loop.Trainer.train_step

    def step(self, n):
        if n == 5:
            raise KeyboardInterrupt
        return orig(self, n)
    monkeypatch.setattr(loop.Trainer, "train_step", step)
    out = tmp_path / "run"
    extra = ("--steps", "6", "--val-fraction", "0", "--save-every", "3", "--sample-prompts", str(prompts),
             "--sample-every", "2", "--sample-max-new-tokens", "3")
    code, _, err = main(finetune_args(chat_model, chat_rows, out, *extra), capsys)
    assert code == 130, err  # stopped in step 5: checkpoint 3, samples of steps 0, 2, 4
    assert sorted({r["step"] for r in read_jsonl(out / "samples.jsonl")}) == [0, 2, 4]
    monkeypatch.setattr(loop.Trainer, "train_step", orig)
    code, _, err = main(finetune_args(chat_model, chat_rows, out, *extra, "--resume", "auto"), capsys)
    assert code == 0, err
    rows = read_jsonl(out / "samples.jsonl")
    assert [r["step"] for r in rows] == [0, 0, 2, 2, 4, 4, 6, 6]  # step 4's from the first process went
    assert [r["prompt"] for r in rows[:2]] == ["add 1 and 1", "add 4 and 4"]


# ---- --keep-best eval -------------------------------------------------------------------------------------
def test_keep_best_eval_writes_final_from_the_lowest_eval(tmp_path, byte_model_dir, byte_shards, capsys,
                                                          monkeypatch):
    from safetensors.torch import load_file

    real, offsets, calls = loop.evaluate, [0.0, 0.0, -0.5, 0.0, 0.0], []

    def step_2_best(*args, **kwargs):  # the eval after step 2 is far below the others
        ev = real(*args, **kwargs)
        calls.append(1)
        return {**ev, "loss": ev["loss"] + offsets[len(calls) - 1]}
    monkeypatch.setattr(loop, "evaluate", step_2_best)
    out = tmp_path / "run"
    argv = pretrain_args(byte_model_dir, byte_shards, out, steps=4, extra=(
        "--no-preflight", "--keep-best", "eval", "--keep", "0"))
    argv[argv.index("--eval-every") + 1] = "1"
    argv[argv.index("--save-every") + 1] = "1"
    code, js, err = main(argv, capsys)
    assert code == 0, err
    assert js["final_holds_step"] == 2 and "final/ holds the weights of step 2" in err
    final = load_file(out / "final" / "model.safetensors")
    at = {s: load_file(out / "checkpoints" / f"step-000000{s}" / "model.safetensors") for s in (2, 4)}
    assert final.keys() == at[2].keys()
    assert all((final[k] == at[2][k]).all() for k in final)
    assert any((final[k] != at[4][k]).any() for k in final)


def test_keep_best_eval_without_an_eval_set_is_exit_2(tmp_path, chat_model, chat_rows, capsys):
    out = tmp_path / "run"
    code, _, err = main(finetune_args(chat_model, chat_rows, out, "--steps", "2", "--val-fraction", "0",
                                      "--keep-best", "eval"), capsys)
    assert code == 2 and "--keep-best eval keeps the weights of the lowest eval loss" in err, err
    assert not out.exists()
