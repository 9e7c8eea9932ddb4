#!/usr/bin/env python3
"""Run the executable mutations of contracts/*.yaml and show that the named tests catch each one.

Every invariant in ``contracts/*.yaml`` lists its tests and a ``mutate:`` list of exact source edits
(``symbol`` or ``file``, ``find``, ``replace``: tools/symbol_anchors.py says how a symbol is found). For each invariant this tool copies the source tree to a scratch
directory (never touching the working tree), applies all of the invariant's edits there, runs only
the named tests with the repository's Python (``PYTHONPATH`` = the scratch ``src`` so the mutated
source is what is imported, not the editable install) and reports:

  caught          a named test failed (the contract holds)
  missed          every named test passed, twice -- the tests cannot see the defect
  caught-on-retry every named test passed once, then one failed: a test that sees the defect only
                  sometimes (passes the gate; listed at the end of the table to be fixed)
  broken          an edit does not apply (its ``find`` is not exactly once in its symbol / file)
  skipped         every named test was skipped (nothing was checked)
  error           pytest could not collect / run the tests (e.g. the mutant breaks an import)
  timeout         the tests ran past the time limit
  baseline-fails  (--baseline) the named tests fail on the unmutated tree already

Exit status 1 when any result is neither ``caught`` nor ``caught-on-retry``. ``--lint`` checks the YAML without running tests:
ids unique, tests defined, a ``mutate:`` on every invariant, every edit applies exactly once (its symbol
names one place; its find occurs once in it), the mutated file still parses and its code (AST) changed.

    tools/mutants.py                 # the fast invariants (what CI runs)
    tools/mutants.py --all           # every invariant
    tools/mutants.py --id KERNEL-ROPE-PAIRING --id LOAD-BF16-BIT-EXACT
    tools/mutants.py --lint
    tools/mutants.py --list
    tools/mutants.py --fast --budget 480 --jobs 2   # what `make test` runs: see below

``--budget SECONDS`` bounds the wall time (CI's): mutants are started in priority order until the budget is
spent and the rest are reported ``not-run`` (they neither pass nor fail the gate). Priority: first the
invariants whose contract file, named tests or mutated source changed in the commits since ``--changed-since``
(default HEAD~10), then the others in an order rotated by the HEAD commit, so successive commits check
different ones and every invariant is checked over a few CI runs; ``make mutants`` runs them all.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from symbol_anchors import AnchorError, SourceIndex, gc_paused, locate, same_code

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "contracts"
# What a scratch copy holds: everything the tests import or read (bench/: the scripts that
# tests/test_e2e_bench.py loads, 1 MB). Not .venv (the tests run with the working tree's interpreter) and not .git.
COPY = ("src", "tests", "contracts", "tools", "bench", "pyproject.toml", "conftest.py")
COSTS = ("fast", "slow")
DEFAULT_TIMEOUT = 600.0
OK = "caught"
FLAKY = "caught-on-retry"  # passes the gate, printed at the end of the table for a fix
PASSING = (OK, FLAKY)
NOT_RUN = "not-run"  # --budget spent before this mutant's turn: no verdict either way


@dataclass
class Edit:
    file: str = ""  # a path relative to the root (text anywhere in the file), or
    find: str | None = None
    replace: str | None = None
    symbol: str = ""  # [module:]Qual.name: find must be once inside that def/class/assignment


@dataclass
class Invariant:
    id: str
    area: str
    source: str  # contracts/<area>.yaml
    tests: list[str]
    edits: list[Edit]
    cost: str = "fast"
    timeout: float = DEFAULT_TIMEOUT
    raw: dict = field(default_factory=dict, repr=False)


@dataclass
class Result:
    id: str
    status: str
    seconds: float
    cost: str
    failed: list[str] = field(default_factory=list)  # the named tests that failed (caught by)
    detail: str = ""
    # CPU seconds of the test processes (user + system): with --jobs 1 on a busy machine this, not the
    # wall time, estimates what the mutant costs a dedicated CI runner
    cpu_seconds: float = 0.0


# ---------------------------------------------------------------- loading and lint


def _as_list(value) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def load_contracts(directory: Path = CONTRACTS) -> tuple[list[Invariant], list[str]]:
    """All invariants of directory/*.yaml and the problems met while reading them."""
    invariants, problems = [], []
    for path in sorted(directory.glob("*.yaml")):
        rel = path.relative_to(directory.parent).as_posix()
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            problems.append(f"{rel}: not valid YAML: {e}")
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("invariants"), list):
            problems.append(f"{rel}: needs a top-level 'invariants:' list")
            continue
        for i, inv in enumerate(doc["invariants"]):
            if not isinstance(inv, dict) or not inv.get("id"):
                problems.append(f"{rel}: invariant #{i + 1} has no 'id'")
                continue
            edits = []
            for item in _as_list(inv.get("mutate")):
                if isinstance(item, dict):
                    edits.append(Edit(str(item.get("file") or ""), item.get("find"), item.get("replace"),
                                      str(item.get("symbol") or "")))
                else:
                    edits.append(Edit("", None, None))
            invariants.append(Invariant(
                id=str(inv["id"]), area=str(doc.get("area", path.stem)), source=rel,
                tests=[str(t) for t in _as_list(inv.get("test"))], edits=edits,
                cost=str(inv.get("cost", "fast")), timeout=float(inv.get("timeout", DEFAULT_TIMEOUT)), raw=inv))
    return invariants, problems


def defined_tests(path: Path) -> set[str]:
    """Test functions (and Class::method) defined at the top level of a test file."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}::{item.name}")
    return names


def apply_edits(root: Path, edits: list[Edit], index: SourceIndex | None = None,
                texts: dict[str, str] | None = None) -> dict[str, str]:
    """The edited text of every file the edits touch (edits apply in order, on root's files, or on
    texts' where it holds a file already edited).

    Raises ValueError naming the edit when it does not apply: a ``symbol`` that names no or several
    places, or a ``find`` not exactly once in its symbol (or, for a ``file`` edit, in its file)."""
    index = index or SourceIndex(root)
    texts = dict(texts or {})
    for n, e in enumerate(edits, 1):
        if bool(e.file) == bool(e.symbol) or not isinstance(e.find, str) or not isinstance(e.replace, str):
            raise ValueError(f"mutate item {n} needs 'symbol' or 'file' (one of them), 'find' and 'replace' (strings)")
        if e.find == e.replace:
            raise ValueError(f"mutate item {n}: 'replace' equals 'find' (no mutation)")
        if e.symbol:
            try:
                sym, at = locate(index, e.symbol, e.find, texts)
            except AnchorError as err:
                raise ValueError(f"mutate item {n}: {err}") from None
            file = sym.file
        else:
            file = e.file
            text = index.text(file, texts)
            if text is None:
                raise ValueError(f"mutate item {n}: {file} does not exist")
            count = text.count(e.find)
            if count != 1:
                where = "is not in" if count == 0 else f"occurs {count} times in"
                raise ValueError(f"mutate item {n}: find {_short(e.find)!r} {where} {file} (must be exactly once)")
            at = text.index(e.find)
        text = index.text(file, texts)
        texts[file] = text[:at] + e.replace + text[at + len(e.find):]
    return texts


def _short(s: str, n: int = 70) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 3] + "..."


def lint(root: Path = ROOT) -> list[str]:
    """Every problem with contracts/*.yaml against the tree at root, one clear line each."""
    with gc_paused():
        return _lint(root)


def _lint(root: Path) -> list[str]:
    invariants, problems = load_contracts(root / "contracts")
    seen: dict[str, str] = {}
    cache: dict[Path, set[str]] = {}
    index = SourceIndex(root)  # each source read and parsed once for every invariant
    unmutated: dict[str, ast.Module | None] = {}  # file -> the AST of its unmutated text
    for inv in invariants:
        where = f"{inv.source}: {inv.id}"
        if inv.id in seen:
            problems.append(f"{where}: duplicate id (also in {seen[inv.id]})")
        seen.setdefault(inv.id, inv.source)
        for key in ("claim", "test", "mutation"):
            if not inv.raw.get(key):
                problems.append(f"{where}: lacks {key!r}")
        if inv.cost not in COSTS:
            problems.append(f"{where}: cost must be one of {COSTS}, not {inv.cost!r}")
        for node in inv.tests:
            file, _, name = node.partition("::")
            name = name.split("[")[0]
            f = root / file
            if not f.is_file():
                problems.append(f"{where}: test file {file} does not exist")
                continue
            if f not in cache:
                cache[f] = defined_tests(f)
            if not name or name not in cache[f]:
                problems.append(f"{where}: test {node} is not defined")
        if not inv.edits:
            problems.append(f"{where}: no 'mutate:' edits (add file/find/replace so the mutation is executable)")
            continue
        try:
            texts = apply_edits(root, inv.edits, index)
        except ValueError as e:
            problems.append(f"{where}: {e}")
            continue
        for name, text in texts.items():
            if name.endswith(".py"):
                if name not in unmutated:
                    try:
                        unmutated[name] = index.tree(name)
                    except AnchorError:
                        unmutated[name] = None  # broken already: its own tests say so, nothing to compare
                problems += [f"{where}: {p}" for p in _code_changed(name, index.text(name) or "", unmutated[name], text)]
    return problems


def _code_changed(name: str, before: str, before_tree: ast.Module | None, after: str) -> list[str]:
    """[] if the mutated source parses and its code (AST) differs from before's, else why not.

    A find/replace that only touches comments or layout passes every test and mutates nothing."""
    try:
        after_tree = ast.parse(after)
    except SyntaxError as e:
        return [f"the mutated {name} does not parse: {e.msg} (line {e.lineno})"]
    if before_tree is not None and same_code(before, before_tree, after, after_tree):
        return [f"the mutation leaves the code of {name} unchanged (only comments or layout differ)"]
    return []


# ---------------------------------------------------------------- running


def make_scratch(parent: Path, root: Path = ROOT) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix="mut-", dir=parent))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache")
    for name in COPY:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, scratch / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, scratch / name)
    return scratch


def test_env(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    # PYTHONPATH entries precede site-packages (where the editable install's .pth adds ROOT/src),
    # so the scratch copy's source is imported; check_isolation() verifies it.
    env["PYTHONPATH"] = str(scratch / "src")
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_isolation(python: str, parent: Path, root: Path = ROOT, package: str = "entrenar") -> str:
    """'' if a scratch copy's package is the one imported (not the working tree's), else why not."""
    scratch = make_scratch(parent, root)
    try:
        marker = "MUTANTS_SANITY_MARKER = 1\n"
        init = scratch / "src" / package / "__init__.py"
        init.write_text(init.read_text() + marker)
        code = (f"import {package} as p, sys; print(p.__file__); "
                "sys.exit(0 if getattr(p, 'MUTANTS_SANITY_MARKER', 0) else 1)")
        proc = subprocess.run([python, "-c", code], check=False, cwd=scratch, env=test_env(scratch), capture_output=True,
                              text=True, timeout=120)
        where = proc.stdout.strip()
        if proc.returncode != 0 or not where.startswith(str(scratch)):
            return f"the scratch copy is shadowed: {package} imported from {where or '?'} ({proc.stderr[-300:]})"
        return ""
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _junit_outcomes(path: Path) -> dict[str, str]:
    """nodeid-ish name -> 'passed' | 'failed' | 'error' | 'skipped' from a pytest junit file."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    try:
        tree = ET.parse(path)
    except ET.ParseError:
        return out
    for case in tree.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            out[name] = "failed"
        elif "error" in kinds:
            out[name] = "error"
        elif "skipped" in kinds:
            out[name] = "skipped"
        else:
            out[name] = "passed"
    return out


def _node_label(junit_name: str, root: Path) -> str:
    # classname "tests.test_x" (or "tests.test_x.Class") + "::name" -> tests/test_x.py::name
    cls, _, name = junit_name.partition("::")
    parts = cls.split(".")
    for cut in range(len(parts), 0, -1):
        if (root / ("/".join(parts[:cut]) + ".py")).is_file():
            rest = parts[cut:]
            return "/".join(parts[:cut]) + ".py::" + "::".join(rest + [name])
    return junit_name


def run_tests(python: str, scratch: Path, tests: list[str], timeout: float,
              markers: str = "") -> tuple[str, list[str], str]:
    """Run the named tests in scratch: (status, failed tests, detail) with status as in Result."""
    junit = scratch / "junit.xml"
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={junit}", *(["-m", markers] if markers else []), *tests]
    proc = subprocess.Popen(cmd, cwd=scratch, env=test_env(scratch), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session: pytest and any training subprocess
        proc.communicate()
        return "timeout", [], f"ran past {timeout:.0f} s"
    outcomes = _junit_outcomes(junit)
    failed = [_node_label(n, scratch) for n, o in outcomes.items() if o in ("failed", "error")]
    tail = _last_line(output)
    if proc.returncode == 1 and failed:
        return "caught", failed, tail
    if proc.returncode == 0:
        if outcomes and all(o == "skipped" for o in outcomes.values()):
            return "skipped", [], tail
        return "missed", [], tail
    if proc.returncode == 5:
        return "error", [], "no tests collected: " + tail
    # 2: interrupted / collection error (e.g. the mutant broke an import); 3, 4: internal / usage
    return "error", failed, _error_excerpt(output) or tail


def _last_line(output: str) -> str:
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return lines[-1].strip("= ") if lines else ""


def _error_excerpt(output: str) -> str:
    for ln in output.splitlines():
        if re.match(r"^E\s+\w*(Error|Exception)", ln):
            return ln[1:].strip()
    return _last_line(output)


def run_one(inv: Invariant, python: str, parent: Path, baseline: bool = False, root: Path = ROOT,
            markers: str = "") -> Result:
    return _run_one(inv, python, parent, baseline, root, markers, _children_cpu())


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _run_one(inv: Invariant, python: str, parent: Path, baseline: bool, root: Path, markers: str,
             cpu0: float) -> Result:
    start = time.monotonic()
    scratch = make_scratch(parent, root)
    try:
        if baseline:
            status, failed, detail = run_tests(python, scratch, inv.tests, inv.timeout, markers)
            if status != "missed":  # "missed" here means: every test passed unmutated, as needed
                return Result(inv.id, "baseline-fails", time.monotonic() - start, inv.cost, failed,
                              f"unmutated: {status}: {detail}")
        try:
            texts = apply_edits(scratch, inv.edits)
        except ValueError as e:
            return Result(inv.id, "broken", time.monotonic() - start, inv.cost, [], str(e))
        for name, text in texts.items():
            (scratch / name).write_text(text)
        status, failed, detail = run_tests(python, scratch, inv.tests, inv.timeout, markers)
        if status == "missed":
            # once in CI (a 2-core runner, two mutants at a time) a mutant passed that is caught in every run
            # here, alone and with two at a time, AVX-512 and AVX2 alike. A second run tells a test that can
            # never see the defect (missed twice) from one that sees it only sometimes (reported FLAKY below)
            status, failed, detail = run_tests(python, scratch, inv.tests, inv.timeout, markers)
            if status == OK:
                status, detail = FLAKY, "missed on the first run, caught on the second: " + ", ".join(failed)
        return Result(inv.id, status, time.monotonic() - start, inv.cost, failed, detail, _children_cpu() - cpu0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_operator(m, tests: list[str], timeout: float, python: str, parent: Path, root: Path = ROOT) -> Result:
    """One operator mutant (tools/operators.py) against its target's tests; Result.id is its label."""
    start = time.monotonic()
    scratch = make_scratch(parent, root)
    try:
        target = scratch / m.file
        text = target.read_text()
        if text[m.start:m.end] != m.original:
            return Result(m.label, "broken", time.monotonic() - start, "op", [], "the source moved")
        target.write_text(m.apply(text))
        status, failed, detail = run_tests(python, scratch, tests, timeout)
        return Result(m.label, status, time.monotonic() - start, "op", failed, detail)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def operator_summary(results: list[Result], targets: list, per_target: dict[str, list[Result]]) -> list[str]:
    """Mutation score per module: killed (caught) / all, and every survivor (missed) by label."""
    lines = []
    for t in targets:
        rs = per_target.get(t.name, [])
        if not rs:
            continue
        killed = sum(r.status == OK for r in rs)
        lines.append(f"{t.name} ({t.file}): {killed}/{len(rs)} killed, score {killed / len(rs):.0%}")
        lines += [f"  {r.status}: {r.id}" + (f" ({r.detail})" if r.status != "missed" else "")
                  for r in rs if r.status != OK]
    return lines


def _run_operators(args, python: str, parent: Path) -> int:
    from operators import load_targets, mutants_of

    targets = [t for t in load_targets(ROOT / "tools" / "mutation_targets.yaml")
               if not args.target or t.name in args.target]
    # One snapshot of the tree for the whole run: others keep editing the working tree meanwhile.
    snapshot = make_scratch(parent)
    jobs = [(t, m) for t in targets for m in mutants_of(snapshot, t.file, t.functions)
            if not args.match or any(x in m.label for x in args.match)]
    if args.list:
        for t, m in jobs:
            print(f"{t.name}\t{m.label}")
        return 0
    per_target: dict[str, list[Result]] = {}

    def one(job) -> Result:
        t, m = job
        r = run_operator(m, t.tests, args.timeout or t.timeout, python, parent, snapshot)
        print(f"  {r.status}: {r.id} ({r.seconds:.1f} s)", file=sys.stderr, flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, jobs))
    for (t, _), r in zip(jobs, results):
        per_target.setdefault(t.name, []).append(r)
    if args.json:
        print(json.dumps({t: [asdict(r) for r in rs] for t, rs in per_target.items()}, indent=1))
    else:
        print("\n".join(operator_summary(results, targets, per_target)))
    return 0 if all(r.status == OK for r in results) else 1


def print_table(results: list[Result], out=sys.stdout) -> None:
    results = [r for r in results if r.status != NOT_RUN]  # counted in main's closing line
    w = max([len(r.id) for r in results] + [2])
    print(f"{'id':<{w}}  {'result':<14}  {'cost':<4}  {'seconds':>7}  {'cpu s':>6}  caught by / detail", file=out)
    for r in results:
        why = ", ".join(f.split("::")[-1] for f in r.failed) if r.status == OK else r.detail
        print(f"{r.id:<{w}}  {r.status:<14}  {r.cost:<4}  {r.seconds:7.1f}  {r.cpu_seconds:6.1f}  {why}", file=out)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    total, cpu = sum(r.seconds for r in results), sum(r.cpu_seconds for r in results)
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(f"{len(results)} mutations: {summary}; {total:.0f} s of test time ({cpu:.0f} CPU s)", file=out)
    # repeated after the summary: CI shows only the tail of a long table, and the failures are what it needs
    for r in results:
        if r.status == FLAKY:
            print(f"FLAKY {r.id}: {r.detail}", file=out)
        elif r.status != OK:
            print(f"NOT CAUGHT {r.id}: {r.status} -- {r.detail or 'every named test passed'}", file=out)


def select(invariants: list[Invariant], ids: list[str], cost: str | None) -> list[Invariant]:
    if ids:
        by_id = {inv.id: inv for inv in invariants}
        unknown = [i for i in ids if i not in by_id]
        if unknown:
            raise SystemExit(f"mutants: unknown invariant id(s): {', '.join(unknown)}")
        return [by_id[i] for i in ids]
    return [inv for inv in invariants if cost is None or inv.cost == cost]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--id", action="append", default=[], help="run this invariant (repeatable)")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fast", action="store_true", help="only cost: fast invariants (the default without --id)")
    p.add_argument("--markers", help="pytest -m expression for the named tests (e.g. 'not real_model')")
    g.add_argument("--all", action="store_true", help="every invariant, fast and slow")
    p.add_argument("--list", action="store_true", help="list the selected invariants and exit")
    p.add_argument("--lint", action="store_true", help="check contracts/*.yaml and exit")
    p.add_argument("--baseline", action="store_true",
                   help="first run the named tests unmutated; report baseline-fails if they fail")
    p.add_argument("--timeout", type=float, help="seconds per mutant (default: each invariant's timeout, 600)")
    p.add_argument("--budget", type=float,
                   help="wall seconds for the whole run: no mutant starts after it (the rest: not-run)")
    p.add_argument("--changed-since", default="HEAD~10",
                   help="with --budget: invariants touched since this git revision run first (default HEAD~10)")
    p.add_argument("--operators", action="store_true",
                   help="general operator mutants over tools/mutation_targets.yaml instead of the contracts")
    p.add_argument("--target", action="append", default=[], help="with --operators: only this target (repeatable)")
    p.add_argument("--match", action="append", default=[],
                   help="with --operators: only mutants whose label contains this text (repeatable)")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"),
                   help="interpreter that runs pytest (default .venv/bin/python)")
    args = p.parse_args(argv)

    python = args.python if Path(args.python).exists() else sys.executable
    if args.operators:
        sys.path.insert(0, str(ROOT / "tools"))
        parent = Path(tempfile.mkdtemp(prefix="entrenar-mutants-"))
        try:
            return _run_operators(args, python, parent)
        finally:
            shutil.rmtree(parent, ignore_errors=True)
    problems = lint()
    if args.lint:
        for line in problems:
            print(line)
        print(f"contracts lint: {len(problems)} problem(s)" if problems else "contracts lint: ok")
        return 1 if problems else 0
    invariants, unreadable = load_contracts()
    for line in unreadable:  # a file that does not parse hides its invariants: say so first
        print(f"mutants: {line}", file=sys.stderr)
    chosen = select(invariants, args.id, None if args.all else "fast")
    if args.timeout:
        for inv in chosen:
            inv.timeout = args.timeout
    if args.list:
        for inv in chosen:
            print(f"{inv.id}\t{inv.cost}\t{inv.source}\t{' '.join(inv.tests)}")
        return 0
    parent = Path(tempfile.mkdtemp(prefix="entrenar-mutants-"))
    try:
        why = check_isolation(python, parent)
        if why:
            print(f"mutants: {why}", file=sys.stderr)
            return 2
        # one snapshot of the working tree for the whole run (others edit it meanwhile); each mutant's
        # scratch copy is made from it
        cpu0, wall0 = _children_cpu(), time.monotonic()
        if args.budget:
            chosen = budget_order(chosen, args.changed_since)
        results = _run_all(chosen, python, parent, args, make_scratch(parent))
        # the run's total CPU (exact whatever --jobs; per-mutant cpu_seconds overlap when jobs > 1)
        totals = {"cpu_seconds": round(_children_cpu() - cpu0, 1), "wall_seconds": round(time.monotonic() - wall0, 1),
                  "jobs": args.jobs}
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results], "totals": totals,
                          "ok": all(r.status in PASSING for r in results)}, indent=1))
    else:
        print_table(results)
        print(f"run: {totals['wall_seconds']:.0f} s wall, {totals['cpu_seconds']:.0f} CPU s of tests, "
              f"--jobs {totals['jobs']}")
        skipped = sum(r.status == NOT_RUN for r in results)
        if skipped:
            print(f"--budget {args.budget:.0f} s: {len(results) - skipped} of {len(results)} mutants run, {skipped} "
                  f"not run this time (a later commit rotates them in; `make mutants` runs every one)")
    return 0 if all(r.status in PASSING or r.status == NOT_RUN for r in results) else 1


def _git(*argv: str) -> str:
    proc = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def touched(inv: Invariant, changed: set[str]) -> bool:
    """Whether a changed path is the invariant's contract file, one of its test files or a file it mutates
    (a symbol's module hint, entrenar.a.b -> src/entrenar/a/b.py)."""
    paths = {inv.source, *(t.split("::")[0] for t in inv.tests)}
    for e in inv.edits:
        if e.file:
            paths.add(e.file)
        if ":" in e.symbol:
            paths.add("src/" + e.symbol.split(":")[0].replace(".", "/") + ".py")
    return bool(paths & changed)


def budget_order(chosen: list[Invariant], since: str) -> list[Invariant]:
    """The order a --budget run starts mutants in: those touched since `since` first, then the rest rotated by
    the HEAD commit (sha256 of commit + id), so each commit's CI checks a different share."""
    import hashlib

    changed = set(_git("diff", "--name-only", since, "HEAD").split())
    head = _git("rev-parse", "HEAD").strip() or time.strftime("%Y-%m-%d")
    def key(inv: Invariant) -> tuple[bool, str]:
        return (not touched(inv, changed), hashlib.sha256(f"{head}:{inv.id}".encode()).hexdigest())
    return sorted(chosen, key=key)


def _run_all(chosen: list[Invariant], python: str, parent: Path, args, snapshot: Path) -> list[Result]:
    markers = args.markers or ""
    deadline = time.monotonic() + args.budget if getattr(args, "budget", None) else None
    def one(inv: Invariant) -> Result:
        if deadline is not None and time.monotonic() >= deadline:
            return Result(inv.id, NOT_RUN, 0.0, inv.cost, detail="--budget spent")
        r = run_one(inv, python, parent, args.baseline, root=snapshot, markers=markers)
        print(f"  {r.id}: {r.status} ({r.seconds:.1f} s)", file=sys.stderr, flush=True)  # progress
        return r

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        return list(pool.map(one, chosen))


if __name__ == "__main__":
    sys.exit(main())
