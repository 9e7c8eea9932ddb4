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


def without_layers(monkeypatch, *names: str) -> str:
    """This process's level without the layers `names` (of those it probed): what the others hold alone.
    Returns that level."""
    level, python = sandbox.isolation_level()
    bare = "+".join(layer for layer in level.split("+") if layer not in names)
    monkeypatch.setattr(sandbox, "_LEVEL", (bare, python))
    return bare


def without_seccomp(monkeypatch) -> str:
    """Without the system-call filter: what the uid, namespaces, Landlock and rlimits hold alone."""
    return without_layers(monkeypatch, "seccomp")
