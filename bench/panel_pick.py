"""The variant of a retention A/B (bench/panel_gpu.sh) to start GRPO from: among the variants whose run finished,
the one whose irrelevance lost least against the base (BFCL irrelevance passes after), then the most simple_python
passes; ties in the order given.

    python -m bench.panel_pick ROOT VARIANT...    prints the chosen variant's name (exit 1 when none finished)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def passes(path: Path, category: str) -> int:
    return sum(1 for line in path.read_text().splitlines()
               if (r := json.loads(line)).get("category") == category and r.get("passed"))


def pick(root: Path, variants: list[str]) -> str | None:
    scored = []
    for order, v in enumerate(variants):
        after = root / v / "after_bfcl.jsonl"
        if after.is_file():
            scored.append((-passes(after, "irrelevance"), -passes(after, "simple_python"), order, v))
    return min(scored)[3] if scored else None


def main() -> None:
    chosen = pick(Path(sys.argv[1]), sys.argv[2:])
    if chosen is None:
        sys.exit("no variant finished its BFCL eval")
    print(chosen)


if __name__ == "__main__":
    main()
