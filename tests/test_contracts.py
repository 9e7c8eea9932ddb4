"""contracts/*.yaml is executable: the lint (ids, tests, mutate edits) is clean, and the mutation runner
(tools/mutants.py) tells caught / missed / broken apart and really imports the mutated copy.

``make mutants`` runs the mutations themselves; this file only checks that each one is well-formed and
applies to the current tree, plus the runner's own behaviour on a toy project.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "contracts").glob("*.yaml"))


def _load_tool():
    spec = importlib.util.spec_from_file_location("entrenar_tools_mutants", ROOT / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


mutants = _load_tool()


def test_contract_files_exist():
    assert FILES, "contracts/ holds no *.yaml"


@pytest.fixture(scope="module")
def lint_problems() -> list[str]:
    """One lint of every contract against the tree (~4 s of CPU: it applies and parses every mutation), shared by
    the per-file checks below instead of re-run by each of them."""
    return mutants.lint(ROOT)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_contract_lint(path, lint_problems):
    """ids unique, tests defined, every invariant has a mutate: whose finds occur exactly once."""
    rel = path.relative_to(ROOT).as_posix()
    problems = [p for p in lint_problems if p.startswith(rel + ":")]
    assert not problems, "\n".join(problems)


def test_contract_ids_unique_across_files(lint_problems):
    problems = [p for p in lint_problems if "duplicate id" in p]
    assert not problems, "\n".join(problems)


# ---- the runner and the lint on a toy project -----------------------------------------------------

TOY_SRC = '''
def add(a, b):
    return a + b


def untested(x):
    return x * 2
'''

TOY_TEST = '''
from toy import add


def test_add():
    assert add(2, 3) == 5


def test_nothing():
    assert True
'''


def _toy(tmp_path: Path, contracts: str) -> Path:
    root = tmp_path / "toy"
    (root / "src" / "toy").mkdir(parents=True)
    (root / "src" / "toy" / "__init__.py").write_text(TOY_SRC)
    (root / "tests").mkdir()
    (root / "tests" / "test_toy.py").write_text(TOY_TEST)
    (root / "contracts").mkdir()
    (root / "contracts" / "toy.yaml").write_text(textwrap.dedent(contracts))
    return root


TOY_CONTRACTS = """
    area: toy
    invariants:
      - id: TOY-CAUGHT
        claim: add adds
        test: tests/test_toy.py::test_add
        mutation: subtract instead
        mutate:
          - file: src/toy/__init__.py
            find: "return a + b"
            replace: "return a - b"
      - id: TOY-MISSED
        claim: untested doubles
        test: tests/test_toy.py::test_nothing
        mutation: triple instead, and no test looks
        mutate:
          - file: src/toy/__init__.py
            find: "return x * 2"
            replace: "return x * 3"
      - id: TOY-BROKEN
        claim: the snippet moved away
        test: tests/test_toy.py::test_add
        mutation: a find that is not in the file
        mutate:
          - file: src/toy/__init__.py
            find: "return a + b + 0"
            replace: "return a - b"
"""


def test_runner_reports_caught_missed_broken(tmp_path):
    root = _toy(tmp_path, TOY_CONTRACTS)
    invariants, problems = mutants.load_contracts(root / "contracts")
    assert not problems
    parent = tmp_path / "scratch"
    parent.mkdir()
    results = {inv.id: mutants.run_one(inv, sys.executable, parent, baseline=True, root=root)
               for inv in invariants}
    assert results["TOY-CAUGHT"].status == "caught", results["TOY-CAUGHT"]
    assert results["TOY-CAUGHT"].failed == ["tests/test_toy.py::test_add"]
    assert results["TOY-MISSED"].status == "missed", results["TOY-MISSED"]
    assert results["TOY-BROKEN"].status == "broken"
    assert "not in src/toy/__init__.py" in results["TOY-BROKEN"].detail
    # the working tree is never touched, and the scratch copies are cleaned up
    assert "return a + b" in (root / "src" / "toy" / "__init__.py").read_text()
    assert list(parent.iterdir()) == []


FLAKY_TEST = '''
from pathlib import Path

from toy import untested


def test_sometimes():
    # sees the defect only from its second run on (a counter beside the scratch copies)
    runs = Path(__file__).resolve().parents[2] / "runs.txt"
    n = int(runs.read_text()) + 1 if runs.exists() else 1
    runs.write_text(str(n))
    assert n == 1 or untested(1) == 2
'''


def test_runner_retries_a_miss_once_and_reports_a_flaky_catch(tmp_path):
    root = _toy(tmp_path, TOY_CONTRACTS)
    (root / "tests" / "test_flaky.py").write_text(FLAKY_TEST)
    invariants = {i.id: i for i in mutants.load_contracts(root / "contracts")[0]}
    flaky = dataclasses.replace(invariants["TOY-MISSED"], id="TOY-FLAKY", tests=["tests/test_flaky.py::test_sometimes"])
    parent = tmp_path / "scratch"
    parent.mkdir()
    r = mutants.run_one(flaky, sys.executable, parent, root=root)
    assert r.status == mutants.FLAKY and "first run" in r.detail, r
    assert (parent / "runs.txt").read_text() == "2"  # run twice, not more
    missed = mutants.run_one(invariants["TOY-MISSED"], sys.executable, parent, root=root)
    assert missed.status == "missed"  # passed twice: still a miss, and the gate fails on it
    out = io.StringIO()
    mutants.print_table([r, missed], out=out)
    tail = out.getvalue().strip().splitlines()[-2:]  # what CI's tail shows
    assert tail == [f"FLAKY TOY-FLAKY: {r.detail}", "NOT CAUGHT TOY-MISSED: missed -- " + (missed.detail or
                    "every named test passed")]
    assert mutants.PASSING == ("caught", mutants.FLAKY)


def test_runner_baseline_fails_when_the_tests_fail_unmutated(tmp_path):
    root = _toy(tmp_path, TOY_CONTRACTS)
    (root / "tests" / "test_toy.py").write_text(TOY_TEST.replace("== 5", "== 6"))
    inv = next(i for i in mutants.load_contracts(root / "contracts")[0] if i.id == "TOY-CAUGHT")
    r = mutants.run_one(inv, sys.executable, tmp_path, baseline=True, root=root)
    assert r.status == "baseline-fails", r


def test_lint_names_each_problem(tmp_path):
    contracts = TOY_CONTRACTS + """
      - id: TOY-CAUGHT
        claim: a second invariant with the same id
        test: tests/test_toy.py::test_gone
        mutation: none given
      - id: TOY-TWICE
        claim: a find that is not unique
        test: tests/nowhere.py::test_x
        mutation: ambiguous
        cost: sometimes
        mutate:
          - file: src/toy/__init__.py
            find: "return"
            replace: "yield"
      - id: TOY-SYNTAX
        claim: the mutated file must parse
        test: tests/test_toy.py::test_add
        mutation: unparsable
        mutate:
          - file: src/toy/__init__.py
            find: "return a + b"
            replace: "return a +"
    """
    problems = "\n".join(mutants.lint(_toy(tmp_path, contracts)))
    for expected in ("TOY-BROKEN: mutate item 1: find 'return a + b + 0' is not in src/toy/__init__.py",
                     "TOY-CAUGHT: duplicate id",
                     "TOY-CAUGHT: test tests/test_toy.py::test_gone is not defined",
                     "TOY-CAUGHT: no 'mutate:' edits",
                     "TOY-TWICE: test file tests/nowhere.py does not exist",
                     "TOY-TWICE: cost must be one of",
                     "TOY-TWICE: mutate item 1: find 'return' occurs 2 times in src/toy/__init__.py",
                     "TOY-SYNTAX: the mutated src/toy/__init__.py does not parse"):
        assert expected in problems, f"{expected!r} not in:\n{problems}"


def test_scratch_copy_is_what_the_tests_import(tmp_path):
    """The editable install (its .pth puts the working tree's src on sys.path) must not shadow the
    mutated copy: PYTHONPATH comes first. Checked with the interpreter the runner uses."""
    python = str(ROOT / ".venv" / "bin" / "python")
    assert mutants.check_isolation(python if Path(python).exists() else sys.executable, tmp_path) == ""


def test_budget_runs_touched_invariants_first_and_leaves_the_rest_not_run(tmp_path):
    """CI's `--budget`: an invariant whose contract, tests or mutated file changed goes first; the others follow
    in an order rotated by the commit; once the budget is spent no mutant starts, and those not run neither pass
    nor fail the gate (the table leaves them out, the closing line counts them)."""
    root = _toy(tmp_path, TOY_CONTRACTS)
    invariants = mutants.load_contracts(root / "contracts")[0]
    by_id = {i.id: i for i in invariants}
    assert mutants.touched(by_id["TOY-MISSED"], {"src/toy/__init__.py"})
    assert not mutants.touched(by_id["TOY-MISSED"], {"src/other.py"})
    fake = dataclasses.replace(by_id["TOY-MISSED"], id="TOY-SYM", source="contracts/x.yaml", tests=["tests/t.py::a"],
                               edits=[mutants.Edit(symbol="entrenar.train.loop:Trainer.step", find="a", replace="b")])
    assert mutants.touched(fake, {"src/entrenar/train/loop.py"}) and mutants.touched(fake, {"tests/t.py"})
    order = [i.id for i in mutants.budget_order(invariants, "HEAD")]  # nothing changed since HEAD: rotation only
    assert sorted(order) == sorted(by_id)
    args = argparse.Namespace(markers="", baseline=False, budget=-1.0, jobs=1)  # spent before the first mutant
    results = mutants._run_all(invariants, sys.executable, tmp_path, args, root)
    assert {r.status for r in results} == {mutants.NOT_RUN}
    out = io.StringIO()
    mutants.print_table(results, out=out)
    assert "TOY" not in out.getvalue()  # not-run rows are no verdict: not listed as NOT CAUGHT
