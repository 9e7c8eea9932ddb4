"""The CLI turns on transparent huge pages for torch's CPU allocator before torch loads (HOST_ALLOCATOR_ENV):
device-to-host copies into fresh memory, which every end-of-run checkpoint and final/ make, were 2.4x faster
with it on an H200 host (bench/RESULTS.md, session 16)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from entrenar.cli import main
from entrenar.cli.main import HOST_ALLOCATOR_ENV

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_main_sets_the_allocator_variable_and_keeps_the_users(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert main(["no-such-command"]) == 2
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    main(["no-such-command"])
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"  # the user's own setting wins
    assert HOST_ALLOCATOR_ENV == {"THP_MEM_ALLOC_ENABLE": "1"}


def test_the_cli_package_loads_without_torch():
    """torch reads the variable once, when it loads: the CLI must not import it before main sets it."""
    code = "import sys, entrenar.cli; assert 'torch' not in sys.modules, 'entrenar.cli imports torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not THP.exists() or "[madvise]" not in THP.read_text(),
                    reason="transparent huge pages are not in madvise mode here: the allocator's request is "
                           "what decides only under madvise")
@pytest.mark.parametrize("user", [None, "0"])
def test_torch_loaded_after_main_gets_huge_pages(user):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if user is not None:
        env["THP_MEM_ALLOC_ENABLE"] = user
    code = ("from entrenar.cli import main; main(['no-such-command']); import torch\n"
            "t = torch.empty(64 * 2**20, dtype=torch.uint8).fill_(1)\n"
            "print(open('/proc/self/smaps_rollup').read())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    huge_kb = int(re.search(r"AnonHugePages:\s+(\d+)", out).group(1))
    if user == "0":
        assert huge_kb < 16 * 1024
    else:
        assert huge_kb >= 32 * 1024  # most of the 64 MB tensor
