"""The sandbox's kernel boundary that holds without the audit hook (a system-call filter, seccomp) and the
bootstrap's settings out of the program's reach: hostile programs that switch the audit hook off through
every route to its settings they find, then start a shell, fork and exec, connect to a Unix socket of the
host, ptrace, read their own memory through process_vm_readv or signal their parent. As root (CI) with every
layer, with the kernel's alone (no audit hook), and through the not-root fallback."""

from __future__ import annotations

import dis
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from entrenar.evaluate import sandbox, seccomp
from entrenar.evaluate.sandbox import SandboxLimits, run_program
from tests.helpers.sandbox import without_hook, without_seccomp

FAST = SandboxLimits(timeout_s=5)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the uid layer needs root (CI and these machines run as root)")
DENIED = "Operation not permitted"  # EPERM: the filter's answer

# Switches the audit hook off wherever its settings can be reached: the bootstrap's module as
# sys.modules["__main__"] (its globals held the hook's settings: _NET, _SPAWN, _inside ...), the globals and
# locals of every frame under the program's, the frames of the traceback of an event the hook refuses (the
# hook's own frame among them), closures of functions found there, and gc's walk of every object.
DISARM = '''
import gc, sys

def _open_up(space):
    if isinstance(space, dict) and ("_hook" in space or "_NET" in space or "_inside" in space):
        space.update(_NET=(), _SPAWN=(), _WALKS=(), _KILL=(), _GUARDED=(), _PATHS=(), _inside=lambda p: True)

def _open_cells(value):
    code = getattr(value, "__code__", None)
    if code is None or not any(word in code.co_name for word in ("hook", "inside")):
        return
    for cell in value.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:
            continue
        if isinstance(held, tuple) and held and all(isinstance(v, str) for v in held):
            cell.cell_contents = ()
        elif isinstance(held, str) and held.startswith("/"):
            cell.cell_contents = "/"

def _frame_route(frame):
    while frame is not None:
        for space in (frame.f_globals, frame.f_locals):
            _open_up(space)
            for value in list(space.values()):
                _open_cells(value)
        frame = frame.f_back

_open_up(vars(sys.modules["__main__"]))
try:
    _frame_route(sys._getframe())
except Exception:
    pass
try:
    import socket
    socket.socket().close()
except Exception as refusal:
    tb = refusal.__traceback__
    while tb is not None:
        try:
            _frame_route(tb.tb_frame)
        except Exception:
            pass
        tb = tb.tb_next
try:
    for obj in gc.get_objects():
        _open_up(obj)
        _open_cells(obj)
except Exception:
    pass
'''


def _without_root(monkeypatch) -> None:
    """The not-root fallback (the root check patched; as root here the program then runs as root)."""
    monkeypatch.setattr(sandbox, "_LEVEL", None)
    monkeypatch.setattr(sandbox, "_is_root", lambda: False)


def _layers(monkeypatch, layers: str) -> str:
    """Set up `layers` ("all", "kernel-only": no audit hook, "not-root"); the level programs then run under."""
    if layers == "not-root":
        _without_root(monkeypatch)
    elif layers == "kernel-only":
        without_hook(monkeypatch)
    if layers != "not-root" and os.geteuid() != 0:
        pytest.skip("as root only")
    return _with_filter()


def _with_filter() -> str:
    """This process's level, which names the filter wherever the filter knows the architecture: a filter
    that does not hold (the probe's fork went through) fails here, not skips."""
    level = sandbox.isolation_level()[0]
    if seccomp.machine() is None:
        pytest.skip("no system-call filter for this architecture")
    assert "seccomp" in level.split("+"), level
    return level


# ---- the bootstrap's settings are out of the program's reach -----------------------------------------
@pytest.mark.parametrize("root", ["as-is", "not-root"])
def test_the_audit_hook_survives_every_route_to_its_settings(monkeypatch, root):
    """After DISARM, the hook still refuses a socket: its settings were in the bootstrap's globals, reachable
    as sys.modules["__main__"] (an emptied _NET let a socket through)."""
    if root == "not-root":
        _without_root(monkeypatch)
    result = run_program(DISARM + "import socket\nsocket.socket(socket.AF_UNIX).close()\n", FAST)
    assert result.status == "failed", result
    assert "sandbox: socket.__new__ is not allowed" in result.error, result.error


def test_the_program_runs_in_a_module_of_its_own():
    """sys.modules["__main__"] is the program's module (its globals), with none of the bootstrap's names;
    the bootstrap's own globals (reachable as a guard's __globals__) hold none of its functions either."""
    look = ("import os, sys\n"
            "own = lambda space: [n for n in space if n.startswith('_') and not n.startswith('__')]\n"
            "main = sys.modules['__main__']\n"
            "assert vars(main) is globals(), sorted(vars(main))\n"
            "assert not own(vars(main)), sorted(vars(main))\n"
            "assert os.mkfifo.__globals__ is not globals()\n"
            "assert not own(os.mkfifo.__globals__), own(os.mkfifo.__globals__)\n")
    result = run_program(look, FAST)
    assert result.passed, result.error


def test_the_hook_looks_up_no_global_or_builtin_name():
    """What the hook calls is bound in its closure when it is made: a program that rebinds a builtin
    (isinstance, PermissionError) or a name of the bootstrap's globals does not change what it refuses."""
    module = compile(sandbox.BOOTSTRAP, "<bootstrap>", "exec")
    make_hook = next(c for c in module.co_consts if getattr(c, "co_name", "") == "_make_hook")
    hook = next(c for c in make_hook.co_consts if getattr(c, "co_name", "") == "hook")
    lookups = [i.argval for i in dis.get_instructions(hook) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    assert lookups == [], lookups
    assert not [c for c in hook.co_consts if hasattr(c, "co_code")], "no nested function (its closure is reachable)"


# ---- a kernel boundary without the hook ----------------------------------------------------------------
@pytest.fixture()
def host_socket():
    """A Unix socket of the host anyone may connect to (0777, in a 0777 directory under /tmp, outside the
    program's work directory), listening, not blocking."""
    d = Path(tempfile.mkdtemp(prefix="entrenar-victim-", dir="/tmp"))
    os.chmod(d, 0o777)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = d / "host.sock"
    server.bind(str(path))
    os.chmod(path, 0o777)
    server.listen(4)
    server.setblocking(False)
    yield path, server
    server.close()
    shutil.rmtree(d, ignore_errors=True)


def _connections(server: socket.socket) -> int:
    seen = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return seen
        conn.close()
        seen += 1


def _unix_connect(path: Path) -> str:
    return (f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(path)!r})\n"
            "s.sendall(b'hello')\ns.close()\n")


@pytest.mark.parametrize("layers", ["all", "kernel-only", "not-root"])
def test_a_unix_socket_of_the_host_is_out_of_reach(monkeypatch, host_socket, layers):
    """DISARM, then connect to the host's socket: refused, and the host side sees no connection. Without
    the hook it is the filter that refuses (EPERM): the network namespace does not cover path sockets."""
    path, server = host_socket
    _layers(monkeypatch, layers)
    result = run_program(DISARM + _unix_connect(path), FAST)
    assert result.status == "failed", result
    assert _connections(server) == 0
    if layers == "kernel-only":
        assert DENIED in result.error, result.error


@ROOT_ONLY
def test_without_the_filter_the_host_socket_is_reachable(monkeypatch, host_socket):
    """The control: uid, network and mount namespaces but no filter and no hook, the same program
    connects (the layer the filter adds is the one that holds)."""
    path, server = host_socket
    without_hook(monkeypatch)
    if "netns" not in without_seccomp(monkeypatch):
        pytest.skip("this machine refuses network namespaces")
    result = run_program(_unix_connect(path), FAST)
    assert result.passed, result.error
    assert _connections(server) == 1


SPAWN = {
    "os.system": "import os\nos.system('echo x > marker')\n",
    "fork-execv": ("import os\npid = os.fork()\n"
                   "if pid == 0:\n    os.execv('/bin/sh', ['sh', '-c', 'echo x > marker'])\n"
                   "os.waitpid(pid, 0)\n"),
    "execv": "import os\nos.execv('/bin/sh', ['sh', '-c', 'echo x > marker'])\n",
}
SHELL_RAN = "\nassert open('marker').read() == 'x\\n', 'no shell ran'\n"


@pytest.mark.parametrize("layers", ["all", "kernel-only", "not-root"])
@pytest.mark.parametrize("case", sorted(SPAWN))
def test_no_program_or_process_starts(monkeypatch, case, layers):
    """DISARM, then start a shell (os.system, fork + execv, execv) that writes a marker in the work
    directory, where the program looks for it: refused at every level, by the filter without the hook."""
    _layers(monkeypatch, layers)
    result = run_program(DISARM + SPAWN[case] + SHELL_RAN, FAST)
    assert result.status == "failed", (case, result)
    if layers == "kernel-only" and case != "os.system":  # system() reports a failed fork as status -1
        assert DENIED in result.error, (case, result.error)


@ROOT_ONLY
@pytest.mark.parametrize("case", sorted(SPAWN))
def test_without_the_filter_a_shell_starts(monkeypatch, case):
    """The control: without filter and hook each program starts its shell (execv's shell writes the marker
    and exits 0 without the token, so that one shows as an exit before the end)."""
    without_hook(monkeypatch)
    without_seccomp(monkeypatch)
    result = run_program(SPAWN[case] + SHELL_RAN, FAST)
    if case == "execv":
        assert result.status == "failed" and "before the program's end" in result.error, result
    else:
        assert result.passed, (case, result.error)


# through ctypes (the audit hook, which refuses ctypes, is out): each call succeeds without the filter
LIBC_CALLS = {
    "ptrace": "rc = libc.ptrace(0, 0, None, None)\n",  # PTRACE_TRACEME
    "process_vm_readv": ("class Iov(ctypes.Structure):\n"
                         "    _fields_ = [('base', ctypes.c_void_p), ('len', ctypes.c_size_t)]\n"
                         "src, dst = ctypes.create_string_buffer(b'secret', 8), ctypes.create_string_buffer(8)\n"
                         "a, b = Iov(ctypes.addressof(src), 8), Iov(ctypes.addressof(dst), 8)\n"
                         "rc = libc.process_vm_readv(os.getpid(), ctypes.byref(b), 1, ctypes.byref(a), 1, 0)\n"),
    "socket": "rc = libc.socket(1, 1, 0)\n",  # AF_UNIX, SOCK_STREAM, straight from the C library
    "socketpair": "fds = (ctypes.c_int * 2)()\nrc = libc.socketpair(1, 1, 0, fds)\n",
    "kill-parent": "rc = libc.kill(os.getppid(), 0)\n",
    # reading the parent's open-file limit (with a new value, setting it: a harness left without files)
    "prlimit-parent": "old = (ctypes.c_ulong * 2)()\nrc = libc.prlimit(os.getppid(), 7, None, old)\n",
    "unshare": "rc = libc.unshare(0x10000000)\n",  # CLONE_NEWUSER
}
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
LIBC_CHECK = "assert rc >= 0, f'refused errno {ctypes.get_errno()}'\n"


@pytest.mark.parametrize("case", sorted(LIBC_CALLS))
def test_process_calls_are_refused_by_the_kernel(monkeypatch, case):
    """Without the audit hook (ctypes allowed) each call is refused with EPERM by the filter, through
    the not-root fallback (the program runs as this process's user, so its parent is a process it could
    signal or trace); the same program without the filter succeeds."""
    _without_root(monkeypatch)
    without_hook(monkeypatch)
    _layers(monkeypatch, "not-root")
    program = LIBC + LIBC_CALLS[case] + LIBC_CHECK
    result = run_program(program, FAST)
    assert result.status == "failed" and "refused errno 1" in result.error, (case, result)
    without_seccomp(monkeypatch)
    control = run_program(program, FAST)
    assert control.passed, (case, control.error)


def test_threads_run_and_own_signals_arrive_under_the_filter():
    """What a task program may need stays: threads (clone with CLONE_THREAD; clone3 answers ENOSYS and
    the C library falls back) and signals to itself."""
    program = ("import os, signal, threading\n"
               "out = []\nt = threading.Thread(target=lambda: out.append(1))\nt.start()\nt.join()\n"
               "got = []\nsignal.signal(signal.SIGUSR1, lambda *a: got.append(1))\n"
               "os.kill(os.getpid(), signal.SIGUSR1)\nsignal.raise_signal(signal.SIGUSR1)\n"
               "assert out == [1] and got == [1, 1], (out, got)\n")
    result = run_program(program, FAST)
    _with_filter()
    assert "seccomp" in result.isolation.split("+"), result.isolation
    assert result.passed, result.error


def test_a_filter_that_does_not_install_stops_the_run(monkeypatch):
    """When the level says seccomp and the filter cannot be installed, the program never runs: failed,
    with the reason (a program that would pass otherwise)."""
    _with_filter()
    monkeypatch.setattr(seccomp, "build_filter", lambda pid: b"\x06\x00\x00\x00\x00\x00\xff\x7f" * 5000)
    result = run_program("pass\n", FAST)
    assert result.status == "failed" and "system-call filter could not be installed" in result.error, result


def test_the_isolation_names_the_filter(monkeypatch):
    """Probed like the other layers and named: as root after the namespaces, not root after rlimits (then
    Landlock where the kernel has it)."""
    if seccomp.machine() is None:
        pytest.skip("no filter for this architecture")
    landlock = "+landlock" if sandbox.landlock_abi() else ""
    level = sandbox.isolation_level()[0]
    assert level.endswith("+seccomp" + landlock), level
    _without_root(monkeypatch)
    assert sandbox.isolation_level()[0] == "rlimits+seccomp" + landlock


HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "aarch64": "/usr/include/asm-generic/unistd.h"}


@pytest.mark.parametrize("arch", sorted(HEADERS))
def test_the_system_call_numbers_are_the_kernels(arch):
    """Each number of the filter's table is the kernel headers' for that architecture (where installed)."""
    header = Path(HEADERS[arch])
    if not header.exists():
        pytest.skip(f"{header} not installed")
    defined = {m.group(1): int(m.group(2))
               for m in re.finditer(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", header.read_text())}
    column = 0 if arch == "x86_64" else 1
    table = {name: nrs[column] for name, nrs in seccomp.SYSCALLS.items() if nrs[column] is not None}
    assert {name: defined.get(name) for name in table} == table
    assert all(name in seccomp.SYSCALLS for name in (*seccomp.DENIED, *seccomp.OWN_PID))
