"""The tests' CLI runners: `run_cli` (in this process, through the CLI's main, parsing its --json line strictly)
and `run_cli_process` (a child `python -m entrenar`, or torchrun for several processes), with `child_env` (this
checkout's src and root on PYTHONPATH, so a child imports entrenar and tests.helpers as this process does) and
`run_torchrun` (one relaunch after a C++ abort at start-up)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
PROCESS_TIMEOUT = 240  # seconds for one CLI child; a hang (a rank waiting on a dead peer) fails instead of blocking CI


def _no_constants(name: str) -> float:
    raise AssertionError(f"non-strict JSON constant {name} in --json output")


def strict_loads(line: str) -> dict:
    """json.loads that rejects NaN / Infinity (what JavaScript, jq and Go parsers do)."""
    return json.loads(line, parse_constant=_no_constants)


class CliRun(tuple):
    """(exit code, the last stdout line as JSON when it is one else None, stderr); `.out`: all of stdout."""

    out: str

    def __new__(cls, code: int, result: dict | None, err: str, out: str) -> Self:
        run = super().__new__(cls, (code, result, err))
        run.out = out
        return run


def run_cli(argv: list[str], capsys=None, *, capture: bool = False) -> Self:
    """`entrenar ARGV` in this process. With pytest's `capsys` (or capture=True, which redirects stdout here)
    the output is read and its last line parsed as strict JSON (the contract: no NaN/Infinity constants);
    without either the output stays where it goes and the result is None."""
    from entrenar import cli

    if capsys is None and capture:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = cli.main(argv)
        out, err = buf.getvalue(), ""
    else:
        code = cli.main(argv)
        out, err = capsys.readouterr() if capsys is not None else ("", "")
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    result = strict_loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    return CliRun(code, result, err, out)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with this checkout's src and root first on PYTHONPATH (a child imports
    entrenar and tests.helpers as this process does), and `extra`."""
    path = os.pathsep.join([SRC, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli_process(argv: list[str], nproc: int = 1, script: str | None = None,
                    timeout: float = PROCESS_TIMEOUT) -> subprocess.CompletedProcess:
    """`python -m entrenar ARGV` (nproc 1) or under torchrun; `script` replaces `-m entrenar` with a
    python file that patches something, then calls the CLI with sys.argv[1:]."""
    target = [script] if script else ["-m", "entrenar"]
    if nproc == 1:
        cmd = [sys.executable, *target, *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), *target, *argv]
    return run_torchrun(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                        env=child_env(OMP_NUM_THREADS="1", ENTRENAR_DIST_TIMEOUT="90"))


LAUNCH_ABORT = "terminate called without an active exception"


def run_torchrun(cmd: list[str], *, check: bool = False, **kwargs):
    """subprocess.run of a torchrun command, launched once more (saying so) when a rank aborted in C++ with
    LAUNCH_ABORT, up to 3 launches: gloo aborting a rank at start-up or teardown on an overloaded 2-core machine
    (seen in 2-worker CI, never alone). Any other failure, and a third abort, is returned as it is."""
    proc = subprocess.run(cmd, check=check, **kwargs)
    for attempt in (2, 3):  # seen twice in a row once (session 7's fresh-clone CI, the toy worker's teardown)
        if proc.returncode == 0 or LAUNCH_ABORT not in (proc.stderr or ""):
            break
        print(f"note: a rank aborted in C++ ({LAUNCH_ABORT}); launch {attempt} of 3", file=sys.stderr)
        proc = subprocess.run(cmd, check=check, **kwargs)
    return proc
