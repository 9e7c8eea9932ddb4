"""bench/e2e_corpus.py and bench/e2e_report.py (issue 24 part 5): the held-out packages never reach the
training files (not as themselves, not vendored under another package, not as a byte-identical copy), the
byte caps hold, the tokenizer's files are training files; the report's target-loss table and calibration."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest


def bench_module(name: str):
    """bench/NAME.py, imported as the package module bench.NAME (bench/ sits beside tests/)."""
    return importlib.import_module(f"bench.{name}")


def code(i: int, pkg: str) -> str:
    return f"# {pkg} file {i}\ndef f{i}(x):\n    return x + {i}\n" + "y = 1\n" * (i % 5)


@pytest.fixture
def site_root(tmp_path: Path) -> Path:
    """A fake site-packages: two training packages, one held-out package (jinja2), a vendored copy of it
    under pip, a byte-identical copy of one of its files elsewhere, a module file, junk to skip."""
    root = tmp_path / "site"
    for pkg in ("alpha", "beta", "jinja2"):
        for i in range(12):
            f = root / pkg / ("sub" if i % 3 else "") / f"m{i}.py"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(code(i, pkg))
    vendored = root / "pip" / "_vendor" / "jinja2" / "x.py"
    vendored.parent.mkdir(parents=True)
    vendored.write_text("# vendored jinja2\n")
    (root / "pip" / "own.py").write_text("def pip_own():\n    pass\n")
    (root / "beta" / "copied.py").write_text(code(0, "jinja2"))  # the same bytes as jinja2/m0.py
    (root / "single.py").write_text("X = 1\n")
    (root / "alpha-1.0.dist-info").mkdir()
    (root / "alpha-1.0.dist-info" / "meta.py").write_text("skip = True\n")
    (root / "alpha" / "empty.py").write_text("\n")
    (root / "alpha" / "latin1.py").write_bytes(b"s = '\xe9'\n")
    return root


def test_heldout_packages_stay_out_of_training(tmp_path, site_root):
    corpus = bench_module("e2e_corpus")
    out = tmp_path / "corpus"
    m = corpus.build(out, train_mb=1, tok_mb=1, heldout_mb=1, heldout=["jinja2"], n_heldout=3, only=[], seed=0,
                     found_roots=[("site", site_root)])
    train = sorted(p.relative_to(out / "train").as_posix() for p in (out / "train").rglob("*.py"))
    held = sorted(p.relative_to(out / "heldout").as_posix() for p in (out / "heldout").rglob("*.py"))
    assert m["heldout_packages"] == ["jinja2"] and len(held) == 12 and all(h.startswith("jinja2/") for h in held)
    assert not [t for t in train if "jinja2" in t]  # neither the package nor pip's vendored copy
    held_bytes = {(out / "heldout" / h).read_bytes() for h in held}
    assert not [t for t in train if (out / "train" / t).read_bytes() in held_bytes]  # beta/copied.py
    assert m["excluded_from_train"] == {"vendored_heldout": 1, "copy_of_heldout": 1, "duplicate": 0}
    assert {"alpha/m0.py", "beta/sub/m1.py", "pip/own.py", "single.py"} <= set(train)
    assert not [t for t in train if "dist-info" in t or t.endswith(("empty.py", "latin1.py"))]
    assert m["skipped"] == {"empty": 1, "not_utf8": 1}
    tok = sorted(p.relative_to(out / "tok").as_posix() for p in (out / "tok").rglob("*.py"))
    assert tok == train  # under its cap the tokenizer sees every training file, and nothing else


def test_caps_and_even_sample(tmp_path, site_root):
    corpus = bench_module("e2e_corpus")
    out = tmp_path / "corpus"
    cap = 600 / 2**20  # bytes -> MiB: a few files
    m = corpus.build(out, train_mb=cap * 2, tok_mb=cap, heldout_mb=cap, heldout=[], n_heldout=1, only=[],
                     seed=0, found_roots=[("site", site_root)])
    assert m["heldout_packages"] == ["jinja2"]  # the first candidate present
    # a cap is crossed by at most the one file that crosses it
    biggest = max(len(code(i, "x")) + 8 for i in range(12))
    assert m["train"]["bytes"] <= 1200 + biggest and m["tokenizer_corpus"]["bytes"] <= 600 + biggest
    assert m["heldout"]["bytes"] <= 600 + biggest
    assert len(m["train"]["largest"]) >= 2  # files in hash order: more than one package under a small cap
    again = corpus.build(tmp_path / "again", train_mb=cap * 2, tok_mb=cap, heldout_mb=cap, heldout=[], n_heldout=1,
                         only=[], seed=0, found_roots=[("site", site_root)])
    assert again["train"] == m["train"]  # the same seed, the same sample


def test_missing_heldout_package_is_refused(tmp_path, site_root):
    corpus = bench_module("e2e_corpus")
    with pytest.raises(SystemExit, match="not installed"):
        corpus.build(tmp_path / "c", 1, 1, 1, ["nosuchpkg"], 3, [], 0, found_roots=[("site", site_root)])


def test_target_table_reads_the_curve():
    report = bench_module("e2e_report")
    curve = [{"step": 0, "tokens": 0, "loss": 10.4}, {"step": 100, "tokens": 1000, "loss": 6.2},
             {"step": 200, "tokens": 2000, "loss": 4.9}, {"step": 300, "tokens": 3000, "loss": 5.1},
             {"step": 400, "tokens": 4000, "loss": 3.9}]
    table = report.target_table(curve)
    got = {t["target_loss"]: t["tokens"] for t in table}
    # 8 and 7 are first reached at step 100, 5 at step 200 (the later rise does not move it), 4 at step 400;
    # nothing at or above the step-0 loss, nothing never reached
    assert got == {8.0: 1000, 7.0: 1000, 6.0: 2000, 5.0: 2000, 4.5: 4000, 4.0: 4000}
    assert report.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert report.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert report.first_difference([1, 2], [1, 2, 3]) == 2


def test_calibrate_stops_the_command_and_sizes_the_run(tmp_path, monkeypatch):
    """A stand-in for pretrain writes one metrics line per 0.05 s until SIGTERM; calibrate stops it after
    --measure-steps lines and turns the median tok/s into --steps for --train-seconds."""
    report = bench_module("e2e_report")
    run = tmp_path / "run"
    fake = tmp_path / "fake.py"
    fake.write_text(
        "import json, signal, sys, time\nfrom pathlib import Path\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        f"p = Path({str(run)!r}); p.mkdir()\n"
        "for i in range(1, 100000):\n"
        "    with open(p / 'metrics.jsonl', 'a') as f:\n"
        "        f.write(json.dumps({'step': i, 'tok_s': 1000.0 if i > 5 else 10.0, 'tokens': 100 * i}) + '\\n')\n"
        "    time.sleep(0.05)\n")
    out = tmp_path / "calib.json"
    monkeypatch.setattr(sys, "argv", ["e2e_report.py", "calibrate", "--run", str(run), "--measure-steps", "12",
                                      "--train-seconds", "30", "--tokens-per-step", "100", "--out", str(out),
                                      "--", sys.executable, str(fake)])
    assert report.main() == 0
    c = json.loads(out.read_text())
    assert c["exit_code"] == 143 and c["measured_steps"] >= 12
    assert c["tok_s"] == 1000 and c["steps"] == 300 and c["eval_every"] == 30  # 30 s x 1000 tok/s / 100
