"""Generation: KV-cache decoding equals full re-forward, greedy equals transformers' generate
(tiny random models and both packaged models), seeded sampling is reproducible, streaming gives
the same text, and `entrenar generate` turns bad input into exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entrenar.cli import main as cli_main
from entrenar.errors import InputError
from entrenar.generate import TextStream, generate, sample_next
from entrenar.model import CausalLM, KVCache
from entrenar.tensors import rel_l2
from entrenar.tokenizer import ChatTokenizer
from tests.helpers.cli import run_cli
from tests.helpers.models import make_hf_model, tiny_causal_lm, tiny_config
from tests.helpers.tokenizers import QWEN, SMOLLM, tiny_tokenizer


def tiny_model(vocab_size: int, arch: str = "qwen2", seed: int = 0) -> CausalLM:
    """A random CausalLM; nonzero Q/K/V biases for qwen2 so the bias path is exercised."""
    cfg = tiny_config(arch, vocab_size=vocab_size, attention_bias=arch == "qwen2", tie_word_embeddings=False,
                      rms_norm_eps=1e-6, max_position_embeddings=256)
    return tiny_causal_lm(cfg, seed, bias_std=0.3, head_scale=10.0).eval()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


PROMPT = "<|im_start|>user\nthe in the er<|im_end|>\n<|im_start|>assistant\n"


# ---- KV cache ------------------------------------------------------------------------------------
def _kv_vs_full(model, tokenizer, prompt_ids, steps):
    cached = generate(model, tokenizer, prompt_ids, steps, keep_logits=True, stop_ids=[])
    full = generate(model, tokenizer, prompt_ids, steps, keep_logits=True, stop_ids=[], use_cache=False)
    return cached, full


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_kv_cache_equals_full_reforward(tok, arch):
    model = tiny_model(len(tok), arch)
    cached, full = _kv_vs_full(model, tok, tok.encode(PROMPT), 24)
    assert cached.token_ids == full.token_ids
    assert len(cached.step_logits) == 24
    errs = [rel_l2(a, b) for a, b in zip(cached.step_logits, full.step_logits)]
    assert max(errs) <= 1e-5, errs


def test_kv_cache_mutation_is_caught(tok, monkeypatch):
    """Mutation: the cache forgets the past (returns only the new keys/values)."""
    model = tiny_model(len(tok))
    original = KVCache.update

    def forgetful(self, layer, k, v):
        original(self, layer, k, v)
        return k, v

    monkeypatch.setattr(KVCache, "update", forgetful)
    cached, full = _kv_vs_full(model, tok, tok.encode(PROMPT), 6)
    errs = [rel_l2(a, b) for a, b in zip(cached.step_logits, full.step_logits)]
    assert max(errs[1:]) > 1e-3


# ---- greedy vs transformers (tiny) ----------------------------------------------------------------
def _hf_greedy(hf, prompt: list[int], n: int, pad_id: int) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=pad_id, return_dict_in_generate=True,
                          output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), [x[0].float() for x in out.logits]


@pytest.fixture(scope="module")
def tiny_pair(tok, tmp_path_factory):
    """(transformers Qwen2 model, our CausalLM loaded from its save_pretrained directory)."""
    from entrenar.formats import load_model

    hf = make_hf_model("qwen2", seed=3, vocab_size=len(tok))
    d = tmp_path_factory.mktemp("tiny-qwen2")
    hf.save_pretrained(d)
    return hf, load_model(d, dtype=torch.float32)


def test_greedy_matches_transformers_tiny(tok, tiny_pair):
    hf, ours = tiny_pair
    prompt = tok.encode(PROMPT)
    ref_ids, ref_logits = _hf_greedy(hf, prompt, 16, tok.pad_id)
    result = generate(ours, tok, prompt, 16, stop_ids=[], keep_logits=True)
    assert result.token_ids == ref_ids
    errs = [rel_l2(a, b) for a, b in zip(result.step_logits, ref_logits)]
    assert len(errs) == 16 and max(errs) <= 1e-5, errs


def test_decode_position_mutation_is_caught(tok, tiny_pair, monkeypatch):
    """Mutation: decoding steps ignore the cache length, so every new token sits at position 0."""
    hf, ours = tiny_pair
    prompt = tok.encode(PROMPT)
    _, ref_logits = _hf_greedy(hf, prompt, 6, tok.pad_id)
    monkeypatch.setattr(KVCache, "length", property(lambda self: 0))
    result = generate(ours, tok, prompt, 6, stop_ids=[], keep_logits=True)
    errs = [rel_l2(a, b) for a, b in zip(result.step_logits, ref_logits)]
    assert errs[0] <= 1e-5 and max(errs[1:]) > 1e-3, errs


# ---- stopping, streaming, sampling ---------------------------------------------------------------
def test_stops_at_end_of_turn(tok):
    model = tiny_model(len(tok))
    sampled = {"temperature": 1.0, "seed": 11}  # a random model's greedy text repeats one token
    free = generate(model, tok, tok.encode(PROMPT), 12, stop_ids=[], **sampled).token_ids
    k = next(i for i in range(2, 12) if free[i] not in free[:i])
    stopper = tiny_tokenizer()
    stopper.eot_id = free[k]  # pretend that token ends the turn
    result = generate(model, stopper, tok.encode(PROMPT), 12, **sampled)
    assert result.token_ids == free[: k + 1] and result.stop_reason == "end_of_turn"
    assert result.text == tok.decode(free[:k])  # the stop token is not part of the text
    stopper.eos_id = free[k]
    assert generate(model, stopper, tok.encode(PROMPT), 12, **sampled).stop_reason == "eos"


def test_ignoring_stop_tokens_mutation_is_caught(tok, monkeypatch):
    """Mutation: generation ignores EOS/end-of-turn -> it runs on to max_new_tokens."""
    model = tiny_model(len(tok))
    free = generate(model, tok, tok.encode(PROMPT), 8, stop_ids=[], temperature=1.0, seed=11).token_ids
    monkeypatch.setattr(ChatTokenizer, "stop_ids", property(lambda self: set()))
    stopper = tiny_tokenizer()
    stopper.eot_id = free[2]
    result = generate(model, stopper, tok.encode(PROMPT), 8, temperature=1.0, seed=11)
    assert result.stop_reason == "max_new_tokens" and len(result.token_ids) == 8


def test_streamed_text_equals_result_text(tok):
    model = tiny_model(len(tok))
    pieces: list[str] = []
    result = generate(model, tok, tok.encode(PROMPT), 30, stop_ids=[], on_text=pieces.append)
    assert "".join(pieces) == result.text == tok.decode(result.token_ids)


def test_stream_holds_split_multibyte_characters(tok):
    text = "ab 日本語 🙂 é!"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # the tiny vocabulary spells these characters byte by byte
    pieces: list[str] = []
    stream = TextStream(tok, pieces.append)
    for i in ids:
        stream.push(i)
    assert stream.finish() == text
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_sampling_is_reproducible_with_a_seed(tok):
    model = tiny_model(len(tok))
    prompt = tok.encode(PROMPT)
    a = generate(model, tok, prompt, 20, temperature=0.9, top_p=0.95, seed=1234, stop_ids=[])
    b = generate(model, tok, prompt, 20, temperature=0.9, top_p=0.95, seed=1234, stop_ids=[])
    c = generate(model, tok, prompt, 20, temperature=0.9, top_p=0.95, seed=1235, stop_ids=[])
    assert a.token_ids == b.token_ids and a.seed == 1234
    assert a.token_ids != c.token_ids
    greedy = generate(model, tok, prompt, 20, stop_ids=[])
    nucleus_of_one = generate(model, tok, prompt, 20, temperature=1.0, top_p=1e-6, seed=7, stop_ids=[])
    assert nucleus_of_one.token_ids == greedy.token_ids


def test_unseeded_sampling_mutation_is_caught(tok, monkeypatch):
    """Mutation: draw from the global RNG instead of the seeded generator -> runs differ."""
    model = tiny_model(len(tok))
    original = torch.Tensor.exponential_  # the sampling noise (generate.pick_rows)
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, generator=None: original(self))
    runs = [generate(model, tok, tok.encode(PROMPT), 20, temperature=1.0, seed=1234, stop_ids=[]).token_ids
            for _ in range(2)]
    assert runs[0] != runs[1]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, 0.75, gen) for _ in range(400)}
    assert draws == {0, 1}  # 0.5 < 0.75 needs the second token; 0.8 >= 0.75 stops there


def test_generate_rejects_bad_arguments(tok):
    model = tiny_model(len(tok))
    with pytest.raises(InputError, match="empty"):
        generate(model, tok, [], 4)
    with pytest.raises(InputError, match="max_new_tokens"):
        generate(model, tok, [1, 2], 0)
    with pytest.raises(InputError, match="out of range"):
        generate(model, tok, [1, len(tok) + 5], 4)
    with pytest.raises(InputError, match="temperature"):
        generate(model, tok, [1], 4, temperature=-1)
    with pytest.raises(InputError, match="top_p"):
        generate(model, tok, [1], 4, top_p=0.0)
    with pytest.raises(InputError, match="context"):
        generate(model, tok, [1] * 250, 10)


# ---- command line ---------------------------------------------------------------------------------
def _tiny_dir(root: Path, name: str, model_vocab: int | None = None, template: str | None = None) -> Path:
    from entrenar.formats import save_hf_dir

    kw = {} if template is None else {"chat_template": template}
    tokenizer = tiny_tokenizer(**kw)
    model = tiny_model(model_vocab or len(tokenizer))
    return save_hf_dir(model, root / name, tokenizer=tokenizer)


def _run(argv, capsys) -> tuple[int, dict | None, str, str]:
    run = run_cli(["generate", *argv], capsys)
    return run[0], (run[1] if "--json" in argv else None), run.out, run[2]


def test_cli_generate_json_and_stream(tmp_path, capsys):
    d = _tiny_dir(tmp_path, "ok")
    rc, js, _, _ = _run(["--model", str(d), "--prompt", "the", "--chat", "--system", "be brief",
                         "--max-new-tokens", "7", "--json"], capsys)
    assert rc == 0 and js["ok"]
    assert set(js) >= {"prompt_tokens", "completion_tokens", "text", "token_ids", "stop_reason", "tokens_per_s"}
    tok = tiny_tokenizer()
    expected_prompt = tok.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the"}],
                                      add_generation_prompt=True).ids
    assert js["prompt_tokens"] == len(expected_prompt)
    assert js["completion_tokens"] == len(js["token_ids"]) <= 7
    rc, _, out, _ = _run(["--model", str(d), "--prompt", "the", "--chat", "--system", "be brief",
                          "--max-new-tokens", "7"], capsys)
    assert rc == 0 and out == js["text"] + "\n"  # streamed to stdout, then a newline
    a = _run(["--model", str(d), "--prompt", "the", "--temperature", "1.0", "--seed", "5",
              "--max-new-tokens", "8", "--json"], capsys)[1]
    b = _run(["--model", str(d), "--prompt", "the", "--temperature", "1.0", "--seed", "5",
              "--max-new-tokens", "8", "--json"], capsys)[1]
    assert a["token_ids"] == b["token_ids"] and a["seed"] == 5


@pytest.mark.parametrize("case", ["empty-prompt", "zero-new-tokens", "template-raises", "id-out-of-range",
                                  "system-without-chat"])
def test_cli_bad_input_exits_2(tmp_path, capsys, case):
    d = _tiny_dir(tmp_path, "ok")
    argv = {"empty-prompt": ["--prompt", ""],
            "zero-new-tokens": ["--prompt", "hi", "--max-new-tokens", "0"],
            "template-raises": ["--prompt", "hi", "--chat"],
            "id-out-of-range": ["--prompt", "hi <|im_end|>"],
            "system-without-chat": ["--prompt", "hi", "--system", "x"]}[case]
    if case == "template-raises":
        d = _tiny_dir(tmp_path, "raises", template="{{ raise_exception('this model takes no chat') }}")
    if case == "id-out-of-range":
        d = _tiny_dir(tmp_path, "small", model_vocab=len(tiny_tokenizer()) - 2)  # <|im_end|> >= vocab_size
    rc, js, _, err = _run(["--model", str(d), *argv, "--json"], capsys)
    assert rc == 2 and js["ok"] is False, err
    expect = {"empty-prompt": "empty", "zero-new-tokens": "max-new-tokens", "template-raises": "takes no chat",
              "id-out-of-range": "out of range", "system-without-chat": "--chat"}[case]
    assert expect in err


def test_id_range_check_mutation_is_caught(tmp_path, capsys, monkeypatch):
    """Mutation: no tokenizer-side id check -> the model's own ValueError escapes (exit 1, traceback)."""
    d = _tiny_dir(tmp_path, "small", model_vocab=len(tiny_tokenizer()) - 2)
    monkeypatch.setattr(ChatTokenizer, "check_ids", lambda self, ids, vocab_size: None)
    with pytest.raises(ValueError) as err:
        cli_main(["generate", "--model", str(d), "--prompt", "hi <|im_end|>", "--json"])
    assert not isinstance(err.value, InputError)


def test_cli_exit_code_in_a_real_process(tmp_path):
    d = _tiny_dir(tmp_path, "ok")
    proc = subprocess.run([sys.executable, "-m", "entrenar", "generate", "--model", str(d), "--prompt", "hi",
                           "--max-new-tokens", "0", "--json"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ok"] is False


# ---- non-finite weights: a clear error, never "ok" with <|endoftext|> x N ------------------------------
POISONED = "model.layers.1.mlp.down_proj.weight"


def _poisoned_model(tok, value: float = float("nan")) -> CausalLM:
    model = tiny_model(len(tok))
    with torch.no_grad():
        model.get_parameter(POISONED)[3, 5] = value
    return model


def test_nan_weight_stops_generation_naming_the_tensor(tok):
    with pytest.raises(InputError) as e:
        generate(_poisoned_model(tok), tok, tok.encode(PROMPT), 8)
    msg = str(e.value)
    assert "non-finite logits" in msg and POISONED in msg and "on the prompt" in msg


def test_overflow_without_bad_weights_says_so(tok):
    model = tiny_model(len(tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(1e38)  # finite weights, logits overflow to inf
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(InputError, match="no weight is NaN/Inf"):
        generate(model, tok, tok.encode(PROMPT), 4)


def test_nonfinite_check_mutation_is_caught(tok, monkeypatch):
    """Mutation: no logits check -> NaN logits 'generate' token 0 over and over and report success."""
    import entrenar.generate as eg

    monkeypatch.setattr(eg, "check_logits_finite", lambda model, logits, generated: None)
    result = generate(_poisoned_model(tok), tok, tok.encode(PROMPT), 8, stop_ids=[])
    assert result.token_ids == [0] * 8  # the silent failure the check exists to stop


def test_cli_generate_on_nan_weights_exits_2(tmp_path, capsys):
    from entrenar.formats import save_hf_dir

    tokenizer = tiny_tokenizer()
    d = save_hf_dir(_poisoned_model(tokenizer), tmp_path / "nan", tokenizer=tokenizer)
    rc, js, _, err = _run(["--model", str(d), "--prompt", "the", "--max-new-tokens", "5", "--json"], capsys)
    assert rc == 2 and js["ok"] is False, err
    assert POISONED in js["error"] and "NaN/Inf" in js["error"]


# ---- packaged models vs transformers (same GGUF weights, fp32) ------------------------------------
CHAT_PROMPTS = ["What is the capital of France?",
                "Write a Python function that checks if a number is prime.",
                "Name three primary colors."]


def _hf_from_gguf(path: Path):
    """transformers' model of the GGUF, converted once per machine (tests/helpers/tokenizers.py)."""
    from tests.helpers.tokenizers import hf_gguf_model

    return hf_gguf_model(path)


def _greedy_parity(model, hf, name):
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(name)
    for prompt in CHAT_PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True).ids
        ours = generate(model, tok, ids, 32)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=sorted(tok.stop_ids), pad_token_id=tok.pad_id)
        assert ours.token_ids == ref[0, len(ids):].tolist(), (prompt, ours.text)
        assert ours.text.strip()


@pytest.mark.real_model
def test_greedy_matches_transformers_smollm(smollm_model, smollm_path):
    _greedy_parity(smollm_model, _hf_from_gguf(smollm_path), SMOLLM)


@pytest.mark.real_model
def test_greedy_matches_transformers_qwen(qwen_model, qwen_path):
    _greedy_parity(qwen_model, _hf_from_gguf(qwen_path), QWEN)


@pytest.mark.real_model
def test_kv_cache_equals_full_reforward_smollm(smollm_model):
    from entrenar.tokenizer import load_tokenizer

    tok = load_tokenizer(SMOLLM)
    ids = tok.encode_chat([{"role": "user", "content": "Count to five."}], add_generation_prompt=True).ids
    cached, full = _kv_vs_full(smollm_model, tok, ids, 12)
    assert cached.token_ids == full.token_ids
    errs = [rel_l2(a, b) for a, b in zip(cached.step_logits, full.step_logits)]
    assert max(errs) <= 1e-5, errs
