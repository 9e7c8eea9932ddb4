"""bench/sft_peers.py: TRL's SFTTrainer trains on the batches `finetune` trains on (the same token ids, the same
trained tokens, the same order), so the speed comparison is the same work."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from bench import sft_peers


def _ours_batches(p: dict, steps: int) -> list[dict]:
    """finetune's batches: its data path (load_sft, the --val-fraction split, --mix, SFTLoader at seed 0)."""
    from entrenar.data.mixing import mix_examples
    from entrenar.data.sft import SFTLoader, load_sft
    from entrenar.tokenizer import load_tokenizer, use_chat_template_file
    from entrenar.train.commands import _split_val

    tok = load_tokenizer(p["model"])
    use_chat_template_file(tok, p["chat_template"])
    examples, _ = load_sft(p["data"], tok, p["max_seq_len"])
    examples, _ = _split_val(examples, 0.05, 0)
    examples, _ = mix_examples(examples, p["mix"], lambda path: load_sft(path, tok, p["max_seq_len"])[0], 0)
    loader = SFTLoader(examples, p["batch"], seed=0, max_seq_len=p["max_seq_len"],
                       pad_id=tok.pad_id if tok.pad_id is not None else tok.eos_id)
    return [loader.next_batch() for _ in range(steps)]


def test_trl_batches_equal_ours(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    steps = 3
    p = {**sft_peers.make_tiny(tmp_path), "steps": steps, "batch": 2, "rank": 4, "lr": 3e-4, "max_seq_len": 512,
         "chat_template": "chatml_tools", "device": "cpu", "work": str(tmp_path / "work")}
    trainer = sft_peers.build_trl_trainer(p)
    theirs = list(trainer.get_train_dataloader())[:steps]
    ours = _ours_batches(p, steps)
    assert len(theirs) == steps
    for step, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        assert t["input_ids"].shape == o["input_ids"].shape, step  # both padded to the batch's longest row
        real = t["attention_mask"].bool()  # where TRL pads, ours pads too (same T, same rows)
        assert torch.equal(t["input_ids"][real], o["input_ids"][real]), step
        # TRL's labels are unshifted (the model shifts them), ours shifted: label t+1 there is label t here
        assert torch.equal(t["labels"][:, 1:], o["labels"][:, :-1]), step
        assert (o["labels"][:, -1] == -100).all() and (t["labels"][:, 0] == -100).all()
        assert (o["labels"] != -100).sum() > 0
    # and the sequence the TRL child reports is the one counted for tokens/s
    seq = sft_peers.training_sequence(p["model"], p["data"], p["mix"], 512, "chatml_tools", steps, 2)
    assert sft_peers.sequence_stats(seq, 2)["sha256"] == sft_peers.sequence_stats(trainer.entrenar_sequence, 2)[
        "sha256"]


def test_defaults_are_the_recipes():
    """The bench's flags default to recipes/smollm2_tool_calls.yaml's, and our row's finetune gets them."""
    from pathlib import Path

    import yaml

    recipe = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "smollm2_tool_calls.yaml").read_text())
    args = sft_peers.build_parser().parse_args(["--out", "x"])
    assert (args.steps, args.batch, args.rank, args.lr, args.max_seq_len, args.chat_template) == (
        recipe["steps"], recipe["batch_size"], recipe["rank"], recipe["lr"], recipe["max_seq_len"],
        recipe["chat_template"])
    assert recipe["mode"] == "lora" and [m.rsplit(":", 1)[1] for m in recipe["mix"]] == ["0.3"]
    p = {"model": recipe["model"], "data": "calls.jsonl", "mix": ["replay.jsonl:0.3"], "steps": args.steps,
         "batch": args.batch, "rank": args.rank, "lr": args.lr, "max_seq_len": args.max_seq_len,
         "chat_template": args.chat_template, "padding_free": args.padding_free, "device": "cuda"}
    cmd = sft_peers.entrenar_command(p, Path("run"))
    flags = dict(zip(cmd[cmd.index("finetune") + 2::2], cmd[cmd.index("finetune") + 3::2]))
    assert flags["--mode"] == "lora" and flags["--mix"] == "replay.jsonl:0.3"
    assert (int(flags["--steps"]), int(flags["--batch-size"]), int(flags["--rank"]), float(flags["--lr"]),
            int(flags["--max-seq-len"])) == (250, 16, 16, 3e-4, 4096)
    assert "--eval-task" not in cmd and "--retain-task" not in cmd  # no in-loop task evals in the timed run
    # the recipe's padding-free batches, unless --no-padding-free
    assert recipe["padding_free"] is True and args.padding_free is True and "--padding-free" in cmd
    p["padding_free"] = sft_peers.build_parser().parse_args(["--out", "x", "--no-padding-free"]).padding_free
    assert "--padding-free" not in sft_peers.entrenar_command(p, Path("run"))


def test_unsloth_row_uses_its_site_and_skips_when_it_does_not_import(tmp_path):
    """The unsloth row imports unsloth from --unsloth-site first (its pinned trl/datasets live there); an import that
    fails in any way makes the row skipped with the cause, and the other rows' children never see that site."""
    site = tmp_path / "site"
    (site / "unsloth").mkdir(parents=True)
    (site / "unsloth" / "__init__.py").write_text("raise RuntimeError('the unsloth of the carried site')\n")
    p = {**sft_peers.make_tiny(tmp_path), "steps": 1, "batch": 2, "rank": 4, "lr": 3e-4, "max_seq_len": 512,
         "chat_template": "chatml_tools", "device": "cpu", "unsloth_site": str(site)}
    row = sft_peers.trl_row("unsloth", p, tmp_path, timeout=300)
    assert row["status"] == "skipped", row
    assert "RuntimeError: the unsloth of the carried site" in row["reason"]
    code, out, _ = sft_peers.run([sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"], 60,
                                 tmp_path / "env.log")
    assert code == 0 and str(site) not in out


def test_a_later_call_adds_rows_to_the_same_sequence(tmp_path):
    """Rows of an earlier call into --out stay when they trained on the same sequence and are not run again."""
    stats = {"sha256": "abc", "tokens": 10}
    rows = [{"row": "trl", "status": "ok"}, {"row": "entrenar", "status": "ok"}]
    (tmp_path / "summary.json").write_text(json.dumps({"sequence": stats, "rows": rows}))
    assert [r["row"] for r in sft_peers.earlier_rows(tmp_path, stats, ["unsloth"])] == ["trl", "entrenar"]
    assert [r["row"] for r in sft_peers.earlier_rows(tmp_path, stats, ["trl"])] == ["entrenar"]
    assert sft_peers.earlier_rows(tmp_path, {"sha256": "other"}, ["unsloth"]) == []


@pytest.mark.real_model
def test_the_trl_rows_train_a_gguf_model(tmp_path):
    """A GGUF (the packaged SmolLM2) reaches TRL as a plain fp32 HF model: transformers marks a model it dequantized
    from a GGUF as quantized and its Trainer refuses to train it (what both TRL rows hit on the GPU)."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    p = {**sft_peers.make_tiny(tmp_path), "model": "smollm2-135m-instruct", "steps": 1, "batch": 2, "rank": 4,
         "lr": 3e-4, "max_seq_len": 512, "chat_template": "chatml_tools", "device": "cpu",
         "work": str(tmp_path / "work")}
    trainer = sft_peers.build_trl_trainer(p)  # raised ValueError (QuantizationMethod.GGUF) before
    assert not getattr(trainer.model, "is_quantized", False)
    from entrenar.formats import load_model

    ours = load_model("smollm2-135m-instruct", dtype=torch.float32).state_dict()
    theirs = trainer.model.get_base_model().state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.base_layer.weight"):
        key = name.replace(".base_layer", "")
        assert torch.equal(theirs[name], ours[key]), name  # the weights finetune loads, bit for bit


def test_our_row_is_checked_against_the_tokens_it_ran(tmp_path, monkeypatch):
    """counted_tokens_match: a padding-free run counts the real tokens, a padded one the tokens padded to each
    batch's longest row; a run that counted the other number does not match."""
    stats = {"samples": 4, "tokens": 100, "padded_tokens": 160, "loss_tokens": 20, "sha256": "x"}
    for padding_free, counted, want in ((True, 100, True), (True, 160, False), (False, 160, True),
                                        (False, 100, False)):
        monkeypatch.setattr(sft_peers, "entrenar_row", lambda p, out, timeout, n=counted: {
            "row": "entrenar", "peer": "entrenar", "status": "ok", "loop_s": 2.0, "counted_tokens": n})
        p = {"steps": 2, "entrenar_flags": [], "padding_free": padding_free}
        monkeypatch.setattr(sft_peers, "write_summary", lambda *a, **k: None)
        row = sft_peers.train_rows(["entrenar"], p, stats, tmp_path, 10.0)[0]
        assert row["counted_tokens_match"] is want and row["tok_s"] == 50.0


def test_our_row_starts_from_an_empty_run_dir(tmp_path, monkeypatch):
    """A later call into the same --out (after a job's time limit cut our row) runs ours again from scratch:
    finetune refuses an --out that holds an unfinished run."""
    old = tmp_path / "entrenar"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    seen = []
    monkeypatch.setattr(sft_peers, "run_entrenar", lambda cmd, out, timeout: (
        seen.append(old.exists()) or ({"row": "entrenar", "status": "failed"}, None)))
    p = {"model": "m", "data": "d", "mix": [], "steps": 1, "batch": 1, "rank": 4, "lr": 1e-3, "max_seq_len": 64,
         "chat_template": "", "device": "cpu"}
    sft_peers.entrenar_row(p, tmp_path, 10.0)
    assert seen == [False]


def test_a_peer_after_ours_runs_that_peer_again_and_is_not_evaluated(tmp_path, monkeypatch):
    """trl-liger-after trains Liger's row again after ours (the faster peer's speed before and after); like
    trl-after it is the same recipe again: only the rows before it are evaluated and paired with ours."""
    assert [sft_peers.row_kind(n) for n in ("trl", "trl-after", "trl-liger", "trl-liger-after", "unsloth")] == [
        "trl", "trl", "trl-liger", "trl-liger", "unsloth"]
    with pytest.raises(AssertionError):
        sft_peers.row_kind("entrenar-after")
    assert "trl-liger-after" in sft_peers.ROWS
    seen = []
    monkeypatch.setattr(sft_peers, "task_eval", lambda r, task, *a: (
        seen.append(r["row"]), r.setdefault("evals", {}).update({task: {"status": "ok"}})))
    monkeypatch.setattr(sft_peers, "write_summary", lambda *a, **k: None)
    rows = [{"row": n, "status": "ok"} for n in ("trl-liger", "entrenar", "trl-liger-after", "trl-after")]
    sft_peers.eval_rows(rows, {"tasks": ["bfcl:simple_python"]}, {}, tmp_path, 10.0)
    assert seen == ["entrenar", "trl-liger"]
