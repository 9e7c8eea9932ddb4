"""`entrenar qa`: golden prompts, generated greedily, and gates on what comes out.

Prompts: plain continuation and chat-templated, prose and code. Gates per answer:
- ``non_empty``: some visible text came out;
- ``no_repetition``: no fragment (>= 3 chars, >= 2 letters) repeated 3+ times in a row;
- ``stops`` (chat): generation ended with end-of-turn / EOS within the token budget;
- ``code_parses`` (chat code): every fenced Python block parses with ``ast``;
- ``coherent``: not gibberish (mostly word-like text, no leaked template markup) and it
  contains the expected answer. A chat answer failing this while the plain prompt's passes means a
  chat template whose markers the model was never trained on (ChatML tokens read as plain text: plain
  continuations fine, chat answers gibberish), reported as such.

The budget is small (a few dozen tokens per prompt) so qa runs in seconds on a CPU.
"""

from __future__ import annotations

import ast
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class GoldenPrompt:
    name: str
    kind: str  # "plain" | "chat"
    topic: str  # "prose" | "code"
    prompt: str
    expect: tuple[str, ...]  # the answer contains one of these (case-insensitive)
    max_new_tokens: int
    system: str | None = None


GOLDEN: tuple[GoldenPrompt, ...] = (
    GoldenPrompt("plain-prose", "plain", "prose", "The capital of France is the city of", ("Paris",), 12),
    GoldenPrompt("plain-code", "plain", "code", "def add(a, b):\n    return", ("a + b", "a+b", "b + a"), 12),
    GoldenPrompt("chat-prose", "chat", "prose", "What is the capital of France? Answer in one short sentence.",
                 ("Paris",), 40),
    GoldenPrompt("chat-code", "chat", "code",
                 "Write a Python function add(a, b) that returns a + b. Reply with one short code block only.",
                 ("def add",), 64),
)

_FENCE = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[ \t]*\n(?P<body>.*?)(?:```|\Z)", re.DOTALL)
_REPEAT = re.compile(r"(.{3,}?)\1{2,}", re.DOTALL)
# a refusal of a harmless request ("I'm sorry ... as an AI, I can't ..."): a fine-tune that taught refusing
REFUSAL = re.compile(
    r"\b(?:I['’]?m sorry|I am sorry|I apologi[sz]e|as an AI\b|as a language model|I can(?:['’]|no)t (?:help|answer|"
    r"assist|provide|do that|comply)|I cannot|I['’]?m (?:not able|unable) to|I am (?:not able|unable) to|I won['’]t be "
    r"able)", re.IGNORECASE)
_MARKUP = re.compile(r"<\|[a-z_]+\|>|<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>")


def repeated_fragment(text: str) -> str | None:
    """The first fragment (>= 3 chars with >= 2 letters) repeated 3+ times in a row, else None."""
    for m in _REPEAT.finditer(text):
        frag = m.group(1)
        if sum(c.isalpha() for c in frag) >= 2:
            return frag
        # a run of punctuation/digits: look further inside it for a wordy fragment
        inner = repeated_fragment(text[m.start() + 1:m.end()]) if m.end() - m.start() > 3 else None
        if inner:
            return inner
    return None


def python_blocks(text: str) -> list[str]:
    """Fenced code blocks tagged python/py (or untagged) -- an unterminated last block included."""
    return [m.group("body") for m in _FENCE.finditer(text) if m.group("lang").lower() in ("", "python", "py",
                                                                                          "python3")]


def parse_errors(blocks: list[str]) -> list[str]:
    errors = []
    for b in blocks:
        try:
            ast.parse(b)
        except SyntaxError as e:
            errors.append(f"line {e.lineno}: {e.msg}")
    return errors


def gibberish_reasons(text: str) -> list[str]:
    """Why ``text`` looks like gibberish (empty list: it reads like text or code)."""
    reasons = []
    if _MARKUP.search(text):
        reasons.append("chat-template markup leaked into the answer")
    visible = [c for c in text if not c.isspace()]
    if visible:
        # the golden prompts are English: byte-level mojibake (Ġ, â, Ċ ...) is not an answer
        odd = sum(not ((c.isascii() and c.isprintable()) or c in "\u2018\u2019\u201c\u201d\u2013\u2014\u2026\u2022")
                  for c in visible)
        if odd / len(visible) > 0.2:
            reasons.append(f"{odd}/{len(visible)} characters are outside printable ASCII")
    words = re.findall(r"[A-Za-z]+", text)
    if len(words) >= 4:
        wordlike = sum(1 for w in words if len(w) <= 20 and (len(w) <= 2 or re.search(r"[aeiouyAEIOUY]", w)))
        if wordlike / len(words) < 0.7:
            reasons.append(f"only {wordlike}/{len(words)} letter runs look like words")
    return reasons


@dataclass
class PromptResult:
    name: str
    kind: str
    topic: str
    prompt: str
    output: str
    new_tokens: int
    stop_reason: str
    seconds: float
    gates: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(self.gates.values())


def _prompt_ids(tokenizer: Any, gp: GoldenPrompt) -> list[int]:
    if gp.kind == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        messages = ([{"role": "system", "content": gp.system}] if gp.system else []) + \
            [{"role": "user", "content": gp.prompt}]
        return list(tokenizer.encode_chat(messages, add_generation_prompt=True).ids)
    return tokenizer.encode(gp.prompt, add_special=True)


# notes of gibberish_reasons that point at markers the model reads as text (the template), not at the answer
_GARBLED = ("chat-template markup leaked", "characters are outside printable ASCII", "only ")


def check_answer(gp: GoldenPrompt, output: str, stopped: bool) -> tuple[dict[str, bool], list[str]]:
    """The gates for one answer (pure function of the text; unit-tested on hand-made strings)."""
    gates: dict[str, bool] = {}
    notes: list[str] = []
    gates["non_empty"] = bool(output.strip())
    frag = repeated_fragment(output)
    gates["no_repetition"] = frag is None
    if frag is not None:
        notes.append(f"fragment repeated 3+ times in a row: {frag!r}")
    if gp.kind == "chat":
        gates["stops"] = stopped
        if not stopped:
            notes.append(f"no end-of-turn within {gp.max_new_tokens} new tokens")
    if gp.kind == "chat" and gp.topic == "code":
        blocks = python_blocks(output) or [output]  # no fence: the whole answer must be the code
        errors = parse_errors(blocks)
        gates["code_parses"] = not errors
        notes += [f"code: {e}" for e in errors]
    refusal = REFUSAL.search(output)
    gates["no_refusal"] = refusal is None
    if refusal is not None:
        notes.append(f"refused a harmless request: {refusal.group(0)!r}")
    reasons = gibberish_reasons(output)
    found = any(e.lower() in output.lower() for e in gp.expect)
    if not found:
        reasons.append(f"expected one of {list(gp.expect)} in the answer")
    gates["coherent"] = not reasons
    notes += reasons
    return gates, notes


def run_qa(model: torch.nn.Module, tokenizer: Any, prompts: tuple[GoldenPrompt, ...] = GOLDEN) -> dict:
    """Generate every golden prompt greedily in one engine call (its greedy tokens are those of one prompt at a
    time: tests/test_engine.py), gate each answer, and report (exit_code 1 if any gate fails). One batched call,
    not one decode per prompt: GUARD-QA runs this twice in every fine-tune, and on a CPU NF4 base prompt-by-prompt
    decoding cost minutes. Each prompt's `seconds` is the whole call's."""
    from ..engine import GenerationSettings, generate_many

    t0 = time.time()
    stop_ids = set(getattr(tokenizer, "stop_ids", set()) or
                   {i for i in (tokenizer.eos_id, tokenizer.eot_id) if i is not None})
    was_training = model.training
    try:
        settings = GenerationSettings(max_new_tokens=max(gp.max_new_tokens for gp in prompts), temperature=0.0,
                                      max_slots=len(prompts), stop_ids=sorted(stop_ids))
        gens = generate_many(model, tokenizer, [_prompt_ids(tokenizer, gp) for gp in prompts], settings,
                             max_new=[gp.max_new_tokens for gp in prompts])
    finally:
        model.train(was_training)
    results: list[PromptResult] = []
    for gp, gen in zip(prompts, gens):
        new = list(gen.token_ids)
        stopped = bool(new) and new[-1] in stop_ids and len(new) <= gp.max_new_tokens
        text = tokenizer.decode([i for i in new if i not in stop_ids], skip_special=False)
        gates, notes = check_answer(gp, text, stopped)
        results.append(PromptResult(gp.name, gp.kind, gp.topic, gp.prompt, text, len(new),
                                    str(gen.stop_reason), round(gen.seconds, 2), gates, notes))
    diagnosis = diagnose(results)
    ok = all(r.ok for r in results)
    return {"prompts": [{**r.__dict__, "ok": r.ok} for r in results], "diagnosis": diagnosis,
            "ok": ok, "exit_code": 0 if ok else 1, "seconds": round(time.time() - t0, 2)}


def diagnose(results: list[PromptResult]) -> str | None:
    """Why the answers fail, from which gates failed where: chat answers garbled while plain continuations are fine
    point at the template; readable chat answers that refuse or miss point at the model; plain ones failing too
    at the weights or the forward."""
    plain_ok = all(r.gates["coherent"] for r in results if r.kind == "plain")
    chat_bad = [r for r in results if r.kind == "chat" and not r.ok]
    diagnosis = None
    garbled = [r for r in chat_bad if any(n.startswith(_GARBLED) for n in r.notes)]
    if plain_ok and chat_bad and garbled:
        diagnosis = ("chat answers fail while plain continuations are fine: the chat template / special tokens "
                     "are not what the model was trained with (e.g. ChatML markers it reads as plain text)")
    elif plain_ok and chat_bad:  # readable chat answers that refuse or miss the answer: the template is not it
        diagnosis = ("a chat answer refused or degraded while the template renders readable answers: the model "
                     "itself answers worse in chat (a fine-tune that taught refusing or calling tools; compare "
                     "with the base: `eval --task chat --compare`, or train with --retain-task chat)")
    elif not plain_ok:
        diagnosis = "plain continuations fail too: the weights or the forward are wrong (run `entrenar verify`)"
    return diagnosis


def format_qa(rep: dict) -> str:
    lines = []
    for p in rep["prompts"]:
        failed = [g for g, v in p["gates"].items() if not v]
        lines.append(f"[{'ok' if p['ok'] else 'FAIL'}] {p['name']} ({p['new_tokens']} tokens, "
                     f"{p['stop_reason']}, {p['seconds']}s){'  failed: ' + ', '.join(failed) if failed else ''}")
        lines.append("    " + p["output"].strip().replace("\n", "\n    ")[:600])
        for n in p["notes"]:
            lines.append(f"    ! {n}")
    if rep.get("diagnosis"):
        lines.append(f"diagnosis: {rep['diagnosis']}")
    lines.append("PASS" if rep["ok"] else "FAIL")
    return "\n".join(lines)
