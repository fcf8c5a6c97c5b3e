"""Catch host syncs on the CPU: the ops that, on an accelerator, make the host wait for the device.

``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` and ``if t:`` reach aten as ``_local_scalar_dense``
or ``is_nonzero``; ``torch.equal`` returns a Python bool; ``nonzero``, ``masked_select``, ``unique``
and indexing with a boolean mask have output shapes that depend on the values. On a CPU all of these
are free, which is why they slip in unnoticed; on CUDA each one stalls the launch queue. A
``TorchDispatchMode`` sees every aten call made under it (backward too, which runs in the calling
thread for CPU tensors), so the CPU test suite can forbid them on the hot path. Not seen: ``.tolist()``,
``.numpy()`` and ``.cpu()`` of a CPU tensor, which reach no aten op there (grep for those).

    with HostSyncs() as syncs:      # record
        ...
    assert not syncs.calls, syncs.report()

    with HostSyncs(forbid=True):    # raise at the first one, with the Python stack that made it
        ...
"""
from __future__ import annotations

import traceback

# AFT-full, -local and -conv choose between one matmul and per-row references from the keys' values:
# one host read per call on an accelerator (lintrans/ops/aft.py, _aft_causal), documented in docs/gpu.md
READS_VALUES = {"aft-full", "aft-local", "aft-conv"}

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# ops that copy a value to the host, or whose output shape is a value
SYNC_OPS = {aten._local_scalar_dense, aten.is_nonzero, aten.item, aten.equal, aten.nonzero, aten.masked_select,
            aten._unique2, aten.unique_consecutive, aten.unique_dim}


class HostSyncError(AssertionError):
    pass


def _is_sync(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if packet in SYNC_OPS:
        return True
    if packet in (aten.index, aten.index_put, aten.index_put_) and len(args) > 1:
        # x[mask]: a boolean index becomes nonzero() inside the kernel
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ())
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return (kwargs or {}).get("output_size") is None  # repeats as a tensor: their sum is the shape
    return False


def _where() -> list[str]:
    """The lintrans frames of the current stack, innermost last: "path:line function: source"."""
    return [f"{f.filename.rsplit('lintrans/', 1)[-1]}:{f.lineno} {f.name}: {f.line}"
            for f in traceback.extract_stack() if "/lintrans/" in f.filename and "/tests/" not in f.filename]


class HostSyncs(TorchDispatchMode):
    """Records (``forbid=False``) or raises ``HostSyncError`` at (``forbid=True``) each host sync."""

    def __init__(self, forbid: bool = False):
        super().__init__()
        self.forbid = forbid
        self.calls: list[tuple[str, list[str]]] = []  # (op, lintrans frames)
        self.ops = 0  # every aten call seen: a test can check the mode saw the work at all

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if _is_sync(func, args, kwargs):
            where = _where()
            self.calls.append((str(func), where))
            if self.forbid:
                raise HostSyncError(f"host sync {func} at\n  " + "\n  ".join(where or ["(outside lintrans)"]))
        return func(*args, **(kwargs or {}))

    def report(self) -> str:
        return "\n".join(f"{op}: {' <- '.join(reversed(where[-3:]))}" for op, where in self.calls)


class CopiesToDevice(TorchDispatchMode):
    """Records ops that take a CPU tensor (not a 0-dim scalar) and give a tensor on another device:
    host-to-device copies, which for ordinary (pageable) memory make CUDA wait too. Run the work on
    the meta device: then every such op is a tensor that was made on the CPU and moved over."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" and t.dim() > 0 for t in ins) and any(t.device.type != "cpu" for t in outs):
            self.calls.append((str(func), _where()))
        return out

    def report(self) -> str:
        return "\n".join(f"{op}: {' <- '.join(reversed(where[-3:]))}" for op, where in self.calls)
