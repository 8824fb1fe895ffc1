"""``zero.Init``'s partition mode (``zero/params/init.py``): what it does with each torch
op on a sealed parameter, by name: metadata runs as is, view-making ops run on the
sealed storage, whole-tensor fills and every other op run on a temporary full tensor
(:class:`PartitionMode` hands those to ``Init.run_on_full``). No communication here
(``Init.run_on_full`` says what it issues).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

METADATA = {
    "shape",
    "dtype",
    "device",
    "size",
    "dim",
    "ndim",
    "ndimension",
    "numel",
    "nelement",
    "stride",
    "storage_offset",
    "is_floating_point",
    "is_complex",
    "requires_grad",
    "requires_grad_",
    "is_leaf",
    "grad",
    "grad_fn",
    "layout",
    "is_sparse",
    "is_cuda",
    "is_meta",
    "names",
    "element_size",
    "data",
    "__len__",
    "untyped_storage",
    "data_ptr",
    "is_contiguous",
    "__hash__",
    "T",
    "mT",
    "H",
    "name",
    "_version",
    "retain_grad",
    "register_hook",
    "register_post_accumulate_grad_hook",
}
VIEWS = {
    "view",
    "view_as",
    "t",
    "transpose",
    "permute",
    "expand",
    "expand_as",
    "narrow",
    "select",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "split",
    "chunk",
    "unbind",
    "detach",
    "unflatten",
    "movedim",
}
FILLS = {
    "normal_",
    "uniform_",
    "zero_",
    "fill_",
    "random_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "cauchy_",
    "bernoulli_",
}


def storage_key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (shared by a sealed parameter and its aliases)."""
    return t.untyped_storage()._cdata


def op_name(func) -> str:
    """The op's name; for a property getter, the property's (``Tensor.shape.__get__``)."""
    owner = getattr(func, "__self__", None)
    if type(func).__name__ == "method-wrapper" and owner is not None:
        return getattr(owner, "__name__", "")
    return getattr(func, "__name__", "")


def _basic_index(name: str, args) -> bool:
    """``t[i]`` / ``t[a:b]`` make views; advanced indexing reads data."""
    if name != "__getitem__":
        return False
    idx = args[1] if len(args) > 1 else None
    items = idx if isinstance(idx, tuple) else (idx,)
    return all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in items)


class SealedEntry(Protocol):
    numel: int  # the whole parameter's elements
    shard: torch.Tensor  # this rank's slice


class SealedTable(Protocol):
    """What the mode asks of ``zero.Init`` (``init.Init``)."""

    def hidden(self, t: torch.Tensor) -> SealedEntry | None: ...

    def entry(self, t: torch.Tensor) -> SealedEntry: ...

    def run_on_full(self, func, name: str, args, kwargs) -> Any: ...


class PartitionMode(TorchFunctionMode):
    """Sees every torch call while ``zero.Init`` is active; routes those touching a
    sealed parameter (see the module docstring)."""

    def __init__(self, init: SealedTable):
        super().__init__()
        self.init = init

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        sealed = [t for t in flat if torch.is_tensor(t) and self.init.hidden(t) is not None]
        name = op_name(func)
        if not sealed or name in METADATA:
            with torch._C.DisableTorchFunctionSubclass():  # the guard is for outside Init
                return func(*args, **kwargs)
        if name in VIEWS or _basic_index(name, args):
            # Views of a sealed parameter stay sealed (same storage). Making one checks
            # the storage is large enough, so give it its size back for that moment: an
            # allocation nobody writes to, so no memory is touched.
            storages = {storage_key(t): t.untyped_storage() for t in sealed}
            entries = [self.init.entry(t) for t in sealed]
            for st, e in zip(storages.values(), entries, strict=False):
                st.resize_(e.numel * e.shard.element_size())
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            finally:
                for st in storages.values():
                    st.resize_(0)
        return self.init.run_on_full(func, name, args, kwargs)
