"""The sandbox of the task eval: a hostile program (loop, fork bomb, file deletion, memory hog, network,
output flood, signals to its parent) scores 0 and harms nothing; HumanEval's own solutions pass."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from entrenar.evaluate import sandbox
from entrenar.evaluate.sandbox import SandboxLimits, isolation_level, run_program
from entrenar.evaluate.tasks import humaneval_path, humaneval_problems, program
from tests.helpers.sandbox import without_hook, without_layers, without_seccomp

FAST = SandboxLimits(timeout_s=1.5)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the uid layer needs root (CI and these machines run as root)")
SANDBOX_UIDS = range(1 << 30, (1 << 30) + (1 << 29))  # where run_program draws its uids


@pytest.fixture()
def drawn_uids(monkeypatch) -> list[int]:
    """The uids run_program draws during the test. Other test workers run sandboxed programs at the same time (task
    evals, rewards), under uids of their own: a check for any sandbox uid saw theirs."""
    uids: list[int] = []
    draw = sandbox.secrets.randbelow

    def spy(n: int) -> int:
        uids.append(draw(n) + (1 << 30))
        return uids[-1] - (1 << 30)

    monkeypatch.setattr(sandbox.secrets, "randbelow", spy)
    return uids


def sandbox_processes(uids: list[int]) -> list[int]:
    """Live pids owned by the sandbox uids drawn by this test (none once run_program has returned)."""
    assert uids and all(u in SANDBOX_UIDS for u in uids)
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid in uids and not sandbox._is_zombie(entry):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def canonical_solutions() -> dict[str, str]:
    """HumanEval's reference bodies (the package's canonical_solution column), by task_id."""
    from entrenar.fileio import read_jsonl

    return {row["task_id"]: row["canonical_solution"] for _, row in read_jsonl(humaneval_path())}


def test_humaneval_solutions_pass_and_a_wrong_one_fails():
    """The program assembly (prompt + body + test + check(entry_point)) and the sandbox run every
    canonical solution of the package to a pass; a wrong body fails with the assertion's traceback."""
    solutions = canonical_solutions()
    problems = humaneval_problems()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda p: run_program(program(p, solutions[p.task_id], False)),
                                problems))
    failed = [(p.task_id, r.error) for p, r in zip(problems, results) if not r.passed]
    assert not failed, failed[:3]
    wrong = run_program(program(problems[0], "    return False\n", False))
    assert wrong.status == "failed" and "AssertionError" in wrong.error


def test_infinite_loop_times_out_and_is_killed(drawn_uids):
    t0 = time.perf_counter()
    result = run_program("while True:\n    pass\n", FAST)
    assert result.status == "timeout" and not result.passed
    assert time.perf_counter() - t0 < FAST.timeout_s + 3
    assert os.geteuid() != 0 or not sandbox_processes(drawn_uids)  # uids are drawn as root (CI) only


@ROOT_ONLY
def test_fork_bomb_is_bounded_and_every_process_dies(monkeypatch, drawn_uids):
    """RLIMIT_NPROC's bound, without the system-call filter (which refuses every fork)."""
    without_seccomp(monkeypatch)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.perf_counter()
    result = run_program(bomb, FAST)
    assert not result.passed and result.status == "timeout"
    assert time.perf_counter() - t0 < FAST.timeout_s + 5
    assert not sandbox_processes(drawn_uids)


@ROOT_ONLY
def test_a_child_that_leaves_the_process_group_is_killed_too(monkeypatch, drawn_uids):
    """It passes (the parent exits 0) but the setsid'd child outliving it is found by its uid and killed
    (without the system-call filter, which refuses the fork itself)."""
    without_seccomp(monkeypatch)
    escape = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
              "time.sleep(0.2)\n")
    result = run_program(escape, FAST)
    assert result.passed, result.error
    assert not sandbox_processes(drawn_uids)


@pytest.fixture()
def open_dir():
    """A world-writable directory under /tmp (pytest's tmp_path is in a 0700 directory the sandbox uid
    cannot even enter): file modes do not protect it, only the sandbox's audit hook does."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="entrenar-victim-", dir="/tmp"))
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("root", ["as-is", "not-root"])
def test_deleting_files_outside_its_directory_fails_and_they_survive(open_dir, monkeypatch, root):
    """As the process is (root here: uid, read-only mounts and the audit hook), and through the not-root
    fallback (the root check patched) without the filter and Landlock, where the audit hook alone refuses
    each attack."""
    if root == "not-root":
        monkeypatch.setattr(sandbox, "_LEVEL", None)
        monkeypatch.setattr(sandbox, "_is_root", lambda: False)
        without_layers(monkeypatch, "seccomp", "landlock")
    victim = open_dir / "precious.txt"
    victim.write_text("keep me")
    os.chmod(victim, 0o666)
    attacks = {
        "remove": f"import os\nos.remove({str(victim)!r})",
        "rmtree": f"import shutil\nshutil.rmtree({str(open_dir)!r})",
        "rename": f"import os\nos.rename({str(victim)!r}, 'stolen.txt')",
        "overwrite": f"open({str(victim)!r}, 'w').write('gone')",
        "shell": f"import subprocess\nsubprocess.run(['rm', '-rf', {str(open_dir)!r}])",
        "os.system": f"import os\nos.system('rm -rf {open_dir}')",
        "ctypes": f"import ctypes\nctypes.CDLL(None).unlink({str(victim).encode()!r})",
    }
    for name, attack in attacks.items():
        result = run_program(attack + f"\nimport os\nassert not os.path.exists({str(victim)!r})\n", FAST)
        assert not result.passed, name
        assert victim.read_text() == "keep me", name
    # inside its own directory it may do as it likes
    mine = run_program("import os, shutil\nos.mkdir('d')\nopen('d/f', 'w').write('x')\nshutil.rmtree('d')\n", FAST)
    assert mine.passed, mine.error


def test_memory_hog_gets_memory_error_not_the_machine():
    # the default 10 s wall limit, not FAST's 1.5 s: a loaded CI runner once took longer than 1.5 s to start the
    # sandboxed interpreter (status "timeout"); RLIMIT_AS answers within the first allocations either way
    limits = SandboxLimits()
    at_once = run_program("x = bytearray(8 << 30)\n", limits)
    assert at_once.status == "failed" and "MemoryError" in at_once.error
    gradual = run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n", limits)
    assert gradual.status == "failed" and "MemoryError" in gradual.error


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        result = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", FAST)
        assert not result.passed and "sandbox: socket" in result.error
        with pytest.raises(TimeoutError):  # nothing ever connected
            server.accept()
    finally:
        server.close()


@ROOT_ONLY
def test_network_namespace_without_the_audit_hook(monkeypatch):
    """The network namespace alone: with the audit hook removed from the bootstrap and no system-call
    filter (which refuses the socket itself), the loopback of the program's network namespace is down, so
    it still cannot reach a server of ours."""
    if "netns" not in isolation_level()[0].split("+"):
        pytest.skip("this machine refuses network namespaces")
    without_hook(monkeypatch)
    without_seccomp(monkeypatch)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        result = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", FAST)
        assert not result.passed and "sandbox:" not in result.error
        assert "Network is unreachable" in result.error or "refused" in result.error, result.error
    finally:
        server.close()


def test_output_flood_is_cut_by_the_file_size_limit():
    t0 = time.perf_counter()
    result = run_program("while True:\n    print('x' * 100000)\n", FAST)
    assert result.status == "failed" and ("File too large" in result.error or "size limit" in result.error)
    assert time.perf_counter() - t0 < FAST.timeout_s + 3


def test_signalling_its_parent_is_refused():
    result = run_program("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", FAST)
    assert not result.passed and "sandbox: os.kill" in result.error


def test_its_working_directory_is_thrown_away(tmp_path, monkeypatch):
    """Also where the work directory's path crosses a 0700 directory (pytest's tmp_path) the sandbox uid
    cannot pass: the layers (probed before, in /tmp) are set up from the directory it starts in."""
    isolation_level()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    result = run_program("open('left.txt', 'w').write('x')\n", FAST)
    assert result.passed, result.error
    assert not list(tmp_path.iterdir())
