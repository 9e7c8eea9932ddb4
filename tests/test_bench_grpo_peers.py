"""bench/grpo_peers.py: TRL's GRPOTrainer rolls out the prompts `finetune --objective grpo` rolls out (the same token
ids, the same order, batch x G per optimizer step, the same lengths and sampling settings), and its reward is
entrenar's bfcl-graded, so the speed comparison is the same work."""

from __future__ import annotations

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

        def rollouts(self, micro_batches, seeds):
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
