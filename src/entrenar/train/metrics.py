"""metrics.jsonl / eval.jsonl writers, the progress display, tokens/s, MFU and peak memory."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from ..errors import InputError
from ..fileio import append_text, atomic_write
from ..fileio import read_jsonl as fileio_read_jsonl
from .precision import uses_bf16

# Dense peak FLOP/s per GPU by name fragment: (bf16, tf32, fp32). For MFU only.
PEAK_FLOPS = {
    "H200": (989.4e12, 494.7e12, 66.9e12),
    "H100": (989.4e12, 494.7e12, 66.9e12),
    "A100": (312e12, 156e12, 19.5e12),
    "L4": (121e12, 60e12, 30.3e12),
    "A10": (125e12, 62.5e12, 31.2e12),
}


def peak_flops(device: torch.device, dtype: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (bf16, tf32, fp32) in PEAK_FLOPS.items():
        if key in name:
            if uses_bf16(dtype):  # bf16 matmuls
                return bf16
            return tf32 if torch.backends.cuda.matmul.allow_tf32 else fp32
    return None


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kb / 1024


def strict_record(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with each non-finite float replaced by None and its key listed under "nonfinite":
    json.dumps writes bare NaN/Infinity, which strict JSON parsers (jq, JavaScript, Go) reject."""
    clean, bad = {}, []
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            clean[k] = None
            bad.append(k)
        else:
            clean[k] = v
    if bad:
        clean["nonfinite"] = bad
    return clean


class JsonlLog:
    """Append-only strict JSON lines (see strict_record); on resume, lines beyond the resumed step
    are dropped (atomically). Each line written also goes to `tracking` (--report-to: train/reporting.py) as a
    row of `kind` (train: metrics.jsonl, eval: eval.jsonl)."""

    def __init__(self, path: Path, tracking: Any | None = None, kind: str = "train"):
        self.path, self.tracking, self.kind = path, tracking, kind

    def truncate_after(self, step: int) -> None:
        """Keep the lines of steps <= `step`. A last line cut short (a kill in the middle of writing it)
        is dropped; a malformed line anywhere else is an InputError naming file:line."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
        kept = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if i == last:
                    break
                raise InputError(f"{self.path}:{i + 1}: not valid JSON ({e.msg}); this run's log was edited "
                                 f"or corrupted: repair or remove that line, then resume") from None
            if record.get("step", 0) <= step:
                kept.append(line)
        atomic_write(self.path, "".join(line + "\n" for line in kept))

    def reset(self) -> None:
        """A run that starts at step 0 drops the lines of an earlier attempt in the same directory."""
        if self.path.exists():
            atomic_write(self.path, "")

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(strict_record(record), allow_nan=False)
        append_text(self.path, line + "\n")  # never through a link (fileio.open_no_follow)
        if self.tracking is not None:  # the trackers get the row as written (what metrics.jsonl says)
            self.tracking.log_row(self.kind, strict_record(record))


class NullLog:
    """metrics.jsonl / eval.jsonl of the ranks other than 0 under torchrun: they write nothing."""

    def truncate_after(self, step: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        pass


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics/eval log ([] when it does not exist yet)."""
    if not Path(path).exists():
        return []
    return [obj for _, obj in fileio_read_jsonl(path)]


def _fmt_time(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """tqdm bar (loss, tok/s, ETA) on a terminal; plain lines every `every` steps otherwise."""

    def __init__(self, total: int, start: int, stream: TextIO | None = None, every: int | None = None):
        self.stream = stream or sys.stderr
        self.total, self.start = total, start
        self.every = every or max(1, total // 20)
        self.t0 = time.perf_counter()
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, file=self.stream, dynamic_ncols=True, unit="step")

    def update(self, step: int, loss: float, tok_s: float, extra: str = "") -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.4f} tok/s {tok_s:,.0f}" + (f" {extra}" if extra else ""))
            return
        if step % self.every == 0 or step == self.total or step == self.start + 1:
            done = step - self.start
            rate = done / max(time.perf_counter() - self.t0, 1e-9)
            eta = (self.total - step) / rate if rate > 0 else float("inf")
            print(f"step {step}/{self.total} loss {loss:.4f} tok/s {tok_s:,.0f} eta {_fmt_time(eta)}"
                  + (f" {extra}" if extra else ""), file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
