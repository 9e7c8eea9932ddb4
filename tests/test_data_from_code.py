"""`entrenar data sft-from-code`: docstring -> function pairs from Python source."""

from __future__ import annotations

import json
import textwrap

from entrenar.cli import main
from entrenar.data.from_code import sft_from_code
from entrenar.data.sft import row_to_messages

MODULE = textwrap.dedent('''
    """Module docstring (not a function)."""
    import functools


    def documented(x: int, y: int = 2) -> int:
        """Add x and y.

        Returns their sum.
        """
        return x + y


    def undocumented(a):
        return a


    class Box:
        """A box."""

        @functools.lru_cache
        def size(self, *, scale=1.0):
            """The box's size, scaled."""
            text = """
    not indented"""
            return len(text) * scale

        def stub(self):
            """Subclasses implement this."""
            raise NotImplementedError

        async def fetch(self, url):
            """Fetch url."""
            return url
''')


def make_tree(root):
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(MODULE)
    (root / "pkg" / "sub" / "a.py").write_text('def first():\n    """First."""\n    return 1\n')
    (root / "pkg" / "broken.py").write_text("def nope(:\n    pass\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "x.py").write_text('def cached():\n    """Cached."""\n    return 0\n')
    (root / "pkg" / "site-packages").mkdir()
    (root / "pkg" / "site-packages" / "third.py").write_text('def third():\n    """Third."""\n    return 3\n')
    return root / "pkg"


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_for_documented_functions_in_order(tmp_path):
    pkg = make_tree(tmp_path)
    stats = sft_from_code([str(pkg)], tmp_path / "out.jsonl")
    rows = read_rows(tmp_path / "out.jsonl")
    assert [r["source"] for r in rows] == ["pkg/mod.py:6", "pkg/mod.py:22", "pkg/mod.py:32", "pkg/sub/a.py:1"]
    assert stats["files"] == 3 and stats["files_unparsable"] == 1 and "broken.py" in stats["unparsable"][0]
    assert stats["functions"] == 6 and stats["functions_with_docstring"] == 5 and stats["stubs_skipped"] == 1
    assert stats["rows"] == 4
    first = rows[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant"]
    assert "def documented(x: int, y: int=2) -> int:" in first[0]["content"]
    assert '"""Add x and y.\n\n    Returns their sum.\n    """' in first[0]["content"]
    assert first[1]["content"] == ('def documented(x: int, y: int = 2) -> int:\n    """Add x and y.\n\n'
                                   '    Returns their sum.\n    """\n    return x + y\n')
    method = rows[1]["messages"]
    assert "method of the class `Box`" in method[0]["content"]
    # decorators kept, indentation removed, a less-indented string continuation kept as written
    assert method[1]["content"].startswith("@functools.lru_cache\ndef size(self, *, scale=1.0):\n")
    assert '\nnot indented"""\n' in method[1]["content"]
    assert rows[2]["messages"][1]["content"].startswith("async def fetch(self, url):")
    for r in rows:  # every row is valid SFT input
        row_to_messages(r)


def test_deterministic_and_system_prompt(tmp_path, capsys):
    pkg = make_tree(tmp_path)
    sft_from_code([str(pkg)], tmp_path / "a.jsonl")
    sft_from_code([str(pkg)], tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    (tmp_path / "system.txt").write_text("You are a careful Python programmer. " * 200)
    rc = main(["data", "sft-from-code", "--out", str(tmp_path / "c.jsonl"), "--system-prompt-file",
               str(tmp_path / "system.txt"), "--exclude", "sub/*", "--json", str(pkg)])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["rows"] == 3 and out["files_unparsable"] == 1
    rows = read_rows(tmp_path / "c.jsonl")
    assert all(r["messages"][0] == {"role": "system", "content": (tmp_path / "system.txt").read_text()}
               for r in rows)


def test_bad_inputs_exit_2(tmp_path, capsys):
    assert main(["data", "sft-from-code", "--out", str(tmp_path / "o.jsonl"), str(tmp_path / "none")]) == 2
    assert "not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.py").write_text("x = 1\n")
    assert main(["data", "sft-from-code", "--out", str(tmp_path / "o.jsonl"), str(tmp_path / "empty")]) == 2
    assert "no documented functions" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
    assert main(["data", "sft-from-code", "--out", str(tmp_path / "o.jsonl"), "--system-prompt-file",
                 str(tmp_path / "missing.txt"), str(tmp_path / "empty")]) == 2


def test_out_is_never_silently_replaced_and_a_directory_is_exit_2(tmp_path, capsys):
    """issue 18 items 8 and 10: an existing --out file was replaced without a word; an existing
    directory as --out was an IsADirectoryError traceback."""
    pkg = make_tree(tmp_path)
    out = tmp_path / "rows.jsonl"
    out.write_text('{"kept": true}\n' * 533)
    rc = main(["data", "sft-from-code", "--out", str(out), str(pkg)])
    err = capsys.readouterr().err
    assert rc == 2 and "already exists" in err and "--overwrite" in err
    assert out.read_text() == '{"kept": true}\n' * 533
    assert main(["data", "sft-from-code", "--out", str(out), "--overwrite", str(pkg)]) == 0
    assert '"kept"' not in out.read_text() and len(read_rows(out)) > 0
    (tmp_path / "adir").mkdir()
    rc = main(["data", "sft-from-code", "--out", str(tmp_path / "adir"), str(pkg)])
    assert rc == 2 and "is a directory" in capsys.readouterr().err


def test_a_single_py_file_is_accepted(tmp_path):
    """issue 18 item 12: `data pack` accepts a .py file, so sft-from-code does too."""
    pkg = make_tree(tmp_path)
    stats = sft_from_code([str(pkg / "sub" / "a.py")], tmp_path / "one.jsonl")
    rows = read_rows(tmp_path / "one.jsonl")
    assert stats["files"] == 1 and len(rows) == 1 and rows[0]["source"] == "sub/a.py:1"
    assert "def first():" in rows[0]["messages"][-1]["content"]


FILTERS = textwrap.dedent('''
    import re
    from os import path as osp

    LIMIT = 3


    def _helper(x):
        """A private helper."""
        return x


    def uses_helper(x):
        """Calls a module helper the prompt never shows."""
        y = x + 1
        y = y * 2
        return _helper(y)


    def uses_constant(x):
        """Reads a module constant."""
        y = x * 2
        y = y - 1
        return min(y, LIMIT)


    def self_contained(text, sep=","):
        """Splits, strips and drops empty pieces."""
        parts = re.split(sep, text)
        out = [p.strip() for p in parts]
        for i, p in enumerate(out):
            if not p:
                out[i] = osp.sep
        try:
            return [p for p in out if p]
        except ValueError as err:
            raise RuntimeError(err) from None


    def short(x):
        """One line."""
        return abs(x)


    class K:
        def method(self, x):
            """A method: needs its class."""
            y = x
            z = y
            return z
''')


def test_answer_fenced_self_contained_and_min_body_lines(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text(FILTERS)
    out = tmp_path / "o.jsonl"
    assert main(["data", "sft-from-code", "--out", str(out), "--answer", "fenced", "--self-contained",
                 "--min-body-lines", "3", str(src), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source"].split(":")[0] for r in rows] == [f"{tmp_path.name}/m.py"]
    answer = rows[0]["messages"][-1]["content"]
    assert answer.startswith("```python\ndef self_contained(text, sep=\",\"):\n") and answer.endswith("\n```")
    # _helper and short are under 3 body lines; uses_helper, uses_constant and the method are not self-contained
    assert stats["short_skipped"] == 2 and stats["not_self_contained_skipped"] == 3 and stats["rows"] == 1
    # the defaults keep every documented function with its plain source
    plain = tmp_path / "p.jsonl"
    sft_from_code([str(src)], plain)
    names = [json.loads(line)["messages"][-1]["content"].split("(")[0] for line in plain.read_text().splitlines()]
    assert names == ["def _helper", "def uses_helper", "def uses_constant", "def self_contained", "def short",
                     "def method"]


def test_free_names():
    import ast

    from entrenar.data.from_code import free_names

    fns = {n.name: n for n in ast.walk(ast.parse(FILTERS)) if isinstance(n, ast.FunctionDef)}
    assert free_names(fns["uses_helper"]) == {"_helper"}
    assert free_names(fns["uses_constant"]) == {"LIMIT"}
    assert free_names(fns["self_contained"]) == {"re", "osp"}  # module imports: allowed by --self-contained


def test_bad_filter_values_exit_2(tmp_path, capsys):
    src = tmp_path / "m.py"
    src.write_text(FILTERS)
    assert main(["data", "sft-from-code", "--out", str(tmp_path / "o.jsonl"), "--min-body-lines", "0",
                 str(src)]) == 2
    assert "--min-body-lines 0" in capsys.readouterr().err
