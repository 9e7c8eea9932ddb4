"""A CPU stand-in for torch.cuda.CUDAGraph with its semantics (used by the static decoder's and the training
step's graph tests): the captured function's aten ops are recorded once (not executed: every tensor they
write is put back), then each replay re-runs exactly those ops on the recorded tensors, so any Python value
read at capture stays frozen, as in a real graph; a host read (.item(), bool(t)), an op with a
data-dependent output shape or a random draw inside the capture fails it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_SYNC = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
             torch.ops.aten.is_nonzero.default}


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors `func` writes in place (its mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.before: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its value before the capture)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNC:
            raise RuntimeError(f"host sync inside the captured step: {func}")
        if torch.Tag.dynamic_output_shape in func.tags:
            raise RuntimeError(f"data-dependent output shape inside the captured step: {func}")
        # a graph would freeze the generator's offset (attention is tagged for its dropout, 0 here)
        if torch.Tag.nondeterministic_seeded in func.tags and "scaled_dot_product" not in func.name():
            raise RuntimeError(f"random draw inside the captured step: {func}")
        written = _written(func, args, kwargs)
        self.before += [(t, t.clone()) for t in written]
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out, bool(written)))
        return out


class ReplayedStep:
    """torch.cuda.CUDAGraph's contract on the CPU: capture records the ops and leaves memory as it was;
    replay() re-runs the recorded ops on the recorded tensors and returns the recorded output."""

    captures = 0

    def __init__(self, fn, pool=None):
        rec = _Recorder()
        with rec:
            self.out = fn()
        with torch.no_grad():
            for t, value in reversed(rec.before):  # a capture executes nothing
                t.copy_(value)
        self.ops = rec.ops
        ReplayedStep.captures += 1

    def pool(self) -> None:
        return None  # a CUDA graph's memory pool: nothing to share on the CPU

    def reset(self) -> None:
        self.ops = None  # a replay after it fails, as on a freed graph

    def replay(self) -> torch.Tensor:
        with torch.no_grad():  # a graph replays kernels; no autograd records anything
            self._run()
        return self.out

    def _run(self) -> None:
        for func, args, kwargs, out, in_place in self.ops:
            new = func(*args, **kwargs)
            for x in tree_flatten(new)[0]:
                if isinstance(x, torch.ScriptObject):  # a collective's Work (c10d runs them asynchronously):
                    x.wait()  # what a replayed NCCL kernel's stream order gives
            if in_place:
                continue  # wrote its recorded arguments
            # into the recorded output (a view onto the same memory is copied onto itself: harmless)
            for dst, src in zip(tree_flatten(out)[0], tree_flatten(new)[0]):
                if isinstance(dst, torch.Tensor) and dst is not src:
                    dst.copy_(src)
