"""From scratch end to end: tokenizer train -> data pack -> pretrain --model PRESET -> a copied
checkpoint directory runs by itself. Presets follow the shards' tokenizer; padding rows of the
rounded vocabulary are never targets; a tokenizer mismatch is exit 2; the llama-370m band."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from entrenar import config
from entrenar.cli import main
from entrenar.config import PARAMETER_BANDS, preset, preset_for_tokenizer, round_vocab
from entrenar.data.corpus import PretrainLoader, read_index
from entrenar.errors import GuardError

CORPUS = [f"def add_{i}(a, b):\n    \"\"\"Add two numbers.\"\"\"\n    return a + b + {i}\n\n" for i in range(60)]


CHAT = "".join(f"<|im_start|>user\nadd_{i}<|im_end|>\n<|im_start|>assistant\na + b + {i}<|im_end|>\n"
               for i in range(10))


def write_corpus(root, n: int = 60, shift: int = 0):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"m{i:02d}.py").write_text(CORPUS[(i + shift) % len(CORPUS)] * 3)
        (root / f"chat{i:02d}.md").write_text(CHAT)  # ChatML turns, so a finetune starts below ln(vocab)
    return root


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    corpus = write_corpus(root / "corpus")
    assert main(["tokenizer", "train", "--vocab-size", "300", "--out", str(root / "tok"), str(corpus)]) == 0
    assert main(["data", "pack", "--model", str(root / "tok"), "--out", str(root / "shards"),
                 "--val-fraction", "0.1", str(corpus)]) == 0
    return root


def pretrain(packed, out, *extra) -> int:
    return main(["pretrain", "--model", "tiny", "--data", str(packed / "shards"), "--out", str(out),
                 "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--save-every", "1",
                 "--no-preflight", *extra])


def test_tokenizer_to_pretrain_to_a_copied_checkpoint_that_generates(packed, tmp_path, capsys):
    assert pretrain(packed, tmp_path / "run") == 0
    err = capsys.readouterr().err
    assert "vocab_size 49152 -> 320" in err and "300 tokens" in err  # the preset followed the tokenizer
    # only the run directory travels; shards and tokenizer dir are not there
    fresh = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "run", fresh / "run", symlinks=True)
    shutil.rmtree(tmp_path / "run")
    run = fresh / "run"
    for d in [run / "checkpoints" / "step-0000001", run / "checkpoints" / "step-0000002", run / "final"]:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
            assert (d / name).is_file(), d / name
        gen = json.loads((d / "generation_config.json").read_text())
        assert gen["eos_token_id"] == 0 and gen["pad_token_id"] == 0  # <|endoftext|>
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["vocab_size"] == 320 and cfg["eos_token_id"] == 0  # issue 18 item 12: not null
    for model in (run / "checkpoints" / "step-0000001", run / "final", run):
        rc = main(["generate", "--model", str(model), "--prompt", "def add_", "--max-new-tokens", "5", "--json"])
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rc == 0 and out["ok"], (model, out)
    ckpt = run / "checkpoints" / "step-0000002"
    rc = main(["eval", "--model", str(ckpt), "--data", str(packed / "shards"), "--seq-len", "16", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["loss"] > 0
    assert main(["convert", str(ckpt), str(fresh / "converted")]) == 0
    assert (fresh / "converted" / "tokenizer.json").is_file() and (fresh / "converted" / "model.safetensors").is_file()


def test_init_with_another_tokenizer_is_exit_2_naming_both(packed, tmp_path, capsys):
    # a model trained on the shards, then shards of a differently trained tokenizer
    assert pretrain(packed, tmp_path / "run") == 0
    other = write_corpus(tmp_path / "other", n=30, shift=7)
    (other / "extra.md").write_text("completely different words here, prose not code. " * 40)
    assert main(["tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path / "tok2"), str(other)]) == 0
    assert main(["data", "pack", "--model", str(tmp_path / "tok2"), "--out", str(tmp_path / "shards2"),
                 str(other)]) == 0
    capsys.readouterr()
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000002"
    rc = main(["pretrain", "--model", "tiny", "--init", str(ckpt), "--data", str(tmp_path / "shards2"),
               "--out", str(tmp_path / "run2"), "--steps", "1", "--seq-len", "16", "--no-preflight"])
    err = capsys.readouterr().err
    assert rc == 2 and str(ckpt) in err and str(tmp_path / "shards2") in err and "different tokenizer" in err
    assert not (tmp_path / "run2").exists()
    # the same tokenizer is accepted: continuing from the checkpoint on its own shards
    rc = main(["pretrain", "--model", "tiny", "--init", str(ckpt), "--data", str(packed / "shards"),
               "--out", str(tmp_path / "run3"), "--steps", "1", "--seq-len", "16", "--no-preflight"])
    assert rc == 0, capsys.readouterr().err


def test_a_changed_shard_tokenizer_is_refused(packed, tmp_path, capsys):
    shutil.copytree(packed / "shards", tmp_path / "shards")
    cfg = tmp_path / "shards" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"eos_token": "<|endoftext|>"', '"eos_token": "<|im_end|>"'))
    rc = main(["pretrain", "--model", "tiny", "--data", str(tmp_path / "shards"), "--out", str(tmp_path / "r"),
               "--steps", "1", "--seq-len", "16", "--no-preflight"])
    assert rc == 2 and "tokenizer_config.json: sha256 differs" in capsys.readouterr().err
    (tmp_path / "shards" / "tokenizer.json").unlink()  # a partial copy of the shard directory
    rc = main(["pretrain", "--model", "tiny", "--data", str(tmp_path / "shards"), "--out", str(tmp_path / "r"),
               "--steps", "1", "--seq-len", "16", "--no-preflight"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer.json: missing" in err and "Copy the whole shard directory" in err
    assert not (tmp_path / "r").exists()


def test_padding_ids_are_never_targets(packed, tmp_path, monkeypatch):
    """The tiny preset over a 300-token tokenizer has 320 rows; ids 300..319 never reach a label.
    A shard holding such an id (corruption) stops with GUARD-DATA before any loss is computed."""
    index = read_index(packed / "shards")
    assert index["vocab_size"] == 300 and round_vocab(300) == 320
    loader = PretrainLoader(packed / "shards", "train", seq_len=16, batch_size=4)
    for _ in range(2 * len(loader) // 4 + 1):  # every window, twice over
        assert int(loader.next_batch()["labels"].max()) < 300
    shutil.copytree(packed / "shards", tmp_path / "bad")
    shard = tmp_path / "bad" / index["splits"]["train"]["shards"][0]["file"]
    toks = np.fromfile(shard, dtype=index["dtype"])
    toks[5] = 300  # the first padding row of the rounded vocabulary (the boundary)
    toks.tofile(shard)
    bad = PretrainLoader(tmp_path / "bad", "train", seq_len=16, batch_size=len(loader))
    with pytest.raises(GuardError, match="GUARD-DATA.*token id 300.*only 300 tokens"):
        bad.next_batch()
    rc = main(["pretrain", "--model", "tiny", "--data", str(tmp_path / "bad"), "--out", str(tmp_path / "r"),
               "--steps", "1", "--seq-len", "16", "--batch-size", str(len(loader)), "--no-preflight"])
    assert rc == 2  # the first batch holds every window


def test_llama_370m_with_a_32000_vocabulary_is_in_its_band(monkeypatch):
    cfg, note = preset_for_tokenizer("llama-370m", 32000, None, 0, 0)
    assert note is None and cfg.vocab_size == 32000 and cfg.eos_token_id == 0
    low, high, vocab = PARAMETER_BANDS["llama-370m"]
    assert low <= cfg.num_parameters() <= high and (low, high, vocab) == (366_000_000, 374_000_000, 32000)
    # another tokenizer changes the embedding rows, not the body: padded to 64, band still checked
    cfg2, note2 = preset_for_tokenizer("llama-370m", 32003, None, 0, 0)
    assert cfg2.vocab_size == 32064 and "32000 -> 32064" in note2
    # mutation: a wrong intermediate size fails when the preset is built, naming the count
    wrong = config.PRESETS["llama-370m"].replace(intermediate_size=4096)
    monkeypatch.setitem(config.PRESETS, "llama-370m", wrong)
    with pytest.raises(ValueError, match=r"443,073,536 parameters .* outside its band"):
        preset("llama-370m")


@pytest.fixture(scope="module")
def base_model(packed):
    """A tiny model pretrained well below ln(vocab), so a finetune's GUARD-INIT-LOSS accepts it."""
    assert main(["pretrain", "--model", "tiny", "--data", str(packed / "shards"), "--out", str(packed / "base"),
                 "--steps", "60", "--seq-len", "32", "--batch-size", "4", "--lr", "1e-2", "--no-preflight"]) == 0
    return packed / "base" / "final"


@pytest.mark.parametrize("mode", ["full", "lora", "qlora"])
def test_finetune_checkpoints_are_runnable_models(base_model, tmp_path, capsys, mode):
    """Every checkpoint of a finetune (full, LoRA, QLoRA) holds the tokenizer, generation_config.json
    and config.json or the PEFT adapter files, so `generate --model CHECKPOINT` runs."""
    rows = [{"messages": [{"role": "user", "content": f"add_{i}"}, {"role": "assistant", "content": f"a + b + {i}"}]}
            for i in range(8)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["finetune", "--model", str(base_model), "--data", str(tmp_path / "sft.jsonl"),
               "--mode", mode, "--rank", "4", "--out", str(tmp_path / "ft"), "--steps", "2", "--batch-size", "2",
               "--max-seq-len", "64", "--save-every", "1", "--no-preflight", "--lr", "1e-3"])
    assert rc == 0, capsys.readouterr().err
    for d in (tmp_path / "ft" / "checkpoints" / "step-0000001", tmp_path / "ft" / "final"):
        names = {p.name for p in d.iterdir()}
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names, names
        assert ("config.json" if mode == "full" else "adapter_config.json") in names, names
        assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 0
        capsys.readouterr()
        rc = main(["generate", "--model", str(d), "--prompt", "add_3", "--chat", "--max-new-tokens", "4", "--json"])
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rc == 0 and out["ok"], (d, out)
