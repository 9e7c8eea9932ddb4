"""Self-distilled replay (`entrenar data replay`): the base model's own answers to general and code requests, as
SFT rows to mix into a narrow fine-tune (`finetune --mix replay.jsonl:0.3`), so the fine-tune keeps answering
ordinary requests the way the base did instead of drifting towards the narrow rows' form (a tool call for every
question, a refusal for plain ones).

The built-in prompts (`--prompts builtin`, 200 of them: explanations and facts over 40 subjects, 20 how-to asks, 40 code asks, 20 comparisons, 20 tips, 20 arithmetic questions) are made from templates and are disjoint
from the `chat` task's requests (evaluate/chat_task.py; tests/test_replay.py checks it), so replay never trains
on the retention panel's own questions. An answer is kept only when it passes the `chat` task's gates (no refusal,
no tool call, no repetition, readable, code that parses): with `--samples K` (and `--temperature` > 0) the first
of K samples that passes is kept; a prompt with none is left out and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..fileio import MAX_ROW_CHARS, read_jsonl

_TOPICS = ("a volcano", "the moon", "a rainbow", "an earthquake", "a glacier", "the heart", "a battery", "a bridge",
           "a compass", "a telescope", "a microscope", "a magnet", "a cloud", "a desert", "a forest", "a river",
           "a hurricane", "an eclipse", "a fossil", "a vaccine", "a thermometer", "an airplane", "a submarine",
           "a piano", "a violin", "a calendar", "a map", "a lighthouse", "a windmill", "a satellite", "coral reefs",
           "honeybees", "penguins", "whales", "owls", "tomatoes", "bread", "cheese", "coffee", "tea")
_HOWTO = ("plant a tree", "write a good email", "prepare for a job interview", "learn to swim", "make pancakes",
          "clean a laptop keyboard", "start running", "organize a bookshelf", "take better photos", "water houseplants",
          "pack a suitcase", "make a budget", "write a short story", "memorize a poem", "fold a paper airplane",
          "keep a journal", "choose a good password", "learn chess", "brew coffee at home", "plan a picnic")
_CODE = ("returns the sum of the digits of an integer", "returns the number of words in a string",
         "returns True if a year is a leap year", "returns the second largest number in a list",
         "returns a string with its characters sorted", "returns the median of a list of numbers",
         "converts kilometres to miles", "returns the greatest common divisor of two integers",
         "returns the list of prime numbers below n", "returns the number of uppercase letters in a string",
         "removes the whitespace from a string", "returns the keys of a dictionary sorted by value",
         "returns the cumulative sums of a list", "checks that two strings are anagrams",
         "returns the longest word in a sentence", "returns a list without its negative numbers",
         "returns the n-th triangular number", "converts a list of pairs into a dictionary",
         "returns the number of days in a month", "rotates a list by k positions",
         "returns the most common element of a list", "returns a string in title case",
         "returns the intersection of two lists", "checks whether all elements of a list are equal",
         "returns the binary representation of an integer", "returns the difference between the max and the min",
         "splits a list into chunks of size n", "returns the digits of a number as a list",
         "counts the lines of a text", "returns the average word length of a sentence",
         "returns the index of the smallest element", "interleaves two lists",
         "returns True if a string contains only digits", "doubles every element of a list",
         "returns the sum of the squares of a list", "returns the first repeated character of a string",
         "returns a dictionary counting the words of a text", "returns the list reversed without slicing",
         "returns the factorial of n computed iteratively", "returns the n-th power of two")
_PAIRS = (("a lake", "a sea"), ("a virus", "a bacterium"), ("weather", "a season"), ("a city", "a village"),
          ("a poem", "a song"), ("a list", "a tuple in Python"), ("speed", "velocity"), ("a planet", "a star"),
          ("rain", "snow"), ("a frog", "a toad"), ("a hill", "a mountain"), ("a noun", "a verb"),
          ("a laptop", "a tablet"), ("baking", "frying"), ("a museum", "a gallery"), ("an ocean", "a river"),
          ("a loop", "a function in programming"), ("a novel", "a short story"), ("a dolphin", "a shark"),
          ("an island", "a peninsula"))
_TIPS = ("studying for a test", "staying hydrated", "writing clean code", "reading more books", "cooking rice",
         "keeping a plant alive", "running a meeting", "learning to draw", "saving energy at home", "sleeping well",
         "giving a short speech", "taking notes", "walking a dog", "reducing stress", "making friends at school",
         "using a spreadsheet", "baking cookies", "riding a bicycle safely", "keeping a room tidy", "debugging code")
_ARITH = [(a, b) for a, b in ((12, 7), (23, 19), (45, 38), (8, 9), (14, 3), (31, 26), (56, 44), (7, 12), (18, 25),
                              (60, 15), (27, 36), (11, 13), (40, 22), (9, 6), (33, 17), (72, 8), (15, 15), (48, 12),
                              (21, 34), (64, 16))]


def builtin_prompts() -> list[dict[str, str]]:
    """200 general and code requests: {"id", "prompt", "topic"} ("code" for the code asks, else "explain")."""
    out = []
    for i, t in enumerate(_TOPICS):
        out.append({"id": f"replay/explain-{i:03d}", "topic": "explain",
                    "prompt": f"Explain what {t} is in two or three sentences."})
        out.append({"id": f"replay/fact-{i:03d}", "topic": "explain",
                    "prompt": f"Tell me one interesting fact about {t}."})
    for i, h in enumerate(_HOWTO):
        out.append({"id": f"replay/howto-{i:03d}", "topic": "explain", "prompt": f"How do I {h}? Give short steps."})
    for i, c in enumerate(_CODE):
        out.append({"id": f"replay/code-{i:03d}", "topic": "code", "prompt": f"Write a Python function that {c}."})
    for i, (x, y) in enumerate(_PAIRS):
        out.append({"id": f"replay/compare-{i:03d}", "topic": "explain",
                    "prompt": f"What is the difference between {x} and {y}? Answer briefly."})
    for i, t in enumerate(_TIPS):
        out.append({"id": f"replay/tip-{i:03d}", "topic": "explain", "prompt": f"Give me one practical tip for {t}."})
    for i, (a, b) in enumerate(_ARITH):
        out.append({"id": f"replay/arith-{i:03d}", "topic": "explain",
                    "prompt": f"What is {a} {'plus' if i % 2 == 0 else 'times'} {b}? Answer with the number and "
                              f"one short sentence."})
    assert len(out) == 200 and len({p["id"] for p in out}) == 200
    return out


def read_prompts(spec: str) -> list[dict[str, str]]:
    """`--prompts builtin`, or a JSONL FILE of {"prompt"[, "id"]} rows (exit 2 naming FILE:LINE on a bad row)."""
    if spec == "builtin":
        return builtin_prompts()
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"--prompts {spec}: not 'builtin' and no such file (JSONL rows with a \"prompt\")")
    out = []
    for n, row in read_jsonl(path, max_line_chars=MAX_ROW_CHARS):  # a line that is not JSON: exit 2, FILE:LINE
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise InputError(f"{path}:{n}: a row needs a non-empty string \"prompt\"")
        out.append({"id": str(row.get("id", f"line {n}")), "prompt": row["prompt"],
                    "topic": "code" if row.get("topic") == "code" else "explain"})
    if not out:
        raise InputError(f"--prompts {spec}: no rows")
    return out


def replay_rows(prompts: list[dict[str, str]], tokenizer: Any, complete: Callable, samples: int, batch_size: int,
                system: str | None = None, log: Callable[[str], None] | None = None
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The SFT rows ({"id", "messages"}) of the answers that pass the chat gates, and the counts (kept, dropped,
    the dropped prompts' ids and the gate that failed them)."""
    from ..evaluate.chat_task import ChatRequest, chat_gates

    def ids_of(p: dict[str, str]) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": p["prompt"]}]
        return list(tokenizer.encode_chat(messages, add_generation_prompt=True).ids)

    prompt_ids = [ids_of(p) for p in prompts]
    kept: dict[int, str] = {}
    failed: dict[int, list[str]] = {}
    for sample in range(samples):
        todo = [i for i in range(len(prompts)) if i not in kept]
        if not todo:
            break
        todo.sort(key=lambda i: -len(prompt_ids[i]))
        for at in range(0, len(todo), batch_size):
            batch = todo[at:at + batch_size]
            if log is not None:
                log(f"sample {sample + 1}/{samples}: prompts {at + 1}-{at + len(batch)} of {len(todo)}")
            for i, c in zip(batch, complete([prompt_ids[i] for i in batch], [sample] * len(batch))):
                request = ChatRequest(prompts[i]["id"], prompts[i]["prompt"], prompts[i]["topic"])
                gates, _ = chat_gates(request, c.text)
                if all(gates.values()) and not c.truncated:
                    kept[i] = c.text.strip()
                else:
                    failed[i] = [g for g, ok in gates.items() if not ok] or ["truncated"]
    rows = []
    for i, p in enumerate(prompts):
        if i in kept:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": kept[i]}]
            rows.append({"id": p["id"], "messages": messages})
    dropped = {prompts[i]["id"]: failed[i] for i in range(len(prompts)) if i not in kept}
    return rows, {"prompts": len(prompts), "kept": len(rows), "dropped": len(dropped), "dropped_ids": dropped}
