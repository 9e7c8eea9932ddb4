"""`finetune --mix FILE:FRACTION`: rows of other SFT files (or, with --objective grpo, prompt files) mixed into the
training rows, each making a stated
fraction of the mixed training set (e.g. `data replay`'s rows at 0.3, so a narrow fine-tune keeps the base's
general answers). FILE's rows are read and validated as --data's are; n_extra = round(FRACTION / (1 - sum of the
fractions) x n_main) rows are taken from FILE in an order fixed by --seed, cycling through FILE again when it has
fewer (a row repeated is trained more often, as in a second epoch). The validation split is taken from --data
before mixing: the eval loss stays the loss on the task's own rows.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import InputError


def parse_mix(spec: str) -> tuple[str, float]:
    """FILE:FRACTION -> (FILE, FRACTION), FRACTION in (0, 1)."""
    path, sep, frac = spec.rpartition(":")
    try:
        fraction = float(frac)
    except ValueError:
        fraction = float("nan")
    if not sep or not path or not 0.0 < fraction < 1.0:
        raise InputError(f"--mix {spec}: give FILE:FRACTION with FRACTION in (0, 1), e.g. replay.jsonl:0.3")
    return path, fraction


def mix_examples(examples: list, specs: list[str], load: Callable[[str], list], seed: int, mark_kl: bool = False
                 ) -> tuple[list, list[dict[str, Any]]]:
    """The training examples with each --mix file's share added (marked `kl` when `mark_kl`), and a report per
    file {file, fraction, rows_in_file, rows_added}."""
    parsed = [parse_mix(s) for s in specs]
    total = sum(f for _, f in parsed)
    if total >= 1.0:
        raise InputError(f"--mix: the fractions add up to {total:g}; they must leave room for --data's rows (< 1)")
    rng = random.Random(seed)
    out, report = list(examples), []
    for path, fraction in parsed:
        rows = load(path)
        if not rows:
            raise InputError(f"--mix {path}: no rows left to mix in")
        want = round(fraction / (1.0 - total) * len(examples))
        order = list(range(len(rows)))
        rng.shuffle(order)
        picked = [rows[order[i % len(rows)]] for i in range(want)]
        added = [replace(row, kl=True) for row in picked] if mark_kl else picked  # GRPO's prompt rows have no kl
        out.extend(added)
        report.append({"file": path, "fraction": fraction, "rows_in_file": len(rows), "rows_added": len(added)})
    return out, report
