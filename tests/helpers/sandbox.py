"""Ways to take one layer out of the sandbox, so a test shows what the other layers hold alone."""

from __future__ import annotations

from entrenar.evaluate import sandbox

# the bootstrap's lines that install the second line (the audit hook and what replaces unaudited calls)
HOOK_LINES = ("    _guard_unaudited(root)\n", "    sys.addaudithook(_make_hook(root))\n")
FILTER_LINE = "    _install_filter(program_filter)\n"


def without_hook(monkeypatch) -> None:
    """The kernel layers alone: the bootstrap installs neither the audit hook nor its guards."""
    for line in HOOK_LINES:
        assert sandbox.BOOTSTRAP.count("\n" + line) == 1, line
        monkeypatch.setattr(sandbox, "BOOTSTRAP", sandbox.BOOTSTRAP.replace("\n" + line, "\n"))


def without_seccomp(monkeypatch) -> str:
    """This process's level without the system-call filter (the layers it probed, less seccomp): what
    the uid, namespaces and rlimits hold alone. Returns that level."""
    level, python = sandbox.isolation_level()
    bare = "+".join(layer for layer in level.split("+") if layer != "seccomp")
    monkeypatch.setattr(sandbox, "_LEVEL", (bare, python))
    return bare
