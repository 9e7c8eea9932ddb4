"""Parity of the HumanEval metric on the packaged Qwen2.5-Coder-0.5B-Instruct: the same harness driven by
our generate_batch and by transformers' generate (greedy) gives the same tokens and the same per-problem
pass/fail (2 short problems, 72 new tokens; all 164: bench/humaneval_parity.py).

The two rows cover what the metric's parity rests on: prompts of unequal length (left padding: HumanEval/52's
is 41 tokens longer), a row that passes and is stopped by the harness's stop rule (HumanEval/23, 65 tokens) and
one that fails and is cut by max_new_tokens (HumanEval/52). Five problems at 96 tokens cost CI ~2 min more for the
same checks."""

from __future__ import annotations

import pytest
import torch

from entrenar.evaluate.harness import TaskEvalSettings, entrenar_completer, task_records
from entrenar.evaluate.oracle import transformers_completer
from entrenar.evaluate.tasks import humaneval_problems

# a short prompt and solution that passes within NEW_TOKENS (stopped by the stop rule), and one cut by NEW_TOKENS
PROBLEMS = ("HumanEval/23", "HumanEval/52")
NEW_TOKENS = 72


@pytest.mark.real_model
def test_humaneval_pass_fail_matches_transformers_qwen(qwen_model, qwen_path):
    from entrenar.tokenizer import load_tokenizer
    from tests.test_generate import _hf_from_gguf

    tok = load_tokenizer("qwen2.5-coder-0.5b-instruct")
    problems = [p for p in humaneval_problems() if p.task_id in PROBLEMS]
    settings = TaskEvalSettings(batch_size=len(PROBLEMS), chat=True)
    ours_ids: dict = {}
    hf_ids: dict = {}
    ours = task_records(problems, tok, entrenar_completer(qwen_model, tok, NEW_TOKENS, True, token_ids=ours_ids),
                        settings)
    with torch.no_grad():
        ref = task_records(problems, tok, transformers_completer(_hf_from_gguf(qwen_path), tok, NEW_TOKENS, True,
                                                                 token_ids=hf_ids), settings)
    assert ours_ids == hf_ids
    assert [r["passed"] for r in ours] == [r["passed"] for r in ref]
    assert [r["completion"] for r in ours] == [r["completion"] for r in ref]
    assert sum(r["passed"] for r in ours) >= 1, [r["error"] for r in ours]  # the metric can see a pass
    assert sorted(len(x) for x in ours_ids) == [110, 151]  # unequal prompts: the shorter one is left-padded
    assert sorted(len(x) for x in ours_ids.values()) == [65, NEW_TOKENS]  # a row stopped early, one cut
