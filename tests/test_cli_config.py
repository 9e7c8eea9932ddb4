"""`--config FILE` (YAML, TOML, JSON, a run's run.json) and the Python API (`entrenar.pretrain(...)` & co.): one
parse (cli/main.py parse_command), so the file's keys, the API's keyword arguments and the command line's flags
are the same names with the same defaults, types and choices; docs/design.md "Command line"."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import entrenar
from entrenar import cli
from entrenar.cli.main import UsageError, parse_command
from entrenar.formats import save_hf_dir
from entrenar.train.metrics import read_jsonl
from tests import test_train_cli
from tests.helpers.cli import child_env
from tests.helpers.cli import run_cli as main
from tests.helpers.models import tiny_causal_lm, tiny_config

byte_shards = test_train_cli.byte_shards
byte_model_dir = test_train_cli.byte_model_dir

TINY = {"max_seq_len": 32, "batch_size": 2, "steps": 2, "lr": 3e-3, "warmup": 1, "eval_batches": 2, "seed": 4,
        "no_preflight": True, "device": "cpu"}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---- --config: the parse ---------------------------------------------------------------------------------
def test_yaml_and_toml_set_the_flags_and_the_command_line_wins(tmp_path):
    yaml_file = _write(tmp_path / "run.yaml", "model: m\ndata: d.jsonl\nout: o\nmode: lora\nseq-len: 128\n"
                                              "rank: 4\nlr: 1e-3\nrslora: true\npack: false\n")
    args = parse_command(["finetune", "--config", str(yaml_file), "--rank", "8"])
    assert (args.model, args.data, args.out, args.mode, args.max_seq_len, args.lr, args.rslora, args.pack) == \
        ("m", "d.jsonl", "o", "lora", 128, 1e-3, True, False)  # YAML reads 1e-3 as text: the flag's parser reads it
    assert args.rank == 8  # the command line overrides the file
    toml_file = _write(tmp_path / "run.toml", 'model = "m"\ndata = "d.jsonl"\nout = "o"\nmax_seq_len = 64\n'
                                              'lr = "auto"\nval_fraction = 0\n')
    args = parse_command(["finetune", "--config", str(toml_file)])
    assert (args.max_seq_len, args.lr, args.val_fraction) == (64, "auto", 0.0)
    assert isinstance(args.val_fraction, float)
    # the required flags came from the file; without it they are still required
    with pytest.raises(UsageError, match="required: --model"):
        parse_command(["finetune"])


def test_positionals_and_nested_commands_take_keys(tmp_path):
    f = _write(tmp_path / "x.yaml", "model: smollm2-135m\nout: m.gguf\ntype: q8_0\n")
    args = parse_command(["export", "gguf", "--config", str(f)])
    assert (args.model, args.out, args.export_type) == ("smollm2-135m", "m.gguf", "q8_0")
    args = parse_command(["export", "gguf", "--config", str(f), "other", "o.gguf"])
    assert (args.model, args.out) == ("other", "o.gguf")


@pytest.mark.parametrize("text, message", [
    ("model: m\nsteps: 10\nlearning_rate: 1e-3\n", ("'learning_rate' is not a flag of `entrenar pretrain`; did "
                                                    "you mean 'lr'?")),
    ("model: m\nsteps: 10\nseq_lenn: 64\n", "did you mean 'max_seq_len'?"),
    ("model: m\nsteps: ten\n", "steps: expected an integer (--steps), got 'ten' (str): invalid literal"),
    ("model: m\nsteps: 1.5\n", "steps: expected an integer (--steps), got 1.5 (float)"),
    ("model: m\nno_preflight: 'yes'\n", "no_preflight: expected true or false (--no-preflight is a switch)"),
    ("model: m\nschedule: cosin\n", "schedule: 'cosin' is not one of cosine, linear, constant (--schedule)"),
    ("model: [m\n", "not valid YAML"),
    ("- model\n- m\n", "expected a mapping of flag names to values at the top, got list"),
    ("model: m\nconfig: other.yaml\n", "'config' cannot be set here (config files do not nest)"),
    ("model: m\nseq_len: 64\nmax-seq-len: 32\n", "name the same flag (--max-seq-len); give one"),
])
def test_a_bad_file_exits_2_naming_the_key_and_the_file(text, message, tmp_path, capsys):
    f = _write(tmp_path / "bad.yaml", text)
    code, result, err = main(["pretrain", "--config", str(f), "--data", "d", "--out", str(tmp_path / "o"),
                              "--json"], capsys)
    assert code == 2, err
    assert str(f) in result["error"] and message in result["error"], result["error"]
    assert not (tmp_path / "o").exists()


def test_a_missing_or_unknown_kind_of_file_exits_2(tmp_path, capsys):
    code, result, _ = main(["generate", "--config", str(tmp_path / "none.yaml"), "--json"], capsys)
    assert code == 2 and "no such file" in result["error"]
    code, result, _ = main(["generate", "--config", str(_write(tmp_path / "c.ini", "x")), "--json"], capsys)
    assert code == 2 and ".yaml, .yml, .toml or .json" in result["error"]


def test_every_flag_of_every_command_is_a_key():
    """Keys come from the command's parser: each option (and alias) in both spellings, each positional."""
    from entrenar.cli.config_file import keys_of, leaf_parser
    from entrenar.cli.main import _leaves

    parser = cli.build_parser()
    for leaf in _leaves(parser):
        keys = keys_of(leaf)
        for action in leaf._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--config"):
                    assert flag[2:] in keys and flag[2:].replace("-", "_") in keys, (leaf.prog, flag)
    finetune, _ = leaf_parser(parser, ["finetune"])
    assert {"seq_len", "seq-len", "max_seq_len", "max-seq-len"} <= set(keys_of(finetune))


# ---- run.json: a finished run, re-run ----------------------------------------------------------------------
def test_run_json_re_runs_the_run_exactly(tmp_path, byte_model_dir, byte_shards, capsys):
    first, again = tmp_path / "first", tmp_path / "again"
    code, r1, err = main(["pretrain", "--model", str(byte_model_dir), "--data", str(byte_shards), "--out",
                          str(first), "--max-seq-len", "32", "--batch-size", "2", "--steps", "3", "--lr", "3e-3",
                          "--warmup", "1", "--eval-batches", "2", "--seed", "7", "--schedule", "linear",
                          "--no-preflight", "--device", "cpu", "--json"], capsys)
    assert code == 0, err
    code, r2, err = main(["pretrain", "--config", str(first / "run.json"), "--out", str(again), "--json"], capsys)
    assert code == 0, err
    rj1, rj2 = (json.loads((d / "run.json").read_text()) for d in (first, again))
    reasons = ("device_reason", "dtype_reason", "cuda_graphs_reason")  # provenance: 'as given' the second time
    assert {k: v for k, v in rj2["config"].items() if k not in reasons} == \
        {k: v for k, v in rj1["config"].items() if k not in reasons}
    assert rj2["data"] == rj1["data"] and rj2["config"]["dtype_reason"] == "--dtype fp32 as given"
    assert [r["loss"] for r in read_jsonl(again / "metrics.jsonl")] == \
        [r["loss"] for r in read_jsonl(first / "metrics.jsonl")]
    assert r2["eval_loss_final"] == r1["eval_loss_final"]
    # a flag on the command line still wins over the recorded one
    args = parse_command(["pretrain", "--config", str(first / "run.json"), "--out", "x", "--steps", "9"])
    assert (args.steps, args.seed, args.schedule, args.seq_len) == (9, 7, "linear", 32)


def test_every_recorded_flag_of_a_finetune_round_trips_through_run_json(tmp_path):
    """run.json as train/commands.py writes it (asdict of the three configs, JSON) gives back every flag that built
    it: the parse of `--config run.json` equals the original parse (a tuple-valued flag such as --profile too)."""
    from dataclasses import asdict

    from entrenar.train.config import DataConfig, LoRAConfig, TrainConfig, from_args

    argv = ["finetune", "--model", "m", "--data", "d.jsonl", "--out", "o", "--mode", "lora", "--rank", "4",
            "--alpha", "8", "--profile", "2:3", "--lr", "1e-3", "--warmup", "5", "--pack", "--eval-task", "humaneval",
            "--eval-task-limit", "7", "--max-seq-len", "96", "--device", "cpu", "--dtype", "fp32", "--steps", "9",
            "--truncation", "keep", "--targets", "q_proj,v_proj", "--skip-invalid",
            # given, as defaults resolved when the config is built (--eval-batches' CPU cap, the objective's
            # --beta) are recorded resolved: a re-run takes the values the run used
            "--eval-batches", "3", "--beta", "0.2"]
    first = parse_command(argv)
    data = from_args(DataConfig, first, "finetune")
    record = {"command": "finetune", "argv": argv, "versions": {}, "seed": first.seed,
              "config": from_args(TrainConfig, first, "finetune", command="finetune", seq_len=data.max_seq_len).to_dict(),
              "lora": asdict(from_args(LoRAConfig, first, "finetune")), "data": asdict(data)}
    f = _write(tmp_path / "run.json", json.dumps(record))
    again = parse_command(["finetune", "--config", str(f), "--out", "o"])
    assert {k: v for k, v in vars(again).items() if k != "config"} == \
        {k: v for k, v in vars(first).items() if k != "config"}


def test_run_json_of_another_command_is_refused(tmp_path, capsys):
    f = _write(tmp_path / "run.json", json.dumps({"command": "finetune", "argv": [], "config": {"steps": 3}}))
    code, result, _ = main(["pretrain", "--config", str(f), "--json"], capsys)
    assert code == 2 and "a run.json of `entrenar finetune`" in result["error"]


# ---- the Python API ------------------------------------------------------------------------------------
def test_import_entrenar_stays_light():
    """The API is loaded on first use: `import entrenar` imports neither torch nor the CLI."""
    code = ("import sys, entrenar; assert callable(entrenar.evaluate) and entrenar.InputError; "
            "print(sorted(m for m in ('torch', 'entrenar.cli', 'entrenar.api', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_api_signature_is_the_parser_s():
    sig = inspect.signature(entrenar.finetune)
    p = sig.parameters
    assert p["model"].default is inspect.Parameter.empty and p["out"].default is inspect.Parameter.empty
    assert (p["mode"].default, p["lr"].default, p["max_seq_len"].default, p["config"].default) == \
        ("full", "auto", 2048, None)
    assert all(q.kind is inspect.Parameter.KEYWORD_ONLY for q in p.values())
    assert inspect.signature(entrenar.evaluate).parameters["task"].default == "loss"
    assert "type" in inspect.signature(entrenar.export_gguf).parameters
    assert "--max-seq-len" in entrenar.pretrain.__doc__


def test_api_and_cli_give_the_same_result(tmp_path, byte_model_dir, byte_shards, capsys):
    """pretrain and eval through the API return what the CLI's --json line carries (timings aside)."""
    code, by_cli, err = main(["pretrain", "--model", str(byte_model_dir), "--data", str(byte_shards), "--out",
                              str(tmp_path / "cli"), *(f"--{k.replace('_', '-')}" if v is True else
                                                       f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()),
                              "--json"], capsys)
    assert code == 0, err
    by_api = entrenar.pretrain(model=byte_model_dir, data=byte_shards, out=tmp_path / "api", **TINY)
    timing = ("seconds", "tok_s", "end_save_s", "run_dir", "final")
    assert {k: v for k, v in by_api.items() if k not in timing} == {k: v for k, v in by_cli.items() if k not in timing}
    assert by_api["ok"] is True and by_api["steps"] == 2
    assert json.loads((tmp_path / "api" / "run.json").read_text())["config"]["seed"] == 4

    code, ev_cli, err = main(["eval", "--model", str(tmp_path / "cli"), "--data", str(byte_shards), "--seq-len",
                              "32", "--batch-size", "2", "--max-batches", "2", "--device", "cpu", "--json"], capsys)
    assert code == 0, err
    ev_api = entrenar.evaluate(model=str(tmp_path / "cli"), data=byte_shards, seq_len=32, batch_size=2,
                               max_batches=2, device="cpu")
    assert ev_api == {**ev_cli, "seconds": ev_api["seconds"]}
    assert entrenar.eval(model=str(tmp_path / "api"), data=byte_shards, seq_len=32, batch_size=2, max_batches=2,
                         device="cpu")["loss"] == ev_api["loss"]  # the same weights, the same loss
    assert capsys.readouterr().out == ""  # the API prints no result text


def test_api_raises_input_error(tmp_path, byte_model_dir):
    with pytest.raises(entrenar.InputError, match="no such file or directory"):
        entrenar.pretrain(model=byte_model_dir, data=tmp_path / "nope", out=tmp_path / "o", **TINY)
    with pytest.raises(entrenar.InputError, match=r"entrenar.pretrain\(\): 'learning_rate' is not a flag .* 'lr'"):
        entrenar.pretrain(model=byte_model_dir, data=tmp_path, out=tmp_path / "o", learning_rate=1e-3)
    with pytest.raises(entrenar.InputError, match="required: --data"):  # argparse's own error, as InputError
        entrenar.pretrain(model=byte_model_dir, out=tmp_path / "o")
    with pytest.raises(entrenar.InputError, match="'dpo' is not one of"):
        entrenar.pretrain(model=byte_model_dir, data=tmp_path, out=tmp_path / "o", schedule="dpo")
    assert not (tmp_path / "o").exists()


def test_api_raises_guard_error(tmp_path, byte_shards):
    """A start no better than uniform (--init of garbage weights): GUARD-INIT-LOSS, exit 3 on the CLI."""
    m = tiny_causal_lm(tiny_config(vocab_size=258, hidden_size=32, intermediate_size=64, tie_word_embeddings=True,
                                   max_position_embeddings=256), 0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    garbage = save_hf_dir(m, tmp_path / "garbage")
    with pytest.raises(entrenar.GuardError) as e:
        entrenar.pretrain(model=garbage, init=garbage, data=byte_shards, out=tmp_path / "run", **TINY)
    assert e.value.guard_id == "GUARD-INIT-LOSS" and e.value.exit_code == 3


def test_api_reads_a_config_file_and_keywords_override_it(tmp_path):
    f = _write(tmp_path / "r.toml", 'model = "m"\nprompt = "hi"\ntemperature = 0.7\nseed = 3\n')
    from entrenar.api import COMMANDS

    args = parse_command([*COMMANDS["generate"], "--config", str(f)], {"seed": 5}, "entrenar.generate()")
    assert (args.model, args.prompt, args.temperature, args.seed) == ("m", "hi", 0.7, 5)


def test_the_readme_recipe_is_the_recipe_file_and_parses():
    """README's config-file recipe is recipes/smollm2_tool_calls.yaml (its comment line aside), and finetune reads it
    as the command-line recipe above it in the README."""
    root = Path(__file__).resolve().parents[1]
    recipe = root / "recipes" / "smollm2_tool_calls.yaml"
    readme = (root / "README.md").read_text()
    block = readme[readme.index("```yaml\n") + len("```yaml\n"):]
    block = block[:block.index("```")]
    assert block == "".join(line + "\n" for line in recipe.read_text().splitlines() if not line.startswith("#"))
    args = parse_command(["finetune", "--config", str(recipe)])
    assert (args.model, args.mode, args.rank, args.lr, args.steps, args.batch_size, args.max_seq_len,
            args.eval_task, args.retain_task, args.mix, args.eval_task_limit, args.eval_task_every, args.keep_best) == \
        ("smollm2-135m-instruct", "lora", 16, 3e-4, 250, 16, 4096, ["bfcl:simple_python,multiple"],
         ["bfcl:irrelevance", "chat"], ["replay.jsonl:0.3"], 100, 50, "task")
    from entrenar.tokenizer import packaged_template

    assert packaged_template(args.chat_template) is not None  # a packaged template by name


def test_api_generate_and_export_gguf_are_the_commands(tmp_path, capsys):
    """entrenar.generate (also a module of the package) and entrenar.export_gguf: the CLI's results, with the
    command line's names (`type` for export gguf's --type, the positionals by name)."""
    from tests.test_cli_flags_documented import _generate_dir

    model = _generate_dir(tmp_path)
    code, by_cli, err = main(["generate", "--model", str(model), "--prompt", "the in the er", "--max-new-tokens", "4",
                              "--temperature", "0.8", "--seed", "3", "--device", "cpu", "--json"], capsys)
    assert code == 0, err
    by_api = entrenar.generate(model=model, prompt="the in the er", max_new_tokens=4, temperature=0.8, seed=3,
                               device="cpu")
    assert by_api == {**by_cli, "tokens_per_s": by_api["tokens_per_s"]} and len(by_api["token_ids"]) == 4
    assert entrenar.generate.generate_batch  # still the library module

    out = entrenar.export_gguf(model=model, out=tmp_path / "m.gguf", type="f32")
    assert out["ok"] and (tmp_path / "m.gguf").stat().st_size == out["bytes"] and out["tensor_types"].keys() == {"F32"}
    with pytest.raises(entrenar.InputError, match="must not exist|exists"):
        entrenar.export_gguf(model=model, out=tmp_path / "m.gguf")
