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


def _bounced(dev, chunk: int = 256 * 2**20):
    """Device -> two pinned chunks (alternating, on a side stream) -> the fresh pageable destination."""
    import torch

    out = torch.empty(dev.numel(), dtype=dev.dtype)
    bounce = [torch.empty(chunk, dtype=dev.dtype, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event(), torch.cuda.Event()]
    stream = torch.cuda.Stream()
    starts = list(range(0, dev.numel(), chunk))
    for i, a in enumerate(starts + [None]):
        if a is not None:
            b = min(a + chunk, dev.numel())
            with torch.cuda.stream(stream):
                bounce[i % 2][: b - a].copy_(dev[a:b], non_blocking=True)
                done[i % 2].record(stream)
        if i:  # the previous chunk: wait for it, then copy it out on the CPU while the next one flies
            p = starts[i - 1]
            q = min(p + chunk, dev.numel())
            done[(i - 1) % 2].synchronize()
            out[p:q].copy_(bounce[(i - 1) % 2][: q - p])
    return out


def _threads(dev, k: int):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(k) as pool:
        return list(pool.map(lambda t: t.cpu(), dev.chunk(k)))


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
    s, _ = _timed(lambda: torch.empty(n, dtype=torch.uint8).zero_().copy_(dev))
    out["fresh pageable, zero_() then copy_"] = gb / s
    s, _ = _timed(lambda: _bounced(dev))
    out["fresh pageable via a 2 x 256 MiB pinned bounce"] = gb / s
    s, _ = _timed(lambda: _threads(dev, 4))
    out["fresh pageable .cpu() of 4 slices on 4 threads"] = gb / s
    s, pinned = _timed(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    out["pinned allocation"] = gb / s
    s, _ = _timed(lambda t=pinned: t.copy_(dev))
    out["pinned copy_"] = gb / s
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
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
