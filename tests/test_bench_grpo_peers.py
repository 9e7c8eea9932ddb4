"""bench/grpo_peers.py: TRL's GRPOTrainer rolls out the prompts `finetune --objective grpo` rolls out (the same token
ids, the same order, batch x G per optimizer step, the same lengths and sampling settings), and its reward is
entrenar's bfcl-graded, so the speed comparison is the same work."""

from __future__ import annotations

import itertools
import json

import pytest

from bench import grpo_peers

STEPS, BATCH, G, NEW = 3, 2, 2, 16


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    tmp = tmp_path_factory.mktemp("grpo_peers")
    p = {**grpo_peers.make_tiny(tmp), "steps": STEPS, "batch": BATCH, "num_generations": G, "max_new_tokens": NEW,
         "rank": 4, "lr": 5e-5, "max_seq_len": 1024, "chat_template": "chatml_tools", "device": "cpu",
         "work": str(tmp / "work")}
    return p, grpo_peers.build_trl_trainer(p)


def _ours_rollout_prompts(p: dict) -> list[list[list[int]]]:
    """The prompt ids of each step's rollout as finetune's GRPOLoader draws them (load_prompts, seed 0): a stand-in
    objective records what the loader asks it to roll out."""
    from entrenar.tokenizer import load_tokenizer, use_chat_template_file
    from entrenar.train.grpo import GRPOLoader, load_prompts

    tok = load_tokenizer(p["model"])
    use_chat_template_file(tok, p["chat_template"])
    examples, _ = load_prompts(p["data"], tok, p["max_seq_len"], p["max_new_tokens"])
    loader = GRPOLoader(examples, p["batch"], seed=0, max_seq_len=p["max_seq_len"], pad_id=tok.eos_id)
    drawn: list[list[list[int]]] = []

    class Recorder:
        grad_accum, iterations = 1, 1

        def rollouts(self, micro_batches, seeds, draw=None):  # draw: --grpo-dynamic-sampling (off here)
            drawn.extend([[e.input_ids.tolist() for e in mb] for mb in micro_batches])
            return [{} for _ in micro_batches]

    loader.objective = Recorder()
    for _ in range(p["steps"]):
        loader.next_batch()
    return drawn


def test_trl_rolls_out_our_prompts_ids_and_shape(built):
    p, trainer = built
    args = trainer.args
    assert (args.num_generations, args.per_device_train_batch_size, args.generation_batch_size) == (G, BATCH * G,
                                                                                                   BATCH * G)
    assert (args.gradient_accumulation_steps, args.num_iterations, args.max_completion_length) == (1, 1, NEW)
    assert args.use_vllm is False and args.shuffle_dataset is False
    assert args.gradient_checkpointing is False  # as ours (GRPOConfig turns it on by default)
    d = grpo_peers.grpo_defaults()
    assert (args.temperature, args.top_p, args.beta, args.loss_type, args.scale_rewards, args.epsilon) == (
        d["temperature"], d["top_p"], d["beta"], d["loss_type"], d["scale_rewards"], d["epsilon"])
    assert trainer.generation_config.max_new_tokens == NEW and trainer.generation_config.do_sample
    from entrenar.tokenizer import load_tokenizer

    assert set(trainer.eos_token_ids) == load_tokenizer(p["model"]).stop_ids
    # the sampler's order: each prompt G times in a row, BATCH prompts per step, ours in our order
    order = list(trainer._get_train_sampler())[:STEPS * BATCH * G]
    prompts = [trainer.train_dataset[i]["prompt"] for i in order]
    ids, _, _ = trainer._tokenize_prompts(prompts)  # what TRL's rollout generates from
    theirs = [ids[s * BATCH * G:(s + 1) * BATCH * G:G] for s in range(STEPS)]
    assert all(ids[k] == ids[k - k % G] for k in range(len(ids)))  # the G copies of a prompt
    assert theirs == _ours_rollout_prompts(p)
    assert len({tuple(x) for step in theirs for x in step}) > 1


def test_reward_is_entrenars_bfcl_graded(built):
    p, trainer = built
    from entrenar.tokenizer import load_tokenizer, use_chat_template_file
    from entrenar.train.rewards import bfcl_graded_reward

    tok = load_tokenizer(p["model"])
    use_chat_template_file(tok, p["chat_template"])
    row = json.loads(trainer.train_dataset[0]["row"])
    call = row["messages"][-1]["tool_calls"][0]["function"]
    right = f'<tool_call>\n{json.dumps({"name": call["name"], "arguments": call["arguments"]})}\n</tool_call>'
    wrong = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nowhere"}}\n</tool_call>' \
        if call["name"] != "get_weather" else '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    stop = min(tok.stop_ids)
    ids = [tok.encode(right, add_special=False) + [stop], tok.encode(wrong, add_special=False)]
    reward = trainer.reward_funcs[0]
    got = reward(prompts=["p", "p"], completions=["ignored", "ignored"], completion_ids=ids,
                 row=[json.dumps(row)] * 2, trainer_state=None)
    assert got == bfcl_graded_reward(["p", "p"], [right, wrong], [row, row])
    assert got[0] == 1.0 and got[1] < 1.0


def test_our_row_runs_the_same_work_and_is_measured_from_its_metrics(tmp_path):
    """Our row's finetune gets the bench's G, batch, lengths, steps, rank, lr, reward; its loop is the step seconds
    plus step 0's rollout (step 1 trains on it), its rollout tokens/s the metrics' tokens over rollout seconds."""
    p = {"model": "M", "data": "D", "steps": 3, "batch": 2, "num_generations": 4, "max_new_tokens": 32, "rank": 8,
         "lr": 1e-5, "max_seq_len": 2048, "chat_template": "chatml_tools", "device": "cuda", "entrenar_flags": []}
    cmd = grpo_peers.entrenar_command(p, tmp_path / "run")
    flags = dict(itertools.pairwise(cmd))  # each flag to the word after it
    for flag, key in (("--steps", "steps"), ("--batch-size", "batch"), ("--num-generations", "num_generations"),
                      ("--max-new-tokens", "max_new_tokens"), ("--rank", "rank"), ("--lr", "lr"),
                      ("--max-seq-len", "max_seq_len")):
        assert flags[flag] == str(p[key]), flag
    assert (flags["--objective"], flags["--reward"], flags["--mode"], flags["--grad-accum"]) == (
        "grpo", "bfcl-graded", "lora", "1")
    # 3 steps of 8 sequences; step 1's 0.5 s excludes its rollout (drawn by step 0's check: 2 s for 80 tokens)
    records = [{"step": 1, "tokens": 1000, "tok_s": 2000.0, "completion_length": 10.0, "rollout_tok_s": 40.0,
                "reward": 0.5, "mem_mb": 100.0},
               {"step": 2, "tokens": 2000, "tok_s": 400.0, "completion_length": 20.0, "rollout_tok_s": 80.0,
                "reward": 0.25, "mem_mb": 300.0},
               {"step": 3, "tokens": 3000, "tok_s": 500.0, "completion_length": 5.0, "rollout_tok_s": 40.0,
                "reward": 0.0, "mem_mb": 200.0}]
    m = grpo_peers.entrenar_measures({"tokens": 3000, "tok_s": 3000 / 5.5, "seconds": 9.0}, records, 8)
    assert m["loop_s"] == pytest.approx(5.5 + 2.0) and m["loop_s_after_first"] == pytest.approx(2.5 + 2.0)
    assert m["generated_tokens"] == 280 and m["rollout_s"] == pytest.approx(2 + 2 + 1)
    assert m["rollout_tok_s"] == pytest.approx(280 / 5) and m["rollout_tok_s_after_first"] == pytest.approx(200 / 3)
    assert (m["optimizer_steps"], m["mean_reward"], m["peak_mem_mb"]) == (3, 0.25, 300.0)
