"""Words of BFCL functions, shared by the SFT rows (bfcl_data) and the near-miss donors (bfcl_nearest): the Python
hint BFCL appends to a function's description, and the subject words of function names."""

from __future__ import annotations

import re
from typing import Any

PYTHON_HINT = " Note that the provided function is in Python 3 syntax."

# Words of function names too generic to tell two functions' subjects apart (get_weather vs get_stock_price).
_GENERIC_NAME_WORDS = frozenset({"get", "set", "list", "create", "update", "delete", "add", "remove", "find", "search",
                                 "fetch", "retrieve", "calculate", "compute", "check", "run", "make", "api", "info",
                                 "data", "details", "by", "for", "and", "the", "all", "new", "v1", "v2", "tool"})


def name_words(functions: list[dict[str, Any]]) -> set[str]:
    """The subject words of the functions' names ("requests.get_weather_forecast" -> {"requests", "weather",
    "forecast"}): split at . _ - and camelCase, lower-cased, generic verbs and short words dropped."""
    words: set[str] = set()
    for f in functions:
        for part in re.split(r"[._\-\s]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", f["name"])):
            w = part.lower()
            if len(w) > 2 and w not in _GENERIC_NAME_WORDS:
                words.add(w)
    return words
