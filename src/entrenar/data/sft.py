"""Supervised fine-tuning data: validated JSONL -> chat-template ids + shifted labels, a report, loaders.

Row forms (one JSON object per line; blank lines are ignored):
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
  {"tools": [...], "messages": [..., assistant "tool_calls", "tool" results]}   (data/tool_calls.py)
  {"prompt": "...", "completion": "..."}
  {"instruction": "...", "input": "...", "output": "..."}     ("input" optional)

Every row is rendered with the model's chat template (``tokenizer.encode_chat``). The loss is on
assistant tokens only, including each assistant turn's end-of-turn token, never on padding.
``max_seq_len`` is the only length limit: a sample whose prompt does not fit is skipped with a
warning naming its line; a sample whose response is cut is skipped (``truncation="skip"``) or kept
cut (``"keep"``), counted either way. ``DataReport`` says what happened; ``DataReport.check``
raises GUARD-DATA (exit 2) when nothing trainable remains, when too much was skipped, when an
end-of-turn token is not trained, or when tool calls break their tools' JSON schemas (without
``skip_invalid``: every such row is listed in the report first, not only the first one).

Labels are shifted: ``labels[t]`` is the target of position t (``ids[t+1]`` when that token is an
assistant token, else -100).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import GuardError, InputError
from ..tensors import IGNORE_INDEX
from . import tabular, tool_calls
from .epochs import EpochCursor

logger = logging.getLogger("entrenar.data")

ROLES = ("system", "user", "assistant")
TRUNCATION_POLICIES = ("skip", "keep")
DEFAULT_MAX_SKIP_FRACTION = 0.5
# --chat-template (tokenizer.use_chat_template_file)
CHAT_TEMPLATE_HELP = ("a jinja chat template file, or a packaged one by name (chatml_tools, qwen2_tools_json), used "
                      "instead of the model's (e.g. one that renders tools)")
MAX_LOGGED_WARNINGS = 20  # per reason; the rest are counted, and the count is logged at the end
ARGUMENT_PROBLEMS_NAMED = 5  # tool-argument problems a GUARD-DATA message names (data check lists the first 20)
BUCKET_MULTIPLE = 64  # length buckets (bucket_lengths) are multiples of this, except the last (max_seq_len)

# Skip reasons (stable keys of DataReport.skipped).
INVALID_REASONS = ("malformed_json", "not_an_object", "unknown_format", "unknown_role", "empty_content",
                   "no_assistant_message", "not_ending_with_assistant") + tool_calls.TOOL_REASONS
# and prompt_too_long, response_truncated (--max-seq-len), no_assistant_tokens (the chat template)


class ChatEncoder(Protocol):
    eot_id: int
    pad_id: int | None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False, **tools: Any) -> Any: ...


@dataclass
class SFTExample:
    """One kept sample. ``labels`` is shifted and has the length of ``input_ids``."""

    input_ids: np.ndarray  # int32 [L]
    labels: np.ndarray  # int32 [L], -100 where not trained
    line: int  # 1-based line in the source file
    prompt_tokens: int  # tokens before the first assistant token
    truncated: bool  # response cut by max_seq_len (only with truncation="keep")
    kl: bool = False  # --kl-to-base pulls this row's tokens towards the base (train/kl_to_base.py)

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def __len__(self) -> int:
        return len(self.input_ids)


class RowError(Exception):
    """A row that fails validation: reason key + message (without file:line)."""

    def __init__(self, reason: str, message: str, remedy: str = ""):
        super().__init__(message)
        self.reason = reason
        self.remedy = remedy or "fix the row, or pass --skip-invalid to skip and count invalid rows"


# ---- validation ---------------------------------------------------------------------------------
def row_to_messages(row: Any) -> list[dict[str, Any]]:
    """A parsed JSONL row -> validated chat messages, or RowError naming the problem."""
    return row_to_chat(row)[0]


def row_to_chat(row: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A parsed JSONL row -> (validated chat messages, its tool schemas or None), or RowError."""
    try:
        return _row_to_chat(row)
    except tool_calls.ToolCallError as e:
        raise RowError(e.reason, str(e)) from e


def _row_to_chat(row: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    if not isinstance(row, dict):
        raise RowError("not_an_object", f"row is a JSON {type(row).__name__}, not an object")
    tools = row.get("tools")
    if tools is not None and "messages" not in row:
        raise RowError("unknown_format", '"tools" needs the "messages" form (a tool call is an assistant '
                                         'message\'s "tool_calls")')
    if tools is not None:
        tools = tool_calls.validate_tools(tools)
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise RowError("unknown_format", '"messages" must be a non-empty list of {"role", "content"} objects')
        out = []
        known = tool_calls.tool_names(tools)
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise RowError("unknown_format", f"messages[{i}] is not an object")
            role = m.get("role")
            if role == "tool" or (role == "assistant" and "tool_calls" in m):
                out.append(tool_calls.normalize_message(m, i, known))
                continue
            if role not in ROLES:
                raise RowError("unknown_role", f"messages[{i}] has unknown role {role!r}; "
                                               f"roles are {', '.join(ROLES)}, tool")
            content = m.get("content")
            if not isinstance(content, str):
                raise RowError("empty_content" if content is None else "unknown_format",
                               f"messages[{i}] ({role}) content must be a string, got "
                               f"{type(content).__name__}")
            if not content.strip():
                raise RowError("empty_content", f"messages[{i}] ({role}) has empty content")
            out.append({"role": role, "content": content})
        if not any(m["role"] == "assistant" for m in out):
            raise RowError("no_assistant_message", "conversation has no assistant message, so nothing "
                                                   "would be trained")
        if out[-1]["role"] != "assistant":
            raise RowError("not_ending_with_assistant",
                           f"conversation ends with a {out[-1]['role']} message, not an assistant turn")
        tool_calls.check_sequence(out)
        return out, tools
    if "chosen" in row and "rejected" in row:  # data/preference.py's is_preference_row (it imports this module)
        # issue 38 item 10: this said "row lacks 'completion'", naming a field instead of the file's kind
        raise RowError("unknown_format", "this is a preference row (prompt/chosen/rejected), not an SFT row "
                                         "(messages, prompt/completion or instruction/output)",
                       "preference pairs train with finetune --objective dpo|ipo|dpo-norm; --skip-invalid skips such "
                       "rows in an SFT file")
    if "prompt" in row or "completion" in row:
        return [_field_message(row, "prompt", "user"), _field_message(row, "completion", "assistant")], None
    if "instruction" in row or "output" in row:
        user = _field_message(row, "instruction", "user")
        extra = row.get("input")
        if extra is not None and not isinstance(extra, str):
            raise RowError("unknown_format", f'"input" must be a string, got {type(extra).__name__}')
        if extra and extra.strip():
            user["content"] = user["content"] + "\n\n" + extra
        return [user, _field_message(row, "output", "assistant")], None
    raise RowError("unknown_format", f"row has keys {sorted(row)[:8]}; expected \"messages\", "
                                     f"\"prompt\"+\"completion\" or \"instruction\"+\"output\"")


def _field_message(row: dict, key: str, role: str) -> dict[str, str]:
    value = row.get(key)
    if value is None:
        raise RowError("empty_content", f"row lacks {key!r}")
    if not isinstance(value, str):
        raise RowError("unknown_format", f"{key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError("empty_content", f"{key!r} is empty")
    return {"role": role, "content": value}


# ---- tokenizing one sample ----------------------------------------------------------------------
def assistant_runs(mask: Sequence[bool]) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of True."""
    runs, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def shifted_labels(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """labels[t] = ids[t+1] where token t+1 is trained, else -100; the last position has no target."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
    labels[:-1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
    return labels


def eot_trained(example: SFTExample, eot_id: int, assistant_contents: Sequence[str | dict[str, Any]],
                decode: Any = None, call_format: str | None = None) -> bool:
    """True when the labels are exactly the assistant turns, each one run ending with end-of-turn.

    With ``decode`` each run's text must also be its turn's content, which catches an assistant
    mask on the wrong tokens (e.g. a span located inside the system prompt) that would train the
    model on text it should only read while its own answer goes untrained. A turn given as a message
    with ``tool_calls`` must read back as its content and calls (``tool_calls.turn_matches``).
    """
    runs = assistant_runs(example.labels != IGNORE_INDEX)
    if len(runs) != len(assistant_contents):
        return False
    for (start, end), turn in zip(runs, assistant_contents):
        if int(example.labels[end - 1]) != eot_id:
            return False
        if decode is None:
            continue
        text = decode(example.labels[start:end - 1].tolist())
        if isinstance(turn, dict):
            if not tool_calls.turn_matches(text, turn, call_format):
                return False
        elif text.strip() != turn.strip():
            return False
    return True


# ---- report ----------------------------------------------------------------------------------------
@dataclass
class DataReport:
    """What loading an SFT file kept and skipped, and how many tokens carry the loss."""

    path: str
    max_seq_len: int
    truncation: str
    rows_read: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    truncated_kept: int = 0
    kept_untruncated: int = 0
    eot_trained: int = 0
    eot_not_trained_lines: list[int] = field(default_factory=list)
    double_bos_lines: list[int] = field(default_factory=list)
    loss_tokens_total: int = 0
    loss_tokens_min: int | None = None
    loss_tokens_max: int | None = None
    tokens_total: int = 0
    longest_prompt_tokens: int = 0
    longest_prompt_line: int | None = None
    longest_sample_tokens: int = 0
    tokenizer: str | None = None
    warnings: list[str] = field(default_factory=list)
    tools: dict[str, int] = field(default_factory=lambda: {"rows_with_tools": 0, "rows_with_calls": 0, "calls": 0,
                                                           "results": 0})
    # tool calls whose arguments break their tool's JSON schema (tool_calls.argument_problems), over every row read
    argument_rows: int = 0
    argument_problems_total: int = 0
    argument_problems: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_LOGGED_WARNINGS, with line

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    @property
    def skip_fraction(self) -> float:
        return self.skipped_total / self.rows_read if self.rows_read else 0.0

    @property
    def loss_tokens_mean(self) -> float | None:
        return self.loss_tokens_total / self.kept if self.kept else None

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def note_arguments(self, line: int, problems: list[dict[str, str]]) -> None:
        """A row whose tool calls break their schemas: counted; its problems listed while fewer than
        MAX_LOGGED_WARNINGS are."""
        self.argument_rows += 1
        self.argument_problems_total += len(problems)
        room = MAX_LOGGED_WARNINGS - len(self.argument_problems)
        self.argument_problems += [{"line": line, **p} for p in problems[:max(room, 0)]]

    def add(self, ex: SFTExample, eot_ok: bool) -> None:
        n = ex.loss_tokens
        self.kept += 1
        self.loss_tokens_total += n
        self.loss_tokens_min = n if self.loss_tokens_min is None else min(self.loss_tokens_min, n)
        self.loss_tokens_max = n if self.loss_tokens_max is None else max(self.loss_tokens_max, n)
        self.tokens_total += len(ex)
        self.longest_sample_tokens = max(self.longest_sample_tokens, len(ex))
        if ex.truncated:
            self.truncated_kept += 1
        else:
            self.kept_untruncated += 1
            if eot_ok:
                self.eot_trained += 1
            elif len(self.eot_not_trained_lines) < MAX_LOGGED_WARNINGS:
                self.eot_not_trained_lines.append(ex.line)

    def to_dict(self) -> dict[str, Any]:
        mean = self.loss_tokens_mean
        return {
            "path": self.path, "tokenizer": self.tokenizer, "max_seq_len": self.max_seq_len,
            "truncation": self.truncation, "rows_read": self.rows_read, "kept": self.kept,
            "skipped_total": self.skipped_total, "skipped": dict(sorted(self.skipped.items())),
            "skip_fraction": round(self.skip_fraction, 6), "truncated_kept": self.truncated_kept,
            "kept_untruncated": self.kept_untruncated, "eot_trained": self.eot_trained,
            "eot_not_trained_lines": self.eot_not_trained_lines, "double_bos_lines": self.double_bos_lines,
            "loss_tokens": {"total": self.loss_tokens_total, "min": self.loss_tokens_min,
                            "mean": None if mean is None else round(mean, 3), "max": self.loss_tokens_max},
            "tokens_total": self.tokens_total,
            "longest_prompt": {"tokens": self.longest_prompt_tokens, "line": self.longest_prompt_line},
            "longest_sample_tokens": self.longest_sample_tokens,
            "tools": dict(self.tools),
            "tool_arguments": {"rows": self.argument_rows, "problems": self.argument_problems_total,
                               "listed": list(self.argument_problems)},
            "warnings": self.warnings,
        }

    def check(self, max_skip_fraction: float = DEFAULT_MAX_SKIP_FRACTION) -> None:
        """GUARD-DATA (exit 2) when this data cannot train what the user thinks it trains."""
        where = f"{self.path} at --max-seq-len {self.max_seq_len}"
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items())) or "none"
        refused = self.argument_rows - self.skipped.get("bad_tool_arguments", 0)  # not skipped: no --skip-invalid
        if refused > 0:
            first = "; ".join(f"line {p['line']}: {tool_calls.describe_argument_problem(p)}"
                              for p in self.argument_problems[:ARGUMENT_PROBLEMS_NAMED])
            more = self.argument_problems_total - min(len(self.argument_problems), ARGUMENT_PROBLEMS_NAMED)
            raise GuardError(
                "GUARD-DATA", f"{self.path}: {refused} rows call a tool with arguments its JSON schema does not "
                f"allow ({self.argument_problems_total} problems: {first}" + (f"; {more} more" if more > 0 else "")
                + "); training on them teaches calls the tools would reject.",
                "fix those calls' arguments, or the tools' schemas where they are wrong (`entrenar data check` lists "
                "each row, tool, parameter and problem), or pass --skip-invalid to skip and count such rows "
                "(bad_tool_arguments).", exit_code=2, details=self.to_dict())
        if self.kept == 0 or self.loss_tokens_total == 0:
            raise GuardError(
                "GUARD-DATA", f"{where}: no loss tokens remain ({self.rows_read} rows read, "
                f"{self.skipped_total} skipped; reasons {reasons}); training would learn nothing.",
                _remedy(self.skipped), exit_code=2, details=self.to_dict())
        if self.skip_fraction > max_skip_fraction:
            raise GuardError(
                "GUARD-DATA", f"{where}: {self.skipped_total} of {self.rows_read} rows "
                f"({self.skip_fraction:.1%}) were skipped, more than --max-skip-fraction "
                f"{max_skip_fraction} (reasons {reasons}).",
                _remedy(self.skipped) + " Or raise --max-skip-fraction if this is intended.",
                exit_code=2, details=self.to_dict())
        if self.double_bos_lines:
            raise GuardError(
                "GUARD-DATA", f"{where}: samples start with BOS twice (lines {self.double_bos_lines}); the "
                f"chat template writes a BOS and the tokenizer adds another.",
                "Use a tokenizer whose add-BOS rule matches its chat template (encode_chat must not add a "
                "second BOS).", exit_code=2, details=self.to_dict())
        if self.eot_trained != self.kept_untruncated:
            raise GuardError(
                "GUARD-DATA", f"{where}: in {self.kept_untruncated - self.eot_trained} of "
                f"{self.kept_untruncated} untruncated samples (lines {self.eot_not_trained_lines}) the labels "
                f"are not exactly the assistant turns each ending with its end-of-turn token; the model "
                f"would not learn to stop, or would learn text it should only read.",
                "The chat template's assistant mask must cover each assistant turn through its end-of-turn "
                "token (check the tokenizer's assistant spans), and padding must be masked by position, "
                "never by comparing ids with pad_id (pad may equal eos).",
                exit_code=2, details=self.to_dict())

    def summary_lines(self) -> list[str]:
        d = self.to_dict()
        lt = d["loss_tokens"]
        lines = [
            (f"data: {self.path} (tokenizer {self.tokenizer}, --max-seq-len {self.max_seq_len}, "
            f"--truncation {self.truncation})"),
            f"  rows read {self.rows_read}, kept {self.kept}, skipped {self.skipped_total} "
            f"({self.skip_fraction:.1%})" + (f": {d['skipped']}" if self.skipped else ""),
            (f"  loss tokens total {lt['total']}, min {lt['min']}, mean {lt['mean']}, max {lt['max']}; "
            f"tokens total {self.tokens_total}"),
            (f"  end-of-turn trained in {self.eot_trained} of {self.kept_untruncated} untruncated kept samples; "
            f"truncated kept {self.truncated_kept}"),
            (f"  longest prompt {self.longest_prompt_tokens} tokens (line {self.longest_prompt_line}); "
            f"longest kept sample {self.longest_sample_tokens} tokens"),
        ]
        t = self.tools
        if t["rows_with_tools"] or t["calls"]:
            lines.append(f"  tool calls: {t['calls']} in {t['rows_with_calls']} rows, {t['results']} tool results; "
                         f"{t['rows_with_tools']} rows with tools")
        if self.argument_rows:
            skipped = self.skipped.get("bad_tool_arguments", 0)
            lines.append(f"  tool-call arguments that break their tool's JSON schema: {self.argument_problems_total} "
                         f"in {self.argument_rows} rows" + (" (skipped: --skip-invalid)" if skipped else
                                                             " (exit 2 unless --skip-invalid)") + ":")
            lines += [f"    line {p['line']}: {tool_calls.describe_argument_problem(p)}" for p in self.argument_problems]
            if self.argument_problems_total > len(self.argument_problems):
                lines.append(f"    ... and {self.argument_problems_total - len(self.argument_problems)} more")
        return lines


def _remedy(skipped: dict[str, int]) -> str:
    parts = []
    if skipped.get("prompt_too_long") or skipped.get("response_truncated"):
        parts.append("raise --max-seq-len (see `entrenar data check` for the longest prompt) or shorten "
                     "the prompts; --truncation keep trains cut responses")
    if any(skipped.get(r) for r in INVALID_REASONS):
        parts.append("fix the invalid rows (run without --skip-invalid to see each file:line)")
    return ("; ".join(parts) or "check the data file") + "."


# ---- loading --------------------------------------------------------------------------------------
def _fit_sample(enc: Any, where: str, lineno: int, max_seq_len: int, truncation: str, report: DataReport,
                bos_id: int | None) -> tuple[SFTExample | None, tuple[str, str] | None]:
    """One encoded conversation -> (the sample to train, None) or (None, (skip reason, message)).

    The loss window is the whole sample up to --max-seq-len: a prompt is never clamped to a fixed
    size (a 512-token clamp once pushed every long-prompt response out of the loss: nothing trained).
    """
    ids = np.asarray(enc.ids, dtype=np.int64)
    mask = np.asarray(enc.assistant_mask, dtype=bool)
    assert len(ids) == len(mask), "encode_chat: ids and assistant_mask differ in length"
    trained = np.nonzero(mask)[0]
    if not len(trained):  # a validated row has assistant content: the template/tokenizer lost it
        return None, ("no_assistant_tokens", (f"{where}: the chat template marked no assistant tokens in this "
                                             f"sample ({len(ids)} tokens); sample SKIPPED. Remedy: check that "
                                             f"the model's chat template writes assistant content verbatim."))
    prompt_len, end = int(trained[0]), int(trained[-1]) + 1  # tokens after the last turn train nothing
    if prompt_len > report.longest_prompt_tokens:
        report.longest_prompt_tokens, report.longest_prompt_line = prompt_len, lineno
    if prompt_len >= max_seq_len:
        return None, ("prompt_too_long",
                      (f"{where}: prompt is {prompt_len} tokens and leaves no room for the response within "
                      f"--max-seq-len {max_seq_len}; sample SKIPPED. Remedy: raise --max-seq-len to at least "
                      f"{end} (prompt + response) or shorten the prompt."))
    truncated = end > max_seq_len
    if truncated and truncation == "skip":
        return None, ("response_truncated",
                      (f"{where}: prompt + response is {end} tokens, more than --max-seq-len {max_seq_len}; "
                      f"sample skipped (--truncation skip). Remedy: raise --max-seq-len to {end}, or "
                      f"--truncation keep to train the cut response."))
    if bos_id is not None and len(ids) > 1 and ids[0] == ids[1] == bos_id \
            and len(report.double_bos_lines) < MAX_LOGGED_WARNINGS:
        report.double_bos_lines.append(lineno)
    end = min(end, max_seq_len)
    ids, mask = ids[:end], mask[:end]
    return SFTExample(ids.astype(np.int32), shifted_labels(ids, mask), lineno, prompt_len, truncated), None


def check_load_inputs(path: Path, tokenizer: ChatEncoder, max_seq_len: int, truncation: str, what: str) -> int:
    """The arguments of a JSONL loader (SFT, preference) checked; returns the end-of-turn id (EOS without one)."""
    if truncation not in TRUNCATION_POLICIES:
        raise InputError(f"--truncation must be one of {', '.join(TRUNCATION_POLICIES)}, got {truncation!r}")
    if not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise InputError(f"--max-seq-len must be an integer >= 2, got {max_seq_len!r}")
    tabular.check_source(path, what)  # a file or a save_to_disk folder; never a hub name
    eot = tokenizer.eot_id if tokenizer.eot_id is not None else getattr(tokenizer, "eos_id", None)
    if eot is None:
        raise InputError("the tokenizer has neither an end-of-turn nor an EOS token, so assistant turns "
                         "cannot end; use the model's own tokenizer")
    return int(eot)


class RowLog:
    """A loader's skipped and invalid rows: each reason's first MAX_LOGGED_WARNINGS warnings logged and kept in
    the report, the rest counted (`finish`); an invalid row is InputError naming FILE:LINE unless skip_invalid."""

    def __init__(self, path: Path, report: DataReport, skip_invalid: bool, columns: tabular.Columns | None = None,
                 list_invalid: bool = False):
        self.path, self.report, self.skip_invalid, self.columns = path, report, skip_invalid, columns
        self.logged: dict[str, int] = {}
        # list_invalid (`data check` without --skip-invalid): every invalid row is listed, then one exit 2 (finish)
        self.list_invalid = list_invalid and not skip_invalid
        self.invalid_rows: list[str] = []

    def skip(self, reason: str, msg: str) -> None:
        self.report.skip(reason)
        self.logged[reason] = self.logged.get(reason, 0) + 1
        if self.logged[reason] <= MAX_LOGGED_WARNINGS:
            logger.warning(msg)
            self.report.warnings.append(msg)

    def invalid(self, where: str, e: RowError) -> None:
        if self.list_invalid:
            self.report.skip(e.reason)
            self.invalid_rows.append(f"{where}: {e}")
            return
        if not self.skip_invalid:
            raise InputError(f"{where}: {e} ({e.remedy})") from e
        self.skip(e.reason, f"{where}: {e}; row skipped (--skip-invalid)")

    def read(self) -> Iterator[tuple[int, str, Any]]:
        """(row number, "FILE:ROW", row) of each row, counted as read, through --columns when given; malformed
        lines go to `malformed`. data/tabular.py reads the file (JSONL: fileio.read_jsonl, the one JSONL reader)."""
        for lineno, where, row in tabular.iter_rows(self.path, on_error=self.malformed):
            self.report.rows_read += 1
            if self.columns is not None:
                try:
                    row = self.columns.apply(row)
                except tabular.ColumnError as e:
                    self.invalid(where, RowError(e.reason, str(e)))
                    continue
            yield lineno, where, row

    def malformed(self, lineno: int, e: json.JSONDecodeError) -> None:
        self.report.rows_read += 1
        self.invalid(f"{self.path}:{lineno}", RowError("malformed_json",
                                                       f"malformed JSON ({e.msg} at column {e.colno})"))

    def finish(self, what: str) -> None:
        for reason, n in self.logged.items():
            if n > MAX_LOGGED_WARNINGS:
                logger.warning(f"{self.path}: {n - MAX_LOGGED_WARNINGS} more rows skipped for {reason} (not shown)")
        if self.report.rows_read == 0:
            raise InputError(f"{self.path}: no rows (the file is empty); {what} needs one JSON object per line")
        if self.invalid_rows:
            listed = "\n  ".join(self.invalid_rows)
            raise InputError(f"{self.path}: {len(self.invalid_rows)} invalid rows:\n  {listed}\nfix them, or pass "
                             f"--skip-invalid to skip and count them")


def load_sft(path: str | Path, tokenizer: ChatEncoder, max_seq_len: int, truncation: str = "skip",
             skip_invalid: bool = False,
             max_skip_fraction: float | None = DEFAULT_MAX_SKIP_FRACTION, columns: tabular.Columns | None = None,
             list_invalid: bool = False) -> tuple[list[SFTExample], DataReport]:
    """Read, validate and tokenize SFT rows (data/tabular.py: JSONL, JSON, Parquet, CSV, a save_to_disk folder;
    ``columns``: --columns).

    Invalid rows raise InputError (exit 2) naming file:line, or with ``skip_invalid`` are counted; with
    ``list_invalid`` every invalid row is named in one InputError after the whole file was read.
    With ``max_skip_fraction`` not None, ``DataReport.check`` runs at the end (GUARD-DATA, exit 2);
    the error's ``details`` hold the report.
    """
    path = Path(path)
    eot_id = check_load_inputs(path, tokenizer, max_seq_len, truncation, "SFT data")
    report = DataReport(str(path), max_seq_len, truncation,
                        tokenizer=str(getattr(tokenizer, "name", None) or getattr(tokenizer, "source", None)
                                      or type(tokenizer).__name__))
    examples: list[SFTExample] = []
    rows = RowLog(path, report, skip_invalid, columns, list_invalid)
    call_format = tool_calls.call_format(getattr(tokenizer, "chat_template", None))
    for lineno, where, row in rows.read():
        try:
            messages, tools = row_to_chat(row)
        except RowError as e:
            rows.invalid(where, e)
            continue
        problems = tool_calls.argument_problems(messages, tools) if tools else []
        if problems:  # every such row is listed; without --skip-invalid DataReport.check refuses them (GUARD-DATA)
            report.note_arguments(lineno, problems)
            if skip_invalid:
                rows.skip("bad_tool_arguments", f"{where}: {tool_calls.describe_argument_problem(problems[0])}"
                          + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                          + "; row skipped (--skip-invalid)")
                continue

        with_tools = tool_calls.has_tool_parts(messages, tools)
        try:  # tools= only for rows that have them: a text row renders as it always did
            enc = tokenizer.encode_chat(messages, tools=tools) if with_tools else tokenizer.encode_chat(messages)
        except InputError as e:  # the chat template rejected this conversation
            if rows.list_invalid:
                rows.invalid(where, RowError("unknown_format", str(e)))
                continue
            raise InputError(f"{where}: {e}") from e
        ex, skipped = _fit_sample(enc, where, lineno, max_seq_len, truncation, report,
                                  getattr(tokenizer, "bos_id", None))
        if ex is None:
            rows.skip(*skipped)
            continue
        assert ex.loss_tokens > 0, f"{where}: a kept sample has no loss tokens"
        examples.append(ex)
        if with_tools:
            tool_calls.count_row(report.tools, messages, tools)
        turns = [m if m.get("tool_calls") else m["content"] for m in messages if m["role"] == "assistant"]
        report.add(ex, not ex.truncated and eot_trained(ex, eot_id, turns, getattr(tokenizer, "decode", None),
                                                        call_format))

    rows.finish("SFT data")
    if max_skip_fraction is not None:
        report.check(max_skip_fraction)
    return examples, report


# ---- batching --------------------------------------------------------------------------------------
def bucket_lengths(max_seq_len: int, buckets: int) -> tuple[int, ...]:
    """``buckets`` fixed batch lengths evenly spaced up to ``max_seq_len``: i * max_seq_len / buckets rounded up
    to a multiple of BUCKET_MULTIPLE, the last exactly max_seq_len, duplicates dropped. 0 -> () ("pad to the
    longest"). Batches padded to these see a few shapes only (e.g. one CUDA graph per shape): (2048, 4) ->
    (512, 1024, 1536, 2048); (1000, 3) -> (384, 704, 1000)."""
    if isinstance(buckets, bool) or not isinstance(buckets, int) or buckets < 0:
        raise ValueError(f"the number of length buckets must be an integer >= 0 (0 = pad to the longest), "
                         f"got {buckets!r}")
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"length buckets need max_seq_len >= 1, got {max_seq_len!r}")
    out: list[int] = []
    for i in range(1, buckets + 1):
        m = BUCKET_MULTIPLE
        length = max_seq_len if i == buckets else min(-(-i * max_seq_len // (buckets * m)) * m, max_seq_len)
        if not out or length > out[-1]:
            out.append(length)
    return tuple(out)


def padded_length(longest: int, pad_to: Sequence[int] = ()) -> int:
    """T of a batch whose longest row has ``longest`` tokens: itself without buckets, else the smallest bucket
    that holds it (never shorter: a row is never cut)."""
    if not pad_to:
        return longest
    assert longest <= pad_to[-1], f"a batch row of {longest} tokens does not fit the last length bucket {pad_to[-1]}"
    return next(b for b in pad_to if b >= longest)


class SFTLoader:
    """Batches of SFT examples: padded (one sample per row) or packed (several per row).

    Packed rows carry ``doc_ids`` (0, 1, ... per sample; padding -1) so attention stays inside
    each sample, and ``position_ids`` restarting at 0 per sample. ``batch_size`` is samples per batch
    when padded and rows (of up to ``max_seq_len`` tokens) per batch when packed. Padding is always
    masked by position (labels -100), never by comparing ids with ``pad_id``.

    ``next_batch`` runs endlessly over epochs, each in an order drawn from ``(seed, epoch)``; a batch
    may take samples from two epochs. ``iter_epoch`` is one pass in file order (for eval).

    ``buckets`` (``bucket_lengths``): each batch's T is padded up to the smallest bucket that holds its longest
    row, so a run sees len(buckets) shapes; () pads to the longest row (T changes every batch).

    ``padding_free``: the samples padded mode draws (the same ones, in the same order, the same cursor and state)
    laid end to end in ONE row of exactly their total length (`collate_padding_free`: no padding at all), with
    ``cu_seqlens``/``max_seqlen`` for varlen attention (varlen.py). Not with ``pack`` or ``buckets``.
    `pad_rows_for_graphs()` (a run whose step is captured in CUDA graphs) then pads each row to one of a few lengths
    (`graph_row_length`) with a span of padding of its own.
    """

    kind = "sft"

    def __init__(self, examples: Sequence[SFTExample], batch_size: int, seed: int = 0, pack: bool = False,
                 max_seq_len: int | None = None, pad_id: int | None = 0, buckets: Sequence[int] = (),
                 padding_free: bool = False):
        if not examples:
            raise InputError("SFT loader: no examples (every row was skipped?)")
        if batch_size < 1:
            raise InputError(f"batch size must be >= 1, got {batch_size}")
        if pack and max_seq_len is None:
            raise InputError("packed SFT batches need max_seq_len (the row length)")
        longest = max(len(e) for e in examples)
        if max_seq_len is not None and longest > max_seq_len:
            raise InputError(f"an example has {longest} tokens, more than max_seq_len {max_seq_len}; load the "
                             f"data with the same --max-seq-len as training")
        buckets = tuple(int(b) for b in buckets)
        if buckets and (list(buckets) != sorted(set(buckets)) or buckets[0] < 1):
            raise InputError(f"SFT length buckets must be increasing positive lengths, got {buckets}")
        need = max_seq_len if pack else longest  # a packed row holds up to max_seq_len tokens
        if buckets and buckets[-1] < need:
            raise InputError(f"the last SFT length bucket {buckets[-1]} is shorter than a batch row can be ({need} "
                             f"tokens); the last bucket must be max_seq_len (bucket_lengths)")
        if padding_free and (pack or buckets):
            raise InputError("padding-free SFT batches are one row of exactly their samples' tokens: they take no "
                             "--pack and no --pad-buckets")
        self.buckets, self.padding_free = buckets, padding_free
        self.graph_rows = 0  # pad_rows_for_graphs: the max_seqlen of rows padded to graph_row_length; 0 = exact rows
        self.examples = list(examples)
        self.batch_size, self.seed, self.pack = batch_size, seed, pack
        # The pad id only fills input positions whose labels are -100 (any valid id works; 0 if None).
        self.max_seq_len, self.pad_id = max_seq_len, 0 if pad_id is None else int(pad_id)
        self.cursor = EpochCursor(len(self.examples), seed)  # the loaders' one epoch/state mechanism
        self.fingerprint = _fingerprint(self.examples)

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    def __len__(self) -> int:
        return len(self.examples)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return self.cursor.order(epoch)

    def _peek(self) -> SFTExample:
        return self.examples[self.cursor.peek()]

    def _advance(self) -> None:
        self.cursor.advance()

    def next_batch(self) -> dict[str, Any]:
        if not self.pack:
            chosen = []
            for _ in range(self.batch_size):
                chosen.append(self._peek())
                self._advance()
            return self._collate(chosen)
        rows = []
        for _ in range(self.batch_size):
            row, used = [], 0
            while not row or used + len(self._peek()) <= self.max_seq_len:
                ex = self._peek()
                row.append(ex)
                used += len(ex)
                self._advance()
            rows.append(row)
        return collate_packed(rows, self.pad_id, self.buckets)

    def iter_epoch(self) -> Iterator[dict[str, Any]]:
        """One pass over all examples in file order; the last batch may be smaller. State untouched."""
        if not self.pack:
            for i in range(0, len(self.examples), self.batch_size):
                yield self._collate(self.examples[i:i + self.batch_size])
            return
        rows, row, used = [], [], 0
        for ex in self.examples:
            if row and used + len(ex) > self.max_seq_len:
                rows.append(row)
                row, used = [], 0
                if len(rows) == self.batch_size:
                    yield collate_packed(rows, self.pad_id, self.buckets)
                    rows = []
            row.append(ex)
            used += len(ex)
        rows.append(row)
        yield collate_packed(rows, self.pad_id, self.buckets)

    def _collate(self, chosen: Sequence[SFTExample]) -> dict[str, Any]:
        """One batch of unpacked samples: padded rows, or one padding-free row."""
        if self.padding_free:
            return collate_padding_free(chosen, self.pad_id, self.graph_rows)
        return collate_padded(chosen, self.pad_id, self.buckets)

    def pad_rows_for_graphs(self) -> None:
        """Padding-free rows padded to graph_row_length from now on (the same samples and counts), so a run whose
        step is captured in CUDA graphs sees a few row shapes, each captured once."""
        assert self.padding_free and self.max_seq_len, "rows padded for graphs are padding-free rows of a max_seq_len"
        self.graph_rows = int(self.max_seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.cursor.state_dict(), "pack": self.pack, "padding_free": self.padding_free,
                "batch_size": self.batch_size, "max_seq_len": self.max_seq_len,
                "num_examples": len(self.examples), "fingerprint": self.fingerprint,
                "buckets": list(self.buckets)}  # for information: batch shapes only, not which samples

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key in ("kind", "num_examples", "fingerprint"):
            if sd.get(key) != self.state_dict()[key]:
                raise InputError(f"cannot resume the SFT loader: saved {key}={sd.get(key)!r}, now "
                                 f"{self.state_dict()[key]!r} (the data or batching changed since the "
                                 f"checkpoint; resume with the same data file, --max-seq-len and batch settings)")
        self.cursor.load_state_dict(sd, "SFT")
        self.seed = self.cursor.seed


def _fingerprint(examples: Sequence[SFTExample]) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(np.int64(ex.line).tobytes())
        h.update(ex.input_ids.tobytes())
        h.update(ex.labels.tobytes())
    return h.hexdigest()[:16]


def collate_padded(examples: Sequence[SFTExample], pad_id: int, pad_to: Sequence[int] = ()) -> dict[str, Any]:
    """One sample per row, right-padded to the longest (or to the smallest of ``pad_to`` that holds it, see
    bucket_lengths); padding has label -100 (by position)."""
    T = padded_length(max(len(e) for e in examples), pad_to)
    input_ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)
    for i, ex in enumerate(examples):
        input_ids[i, :len(ex)] = torch.from_numpy(ex.input_ids.astype(np.int64))
        labels[i, :len(ex)] = torch.from_numpy(ex.labels.astype(np.int64))
    batch = {"input_ids": input_ids, "labels": labels, "sample_ids": [e.line for e in examples]}
    if any(e.kl for e in examples):  # --kl-to-base's chosen rows, by position (train/kl_to_base.py)
        batch["kl_mask"] = torch.tensor([e.kl for e in examples])[:, None].expand(-1, T).clone()
    return batch


def collate_packed(rows: Sequence[Sequence[SFTExample]], pad_id: int, pad_to: Sequence[int] = ()) -> dict[str, Any]:
    """Several samples per row; doc_ids keep attention inside a sample, positions restart per sample. T: the
    longest row, or the smallest of ``pad_to`` that holds it (bucket_lengths)."""
    T = padded_length(max(sum(len(e) for e in row) for row in rows), pad_to)
    B = len(rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    doc_ids = torch.zeros((B, T), dtype=torch.long)
    position_ids = torch.zeros((B, T), dtype=torch.long)
    kl_mask = torch.zeros((B, T), dtype=torch.bool)
    sample_ids = []
    for b, row in enumerate(rows):
        at = 0
        for d, ex in enumerate(row):
            n = len(ex)
            input_ids[b, at:at + n] = torch.from_numpy(ex.input_ids.astype(np.int64))
            labels[b, at:at + n] = torch.from_numpy(ex.labels.astype(np.int64))
            doc_ids[b, at:at + n] = d
            position_ids[b, at:at + n] = torch.arange(n)
            sample_ids.append(ex.line)
            if ex.kl:  # --kl-to-base's chosen rows, by position (train/kl_to_base.py)
                kl_mask[b, at:at + n] = True
            at += n
        doc_ids[b, at:] = -1  # padding is a document of its own (-1): no sample attends to it
        position_ids[b, at:] = torch.arange(T - at)
    batch = {"input_ids": input_ids, "labels": labels, "doc_ids": doc_ids, "position_ids": position_ids,
             "sample_ids": sample_ids}
    if kl_mask.any():
        batch["kl_mask"] = kl_mask
    return batch


GRAPH_ROW_STEPS = 4  # lengths per doubling of a padding-free row padded for CUDA graphs (graph_row_length)


def graph_row_length(n: int) -> int:
    """The length a padding-free row of n tokens is padded to when the step is captured in CUDA graphs: n rounded up
    to a multiple of 2^(floor(log2 n) - 2), at least 256: GRAPH_ROW_STEPS lengths per doubling, so a run sees a few
    shapes (each captured once) at less than 25% padding (12% on average)."""
    step = max(256, 1 << max(0, n.bit_length() - 1 - (GRAPH_ROW_STEPS.bit_length() - 1)))
    return -(-n // step) * step


def collate_padding_free(examples: Sequence[SFTExample], pad_id: int, graph_rows: int = 0) -> dict[str, Any]:
    """The samples end to end in one row [1, N], N = their total length (collate_packed's row, so no padding), plus
    "cu_seqlens" (int32 [n+1], CPU: the cumulative lengths, varlen attention's spans) and "max_seqlen" (int).

    ``graph_rows`` (the run's max_seq_len; SFTLoader.pad_rows_for_graphs): the row padded to graph_row_length(N) by a
    last span of padding (labels -100, a document of its own: every token of the row is in a span, so flash
    attention writes every output), "samples" = n (the spans before it: what batch_counts counts), and a max_seqlen
    that is the same for every row of that length (a graph replays the value it captured): at most T, and at least
    every sample (<= max_seq_len, graph_rows) and the padding span (shorter than the rounding step: 256, or <= T // 4
    above it)."""
    lengths = [len(e) for e in examples]
    n = sum(lengths)
    T = graph_row_length(n) if graph_rows else n
    batch = collate_packed([examples], pad_id, (T,) if T > n else ())
    batch["cu_seqlens"] = torch.tensor(np.concatenate([[0], np.cumsum(lengths), [T] if T > n else []]),
                                       dtype=torch.int32)
    batch["max_seqlen"] = min(T, max(graph_rows, T // 4, 256)) if graph_rows else max(lengths)
    if T > n:
        batch["samples"] = len(examples)
    return batch
