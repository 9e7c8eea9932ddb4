"""Inputs that made a command hang (issue 28 item 6): a glob through a symlink loop, and a chat template
that loops (nested `range(99999)`) or writes without end. Each now finishes: the loop is walked once,
the template is stopped with exit 2.

Seen red before the fix: the symlink-loop commands ran into the 60 s timeout (glob followed
loop/self and loop/again 2^40 ways); the template test ran until killed.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from entrenar.data.sources import expand_inputs, glob_files

SRC = Path(__file__).resolve().parents[1] / "src"


def _loop_corpus(root: Path) -> Path:
    loop = root / "messy" / "loop"
    loop.mkdir(parents=True)
    (loop / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 30)
    (loop / "sub").mkdir()
    (loop / "sub" / "b.md").write_text("pack my box with five dozen liquor jugs\n" * 30)
    os.symlink("../loop", loop / "self")
    os.symlink("../loop", loop / "again")
    return loop


def test_a_symlink_loop_is_walked_once_by_tokenizer_train_and_data_pack(tmp_path):
    _loop_corpus(tmp_path)
    script = ("import sys; from entrenar.cli import main\n"
              "a = main(['tokenizer', 'train', '--vocab-size', '270', '--out', 'tok', '--json', 'messy/loop/**'])\n"
              "b = main(['data', 'pack', '--model', 'tok', '--out', 'shards', '--json', 'messy/loop/**', 'messy'])\n"
              "sys.exit(10 * a + b)\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", script], check=False, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert sorted(index["inputs"]) == ["messy/loop/a.txt", "messy/loop/sub/b.md"]  # each real file once


def test_expand_inputs_follows_a_symlinked_directory_once(tmp_path):
    loop = _loop_corpus(tmp_path)
    assert expand_inputs([str(loop)]) == [loop / "a.txt", loop / "sub" / "b.md"]


@pytest.mark.parametrize("pattern", ["**", "**/*.txt", "a/**", "a/**/*.py", "*/b?/*", "a/**/c[0-9].txt",
                                     "a/*/**/*.md", "**/.h/*", "a/[!b]*/*.txt", "x*"])
def test_glob_files_matches_what_glob_matches_without_loops(tmp_path, monkeypatch, pattern):
    for rel in ("a/x.txt", "a/b1/c1.txt", "a/b1/c2.py", "a/b2/d/e.md", "a/.h/hidden.txt", ".h/top.txt",
                "a/b2/.dot.txt", "x1.txt", "xdir/y.txt", "a/c3.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    monkeypatch.chdir(tmp_path)
    expected = sorted(Path(f) for f in glob.glob(pattern, recursive=True) if Path(f).is_file())
    assert sorted(glob_files(pattern)) == expected
    absolute = str(tmp_path / pattern)
    assert sorted(glob_files(absolute)) == sorted(Path(f) for f in glob.glob(absolute, recursive=True)
                                                  if Path(f).is_file())


# ---- chat templates: bounded by time and output size ---------------------------------------------------
LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
WRITES = "{% for i in range(99999) %}{% for j in range(99999) %}{{ 'xxxxxxxx' }}{% endfor %}{% endfor %}"
USER = [{"role": "user", "content": "hi"}]


def test_a_template_that_loops_without_output_is_stopped_by_time(monkeypatch):
    from entrenar import chat_limits as tokmod
    from entrenar.errors import InputError
    from tests.helpers.tokenizers import tiny_tokenizer

    monkeypatch.setattr(tokmod, "RENDER_SECONDS", 0.5)
    with pytest.raises(InputError, match=r"chat template ran longer than 0.5 s"):
        tiny_tokenizer(chat_template=LOOPS).render_chat(USER)


def test_the_alarm_stops_a_finite_loop_that_writes_nothing(monkeypatch):
    """400 M silent iterations (10 s or more on any CPU; 36 M took only ~1.5 s on an idle machine, and the mutant
    without the alarm then passed) stopped after 0.2 s: only the alarm can, nothing is written until the loops
    end (the clock between pieces would stop it only then)."""
    import time

    from entrenar import chat_limits as tokmod
    from entrenar.errors import InputError
    from tests.helpers.tokenizers import tiny_tokenizer

    monkeypatch.setattr(tokmod, "RENDER_SECONDS", 0.2)
    silent = ("{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}"
              "{{ messages[0]['content'] }}")
    tok = tiny_tokenizer(chat_template=silent)
    t0 = time.monotonic()
    with pytest.raises(InputError, match=r"ran longer than 0.2 s"):
        tok.render_chat(USER)
    assert time.monotonic() - t0 < 2.0


def test_a_template_that_writes_without_end_is_stopped_by_size(monkeypatch):
    from entrenar import chat_limits as tokmod
    from entrenar.errors import InputError
    from tests.helpers.tokenizers import tiny_tokenizer

    monkeypatch.setattr(tokmod, "MAX_RENDER_CHARS", 1 << 16)
    with pytest.raises(InputError, match=r"chat template wrote more than"):
        tiny_tokenizer(chat_template=WRITES).encode_chat(USER)


def test_the_time_bound_holds_off_the_main_thread_too(monkeypatch):
    """SIGALRM exists only in the main thread; elsewhere the bound is checked between output pieces."""
    import threading

    from entrenar import chat_limits as tokmod
    from entrenar.errors import InputError
    from tests.helpers.tokenizers import tiny_tokenizer

    monkeypatch.setattr(tokmod, "RENDER_SECONDS", 0.5)
    # one character per 2,000 silent iterations: 50 M iterations (seconds on any CPU) write 25,000 characters,
    # far below the size bound, so only the clock can stop it (WRITES reached 16 Mi characters within 0.5 s on
    # an idle machine); without the clock it ends on its own and nothing is raised
    slow_writer = "{% for i in range(25000) %}{% for j in range(2000) %}{% endfor %}{{ 'x' }}{% endfor %}"
    errors: list[BaseException] = []

    def render() -> None:
        try:
            tiny_tokenizer(chat_template=slow_writer).render_chat(USER)
        except InputError as e:
            errors.append(e)

    t = threading.Thread(target=render, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive() and len(errors) == 1 and "longer than 0.5 s" in str(errors[0])


def test_a_normal_template_renders_unchanged_after_a_bounded_one(monkeypatch):
    from entrenar import chat_limits as tokmod
    from entrenar.errors import InputError
    from tests.helpers.tokenizers import tiny_tokenizer

    monkeypatch.setattr(tokmod, "RENDER_SECONDS", 0.3)
    with pytest.raises(InputError):
        tiny_tokenizer(chat_template=LOOPS).render_chat(USER)
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no timer left behind
    assert tiny_tokenizer(chat_template="{{ messages[0]['content'] }}!").render_chat(USER).text == "hi!"
