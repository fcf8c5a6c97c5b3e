"""The memory an op allocates through torch, counted op by op as it runs (a dispatch mode): how tests
check that sparse attention never builds a T x T matrix, without timing anything or reading the
process's memory, which other tests and the allocator's caching would blur."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree):
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)}


class Allocations(TorchDispatchMode):
    """Within ``with Allocations() as a``: ``a.largest``, the bytes of the largest storage any op
    created, and ``a.total``, the bytes of all of them (views, in-place ops and outputs written into
    their inputs allocate nothing and are not counted)."""

    def __init__(self):
        super().__init__()
        self.largest = self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = _storages((args, kwargs))
        for ptr, nbytes in _storages(out).items():
            if ptr not in known:
                self.largest, self.total = max(self.largest, nbytes), self.total + nbytes
        return out
