"""DDP is built without torch's `broadcast_buffers` FutureWarning (issue 28 item 9): torch 2.13 deprecated
the argument, and every rank printed the warning at the start of every run. The buffers are still not
synchronised (init_sync=False, no sync in forward): the argument is passed the new way when torch has it.

Seen red before the fix: the FutureWarning in the child's stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def test_apply_ddp_prints_no_broadcast_buffers_warning(tmp_path):
    script = textwrap.dedent(f"""
        import warnings
        import torch, torch.distributed as dist
        warnings.simplefilter("always")  # a warning shown once per process must show here
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        try:
            from entrenar.train import distributed as D, parallel as P
            model = torch.nn.Linear(4, 4)
            model.register_buffer("counter", torch.zeros(1))
            ddp = P.apply_ddp(model, D.DistContext(rank=0, world=1))
            loss = ddp(torch.ones(2, 4)).sum()
            loss.backward()
            print("BUFFERS_SYNCED_IN_FORWARD", getattr(ddp, "forward_sync_buffers", ddp.will_sync_module_buffers()))
        finally:
            dist.destroy_process_group()
    """)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "broadcast_buffers" not in proc.stderr, proc.stderr[-3000:]
    assert "BUFFERS_SYNCED_IN_FORWARD False" in proc.stdout
