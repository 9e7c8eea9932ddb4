"""Symbol anchors of contract mutations (tools/symbol_anchors.py, tools/mutants.py) and their converter
(tools/anchor_contracts.py), on a toy project: an edit names a def/class/assignment and its find must be
once inside it, wherever the code moved; ambiguity and a repeated find are lint errors naming the places."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import anchor_contracts  # tools/ is not a package: on sys.path just above
import mutants

CORE = '''\
"""A toy module."""
import math

LIMIT = 3


class Adder:
    def add(self, a, b):
        return a + b

    def twice(self, a):
        return self.add(a, a) + self.add(a, a)


def scale(x):
    return x * LIMIT + math.floor(0.5)
'''

TESTS = '''\
from toy.core import Adder, scale


def test_add():
    assert Adder().add(2, 3) == 5


def test_scale():
    assert scale(2) == 6
'''


def _toy(tmp_path: Path, contracts: str, core: str = CORE, **modules: str) -> Path:
    root = tmp_path / "toy"
    (root / "src" / "toy").mkdir(parents=True)
    (root / "src" / "toy" / "__init__.py").write_text("")
    (root / "src" / "toy" / "core.py").write_text(core)
    for name, text in modules.items():
        (root / "src" / "toy" / f"{name}.py").write_text(text)
    (root / "tests").mkdir()
    (root / "tests" / "test_toy.py").write_text(TESTS)
    (root / "contracts").mkdir()
    (root / "contracts" / "toy.yaml").write_text(textwrap.dedent(contracts))
    return root


def _contract(*items: str, test: str = "tests/test_toy.py::test_add") -> str:
    body = "".join(textwrap.indent(textwrap.dedent(i).strip("\n") + "\n", "      ") for i in items)
    return (f"area: toy\ninvariants:\n  - id: TOY-ONE\n    claim: c\n    test: {test}\n    mutation: m\n"
            f"    mutate:\n{body}")


def _problems(tmp_path: Path, item: str, **modules: str) -> str:
    """The lint's lines for a toy whose one invariant has the one mutate item."""
    return "\n".join(mutants.lint(_toy(tmp_path, _contract(item), **modules)))


ADD_BY_SYMBOL = """\
    - symbol: toy.core:Adder.add
      find: "return a + b"
      replace: "return a - b"
"""


def test_symbol_anchor_applies_inside_its_symbol(tmp_path):
    root = _toy(tmp_path, _contract(ADD_BY_SYMBOL))
    assert mutants.lint(root) == []
    inv = mutants.load_contracts(root / "contracts")[0][0]
    texts = mutants.apply_edits(root, inv.edits)
    assert list(texts) == ["src/toy/core.py"] and "return a - b" in texts["src/toy/core.py"]


def test_symbol_moved_to_another_file_is_still_found(tmp_path):
    """The class moved from toy/core.py to toy/arith.py: the edit's module hint is stale, the lint is
    still clean and the mutation lands in the new file."""
    adder = CORE[CORE.index("class Adder"):CORE.index("def scale")]
    root = _toy(tmp_path, _contract(ADD_BY_SYMBOL), core=CORE.replace(adder, "from toy.arith import Adder\n\n\n"),
                arith=adder)
    assert mutants.lint(root) == []
    inv = mutants.load_contracts(root / "contracts")[0][0]
    assert list(mutants.apply_edits(root, inv.edits)) == ["src/toy/arith.py"]


def test_method_moved_to_another_class_is_found_by_its_last_part(tmp_path):
    summer = "class Summer:\n    def add(self, a, b):\n        return a + b\n"
    without_add = CORE.replace("    def add(self, a, b):\n        return a + b\n\n", "")
    root = _toy(tmp_path, _contract(ADD_BY_SYMBOL), core=without_add, sums=summer)
    problems = mutants.lint(root)
    assert problems == [], problems
    assert list(mutants.apply_edits(root, mutants.load_contracts(root / "contracts")[0][0].edits)) == \
        ["src/toy/sums.py"]
    # ...but only while that last part names one symbol: with Adder.add left in place it names two
    problems = _problems(tmp_path / "2", ADD_BY_SYMBOL.replace("Adder.add", "Gone.add"), sums=summer)
    assert "ambiguous (by its last part 'add'), 2 candidates" in problems, problems


def test_ambiguous_symbol_is_a_lint_error_naming_the_candidates(tmp_path):
    """Adder is defined in two modules and the hint (toy.gone) names neither: the lint lists both."""
    adder = CORE[CORE.index("class Adder"):CORE.index("def scale")]
    problems = _problems(tmp_path, ADD_BY_SYMBOL.replace("toy.core:", "toy.gone:"), copy=adder)
    assert "TOY-ONE: mutate item 1: symbol toy.gone:Adder.add: not in toy.gone, and ambiguous, 2 candidates" \
        in problems, problems
    assert "toy.copy:Adder.add (src/toy/copy.py:2)" in problems and "toy.core:Adder.add (src/toy/core.py:8)" \
        in problems, problems
    # with a hint that names one of them, the anchor is exact again
    assert _problems(tmp_path / "2", ADD_BY_SYMBOL, copy=adder) == ""


def test_find_twice_in_its_symbol_is_a_lint_error(tmp_path):
    twice = ADD_BY_SYMBOL.replace("Adder.add", "Adder.twice").replace("return a + b", "self.add(a, a)")
    problems = _problems(tmp_path, twice)
    assert ("mutate item 1: find 'self.add(a, a)' occurs 2 times in symbol toy.core:Adder.twice "
            "(src/toy/core.py:11) (must be exactly once)") in problems, problems


def test_find_outside_its_symbol_and_unknown_symbols_are_lint_errors(tmp_path):
    outside = ADD_BY_SYMBOL.replace("Adder.add", "scale")  # "return a + b" is in the file, not in scale
    missing = ADD_BY_SYMBOL.replace("Adder.add", "Adder.sub")
    problems = _problems(tmp_path, outside)
    assert "mutate item 1: find 'return a + b' is not in symbol toy.core:scale (src/toy/core.py:15)" in problems
    problems = _problems(tmp_path / "2", missing)
    assert "mutate item 1: symbol toy.core:Adder.sub: module toy.core has no such symbol, and no such symbol " \
        "under src/" in problems, problems


def test_a_mutation_that_changes_no_code_is_a_lint_error(tmp_path):
    comment_only = ADD_BY_SYMBOL.replace("return a - b", "return a + b  # mutant?")
    problems = _problems(tmp_path, comment_only)
    assert "the mutation leaves the code of src/toy/core.py unchanged" in problems, problems
    # the comparison looks only at what changed: a def's header, a nested body, a blank line added
    for find, replace in (("def add(self, a, b):", "def add(self, a, b=0):"), ("+ b", "+ b  # mutant?\n"),
                          ("return a + b", "return a + b + 0")):
        item = ADD_BY_SYMBOL.replace("return a + b", find).replace("return a - b", replace)
        unchanged = "unchanged" in _problems(tmp_path / find, item)
        assert unchanged == (find == "+ b"), (find, replace)


def test_symbol_anchored_mutant_is_run_and_caught(tmp_path):
    root = _toy(tmp_path, _contract(ADD_BY_SYMBOL))
    inv = mutants.load_contracts(root / "contracts")[0][0]
    parent = tmp_path / "scratch"
    parent.mkdir()
    r = mutants.run_one(inv, sys.executable, parent, root=root)
    assert r.status == "caught" and r.failed == ["tests/test_toy.py::test_add"], r


# ---- the converter ---------------------------------------------------------------------------------

FILE_ANCHORED = """\
# a comment the converter keeps
area: toy
invariants:
  - id: TOY-ADD  # trailing comment
    claim: add adds
    test: tests/test_toy.py::test_add
    mutation: subtract
    mutate:
      - file: src/toy/core.py
        find: "        return a + b\\n"
        replace: "        return a - b\\n"
      # between items
      - file: src/toy/core.py
        find: 'LIMIT = 3'
        replace: 'LIMIT = 2'
  - id: TOY-SCALE
    claim: scale scales
    test: tests/test_toy.py::test_scale
    mutation: two edits of one symbol, the second on the first one's result
    mutate:
    - file: src/toy/core.py
      find: return x * LIMIT
      replace: return x + LIMIT
    - find: "x + LIMIT +"
      file: "src/toy/core.py"
      replace: "x - LIMIT +"
    - file: src/toy/core.py
      find: "import math\\n"
      replace: "import math as _m\\nmath = _m\\n"
"""

CONVERTED = FILE_ANCHORED.replace(
    "      - file: src/toy/core.py\n        find: \"        return", "      - symbol: toy.core:Adder.add\n"
    "        find: \"        return").replace(
    "      - file: src/toy/core.py\n        find: 'LIMIT", "      - symbol: toy.core:LIMIT\n        find: 'LIMIT").replace(
    "    - file: src/toy/core.py\n      find: return x", "    - symbol: toy.core:scale\n      find: return x").replace(
    '      file: "src/toy/core.py"\n', "      symbol: toy.core:scale\n")


def test_converter_anchors_in_place_keeps_the_rest_and_is_idempotent(tmp_path, capsys):
    root = _toy(tmp_path, FILE_ANCHORED)
    path = root / "contracts" / "toy.yaml"
    before = mutants.apply_edits(root, mutants.load_contracts(root / "contracts")[0][0].edits)
    assert anchor_contracts.main(["--root", str(root), "--check"]) == 1
    assert path.read_text() == FILE_ANCHORED  # --check writes nothing
    assert anchor_contracts.main(["--root", str(root)]) == 0
    # only the anchors changed: comments, quoting, key order, indentation and the import edit are as they were
    assert path.read_text() == CONVERTED
    assert "4 converted, 1 left file-anchored: module-level text" in capsys.readouterr().out
    assert mutants.lint(root) == []
    after = mutants.load_contracts(root / "contracts")[0]
    assert mutants.apply_edits(root, after[0].edits) == before
    # a second run and --check change nothing
    assert anchor_contracts.main(["--root", str(root)]) == 0
    assert anchor_contracts.main(["--root", str(root), "--check"]) == 0
    assert path.read_text() == CONVERTED


def test_converter_refreshes_a_moved_symbol(tmp_path):
    adder = CORE[CORE.index("class Adder"):CORE.index("def scale")]
    root = _toy(tmp_path, _contract(ADD_BY_SYMBOL), core=CORE.replace(adder, ""), arith=adder)
    assert anchor_contracts.main(["--root", str(root)]) == 0
    assert "- symbol: toy.arith:Adder.add\n" in (root / "contracts" / "toy.yaml").read_text()
    assert anchor_contracts.main(["--root", str(root), "--check"]) == 0


def test_converter_re_anchors_a_find_that_moved_out_of_its_symbol_or_file(tmp_path):
    """`return a + b` moved from Adder.add into plus() of another module: the lint names the stale anchors
    (symbol and file alike); the converter re-anchors both where the find now is, once in all of src/."""
    file_anchored = ADD_BY_SYMBOL.replace("symbol: toy.core:Adder.add", "file: src/toy/core.py")
    second = _contract(file_anchored).split("invariants:\n")[1].replace("TOY-ONE", "TOY-TWO")
    root = _toy(tmp_path, _contract(ADD_BY_SYMBOL) + second,
                core=CORE.replace("return a + b", "return plus(a, b)"), ops="def plus(a, b):\n    return a + b\n")
    problems = "\n".join(mutants.lint(root))
    assert "find 'return a + b' is not in symbol toy.core:Adder.add" in problems, problems
    assert anchor_contracts.main(["--root", str(root)]) == 0
    text = (root / "contracts" / "toy.yaml").read_text()
    assert text.count("- symbol: toy.ops:plus\n") == 2, text
    assert mutants.lint(root) == []
    assert anchor_contracts.main(["--root", str(root), "--check"]) == 0
