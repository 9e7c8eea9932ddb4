"""`chat`: ordinary requests a fine-tune must keep answering (`eval --task chat`, `--eval-task chat`,
`--retain-task chat`).

A built-in set of 120 requests a user asks an assistant: short factual questions (each with the words a right
answer contains), explanations and how-to questions (no single answer: judged by the gates alone) and short code
asks. No tools are shown. Each answer is scored two ways:

(a) **pass/fail gates**, so the paired McNemar test applies as for any task: `non_empty`, `no_repetition` (no
    fragment repeated 3+ times in a row), `no_refusal` (not "I'm sorry ... as an AI, I can't ..." to a harmless
    request), `no_tool_call` (no `<tool_call>` block and no reply that is a JSON call object), `coherent` (reads as
    text: verify/qa.py's gibberish rules, and the expected words where the request has them) and, for code asks,
    `code_parses` (every fenced Python block parses). `qa`'s gates, on 120 requests instead of 4.
(b) **drift from the base**: the mean per-token log-likelihood, under the model being judged, of the base model's
    own greedy answers (`base_answer_logp`, a continuous number, token-weighted over the set). In a run the base
    is the step-0 model (a LoRA's adapters are zero then; a full fine-tune's start); `eval --task chat --adapter A`
    takes the adapters switched off. A fine-tune that keeps the base's behaviour keeps this near its step-0 value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..verify.qa import REFUSAL, gibberish_reasons, parse_errors, python_blocks, repeated_fragment

CHAT_MAX_NEW_TOKENS = 160
GATES = ("non_empty", "no_repetition", "no_refusal", "no_tool_call", "coherent", "code_parses")


@dataclass(frozen=True)
class ChatRequest:
    task_id: str
    prompt: str
    topic: str  # "fact" | "explain" | "code"
    expect: tuple[str, ...] = ()  # a right answer contains one of these (case-insensitive); () = gates only


def _facts() -> list[ChatRequest]:
    qa = [
        ("What is the capital of France?", ("Paris",)), ("What is the capital of Japan?", ("Tokyo",)),
        ("What is the capital of Italy?", ("Rome",)), ("What is the capital of Germany?", ("Berlin",)),
        ("What is the capital of Spain?", ("Madrid",)), ("What is the capital of Canada?", ("Ottawa",)),
        ("What is the capital of Egypt?", ("Cairo",)), ("What is the capital of Russia?", ("Moscow",)),
        ("What is the capital of the United Kingdom?", ("London",)), ("What is the capital of China?", ("Beijing",)),
        ("What is 2 + 3?", ("5", "five")), ("What is 7 times 6?", ("42", "forty-two", "forty two")),
        ("What is 10 minus 4?", ("6", "six")), ("What is 100 divided by 4?", ("25", "twenty-five")),
        ("What is 9 squared?", ("81", "eighty-one")), ("How many days are in a week?", ("7", "seven")),
        ("How many legs does a spider have?", ("8", "eight")), ("How many continents are there?", ("7", "seven")),
        ("How many minutes are in an hour?", ("60", "sixty")), ("How many hours are in a day?", ("24",)),
        ("What color is the sky on a clear day?", ("blue",)), ("What color are ripe bananas?", ("yellow",)),
        ("What is the largest planet in our solar system?", ("Jupiter",)),
        ("Which planet is known as the Red Planet?", ("Mars",)),
        ("What is the chemical symbol for water?", ("H2O", "H₂O")),
        ("What gas do plants take in from the air to make food?", ("carbon dioxide", "CO2")),
        ("What is the freezing point of water in degrees Celsius?", ("0", "zero")),
        ("What is the boiling point of water at sea level in degrees Celsius?", ("100",)),
        ("Who wrote the play Romeo and Juliet?", ("Shakespeare",)),
        ("What is the opposite of hot?", ("cold",)), ("What is the opposite of up?", ("down",)),
        ("What do bees make?", ("honey",)), ("What is the largest ocean on Earth?", ("Pacific",)),
        ("What is the fastest land animal?", ("cheetah",)), ("What is the tallest animal?", ("giraffe",)),
        ("In which country are the pyramids of Giza?", ("Egypt",)),
        ("What language is mainly spoken in Brazil?", ("Portuguese",)),
        ("Which star is at the center of our solar system?", ("Sun",)),
        ("What is the plural of mouse?", ("mice",)), ("What is the first letter of the English alphabet?", ("A",)),
    ]
    return [ChatRequest(f"chat/fact-{i:03d}", q, "fact", e) for i, (q, e) in enumerate(qa)]


def _explanations() -> list[ChatRequest]:
    asks = [
        "Explain in two sentences why the sky is blue.", "Give me three tips for sleeping better.",
        "What is photosynthesis? Answer briefly.", "Describe a cat in one sentence.",
        "Tell me a short joke about cats.", "Write a haiku about the sea.",
        "How do I boil an egg?", "What are the benefits of drinking water?",
        "Summarize what a computer does in one sentence.", "Why do we have seasons? Keep it short.",
        "Suggest a name for a pet dog.", "How can I be more productive when working from home?",
        "Write a short thank-you note to a friend.", "What should I pack for a day at the beach?",
        "Explain what a noun is.", "Give me a simple recipe for a sandwich.",
        "What is the difference between weather and climate?", "How do plants grow? Answer briefly.",
        "Write one sentence encouraging someone who is learning to code.", "Why is exercise good for you?",
        "Describe the taste of a lemon.", "What is a good way to start learning a new language?",
        "Tell me an interesting fact about the ocean.", "Explain what gravity is in simple words.",
        "How do I make a cup of tea?", "What is a rainbow?", "Write a two-line poem about autumn.",
        "What are three primary colors?", "How can I save money on groceries?",
        "What is the water cycle? Answer in a few sentences.", "Explain what a variable is in programming.",
        "What does a library do?", "Give me a fun weekend activity idea.", "Why do leaves change color in fall?",
        "What is the internet? Explain simply.", "How do I stay calm before an exam?",
        "Write a friendly greeting for a new neighbour.", "What is recycling and why does it matter?",
        "Describe a sunrise in one sentence.", "What makes a good friend?",
    ]
    return [ChatRequest(f"chat/explain-{i:03d}", q, "explain") for i, q in enumerate(asks)]


def _code() -> list[ChatRequest]:
    asks = [
        ("Write a Python function that returns the square of a number.", ("def",)),
        ("Write a Python function is_even(n) that returns True if n is even.", ("def is_even",)),
        ("Write a Python function that reverses a string.", ("def",)),
        ("Write a Python function that returns the maximum of a list.", ("def",)),
        ("Write a Python function that counts the vowels in a string.", ("def",)),
        ("Write a Python function factorial(n).", ("def factorial",)),
        ("Write a Python function that checks whether a string is a palindrome.", ("def",)),
        ("Write a Python function that sums a list of numbers.", ("def",)),
        ("Write a Python function fibonacci(n) that returns the n-th Fibonacci number.", ("def fibonacci",)),
        ("Write a Python function that converts Celsius to Fahrenheit.", ("def",)),
        ("Write a Python function that removes duplicates from a list.", ("def",)),
        ("Write a Python function that returns the length of a list without using len.", ("def",)),
        ("Write a Python function that capitalizes every word in a sentence.", ("def",)),
        ("Write a Python function that returns the average of a list of numbers.", ("def",)),
        ("Write a Python function that checks if a number is prime.", ("def",)),
        ("Write a Python function that merges two dictionaries.", ("def",)),
        ("Write a Python function that returns the first n even numbers.", ("def",)),
        ("Write a Python function that counts words in a sentence.", ("def",)),
        ("Write a Python function that returns the minimum of two numbers.", ("def",)),
        ("Write a Python function that sorts a list of strings by length.", ("def",)),
        ("Show how to read a text file line by line in Python.", ("open",)),
        ("Show how to loop over a dictionary's keys and values in Python.", ("for",)),
        ("Write a Python list comprehension that squares the numbers 1 to 10.", ("for",)),
        ("Show how to define a simple Python class Dog with a bark method.", ("class Dog",)),
        ("Write a Python function that joins a list of strings with commas.", ("def",)),
        ("Write a Python function that returns the last element of a list.", ("def",)),
        ("Write a Python function that checks whether a key is in a dictionary.", ("def",)),
        ("Write a Python function that converts a string to uppercase.", ("def",)),
        ("Write a Python function that returns the absolute value of a number without abs.", ("def",)),
        ("Write a Python function that flattens a list of lists.", ("def",)),
        ("Write a Python function that counts how often each letter occurs in a string.", ("def",)),
        ("Write a Python function that returns a list of numbers from 1 to n.", ("def",)),
        ("Write a Python function that swaps two variables and returns them.", ("def",)),
        ("Write a Python function that checks if a list is sorted.", ("def",)),
        ("Write a Python function that returns the product of a list of numbers.", ("def",)),
        ("Write a Python function that computes the area of a circle.", ("def",)),
        ("Write a Python function that repeats a string n times.", ("def",)),
        ("Write a Python function that returns the even numbers of a list.", ("def",)),
        ("Write a Python function that finds the index of an item in a list.", ("def",)),
        ("Write a Python function that converts a list of numbers to strings.", ("def",)),
    ]
    return [ChatRequest(f"chat/code-{i:03d}", q, "code", e) for i, (q, e) in enumerate(asks)]


CHAT_SET: tuple[ChatRequest, ...] = (*_facts(), *_explanations(), *_code())

def tool_call_in(text: str) -> bool:
    """A tool call where none was asked for: a `<tool_call>` block, or a reply that is a JSON call object
    (or a list of them), fenced or not."""
    if "<tool_call>" in text:
        return True
    body = text.strip()
    fenced = re.fullmatch(r"```[A-Za-z]*\n?(.*?)\n?```", body, re.DOTALL)
    body = fenced.group(1).strip() if fenced else body
    if not body.startswith(("{", "[")):
        return False
    try:
        value = json.loads(body)
    except ValueError:
        return False
    items = value if isinstance(value, list) else [value]
    return bool(items) and all(isinstance(v, dict) and "name" in v for v in items)


def chat_gates(request: ChatRequest, text: str) -> tuple[dict[str, bool], list[str]]:
    """The pass/fail gates of one answer (a pure function of the text; unit-tested on hand-made answers)."""
    gates: dict[str, bool] = {"non_empty": bool(text.strip())}
    notes: list[str] = []
    frag = repeated_fragment(text)
    gates["no_repetition"] = frag is None
    if frag is not None:
        notes.append(f"fragment repeated 3+ times in a row: {frag!r}")
    refusal = REFUSAL.search(text)
    gates["no_refusal"] = refusal is None
    if refusal is not None:
        notes.append(f"refused a harmless request: {refusal.group(0)!r}")
    gates["no_tool_call"] = not tool_call_in(text)
    if not gates["no_tool_call"]:
        notes.append("a tool call where no tool was offered")
    reasons = gibberish_reasons(text)
    if request.expect and not any(e.lower() in text.lower() for e in request.expect):
        reasons.append(f"expected one of {list(request.expect)} in the answer")
    gates["coherent"] = not reasons
    notes += reasons
    if request.topic == "code":
        errors = parse_errors(python_blocks(text) or [text])
        gates["code_parses"] = not errors
        notes += [f"code: {e}" for e in errors]
    return gates, notes


def chat_prompt_ids(request: ChatRequest, tokenizer: Any) -> list[int]:
    """The request as the model's chat template renders one user message (the template's default system)."""
    return list(tokenizer.encode_chat([{"role": "user", "content": request.prompt}], add_generation_prompt=True).ids)


def answers_logp(model: Any, prompts: Sequence[list[int]], answers: Sequence[list[int]], device: str,
                 bf16: bool = False) -> list[tuple[float, int]]:
    """(sum of log-probabilities, token count) of each answer's tokens after its prompt, under `model`."""
    import torch

    out: list[tuple[float, int]] = []
    for prompt, answer in zip(prompts, answers):
        if not answer:
            out.append((0.0, 0))
            continue
        ids = torch.tensor([list(prompt) + list(answer)], device=device)
        labels = ids[:, 1:].clone()
        labels[:, :len(prompt) - 1] = -100  # the prompt is given, not scored: only the answer's tokens
        with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            per_token = model(ids[:, :-1], labels=labels, per_token=True)  # fp32 cross-entropy, 0 where ignored
        out.append((-float(per_token.sum()), len(answer)))
    return out


def chat_records(requests: Sequence[ChatRequest], tokenizer: Any, complete: Callable, token_ids: dict,
                 batch_size: int, base_answers: dict[str, list[int]] | None, logp_of: Callable,
                 log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One record per request: the answer, its gates, passed (every gate), and the base answer's log-likelihood
    under this model (`base_logp`, `base_tokens`; the base's answers are these when `base_answers` is None)."""
    ids = [chat_prompt_ids(r, tokenizer) for r in requests]
    texts: list[tuple[str, bool]] = [("", False)] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: -len(ids[i]))
    for at in range(0, len(order), batch_size):
        batch = order[at:at + batch_size]
        if log is not None:
            log(f"chat requests {at + 1}-{at + len(batch)} of {len(requests)}: generating")
        for i, c in zip(batch, complete([ids[i] for i in batch], [0] * len(batch))):
            texts[i] = (c.text, c.truncated)
    own = {r.task_id: list(token_ids.get(tuple(p), [])) for r, p in zip(requests, ids)}
    base = base_answers if base_answers is not None else own
    scored = logp_of(ids, [base.get(r.task_id, []) for r in requests])
    records = []
    for r, p, (text, truncated), (logp, n) in zip(requests, ids, texts, scored):
        gates, notes = chat_gates(r, text)
        passed = all(gates.values())
        records.append({"task_id": r.task_id, "topic": r.topic, "passed": passed,
                        "status": "passed" if passed else "failed", "gates": gates, "error": "; ".join(notes),
                        "completion": text, "truncated": truncated, "answer_ids": own[r.task_id],
                        "prompt_tokens": len(p), "base_logp": logp, "base_tokens": n})
    return records


def chat_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """pass rate, per-gate failures, and base_answer_logp (token-weighted mean log-likelihood of the base's
    answers under the judged model)."""
    n = len(records)
    passed = sum(1 for r in records if r["passed"])
    tokens = sum(r["base_tokens"] for r in records)
    return {"pass_rate": passed / n if n else None, "passed": passed, "problems": n,
            "truncated": sum(1 for r in records if r.get("truncated")),
            "gate_failures": {g: sum(1 for r in records if not r["gates"].get(g, True)) for g in GATES},
            "base_answer_logp": sum(r["base_logp"] for r in records) / tokens if tokens else None}
