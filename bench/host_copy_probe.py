"""How fast device tensors reach host memory on this machine: the end-of-run save's first step.

Issue 36 item 5: the 7B end of run spent 38 s staging 23 GB per rank and 49 s gathering 30 GB to rank 0,
~0.6 GB/s a process, far below PCIe. This times, for one N GiB device tensor: a copy into fresh pageable
memory (`.cpu()`), the same again, into pageable memory already touched, fresh pinned memory (allocation
and copy apart), and first-touching fresh memory without a copy. Run it once plain and once with
THP_MEM_ALLOC_ENABLE=1 (torch's CPU allocator then asks for transparent huge pages: 512x fewer page
faults, which a virtual machine pays dearly for); the variable is read when torch loads, hence the
subprocess per setting.

    python bench/host_copy_probe.py --gib 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _timed(fn) -> tuple[float, object]:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def probe(gib: float) -> dict[str, float]:
    """GB/s of each way to host memory for one `gib` GiB device tensor (this process's setting)."""
    import torch

    n = int(gib * 2**30)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(7)
    gb = n / 1e9
    out: dict[str, float] = {}
    s, first = _timed(dev.cpu)
    out["fresh pageable .cpu()"] = gb / s
    del first
    s, again = _timed(dev.cpu)
    out["fresh pageable .cpu(), again"] = gb / s
    s, _ = _timed(lambda t=again: t.copy_(dev))
    out["touched pageable copy_"] = gb / s
    del again
    s, touched = _timed(lambda: torch.empty(n, dtype=torch.uint8).fill_(1))
    out["fresh pageable first touch (fill, no copy)"] = gb / s
    del touched
    s, pinned = _timed(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    out["pinned allocation"] = gb / s
    s, _ = _timed(lambda t=pinned: t.copy_(dev))
    out["pinned copy_"] = gb / s
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--one", action="store_true", help="measure in this process (the parent runs both settings)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(probe(args.gib)))
        return
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print("transparent_hugepage:", thp.read_text().strip() if thp.exists() else "(absent)")
    for setting in ("0", "1"):
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": setting}
        done = subprocess.run([sys.executable, __file__, "--gib", str(args.gib), "--one"], env=env,
                              capture_output=True, text=True, check=False)
        print(f"THP_MEM_ALLOC_ENABLE={setting}:", done.stdout.strip() or done.stderr[-2000:])


if __name__ == "__main__":
    main()
