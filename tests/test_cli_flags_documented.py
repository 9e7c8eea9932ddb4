"""Every flag does what docs/design.md and its --help say, shown through the real CLI entry point.

The audit (flag -> test) found these flags parsed and recorded but with no test of their effect; each test
here runs the command on a tiny model (byte-level shards of test_train_cli, SmolLM2's tokenizer on a tiny
base, the tiny tokenizer of test_tokenizer) and reads the effect back from what the command wrote:
checkpoints, metrics.jsonl / eval.jsonl columns, the adapter config, the generated ids, the shards.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from entrenar.train.metrics import read_jsonl
from tests import test_train_cli
from tests.helpers.cli import run_cli as main

# the byte-level model of test_train_cli (an architecture pretrain initialises), module-scoped there
byte_model_dir = test_train_cli.byte_model_dir


def pretrain(model: Path, data: Path, out: Path, *extra: str, capsys=None) -> tuple[int, dict | None, str]:
    """`entrenar pretrain` with small fixed shapes (seq 32, batch 2) and nothing else preset: the flags
    under test are the caller's, every other one at its documented default."""
    return main(["pretrain", "--model", str(model), "--data", str(data), "--out", str(out), "--seq-len", "32",
                 "--batch-size", "2", "--no-preflight", "--json", *extra], capsys)


def _help(*command: str) -> str:
    """`entrenar COMMAND --help` as printed."""
    import contextlib
    import io

    from entrenar import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    return " ".join(buf.getvalue().split())


def checkpoint_steps(run: Path) -> list[int]:
    return sorted(int(d.name.split("-")[1]) for d in (run / "checkpoints").iterdir()
                  if d.name.startswith("step-") and not d.is_symlink())


# ---- pretrain / finetune: checkpoints, schedule, eval, seed ---------------------------------------------
def test_keep_n_leaves_the_newest_n_checkpoints_and_0_keeps_all(tmp_path, byte_model_dir, small_shards, capsys):
    """--keep N: the newest N complete checkpoints stay; --keep 0 keeps every one (docs/design.md)."""
    common = ("--steps", "4", "--save-every", "1", "--eval-batches", "1")
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "k2", *common, "--keep", "2", capsys=capsys)
    assert code == 0, err
    assert checkpoint_steps(tmp_path / "k2") == [3, 4]
    assert (tmp_path / "k2" / "checkpoints" / "latest").resolve().name == "step-0000004"
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "k0", *common, "--keep", "0", capsys=capsys)
    assert code == 0, err
    assert checkpoint_steps(tmp_path / "k0") == [1, 2, 3, 4]


def test_default_keep_is_3(tmp_path, byte_model_dir, small_shards, capsys):
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "r", "--steps", "5", "--save-every", "1",
                            "--eval-batches", "1", capsys=capsys)
    assert code == 0, err
    assert checkpoint_steps(tmp_path / "r") == [3, 4, 5]


def _lrs(run: Path) -> list[float]:
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["lr"] for r in rows]


def test_warmup_default_and_schedules_in_the_lr_column(tmp_path, byte_model_dir, small_shards, capsys):
    """metrics.jsonl's lr: --warmup defaults to min(100, steps/10) (2 of 20 steps: a linear ramp to --lr),
    then --schedule decays to 0.1 x the peak by the last step (cosine by default); --warmup 0 starts at the
    peak; constant stays there; linear falls by equal steps."""
    peak = 4e-3
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "cos", "--steps", "20", "--lr", str(peak),
                            "--eval-batches", "1", capsys=capsys)
    assert code == 0, err
    lrs = _lrs(tmp_path / "cos")
    assert lrs[:3] == pytest.approx([peak / 2, peak, peak], rel=1e-9)  # warmup 2 = min(100, 20/10)
    # cosine over the 18 steps after warmup, to min_lr_ratio 0.1 of the peak
    assert lrs[-1] == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 17 / 18))), rel=1e-9)
    assert all(a >= b for a, b in itertools.pairwise(lrs[1:])), "cosine decay never rises"
    run = json.loads((tmp_path / "cos" / "run.json").read_text())
    assert run["config"]["warmup"] == 2 and run["config"]["schedule"] == "cosine"

    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "const", "--steps", "4", "--lr", str(peak),
                            "--warmup", "0", "--schedule", "constant", "--eval-batches", "1", capsys=capsys)
    assert code == 0, err
    assert _lrs(tmp_path / "const") == pytest.approx([peak] * 4, rel=1e-9)

    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "lin", "--steps", "5", "--lr", str(peak),
                            "--warmup", "1", "--schedule", "linear", "--eval-batches", "1", capsys=capsys)
    assert code == 0, err
    # warmup 1 step, then 4 steps from the peak down towards 0.1 x peak: 1 - progress, progress = k / 4
    assert _lrs(tmp_path / "lin") == pytest.approx([peak * (0.1 + 0.9 * (1 - k / 4)) for k in (0, 0, 1, 2, 3)],
                                                   rel=1e-9)


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory) -> Path:
    """Byte-level shards with a val split of a few windows (an eval over all of it stays fast)."""
    from entrenar.data.corpus import pack

    root = tmp_path_factory.mktemp("small")
    for i in range(24):
        (root / f"d{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox. " * (3 + i % 4))
    pack([str(root)], test_train_cli.ByteTokenizer(), root / "shards", val_fraction=0.25, seed=1)
    return root / "shards"


def test_eval_every_and_eval_batches(tmp_path, byte_model_dir, small_shards, capsys):
    """--eval-every N evaluates at step 0, every N steps and at the end; --eval-batches N bounds each eval
    to N batches; 0 = at start and end / all batches. --save-every N checkpoints every N steps and at the end;
    0 at the end only."""
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "a", "--steps", "5", "--eval-every", "3",
                            "--eval-batches", "2", "--save-every", "2", capsys=capsys)
    assert code == 0, err
    rows = read_jsonl(tmp_path / "a" / "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 3, 5]  # and at the end, off the period
    assert checkpoint_steps(tmp_path / "a") == [2, 4, 5]  # --save-every 2, and the end
    assert {r["batches"] for r in rows} == {2} and {r["tokens"] for r in rows} == {2 * 2 * 32}

    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "b", "--steps", "2", "--eval-batches", "0",
                            capsys=capsys)
    assert code == 0, err
    rows = read_jsonl(tmp_path / "b" / "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 2]  # --eval-every 0: at start and end
    assert checkpoint_steps(tmp_path / "b") == [2]  # --save-every 0 (the default): a checkpoint at the end only
    val_windows = json.loads((tmp_path / "b" / "data_report.json").read_text())["val_windows"]
    assert val_windows > 2 * 2, "the val split must be larger than the bounded eval above"
    assert {r["tokens"] for r in rows} == {val_windows * 32}  # every val window, once
    assert {r["batches"] for r in rows} == {math.ceil(val_windows / 2)}


def test_seed_same_command_same_metrics_other_seed_differs(tmp_path, byte_model_dir, small_shards, capsys):
    """--seed seeds init and data order: the same command twice gives identical metrics (docs/design.md)."""
    def losses(name: str, seed: str) -> list[float]:
        code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / name, "--steps", "3", "--seed", seed,
                                "--eval-batches", "1", capsys=capsys)
        assert code == 0, err
        return [r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")]

    a, b, c = losses("a", "7"), losses("b", "7"), losses("c", "8")
    assert a == b
    assert a != c


# ---- finetune: --lr auto and the adapter flags, --max-skip-fraction, --val, --pack -------------------------
@pytest.fixture(scope="module")
def sft_base(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny base with SmolLM2's tokenizer whose start passes GUARD-INIT-LOSS, and 8 chat rows."""
    from tests.test_peft_seed import tiny_base_and_data

    return tiny_base_and_data(tmp_path_factory.mktemp("sftbase"))


def finetune(base: Path, data: Path, out: Path, *extra: str, capsys=None) -> tuple[int, dict | None, str]:
    return main(["finetune", "--model", str(base), "--data", str(data), "--out", str(out), "--batch-size", "2",
                 "--max-seq-len", "64", "--no-preflight", "--json", *extra], capsys)


def test_lr_auto_follows_rank_alpha_rslora_and_the_adapter_flags_reach_the_adapter(tmp_path, sft_base, capsys):
    """finetune's default --lr is auto: the rate auto_lr gives for this --rank/--alpha/--rslora (2.5e-5 for
    r=4, alpha 64, rslora; 5e-5 without rslora), logged and in every lr row; --rank/--alpha/--rslora/
    --targets/--dropout are what final/adapter_config.json and the adapter tensors say."""
    from safetensors.torch import load_file

    from entrenar.peft import auto_lr

    base, data = sft_base
    out = tmp_path / "lora"
    code, _, err = finetune(base, data, out, "--mode", "lora", "--rank", "4", "--alpha", "64", "--rslora",
                            "--targets", "q_proj,v_proj", "--dropout", "0.1", "--steps", "2",
                            "--schedule", "constant", capsys=capsys)
    assert code == 0, err
    want, _ = auto_lr("lora", 4, True, 64.0)
    assert want == pytest.approx(2.5e-5) and auto_lr("lora", 4, False, 64.0)[0] == pytest.approx(5e-5)
    assert f"--lr auto: {want:g}" in err
    assert _lrs(out) == pytest.approx([want, want], rel=1e-12)
    assert json.loads((out / "run.json").read_text())["config"]["lr"] == pytest.approx(want)
    cfg = json.loads((out / "final" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"], cfg["lora_dropout"]) == (4, 64, True, 0.1)
    assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    tensors = load_file(str(out / "final" / "adapter_model.safetensors"))
    assert {n.split(".")[-3] for n in tensors} == {"q_proj", "v_proj"}  # ...q_proj.lora_A.weight
    assert {t.shape[0] for n, t in tensors.items() if "lora_A" in n} == {4}

    code, _, err = finetune(base, data, tmp_path / "full", "--steps", "1", capsys=capsys)
    assert code == 0, err
    assert _lrs(tmp_path / "full") == [pytest.approx(auto_lr("full")[0])]  # 2e-5, warmup 0 of 1 step
    code, _, err = finetune(base, data, tmp_path / "given", "--steps", "1", "--lr", "1e-3", capsys=capsys)
    assert code == 0, err
    assert _lrs(tmp_path / "given") == [pytest.approx(1e-3)]


def test_max_skip_fraction_is_the_threshold_of_guard_data(tmp_path, sft_base, capsys):
    """--skip-invalid counts the 2 bad rows of 10 (0.2 skipped): --max-skip-fraction 0.1 is GUARD-DATA, exit 2,
    before training; 0.25 trains with the 2 rows counted in data_report.json."""
    base, data = sft_base
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(data.read_text() + json.dumps({"prompt": "no completion"}) + "\n"
                     + json.dumps({"text": "not a chat row"}) + "\n")
    code, result, err = finetune(base, mixed, tmp_path / "strict", "--steps", "1", "--skip-invalid",
                                 "--max-skip-fraction", "0.1", capsys=capsys)
    assert code == 2 and result["guard"] == "GUARD-DATA", err
    assert not (tmp_path / "strict" / "metrics.jsonl").exists()
    code, _, err = finetune(base, mixed, tmp_path / "lenient", "--steps", "1", "--skip-invalid",
                            "--max-skip-fraction", "0.25", capsys=capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "lenient" / "data_report.json").read_text())["train"]
    assert (report["rows_read"], report["skipped_total"], report["skip_fraction"]) == (10, 2, 0.2)
    code, result, _ = finetune(base, mixed, tmp_path / "no-skip", "--steps", "1", capsys=capsys)
    assert code == 2 and "--skip-invalid" in result["error"]  # without --skip-invalid a bad row is exit 2


def test_val_file_and_val_fraction(tmp_path, sft_base, capsys):
    """--val FILE is the eval set (its rows, every one); without it --val-fraction of --data is held out."""
    base, data = sft_base
    val = tmp_path / "val.jsonl"
    val.write_text("".join(data.read_text().splitlines(keepends=True)[:3]))  # the tokens the base knows
    code, _, err = finetune(base, data, tmp_path / "v", "--steps", "1", "--val", str(val), capsys=capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "v" / "data_report.json").read_text())
    assert (report["train_examples"], report["val_examples"]) == (8, 3)
    code, _, err = finetune(base, data, tmp_path / "f", "--steps", "1", "--val-fraction", "0.25", capsys=capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "f" / "data_report.json").read_text())
    assert (report["train_examples"], report["val_examples"]) == (6, 2)


def test_pack_puts_several_samples_in_a_row(tmp_path, sft_base, capsys):
    """--pack: a row of --max-seq-len tokens holds several samples, so one row of a step trains the loss tokens
    of each of them (padded: exactly one sample per row)."""
    base, data = sft_base
    rows = {}
    for name, extra in (("padded", ()), ("packed", ("--pack",))):
        code, _, err = finetune(base, data, tmp_path / name, "--steps", "1", "--batch-size", "1",
                                "--val-fraction", "0", "--max-seq-len", "128", *extra, capsys=capsys)
        assert code == 0, err
        rows[name] = read_jsonl(tmp_path / name / "metrics.jsonl")[0]
    # each sample of this data is 36 tokens of which 3 train (the answer and <|im_end|>); 128 hold 3 samples
    assert rows["padded"]["loss_tokens"] == 3
    assert rows["packed"]["loss_tokens"] == 3 * 3
    assert "--batch-size then counts rows" in _help("finetune")  # what --batch-size 1 meant here


# ---- generate: --max-new-tokens, --temperature, --top-p, --seed ------------------------------------------
def _generate_dir(root: Path, context: int = 256) -> Path:
    """An HF dir of test_generate's tiny random model (sharp logits, untied head) with the tiny tokenizer;
    `context` is its max_position_embeddings. The head rows of the stop tokens are zero: their logit 0 is
    below the largest of ~270 sharp logits, so greedy decoding never stops before its bound."""
    import torch

    from entrenar.formats import save_hf_dir
    from tests.helpers.models import tiny_causal_lm, tiny_config
    from tests.helpers.tokenizers import tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = tiny_config("qwen2", vocab_size=len(tok), tie_word_embeddings=False, rms_norm_eps=1e-6,
                      max_position_embeddings=context)
    model = tiny_causal_lm(cfg, 0, bias_std=0.3, head_scale=10.0).eval()
    with torch.no_grad():
        for i in {tok.eos_id, tok.eot_id} - {None}:
            model.lm_head.weight[i] = 0.0
    return save_hf_dir(model, root / f"gen-{context}", tokenizer=tok)


def generate_cli(model: Path, *extra: str, capsys) -> dict:
    code, result, err = main(["generate", "--model", str(model), "--prompt", "the in the er", "--json", *extra],
                             capsys)
    assert code == 0 and result["ok"], err
    return result


def test_max_new_tokens_bounds_the_output_and_defaults_to_the_context_left(tmp_path, capsys, monkeypatch):
    """--max-new-tokens N: exactly N tokens when nothing stops earlier (this model's greedy text never reaches
    a stop token); without it, the default (256) or what is left of the context if less."""
    from entrenar import generate
    from entrenar.cli import models as model_commands

    model = _generate_dir(tmp_path, context=20)
    r = generate_cli(model, "--max-new-tokens", "5", capsys=capsys)
    assert (r["completion_tokens"], len(r["token_ids"]), r["stop_reason"]) == (5, 5, "max_new_tokens")
    r = generate_cli(model, capsys=capsys)
    assert r["completion_tokens"] == 20 - r["prompt_tokens"] and r["prompt_tokens"] > 0
    assert generate.DEFAULT_MAX_NEW_TOKENS == 256 and "default 256" in _help("generate")
    monkeypatch.setattr(model_commands, "DEFAULT_MAX_NEW_TOKENS", 9)  # 256 tokens take ~30 s on this CPU
    r = generate_cli(_generate_dir(tmp_path, context=400), capsys=capsys)
    assert r["completion_tokens"] == 9  # the default when the context has room


def test_temperature_top_p_and_seed_reach_the_sampler(tmp_path, capsys):
    """--temperature 0 (the default) is greedy, as the library's generate; --top-p 1e-6 keeps only the most
    likely token, so sampling at any temperature is greedy again; --top-p 1 at --temperature 3 samples
    other tokens, the same ones for the same --seed."""
    import torch

    from entrenar.formats import load_model
    from entrenar.generate import generate
    from tests.helpers.tokenizers import tiny_tokenizer

    model = _generate_dir(tmp_path)
    n = ("--max-new-tokens", "12")
    greedy = generate_cli(model, *n, capsys=capsys)["token_ids"]
    tok = tiny_tokenizer()
    lib = generate(load_model(model, dtype=torch.float32).eval(), tok, tok.encode("the in the er"), 12)
    assert greedy == lib.token_ids
    assert generate_cli(model, *n, "--temperature", "3", "--top-p", "1e-6", "--seed", "1",
                        capsys=capsys)["token_ids"] == greedy
    hot = generate_cli(model, *n, "--temperature", "3", "--top-p", "1", "--seed", "1", capsys=capsys)["token_ids"]
    assert hot != greedy
    assert generate_cli(model, *n, "--temperature", "3", "--seed", "1", capsys=capsys)["token_ids"] == hot
    assert generate_cli(model, *n, "--temperature", "3", "--seed", "2", capsys=capsys)["token_ids"] != hot
    assert "nucleus sampling" in _help("generate")  # --top-p had no help text before this audit


# ---- data pack, tokenizer train, eval: --workers, --shard-tokens, --seed, --overwrite, --min-frequency, --split
def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_data_pack_workers_shard_tokens_seed_and_overwrite(tmp_path, capsys, monkeypatch):
    """`data pack`: --workers 2 tokenizes in a pool of 2 processes and writes the same bytes as --workers 1;
    --shard-tokens N caps every shard file at N tokens; --seed picks another train/val split of the
    documents; an existing --out is exit 2 unless --overwrite, which replaces it."""
    import numpy as np

    from entrenar.data import corpus
    from entrenar.tokenizer_train import train_tokenizer
    from tests.test_data_pack import TEXTS

    (tmp_path / "c.txt").write_text("".join(TEXTS) * 3)
    train_tokenizer([str(tmp_path / "c.txt")], 320, tmp_path / "tok")
    src = tmp_path / "src"
    src.mkdir()
    for i, t in enumerate(TEXTS):
        (src / f"m{i:02d}.py").write_text(t)
    monkeypatch.setattr(corpus, "TASK_BYTES", 400)  # several encode tasks, so both workers get some
    monkeypatch.setattr(corpus, "MIN_SHARD_TOKENS", 64)  # shards of 97 tokens: several for this small corpus
    pools = []  # (workers, tasks) of each pack: _run_tasks spawns a pool when both are > 1
    real_run_tasks = corpus._run_tasks

    def run_tasks(tasks, ctx, workers):
        pools.append((workers, len(tasks)))
        return real_run_tasks(tasks, ctx, workers)

    monkeypatch.setattr(corpus, "_run_tasks", run_tasks)

    def pack(out: str, *extra: str) -> tuple[int, dict | None, str]:
        return main(["data", "pack", "--model", str(tmp_path / "tok"), "--out", str(tmp_path / out),
                     "--shard-tokens", "97", "--val-fraction", "0.25", "--json", *extra, str(src)], capsys)

    code, one, err = pack("w1", "--workers", "1", "--seed", "3")
    assert code == 0, err
    code, two, err = pack("w2", "--workers", "2", "--seed", "3")
    assert code == 0 and two["workers"] == 2, err
    assert pools[0][0] == 1 and pools[1][0] == 2 and pools[1][1] > 2  # a pool of 2 over several tasks
    assert _files(tmp_path / "w1") == _files(tmp_path / "w2")
    index = corpus.read_index(tmp_path / "w1")
    shards = [s for split in index["splits"].values() for s in split["shards"]]
    assert len(shards) > 3
    assert all(0 < np.fromfile(tmp_path / "w1" / s["file"], dtype=index["dtype"]).size <= 97 for s in shards)

    code, other, err = pack("s4", "--seed", "4")
    assert code == 0, err
    assert one["documents"] == other["documents"] == 40  # every document, split another way
    assert one["splits"]["val"] != other["splits"]["val"] and one["splits"]["val"]["documents"] > 0
    assert "seeded hash" in _help("data", "pack")  # --val-fraction is per document: about that fraction, not exact

    before = _files(tmp_path / "w1")
    code, refused, _ = pack("w1", "--seed", "4")
    assert code == 2 and "--overwrite" in refused["error"] and _files(tmp_path / "w1") == before
    code, _, err = pack("w1", "--seed", "4", "--overwrite")
    assert code == 0, err
    assert _files(tmp_path / "w1") == _files(tmp_path / "s4")


def test_tokenizer_min_frequency_bounds_the_merges(tmp_path, capsys):
    """`tokenizer train --min-frequency N`: no merge of a pair seen fewer than N times. A pair-count above
    every pair's count leaves only the byte alphabet and the specials, whatever --vocab-size asks."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 20 + "zq xj\n")
    sizes = {}
    for n in ("1", "1000"):
        out = tmp_path / f"tok{n}"
        code, _, err = main(["tokenizer", "train", "--vocab-size", "400", "--out", str(out), "--min-frequency", n,
                             "--json", str(corpus)], capsys)
        assert code == 0, err
        model = json.loads((out / "tokenizer.json").read_text())["model"]
        sizes[n] = (len(model["vocab"]), len(model["merges"]))
    assert sizes["1000"] == (256 + 3, 0)  # no pair occurs 1000 times: 256 bytes + 3 specials, no merge
    assert sizes["1"][1] == sizes["1"][0] - 259 > 0  # every pair seen once may merge: one token per merge


def test_eval_split_picks_the_shard_split_and_defaults_to_val(tmp_path, byte_model_dir, small_shards, capsys):
    """`eval --split train|val` evaluates that split of the shards (every window with --max-batches 0);
    without it, val when the shards have one."""
    from entrenar.data.corpus import read_index

    splits = read_index(small_shards)["splits"]

    def ev(*extra: str) -> dict:
        code, result, err = main(["eval", "--model", str(byte_model_dir), "--data", str(small_shards), "--seq-len",
                                  "32", "--batch-size", "4", "--json", *extra], capsys)
        assert code == 0, err
        return result

    val, train, default = ev("--split", "val"), ev("--split", "train"), ev()
    assert val["tokens"] == (splits["val"]["tokens"] - 1) // 32 * 32  # windows of 32 targets, shifted by one
    assert train["tokens"] == (splits["train"]["tokens"] - 1) // 32 * 32
    assert train["tokens"] > val["tokens"] and default == {**default, "loss": val["loss"], "tokens": val["tokens"]}
    assert ev("--split", "train", "--max-batches", "2")["tokens"] == 2 * 4 * 32


# ---- --adapter / --force-base on every command that takes an adapter ----------------------------------------
@pytest.fixture(scope="module")
def adapter_on_a(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(base A with the tiny tokenizer, base B: the same shape from another seed, a LoRA adapter trained on A
    whose B matrices are nonzero so it changes the output)."""
    import torch

    from entrenar import peft as ep
    from entrenar.formats import load_model, save_hf_dir
    from tests.test_peft import randomize_adapters

    root = tmp_path_factory.mktemp("adapter")
    a = _generate_dir(root / "A")
    b_model = load_model(a, dtype=torch.float32)
    with torch.no_grad():
        for p in b_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    from tests.helpers.tokenizers import tiny_tokenizer

    b = save_hf_dir(b_model, root / "B", tokenizer=tiny_tokenizer())
    m = load_model(a, dtype=torch.float32)
    ep.apply_lora(m, rank=4, alpha=8)
    randomize_adapters(m, std=0.5)
    ep.save_adapter(m, root / "adapter", str(a))
    return Path(a), Path(b), root / "adapter"


def test_generate_adapter_changes_the_output(tmp_path, adapter_on_a, capsys):
    a, _, adapter = adapter_on_a
    n = ("--max-new-tokens", "6")
    plain = generate_cli(a, *n, capsys=capsys)["token_ids"]
    assert generate_cli(a, *n, "--adapter", str(adapter), capsys=capsys)["token_ids"] != plain


@pytest.mark.parametrize("command", ["generate", "eval", "export", "verify", "qa"])
def test_force_base_is_needed_to_apply_an_adapter_to_another_base(command, tmp_path, adapter_on_a, capsys):
    """An adapter recorded for base A on base B: exit 2 naming --force-base; with --force-base the command runs
    (docs/design.md: any command taking --adapter)."""
    _, b, adapter = adapter_on_a
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"the {w}", "completion": w}) + "\n" for w in ("in", "er", "the")))
    argv = {"generate": ["generate", "--model", str(b), "--prompt", "the", "--max-new-tokens", "2"],
            "eval": ["eval", "--model", str(b), "--data", str(data), "--max-seq-len", "64"],
            "export": ["export", "gguf", str(b), str(tmp_path / "m.gguf"), "--type", "f32"],
            "verify": ["verify", "--model", str(b), "--seq-len", "32", "--no-grads"],
            "qa": ["qa", "--model", str(b)]}[command]
    argv += ["--adapter", str(adapter), "--json"]
    code, result, err = main(argv, capsys)
    assert code == 2 and "--force-base" in result["error"], err
    assert not (tmp_path / "m.gguf").exists()
    if command == "qa":
        return  # qa's forced run generates its golden prompts (~20 s here); the load it shares is shown above
    code, result, err = main([*argv, "--force-base"], capsys)
    assert code == 0 and result["ok"], err
    assert "--force-base" in err  # the forced mismatch is reported, not silent


# ---- --truncation (finetune, eval, data check), eval --dtype -------------------------------------------------
@pytest.mark.parametrize("command", ["finetune", "eval", "data check"])
def test_truncation_keep_trains_cut_samples_skip_drops_them(command, tmp_path, sft_base, capsys):
    """Every sample of this data is 36 tokens whose last 3 are the response: at --max-seq-len 35 each response
    is cut. --truncation skip (the default) skips all 8 (GUARD-DATA, exit 2); keep keeps the 8 cut samples."""
    base, data = sft_base

    def run(*extra: str) -> tuple[int, dict | None, str]:
        if command == "finetune":
            return finetune(base, data, tmp_path / f"run{len(extra)}", "--steps", "1", "--val-fraction", "0",
                            "--max-seq-len", "35", *extra, capsys=capsys)
        argv = (["eval", "--model", str(base), "--data", str(data), "--batch-size", "2"] if command == "eval" else
                ["data", "check", "--model", str(base), "--data", str(data)])
        return main([*argv, "--max-seq-len", "35", "--json", *extra], capsys)

    code, result, err = run()
    assert code == 2 and result["guard"] == "GUARD-DATA", err
    code, result, err = run("--truncation", "keep")
    assert code == 0, err
    if command == "finetune":
        report = json.loads((tmp_path / "run2" / "data_report.json").read_text())["train"]
        assert read_jsonl(tmp_path / "run2" / "metrics.jsonl")[0]["loss_tokens"] == 2 * 2  # 2 of 3 per sample
    elif command == "eval":
        assert result["tokens"] == 8 * 2  # every sample, its 2 response tokens inside 35
        return
    else:
        report = result["report"]
    assert (report["kept"], report["truncated_kept"], report["skipped_total"]) == (8, 8, 0)


def test_eval_dtype_bf16_is_a_bf16_forward_within_the_ce_bound(tmp_path, byte_model_dir, small_shards, capsys):
    """`eval --dtype bf16` runs the forward in bf16 autocast: another loss than fp32's, within docs/design.md's
    0.05 nats of CE between a bf16 and an fp32 forward."""
    def loss(dtype: str) -> float:
        code, result, err = main(["eval", "--model", str(byte_model_dir), "--data", str(small_shards), "--seq-len",
                                  "32", "--batch-size", "4", "--max-batches", "2", "--dtype", dtype, "--json"], capsys)
        assert code == 0, err
        return result["loss"]

    fp32, bf16 = loss("fp32"), loss("bf16")
    assert fp32 != bf16 and abs(fp32 - bf16) <= 0.05


@pytest.mark.parametrize(("flag", "value"), [("--shard-tokens", "0"), ("--workers", "0"), ("--val-fraction", "1")])
def test_data_pack_bad_number_exits_2_naming_the_flag(flag, value, tmp_path, capsys):
    """A bad number for a `data pack` flag is exit 2 naming that flag, nothing written."""
    from entrenar.tokenizer import save_tokenizer_files
    from tests.helpers.tokenizers import tiny_tokenizer

    tok_dir = tmp_path / "tok"
    save_tokenizer_files(tiny_tokenizer(), tok_dir)
    (tmp_path / "a.txt").write_text("some text\n")
    code, result, err = main(["data", "pack", "--model", str(tok_dir), "--out", str(tmp_path / "out"), flag, value,
                              "--json", str(tmp_path / "a.txt")], capsys)
    assert code == 2 and flag in result["error"], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flag", "value"), [("--top-p", "0"), ("--top-p", "1.5"), ("--temperature", "-1"),
                                             ("--max-new-tokens", "0")])
def test_generate_bad_sampling_number_exits_2_naming_the_flag(flag, value, tmp_path, capsys):
    model = _generate_dir(tmp_path)
    code, result, err = main(["generate", "--model", str(model), "--prompt", "the", flag, value, "--json"], capsys)
    assert code == 2 and flag in result["error"], err


# ---- --json: non-finite numbers are null and named (docs/design.md), verify included ----------------------
def test_verify_json_writes_nonfinite_as_null_and_names_them(capsys, monkeypatch):
    """docs/design.md: under --json a non-finite number is null and its key is listed under "nonfinite" (one
    rule for every command). verify wrote the strings "nan" / "inf" instead, so a client reading relL2 as a
    number got a string."""
    from entrenar.cli import verify as commands

    report = {"ok": False, "exit_code": 1, "sequences": [{"logits_rel_l2": float("nan")}],
              "first_divergent": {"name": "embed", "rel_l2": float("inf"), "bound": 1e-5}}
    monkeypatch.setattr(commands, "run_verify", lambda *a, **k: report)
    code, result, _ = main(["verify", "--model", "whatever", "--json"], capsys)
    assert code == 1 and result["ok"] is False
    assert result["sequences"][0]["logits_rel_l2"] is None and result["first_divergent"]["rel_l2"] is None
    assert result["nonfinite"] == ["first_divergent.rel_l2", "sequences[0].logits_rel_l2"]


def test_weight_decay_shrinks_only_matrices_by_lr_times_wd(tmp_path, byte_model_dir, small_shards, capsys):
    """--weight-decay is AdamW's decoupled decay on >=2-D weights: after one step at lr 1e-2, --weight-decay 0.5
    leaves every matrix lr x 0.5 x its initial value below the run without decay; norms are not decayed."""
    import torch
    from safetensors.torch import load_file

    from entrenar.formats import load_state
    from entrenar.model import CausalLM

    finals = {}
    for wd in ("0", "0.5"):
        code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / wd, "--steps", "1", "--lr", "1e-2",
                                "--warmup", "0", "--schedule", "constant", "--weight-decay", wd, "--eval-batches", "1",
                                capsys=capsys)
        assert code == 0, err
        finals[wd] = load_file(str(tmp_path / wd / "final" / "model.safetensors"))
    cfg, _, _ = load_state(str(byte_model_dir))
    init = CausalLM(cfg)
    init.init_weights(0)  # pretrain --model DIR: that architecture, random init from --seed 0
    start = init.state_dict()
    decayed = 0
    for name, plain in finals["0"].items():
        delta = plain.double() - finals["0.5"][name].double()
        if plain.dim() < 2:
            assert torch.equal(delta, torch.zeros_like(delta)), name
        else:
            torch.testing.assert_close(delta, 1e-2 * 0.5 * start[name].double(), rtol=1e-3, atol=1e-7)
            decayed += 1
    assert decayed >= 2 * 7  # every projection of both layers (and the embedding)


@pytest.mark.parametrize("policy", ["warn", "skip", "stop"])
def test_on_spike_policy_through_pretrain(policy, tmp_path, byte_model_dir, small_shards, capsys, monkeypatch):
    """--on-spike: one step whose loss (and gradient) is 50x is GUARD-SPIKE. warn (the default) names it and
    applies the step; skip drops that update and marks the metrics row; stop exits 3 naming the step."""
    from tests.test_train_loop import _scale_loss_at_call

    _scale_loss_at_call(monkeypatch, 20, 50.0)
    extra = () if policy == "warn" else ("--on-spike", policy)
    code, result, err = pretrain(byte_model_dir, small_shards, tmp_path / "r", "--steps", "22", "--lr", "1e-4",
                                 "--warmup", "0", "--eval-batches", "1", *extra, capsys=capsys)
    if policy == "stop":
        assert code == 3 and result["guard"] == "GUARD-SPIKE" and "step 20" in result["error"], err
        return
    assert code == 0, err
    assert "GUARD-SPIKE" in err and "step 20" in err
    skipped = [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if r["skipped"]]
    assert skipped == ([20] if policy == "skip" else [])
    assert result["counters"].get("spike_skipped", 0) == (1 if policy == "skip" else 0)
    # the warning is listed in the summary's warnings, not only counted (a destroyed run was "warnings": [])
    spikes = [w for w in result["warnings"] if w["guard"] == "GUARD-SPIKE"]
    assert [w["step"] for w in spikes] == [20] and "step 20" in spikes[0]["message"]


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_on_nonfinite_policy_through_pretrain(policy, tmp_path, byte_model_dir, small_shards, capsys, monkeypatch):
    """--on-nonfinite: a NaN loss at step 3 is GUARD-NONFINITE. stop (the default) exits 3 naming the step, with
    the last good checkpoint (step 2) kept and no final/; skip drops that update, marks its metrics row, counts
    it and ends with exit 0."""
    from tests.test_train_loop import _scale_loss_at_call

    _scale_loss_at_call(monkeypatch, 3, float("nan"))
    extra = () if policy == "stop" else ("--on-nonfinite", policy)
    out = tmp_path / "r"
    code, result, err = pretrain(byte_model_dir, small_shards, out, "--steps", "4", "--eval-batches", "1", *extra,
                                 capsys=capsys)
    if policy == "stop":
        assert code == 3 and result["guard"] == "GUARD-NONFINITE" and "step 3" in result["error"], err
        assert checkpoint_steps(out) == [2] and not (out / "final").exists()
        return
    assert code == 0, err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["skipped"]] == [3]
    assert result["counters"]["nonfinite_skipped"] == 1 and (out / "final").is_dir()


# ---- export gguf --type: the stored type of the 2-D weights, read back with the gguf package -----------------
@pytest.mark.parametrize(("typ", "stored"), [(None, "F16"), ("f32", "F32"), ("bf16", "BF16"), ("q4_0", "Q4_0")])
def test_export_type_is_the_stored_type_of_2d_weights(typ, stored, tmp_path, capsys):
    """`export gguf --type T` (default f16): every 2-D weight is stored as T, norms and biases stay F32."""
    from gguf import GGUFReader

    model = _generate_dir(tmp_path)
    out = tmp_path / "m.gguf"
    code, _, err = main(["export", "gguf", str(model), str(out), "--json",
                        *(() if typ is None else ("--type", typ))], capsys)
    assert code == 0, err
    types = {t.name: (t.tensor_type.name, len([d for d in t.shape if d > 1])) for t in GGUFReader(str(out)).tensors}
    assert {name for name, (_, dims) in types.items() if dims < 2}, "the model has norms and biases"
    for name, (tensor_type, dims) in types.items():
        assert tensor_type == (stored if dims >= 2 else "F32"), (name, tensor_type)


def test_init_starts_from_that_models_weights(tmp_path, byte_model_dir, small_shards, capsys):
    """pretrain --init MODEL: step 0 is MODEL's weights (its step-0 eval loss is the loss of MODEL's last eval on
    the same batch, not a random init's), and GUARD-INIT-LOSS judges that start."""
    common = ("--eval-batches", "1", "--lr", "3e-3", "--warmup", "0")
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "first", "--steps", "12", *common, capsys=capsys)
    assert code == 0, err
    trained = read_jsonl(tmp_path / "first" / "eval.jsonl")[-1]["loss"]
    code, _, err = pretrain(byte_model_dir, small_shards, tmp_path / "cont", "--steps", "1",
                            "--init", str(tmp_path / "first" / "final"), *common, capsys=capsys)
    assert code == 0, err
    step0 = read_jsonl(tmp_path / "cont" / "eval.jsonl")[0]
    assert step0["step"] == 0 and step0["loss"] == pytest.approx(trained, rel=1e-6)
    random_start = read_jsonl(tmp_path / "first" / "eval.jsonl")[0]["loss"]
    assert abs(random_start - trained) > 0.1  # a random init would be told apart
    assert json.loads((tmp_path / "cont" / "run.json").read_text())["config"]["check_init_loss"] is True


def test_resume_path_continues_from_that_checkpoint_and_allow_config_change(tmp_path, byte_model_dir, small_shards,
                                                                           capsys):
    """--resume PATH continues from that checkpoint (not the newest): steps 3-4 come again with the losses of the
    straight run. A changed --batch-size is refused (exit 2 naming --allow-config-change) unless that flag."""
    run = tmp_path / "run"
    common = ("--steps", "4", "--save-every", "2", "--keep", "0", "--eval-batches", "1")
    code, _, err = pretrain(byte_model_dir, small_shards, run, *common, capsys=capsys)
    assert code == 0, err
    straight = [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]
    step2 = run / "checkpoints" / "step-0000002"
    code, result, err = pretrain(byte_model_dir, small_shards, run, *common, "--resume", str(step2), capsys=capsys)
    assert code == 0, err
    assert result["start_step"] == 2 and "resume: step 2" in err
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows][-2:] == [3, 4] and [r["loss"] for r in rows][-2:] == straight[2:]

    more = (*common[:1], "6", *common[2:])
    code, result, err = pretrain(byte_model_dir, small_shards, run, *more, "--resume", "auto", "--batch-size", "4",
                                 capsys=capsys)
    assert code == 2 and "--allow-config-change" in result["error"], err
    code, result, err = pretrain(byte_model_dir, small_shards, run, *more, "--resume", "auto", "--batch-size", "4",
                                 "--allow-config-change", capsys=capsys)
    assert code == 0 and result["start_step"] == 4, err
    assert read_jsonl(run / "metrics.jsonl")[-1]["loss_tokens"] == 4 * 32  # the new batch size


def test_preset_takes_the_shards_vocabulary_rounded_up_to_64(tmp_path, small_shards, capsys):
    """docs/design.md: with shards of another vocabulary a preset takes the shards' vocabulary size rounded up to
    a multiple of 64 (258 byte-level tokens -> 320), and says so."""
    code, _, err = pretrain("tiny", small_shards, tmp_path / "r", "--steps", "1", "--eval-batches", "1",
                            capsys=capsys)
    assert code == 0, err
    assert "vocab_size" in err and "-> 320" in err and "multiple of 64" in err
    assert json.loads((tmp_path / "r" / "final" / "config.json").read_text())["vocab_size"] == 320


def test_verify_dtype_runs_the_path_under_test_in_that_dtype(tmp_path, capsys):
    """verify --dtype: fp32 matches the float64 reference to 1e-5 (docs/design.md); bf16 is a bf16 path, visibly
    less exact, inside bf16's 2e-2 logits bound; the report names the dtype and its bounds."""
    model = _generate_dir(tmp_path)
    worst = {}
    for dtype in ("fp32", "bf16"):
        code, rep, err = main(["verify", "--model", str(model), "--seq-len", "32", "--no-grads", "--dtype", dtype,
                               "--json"], capsys)
        assert code == 0 and rep["ok"] and rep["dtype"] == dtype, err
        assert rep["grads"] is None  # --no-grads: no backward comparison
        worst[dtype] = max(s["logits_rel_l2"] for s in rep["sequences"])
    assert worst["fp32"] <= 1e-5
    assert 1e-4 < worst["bf16"] <= 2e-2


# ---- the documentation names only flags that exist ----------------------------------------------------------
DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"
COMMANDS = ("inspect", "convert", "export gguf", "generate", "tokenizer train", "data pack", "data sft-from-code",
            "data tasks-from-code", "data sft-from-bfcl", "data replay",
            "data check", "pretrain", "finetune", "eval", "verify", "qa", "merge", "plot", "help")


def _documented_flags() -> dict[str, set[str]]:
    """{command: flags} of the command block of docs/design.md (a command line and its indented continuations)."""
    import re

    text = DESIGN.read_text()
    block = text[text.index("```\nentrenar inspect"):]
    block = block[:block.index("```", 3)]
    flags: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        if line.startswith("entrenar "):
            rest = line.removeprefix("entrenar ")
            command = next(c for c in sorted(COMMANDS, key=len, reverse=True) if rest.startswith(c + " "))
        elif not line.startswith(" "):
            command = None
        if command:
            flags.setdefault(command, set()).update(re.findall(r"--[a-z][a-z0-9-]*", line))
    return flags


def test_every_flag_design_md_names_exists_in_that_commands_help():
    flags = _documented_flags()
    assert set(flags) == set(COMMANDS), set(COMMANDS) - set(flags)
    assert sum(len(f) for f in flags.values()) > 30
    missing = {c: sorted(f for f in fs if f not in _help(*c.split()).split()) for c, fs in flags.items()}
    assert not {c: m for c, m in missing.items() if m}


def test_notable_flags_of_design_md_exist_in_pretrain_or_finetune():
    import re

    text = DESIGN.read_text()
    notable = text[text.index("Notable flags:"):text.index("Long sequences")]
    offered = set(_help("pretrain").split()) | set(_help("finetune").split())
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", notable))
    assert {"--dtype", "--keep", "--warmup", "--eval-batches", "--lr", "--max-skip-fraction", "--force-base"} <= named
    offered |= set(_help("generate").split())  # --force-base: any command taking --adapter; --max-new-tokens
    assert named <= offered, named - offered


def test_batch_size_times_grad_accum_is_the_step(tmp_path, byte_model_dir, small_shards, capsys):
    """docs/design.md: batch 4 == batch 2 x --grad-accum 2 == batch 1 x --grad-accum 4 -- the same windows, the
    same loss and update per step (fp32 summation order apart)."""
    runs = {}
    for bs, ga in ((4, 1), (2, 2), (1, 4)):
        out = tmp_path / f"b{bs}a{ga}"
        code, _, err = main(["pretrain", "--model", str(byte_model_dir), "--data", str(small_shards), "--out",
                             str(out), "--seq-len", "32", "--batch-size", str(bs), "--grad-accum", str(ga), "--steps",
                             "3", "--lr", "3e-3", "--eval-batches", "1", "--no-preflight", "--json"], capsys)
        assert code == 0, err
        runs[bs, ga] = read_jsonl(out / "metrics.jsonl")
    ref = runs[4, 1]
    for rows in runs.values():
        assert [r["loss_tokens"] for r in rows] == [4 * 32] * 3
        assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
        assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4)


def test_a_lora_run_is_a_model_and_an_adapter(tmp_path, sft_base, capsys):
    """A LoRA run directory as --model (its final adapter on the recorded base) gives what --model BASE --adapter
    RUN/final gives (eval's loss, generate's ids), and differs from the bare base."""
    base, data = sft_base
    run = tmp_path / "lora"
    code, _, err = finetune(base, data, run, "--mode", "lora", "--rank", "4", "--steps", "3", "--lr", "1e-2",
                            capsys=capsys)
    assert code == 0, err

    def ev(*spec: str) -> float:
        code, result, err = main(["eval", *spec, "--data", str(data), "--max-seq-len", "64", "--json"], capsys)
        assert code == 0, err
        return result["loss"]

    def gen(*spec: str) -> list[int]:
        code, result, err = main(["generate", *spec, "--prompt", "Say one.", "--chat", "--max-new-tokens", "4",
                                  "--json"], capsys)
        assert code == 0, err
        return result["token_ids"]

    as_model = ev("--model", str(run))
    assert as_model == pytest.approx(ev("--model", str(base), "--adapter", str(run / "final")), rel=1e-6)
    assert as_model != pytest.approx(ev("--model", str(base)), rel=1e-3)
    assert gen("--model", str(run)) == gen("--model", str(base), "--adapter", str(run))


def test_an_adapter_brings_the_chat_template_it_was_trained_with(tmp_path, sft_base, capsys):
    """finetune --mode lora --chat-template FILE saves that template with the adapter; `generate --model BASE
    --adapter RUN` and `eval --task humaneval --model BASE --adapter RUN` render chats with it (as `--model RUN`
    does), not with the base's own."""
    from entrenar.tokenizer import load_tokenizer

    base, data = sft_base
    template = tmp_path / "marked.jinja"
    template.write_text("{{ 'Trained template. ' }}" + load_tokenizer(base).chat_template)
    run = tmp_path / "lora"
    code, _, err = finetune(base, data, run, "--mode", "lora", "--rank", "4", "--steps", "1", "--chat-template",
                            str(template), capsys=capsys)
    assert code == 0, err

    def prompt_tokens(*spec: str) -> int:
        code, result, err = main(["generate", *spec, "--prompt", "Say one.", "--chat", "--max-new-tokens", "1",
                                  "--json"], capsys)
        assert code == 0, err
        return result["prompt_tokens"]

    trained = prompt_tokens("--model", str(run))
    assert prompt_tokens("--model", str(base), "--adapter", str(run)) == trained
    assert prompt_tokens("--model", str(base)) < trained  # the base's own template has no marker
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n",
                                 "entry_point": "f"}) + "\n")
    out = tmp_path / "he.jsonl"
    code, _, err = main(["eval", "--task", "humaneval", "--model", str(base), "--adapter", str(run), "--data",
                         str(tasks), "--max-new-tokens", "1", "--out", str(out), "--json"], capsys)
    assert code == 0, err
    he_tokens = json.loads(out.read_text().splitlines()[0])["prompt_tokens"]
    code, _, err = main(["eval", "--task", "humaneval", "--model", str(base), "--data", str(tasks),
                         "--max-new-tokens", "1", "--out", str(out), "--overwrite", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out.read_text().splitlines()[0])["prompt_tokens"] < he_tokens


def test_eval_chat_template_renders_sft_rows_and_task_prompts(tmp_path, sft_base, capsys):
    """eval --chat-template FILE: SFT rows (--task loss) and --task humaneval's chat prompts are rendered by FILE
    (another loss, longer prompts with a marker template); with token shards it is exit 2 before any loading."""
    from entrenar.tokenizer import load_tokenizer

    base, data = sft_base
    template = tmp_path / "marked.jinja"
    template.write_text("{{ 'Another template, a longer prefix. ' }}" + load_tokenizer(base).chat_template)

    def loss(*extra: str) -> float:
        code, result, err = main(["eval", "--model", str(base), "--data", str(data), "--max-seq-len", "128", *extra,
                                  "--json"], capsys)
        assert code == 0, err
        return result["loss"]

    assert loss("--chat-template", str(template)) != pytest.approx(loss(), rel=1e-6)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n",
                                 "entry_point": "f"}) + "\n")
    tokens = []
    for extra in ([], ["--chat-template", str(template)]):
        out = tmp_path / f"he{len(extra)}.jsonl"
        code, _, err = main(["eval", "--task", "humaneval", "--model", str(base), "--data", str(tasks),
                             "--max-new-tokens", "1", "--out", str(out), *extra, "--json"], capsys)
        assert code == 0, err
        tokens.append(json.loads(out.read_text().splitlines()[0])["prompt_tokens"])
    assert tokens[1] > tokens[0]
    shards = tmp_path / "shards"
    shards.mkdir()
    code, result, _ = main(["eval", "--model", "no-such-model", "--data", str(shards), "--chat-template",
                            str(template), "--json"], capsys)
    assert code == 2 and "token shards" in result["error"]


def test_convert_dtype_keep_fp32_bf16(tmp_path, capsys):
    """convert --dtype: keep = the stored float dtype (float32 for a quantized GGUF), fp32 / bf16 cast."""
    from safetensors.torch import load_file

    def dtypes(d: Path) -> set[str]:
        return {str(t.dtype) for t in load_file(str(d / "model.safetensors")).values()}

    model = _generate_dir(tmp_path)
    cases = [(model, "bf16", "bf16"), (tmp_path / "bf16", "keep", "kept"), (tmp_path / "bf16", "fp32", "back"),
             (tmp_path / "q8.gguf", "keep", "from-q8")]
    code, _, err = main(["export", "gguf", str(model), str(tmp_path / "q8.gguf"), "--type", "q8_0", "--json"], capsys)
    assert code == 0, err
    for src, dtype, out in cases:
        code, _, err = main(["convert", str(src), str(tmp_path / out), "--dtype", dtype, "--json"], capsys)
        assert code == 0, err
    assert dtypes(tmp_path / "bf16") == dtypes(tmp_path / "kept") == {"torch.bfloat16"}
    assert dtypes(tmp_path / "back") == dtypes(tmp_path / "from-q8") == {"torch.float32"}


def test_every_option_with_a_default_shows_it_in_help():
    """--help shows each option's default (a user should not read the source for it): the value, or its
    documented form (64 Mi tokens per shard)."""
    import argparse

    from entrenar.cli import build_parser

    shown_as = {"--shard-tokens": "64 Mi"}
    missing = []

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif a.option_strings and a.default not in (None, False, [], argparse.SUPPRESS):
                want = shown_as.get(a.option_strings[0], f"{a.default:g}" if isinstance(a.default, float)
                                    else str(a.default))
                if want not in (a.help or ""):
                    missing.append(f"{command} {a.option_strings[0]} (default {a.default!r})")

    walk(build_parser(), "")
    assert not missing
