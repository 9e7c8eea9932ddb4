"""All-reduce / all-gather bus bandwidth of this node's GPUs through torch + NCCL (torchrun).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N bench/nccl_bandwidth.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    for mib in (64, 1024):
        x = torch.ones(mib * 2**20 // 4, device="cuda")
        out = torch.empty(world * x.numel(), device="cuda")
        for name, fn, factor in (("all_reduce", lambda x=x: dist.all_reduce(x), 2 * (world - 1) / world),
                                 ("all_gather", lambda x=x, out=out: dist.all_gather_into_tensor(out, x), (world - 1))):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 10
            if rank == 0:
                print(f"{name} {mib} MiB x {world} GPUs: {dt * 1e3:.2f} ms, bus {factor * x.numel() * 4 / dt / 1e9:.0f} GB/s",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
