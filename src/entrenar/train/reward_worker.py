"""The process a `--reward python:FILE.py:FUNC` runs in (train/rewards.py PythonReward), standard library only.

argv: FILE FUNC; stdin: JSON [[prompt, completion, row], ...]; stdout's last line: {"ok": true, "rewards": [...]}
or {"ok": false, "error": ..., "line": N} naming the line of FILE where it went wrong (FUNC's def for a bad return).
"""

import importlib.util
import json
import math
import sys
import traceback


def _line_in(path, tb, default):
    lines = [f.lineno for f in traceback.extract_tb(tb) if f.filename == path]
    return lines[-1] if lines else default


def main():
    path, name = sys.argv[1], sys.argv[2]
    items = json.load(sys.stdin)
    try:
        spec = importlib.util.spec_from_file_location("entrenar_user_reward", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which exits 2
        return {"ok": False, "error": f"importing it raised {type(e).__name__}: {e}",
                "line": _line_in(path, e.__traceback__, 1)}
    func = getattr(module, name, None)
    if not callable(func):
        return {"ok": False, "error": f"{name} is not a function of {path}", "line": 1}
    line = getattr(getattr(func, "__code__", None), "co_firstlineno", 1)
    out = []
    for i, (prompt, completion, row) in enumerate(items):
        try:
            value = func(prompt, completion, row)
        except BaseException as e:  # noqa: BLE001 -- reported to the parent, which exits 2
            return {"ok": False, "error": f"{name} raised {type(e).__name__}: {e} (completion {i})",
                    "line": _line_in(path, e.__traceback__, line)}
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return {"ok": False, "line": line,
                    "error": f"{name} returned {value!r} ({type(value).__name__}) for completion {i}: a reward must "
                             f"be a finite number (int or float)"}
        out.append(float(value))
    return {"ok": True, "rewards": out}


if __name__ == "__main__":
    print(json.dumps(main()))
