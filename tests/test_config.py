"""ModelConfig: presets, parameter counts (checked against transformers and our own module), and
config.json round trips through transformers' AutoConfig."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from entrenar.config import PRESETS, ModelConfig, preset
from entrenar.errors import InputError


def _hf_param_count(cfg: ModelConfig) -> int:
    """Parameters of the transformers model for this config (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = cfg.to_hf_dict()
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


def _our_param_count(cfg: ModelConfig) -> int:
    from entrenar.model import CausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(cfg).parameters())


def test_llama_370m_parameter_count():
    cfg = preset("llama-370m")
    n = cfg.num_parameters()
    assert 366_000_000 <= n <= 374_000_000, n
    assert n == _our_param_count(cfg) == _hf_param_count(cfg)


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts_agree(name):
    cfg = preset(name)
    assert cfg.num_parameters() == _our_param_count(cfg)


def test_known_model_sizes():
    # published sizes: SmolLM2-135M = 134.5M, Qwen2.5-0.5B = 494.0M (tied head)
    assert preset("smollm2-135m").num_parameters() == 134_515_008
    assert preset("qwen2.5-0.5b").num_parameters() == 494_032_768


ROUNDTRIP = {
    **{name: preset(name) for name in PRESETS},
    "llama-linear-scaling": preset("tiny").replace(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama3-scaling": preset("tiny").replace(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, rope_theta=500000.0),
    "qwen2-untied-eps1e-6": preset("qwen2.5-0.5b").replace(tie_word_embeddings=False),
}

_FIELDS = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("extra",)]


def roundtrip_through_transformers(cfg: ModelConfig, tmp_path) -> ModelConfig:
    """ours -> config.json -> AutoConfig (checked) -> save_pretrained -> ours."""
    from transformers import AutoConfig

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(parents=True)
    cfg.save(src / "config.json")
    hf = AutoConfig.from_pretrained(src)
    assert hf.model_type == cfg.architecture
    assert hf.vocab_size == cfg.vocab_size and hf.hidden_size == cfg.hidden_size
    assert hf.num_hidden_layers == cfg.num_layers and hf.intermediate_size == cfg.intermediate_size
    assert hf.num_attention_heads == cfg.num_heads and hf.num_key_value_heads == cfg.num_kv_heads
    assert getattr(hf, "head_dim", None) in (None, cfg.head_dim)
    assert hf.rms_norm_eps == cfg.rms_norm_eps
    assert hf.rope_parameters["rope_theta"] == cfg.rope_theta
    assert hf.rope_parameters["rope_type"] == (cfg.rope_scaling or {}).get("rope_type", "default")
    assert hf.tie_word_embeddings == cfg.tie_word_embeddings
    hf.save_pretrained(dst)
    return ModelConfig.load(dst / "config.json")


@pytest.mark.parametrize("name", list(ROUNDTRIP))
def test_config_json_roundtrip_through_autoconfig(name, tmp_path):
    cfg = ROUNDTRIP[name]
    back = roundtrip_through_transformers(cfg, tmp_path)
    for f in _FIELDS:
        if f == "initializer_range":
            continue
        assert getattr(back, f) == getattr(cfg, f), f"{name}: {f} {getattr(back, f)!r} != {getattr(cfg, f)!r}"


def test_rope_parameters_ignored_is_caught(tmp_path, monkeypatch):
    """transformers >= 5 writes theta into rope_parameters; a reader that ignores it gets 1e4."""
    cfg = preset("qwen2.5-0.5b")
    assert roundtrip_through_transformers(cfg, tmp_path / "ok").rope_theta == 1e6
    real = ModelConfig.from_hf_dict.__func__
    monkeypatch.setattr(ModelConfig, "from_hf_dict", classmethod(
        lambda cls, d: real(cls, {k: v for k, v in d.items() if k != "rope_parameters"})))
    assert roundtrip_through_transformers(cfg, tmp_path / "mutated").rope_theta != 1e6


def test_gptj_and_qk_norm_survive_config_json(tmp_path):
    cfg = preset("tiny").replace(rope_style="gptj", qk_norm=True)
    cfg.save(tmp_path / "config.json")
    back = ModelConfig.load(tmp_path / "config.json")
    assert back.rope_style == "gptj" and back.qk_norm


def test_invalid_configs_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="multiple"):
        preset("tiny").replace(num_kv_heads=3)
    with pytest.raises(ValueError, match="rope_style"):
        preset("tiny").replace(rope_style="alibi")
    with pytest.raises(ValueError, match="preset"):
        preset("no-such-preset")
    # a bad config.json is an InputError naming the file
    from entrenar.formats.hf import read_config

    d = preset("tiny").to_hf_dict()
    d["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(InputError, match=str(tmp_path / "config.json")):
        read_config(tmp_path)


# ---- the run's typed config (train/config.py): one source of defaults, --help generated -------------------
def _parser_defaults(command: str) -> dict:
    from entrenar import cli

    sub = next(a for a in cli.build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    p = sub.choices[command]
    return {a.dest: a.default for a in p._actions if a.option_strings}, p


@pytest.mark.parametrize("command", ["pretrain", "finetune", "eval"])
def test_cli_defaults_are_the_dataclass_defaults(command):
    from entrenar.train.config import CONFIGS, _cli, default_of

    defaults, _ = _parser_defaults(command)
    offered = 0
    for cls in CONFIGS:
        for f in dataclasses.fields(cls):
            spec = _cli(f, command)
            if spec is None:
                # eval's --beta is eval's own (on preference pairs; default: the run's beta), not TrainConfig's;
                # so are its task sampling flags, which finetune --objective grpo names alike
                own = ("model", "data", "beta", "temperature", "top_p", "max_new_tokens") if command == "eval" \
                    else ("model", "data")
                assert f.name not in defaults or f.name in own, (command, f.name)
                continue
            offered += 1
            if not spec["required"]:
                assert defaults[f.name] == default_of(cls, f.name, command), (command, f.name)
    assert offered >= {"pretrain": 20, "finetune": 30, "eval": 11}[command]


def test_documented_defaults_win():
    """The CLI's documented defaults (README / --help) are the dataclass's: TrainConfig used to say
    steps 100 and eval_batches 0 (all) while the CLI said 1000 and 20."""
    from entrenar.train.config import DataConfig, LoRAConfig, TrainConfig, default_of

    t = TrainConfig()
    assert (t.steps, t.batch_size, t.seq_len, t.lr, t.eval_batches, t.keep, t.weight_decay) == \
        (1000, 8, 512, 3e-4, 20, 3, 0.1)
    assert t.warmup == 100 and TrainConfig(steps=50).warmup == 5 and TrainConfig(warmup=0).warmup == 0
    assert default_of(TrainConfig, "lr", "finetune") == "auto"
    assert default_of(TrainConfig, "weight_decay", "finetune") == 0.0
    assert default_of(TrainConfig, "eval_batches", "eval") == 0
    assert (LoRAConfig().rank, LoRAConfig().alpha, LoRAConfig().effective_alpha) == (16, None, 32.0)
    assert (DataConfig().max_seq_len, DataConfig().val_fraction, DataConfig().truncation) == (2048, 0.05, "skip")
    assert not hasattr(TrainConfig(), "extra")  # mode, model spec and data paths are typed fields


def test_a_default_lives_only_in_the_dataclass(monkeypatch):
    """Changing the field's default changes the parser and its --help: nothing else holds it."""
    from entrenar.train.config import TrainConfig

    steps = next(f for f in dataclasses.fields(TrainConfig) if f.name == "steps")
    monkeypatch.setattr(steps, "default", 777)
    defaults, p = _parser_defaults("pretrain")
    assert defaults["steps"] == 777 and "optimizer steps (777)" in p.format_help()


def test_commands_module_declares_no_config_flag():
    """cli/train.py adds only --out and --resume (and plot's); every other option is generated (the runs
    themselves, train/commands.py, declare none)."""
    import re

    from entrenar.cli import train as cli_train
    from entrenar.train import commands

    texts = [Path(m.__file__).read_text(encoding="utf-8") for m in (cli_train, commands)]
    flags = [set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', text)) for text in texts]
    assert flags == [{"--out", "--resume"}, set()], flags
    assert not any("3e-4" in text or "2048" in text for text in texts)


def test_from_args_reads_every_offered_flag():
    from entrenar import cli
    from entrenar.train.config import DataConfig, LoRAConfig, TrainConfig, from_args

    args = cli.build_parser().parse_args([
        "finetune", "--model", "m", "--data", "d.jsonl", "--out", "o", "--mode", "lora", "--rank", "4",
        "--alpha", "8", "--steps", "7", "--lr", "1e-3", "--max-seq-len", "128", "--val-fraction", "0.2",
        "--max-skip-fraction", "0.1", "--keep", "0", "--seed", "3", "--pack", "--rslora"])
    t = from_args(TrainConfig, args, "finetune", command="finetune")
    lo = from_args(LoRAConfig, args, "finetune")
    d = from_args(DataConfig, args, "finetune")
    assert (t.command, t.model, t.mode, t.steps, t.lr, t.keep, t.seed, t.weight_decay) == \
        ("finetune", "m", "lora", 7, 1e-3, 0, 3, 0.0)
    assert (lo.rank, lo.alpha, lo.rslora) == (4, 8.0, True)
    assert (d.data, d.max_seq_len, d.val_fraction, d.max_skip_fraction, d.pack) == ("d.jsonl", 128, 0.2, 0.1, True)
    assert t.seq_len == 512  # finetune's windows come from --max-seq-len; the command sets it (see below)


@pytest.mark.parametrize("command,flag", [("pretrain", "--max-seq-len"), ("finetune", "--max-seq-len"),
                                          ("eval", "--max-seq-len")])
def test_validation_names_the_flag_of_the_command(command, flag):
    from entrenar.train.config import TrainConfig

    with pytest.raises(InputError, match=f"^{flag} must be a positive integer"):
        TrainConfig(command=command, seq_len=0).validate()
    with pytest.raises(InputError, match="--max-batches must be >= 0"):
        TrainConfig(command="eval", eval_batches=-1).validate()


@pytest.mark.parametrize("bad,message", [
    ({"lr": float("nan")}, "--lr must be a finite number > 0"), ({"lr": -1e-3}, "--lr must be"),
    ({"clip": -1.0}, "--clip"), ({"weight_decay": float("inf")}, "--weight-decay"),
    ({"dtype": "fp16"}, "--dtype"), ({"keep": -1}, "--keep must be >= 0"), ({"device": "tpu"}, "not a device")])
def test_train_config_validation(bad, message):
    from entrenar.train.config import TrainConfig

    with pytest.raises(InputError, match=message):
        TrainConfig(**bad).validate()


@pytest.mark.parametrize("cls,bad,message", [
    ("LoRAConfig", {"alpha": 0.0}, "--alpha must be a finite number > 0"),
    ("LoRAConfig", {"alpha": -16.0}, "--alpha must be"), ("LoRAConfig", {"rank": 0}, "--rank"),
    ("LoRAConfig", {"dropout": 1.0}, "--dropout"), ("DataConfig", {"max_seq_len": 0}, "--max-seq-len"),
    ("DataConfig", {"val_fraction": 1.0}, "--val-fraction"),
    ("DataConfig", {"max_skip_fraction": 1.5}, "--max-skip-fraction")])
def test_lora_and_data_validation(cls, bad, message):
    from entrenar.train import config

    with pytest.raises(InputError, match=message):
        getattr(config, cls)(**bad).validate()


def test_data_config_shares_the_data_modules_constants():
    from entrenar.data import sft
    from entrenar.train.config import DataConfig

    assert DataConfig().max_skip_fraction == sft.DEFAULT_MAX_SKIP_FRACTION
    assert DataConfig.__dataclass_fields__["truncation"].metadata["cli"]["choices"] == sft.TRUNCATION_POLICIES


@pytest.mark.parametrize("mb", [0, -5])
def test_ddp_bucket_mb_must_be_positive(mb):
    """--ddp-bucket-mb 0 would give DDP a bucket per parameter tensor (hundreds of all-reduces a step): exit 2."""
    from entrenar.train.config import DDP_BUCKET_MB, TrainConfig

    assert TrainConfig().ddp_bucket_mb == DDP_BUCKET_MB
    with pytest.raises(InputError, match="^--ddp-bucket-mb must be a positive integer"):
        TrainConfig(ddp_bucket_mb=mb).validate()
