"""The task eval's harness driven by transformers' `generate` (greedy): the oracle of the metric's parity
(bench/humaneval_parity.py, tests/test_eval_task_real.py). Only the token ids come from transformers;
prompts, stop rule, decoding of the ids to text, extraction and the sandbox are the harness's own."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .harness import Complete, Completion
from .tasks import completion_done as task_done


def transformers_completer(hf_model, tokenizer, max_new_tokens: int, chat: bool,
                           token_ids: dict | None = None, stop: Callable[[str], bool] | None = None) -> Complete:
    """Complete on `hf_model.generate(do_sample=False)`: left padding with an attention mask, stopping each
    row at a stop token or, through a StoppingCriteria, by `stop(text)` (default: tasks.completion_done for
    `chat`'s format), as generate_batch does. Greedy: every sample of a prompt is the same, so `samples` (one
    index per prompt, the Complete protocol) only has to be accepted."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    def completion_done(text: str, chat: bool) -> bool:
        return stop(text) if stop is not None else task_done(text, chat)

    stops = set(tokenizer.stop_ids)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0

    class DoneRule(StoppingCriteria):
        def __init__(self, prompt_len: int):
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([completion_done(tokenizer.decode(row[self.prompt_len:].tolist()), chat)
                                 for row in input_ids], dtype=torch.bool, device=input_ids.device)

    def complete(batch_ids: list[list[int]], samples: Sequence[int]) -> list[Completion]:
        width = max(len(x) for x in batch_ids)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch_ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch_ids])
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=sorted(stops), pad_token_id=pad,
                                    stopping_criteria=StoppingCriteriaList([DoneRule(width)]))
        texts = []
        for prompt, row in zip(batch_ids, out[:, width:].tolist()):
            kept: list[int] = []  # the row up to where generate_batch would have stopped it (padding follows)
            stopped = False  # by a stop token or the stop rule; else max_new_tokens cut it
            for t in row:
                kept.append(t)
                if t in stops or completion_done(tokenizer.decode(kept), chat):
                    stopped = True
                    break
            if token_ids is not None:
                token_ids[tuple(prompt)] = kept
            texts.append(Completion(tokenizer.decode(kept[:-1] if kept and kept[-1] in stops else kept), not stopped))
        return texts

    return complete
