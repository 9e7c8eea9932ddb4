"""Preference data (DPO): validated JSONL -> (chosen, rejected) token pairs with response-only labels, a
report, a loader.

Row forms (one JSON object per line; blank lines are ignored), TRL's preference formats:
  {"prompt": "...", "chosen": "...", "rejected": "..."}                       text prompt (one user turn)
  {"prompt": [chat messages], "chosen": [assistant message(s)], "rejected": [...]}   conversational
  {"messages": [chat messages], "chosen": "..." | [...], "rejected": "..." | [...]}  (same, SFT's key)
A response given as a string is one assistant message. Rows with "tools" are refused (tool-call pairs are not
supported yet: exit 2 naming the row). The prompt messages and each response are validated by
SFT's rules (data/sft.py: roles, non-empty content, the conversation ends with an assistant turn) and rendered
with the model's chat template; the labels are the response's assistant turns only (each through its
end-of-turn token), never the prompt, even where the prompt holds earlier assistant turns.

Each pair is cut to --max-seq-len by SFT's rule (`sft._fit_sample`, per sequence): a prompt that leaves no
room for a response is skipped (prompt_too_long), a cut response is skipped or kept (--truncation); a row whose
chosen and rejected are the same (`identical_responses`) is an invalid row (exit 2 naming file:line, or
counted with --skip-invalid); a pair whose two sequences are the same tokens after rendering and truncation is
skipped (`identical_tokens`: it carries no preference, and as a DPO pair its margin is 0 forever). The report
(PreferenceReport, SFT's DataReport counted in pairs) raises GUARD-DATA (exit 2) by SFT's rules.

Batches: {"input_ids" [B, 2, T], "labels" [B, 2, T] (shifted, -100 ignored; [:, 0] chosen, [:, 1] rejected),
"sample_ids" (the rows' lines)}: one row per pair, so a distributed run splits pairs by global index
(train/distributed.py RankSlice) exactly as it splits SFT samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ..errors import InputError
from ..tensors import IGNORE_INDEX
from . import tabular
from .sft import (
    DEFAULT_MAX_SKIP_FRACTION,
    MAX_LOGGED_WARNINGS,
    ChatEncoder,
    DataReport,
    RowError,
    RowLog,
    SFTExample,
    SFTLoader,
    _fit_sample,
    assistant_runs,
    check_load_inputs,
    eot_trained,
    row_to_messages,
)

RESPONSES = ("chosen", "rejected")


def is_preference_row(row: Any) -> bool:
    """A row of preference data (has "chosen" and "rejected"); `data check` reads such a file as one."""
    return isinstance(row, dict) and "chosen" in row and "rejected" in row


def is_preference_file(path: str | Path, columns: tabular.Columns | None = None) -> bool:
    """Whether a row source holds preference rows: its first readable row (through --columns) has "chosen" and
    "rejected"."""
    for _, _, row in tabular.iter_rows(Path(path), on_error=lambda lineno, e: None):
        try:
            return is_preference_row(columns.apply(row) if columns is not None else row)
        except tabular.ColumnError:
            return False
    return False


@dataclass
class PreferenceExample:
    """One kept pair: the prompt + chosen and prompt + rejected samples (SFT samples, labels on the response)."""

    chosen: SFTExample
    rejected: SFTExample
    line: int

    @property
    def input_ids(self) -> np.ndarray:  # both sequences: what the loader's fingerprint hashes
        return np.concatenate([self.chosen.input_ids, self.rejected.input_ids])

    @property
    def labels(self) -> np.ndarray:
        return np.concatenate([self.chosen.labels, self.rejected.labels])

    def __len__(self) -> int:  # the longer sequence: a batch row is padded to it
        return max(len(self.chosen), len(self.rejected))


# ---- validation ---------------------------------------------------------------------------------
def _response(row: dict, key: str) -> list[dict]:
    value = row.get(key)
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        return [value]
    if isinstance(value, list) and value:
        return value
    raise RowError("empty_content" if value in (None, "", []) else "unknown_format",
                   f'"{key}" must be a string or a non-empty list of assistant messages, got '
                   f"{type(value).__name__ if value not in ('', []) else repr(value)}")


def row_to_pair(row: Any) -> tuple[list[dict], list[dict], list[dict]]:
    """A parsed JSONL row -> (prompt messages, chosen messages, rejected messages), validated, or RowError."""
    if not isinstance(row, dict):
        raise RowError("not_an_object", f"row is a JSON {type(row).__name__}, not an object")
    if not is_preference_row(row):
        raise RowError("unknown_format", f"row has keys {sorted(row)[:8]}; a preference row has \"prompt\" (or "
                                         f"\"messages\"), \"chosen\" and \"rejected\"")
    if row.get("tools") is not None:  # the tool-call rendering of SFT rows is not wired into pairs (yet): say so
        raise RowError("unknown_format", '"tools" in a preference row is not supported; train tool calls with '
                                         "--objective sft rows")
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RowError("empty_content", '"prompt" is empty')
        prompt_msgs = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        prompt_msgs = prompt
    else:
        raise RowError("empty_content" if prompt in (None, "", []) else "unknown_format",
                       'a preference row needs "prompt" (a string or chat messages) or "messages"')
    pair = []
    for key in RESPONSES:
        response = _response(row, key)
        if any(not isinstance(m, dict) or m.get("role") != "assistant" for m in response):
            raise RowError("unknown_role", f'"{key}" must hold assistant messages only')
        try:  # SFT's validation of the whole conversation (roles, contents, ends with the assistant)
            full = row_to_messages({"messages": [*prompt_msgs, *response]})
        except RowError as e:
            raise RowError(e.reason, f"{key}: {e}") from None
        pair.append(full)
    n_prompt = len(prompt_msgs)
    chosen, rejected = pair[0][n_prompt:], pair[1][n_prompt:]
    if chosen == rejected:
        raise RowError("identical_responses", "chosen and rejected are the same response: the pair carries no "
                                              "preference (its DPO margin is 0 whatever the model learns)")
    return pair[0][:n_prompt], chosen, rejected


# ---- report ----------------------------------------------------------------------------------------
class PreferenceReport(DataReport):
    """SFT's report counted in pairs: kept / skipped / eot-trained are pairs; loss and tokens are both
    sequences'. `check` (GUARD-DATA) is SFT's."""

    def add_pair(self, chosen: SFTExample, rejected: SFTExample, eot_ok: bool, line: int) -> None:
        n = chosen.loss_tokens + rejected.loss_tokens
        self.kept += 1
        self.loss_tokens_total += n
        self.loss_tokens_min = n if self.loss_tokens_min is None else min(self.loss_tokens_min, n)
        self.loss_tokens_max = n if self.loss_tokens_max is None else max(self.loss_tokens_max, n)
        self.tokens_total += len(chosen) + len(rejected)
        self.longest_sample_tokens = max(self.longest_sample_tokens, len(chosen), len(rejected))
        if chosen.truncated or rejected.truncated:
            self.truncated_kept += 1
            return
        self.kept_untruncated += 1
        if eot_ok:
            self.eot_trained += 1
        elif len(self.eot_not_trained_lines) < MAX_LOGGED_WARNINGS:
            self.eot_not_trained_lines.append(line)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "kind": "preference", "counted_in": "pairs (loss and tokens: both sequences)"}


# ---- tokenizing one pair ---------------------------------------------------------------------------
def _response_only(enc: Any, n_turns: int) -> SimpleNamespace:
    """The encoded conversation with its assistant mask kept on the last `n_turns` assistant runs only:
    the response, not assistant turns inside the prompt."""
    mask = list(enc.assistant_mask)
    runs = assistant_runs(mask)
    for start, end in runs[:max(0, len(runs) - n_turns)]:
        mask[start:end] = [False] * (end - start)
    return SimpleNamespace(ids=enc.ids, assistant_mask=mask)


def load_preference(path: str | Path, tokenizer: ChatEncoder, max_seq_len: int, truncation: str = "skip",
                    skip_invalid: bool = False, max_skip_fraction: float | None = DEFAULT_MAX_SKIP_FRACTION,
                    columns: tabular.Columns | None = None, list_invalid: bool = False
                    ) -> tuple[list[PreferenceExample], PreferenceReport]:
    """Read, validate and tokenize a preference JSONL file (SFT's contract: invalid rows exit 2 naming
    file:line unless `skip_invalid`; GUARD-DATA at the end when `max_skip_fraction` is not None)."""
    path = Path(path)
    eot = check_load_inputs(path, tokenizer, max_seq_len, truncation, "preference data")
    report = PreferenceReport(str(path), max_seq_len, truncation,
                              tokenizer=str(getattr(tokenizer, "name", None) or type(tokenizer).__name__))
    examples: list[PreferenceExample] = []
    rows = RowLog(path, report, skip_invalid, columns, list_invalid)
    for lineno, where, row in rows.read():
        try:
            prompt, *responses = row_to_pair(row)
        except RowError as e:
            rows.invalid(where, e)
            continue
        pair, skipped = [], None
        for response in responses:
            try:
                enc = tokenizer.encode_chat([*prompt, *response])
            except InputError as e:  # the chat template rejected this conversation
                if not rows.list_invalid:
                    raise InputError(f"{where}: {e}") from e
                rows.invalid(where, RowError("unknown_format", str(e)))
                skipped = ()
                break
            ex, skipped = _fit_sample(_response_only(enc, len(response)), where, lineno, max_seq_len, truncation,
                                      report, getattr(tokenizer, "bos_id", None))
            if ex is None:
                break
            pair.append(ex)
        if skipped == ():  # listed as invalid (list_invalid)
            continue
        if skipped is not None:
            rows.skip(*skipped)
            continue
        chosen, rejected = pair
        if np.array_equal(chosen.input_ids, rejected.input_ids) and np.array_equal(chosen.labels, rejected.labels):
            rows.skip("identical_tokens", f"{where}: chosen and rejected are the same {len(chosen)} tokens after "
                                     f"rendering and --max-seq-len {max_seq_len}: the pair carries no preference; "
                                     f"pair SKIPPED. Remedy: raise --max-seq-len so the responses' difference fits")
            continue
        decode = getattr(tokenizer, "decode", None)
        eot_ok = all(eot_trained(ex, eot, [m if m.get("tool_calls") else m["content"] for m in resp], decode)
                     for ex, resp in zip(pair, responses, strict=True))
        examples.append(PreferenceExample(chosen, rejected, lineno))
        report.add_pair(chosen, rejected, eot_ok, lineno)

    rows.finish("preference data")
    if max_skip_fraction is not None:
        report.check(max_skip_fraction)
    return examples, report


# ---- batching --------------------------------------------------------------------------------------
def collate_pairs(examples: Sequence[PreferenceExample], pad_id: int) -> dict[str, Any]:
    """One pair per row: [B, 2, T] right-padded to the longest sequence of the batch; padding has label -100."""
    T = max(len(e) for e in examples)
    input_ids = torch.full((len(examples), 2, T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), 2, T), IGNORE_INDEX, dtype=torch.long)
    for i, ex in enumerate(examples):
        for j, seq in enumerate((ex.chosen, ex.rejected)):
            input_ids[i, j, :len(seq)] = torch.from_numpy(seq.input_ids.astype(np.int64))
            labels[i, j, :len(seq)] = torch.from_numpy(seq.labels.astype(np.int64))
    return {"input_ids": input_ids, "labels": labels, "sample_ids": [e.line for e in examples]}


class PreferenceLoader(SFTLoader):
    """SFT's loader (the one epoch cursor, state, resume checks) over pairs; never packed."""

    kind = "preference"

    def __init__(self, examples: Sequence[PreferenceExample], batch_size: int, seed: int = 0, pack: bool = False,
                 max_seq_len: int | None = None, pad_id: int | None = 0):
        assert not pack, "preference pairs are never packed (cmd_finetune refuses --pack)"
        super().__init__(examples, batch_size, seed=seed, pack=False, max_seq_len=max_seq_len, pad_id=pad_id)

    def next_batch(self) -> dict[str, Any]:
        chosen = []
        for _ in range(self.batch_size):
            chosen.append(self._peek())
            self._advance()
        return collate_pairs(chosen, self.pad_id)

    def iter_epoch(self) -> Iterator[dict[str, Any]]:
        for i in range(0, len(self.examples), self.batch_size):
            yield collate_pairs(self.examples[i:i + self.batch_size], self.pad_id)


__all__ = ["PreferenceExample", "PreferenceLoader", "PreferenceReport", "collate_pairs", "is_preference_file", "is_preference_row",
           "load_preference", "row_to_pair"]
