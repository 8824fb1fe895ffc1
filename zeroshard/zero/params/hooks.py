"""The released-parameter guard of stage 3 and ``zero.Init``. No communication here.

* :func:`guard`: gives a parameter a subclass whose ``__torch_function__`` refuses ops
  on it while it is released (only this rank's shard held), naming the parameter and
  ``GatheredParameters``, instead of computing on an empty placeholder, but for the
  reads :data:`RELEASED_READS` lists (metadata answered for the whole parameter, autograd
  state and hooks, plumbing; ``.data`` is an alias refusing values the same way); it
  also notes reads of ``.data`` of a gathered one (``zero/params/edits.py``). A parameter
  built under ``zero.Init`` (full shape, storage freed until gathered) is guarded the
  same way from the end of the ``Init`` block until ``initialize``: metadata and aliases
  (``p.data``, ``detach()``, views: :class:`SealedView`, which checks again on use) are
  fine, and so are moves to where it already is (``module.to(its device)``, ``.float()``
  of fp32); anything reading its values raises instead of reading freed memory.
"""

from __future__ import annotations

import torch

from zeroshard import ZeroshardError
from zeroshard.zero.params.edits import watch


class PartitionedParameterError(ZeroshardError, RuntimeError):
    """A stage-3 parameter used while only this rank's shard of it is held."""


# What a released stage-3 parameter answers outside forward (README: "Parameters
# touched outside forward"); the one list. Every other op refuses, naming the parameter
# and GatheredParameters: anything that reads or writes its values.
#: the whole parameter's shape (not the empty placeholder's): answered from it
WHOLE_METADATA = frozenset(
    {
        "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "nbytes",
        "stride", "is_contiguous", "__len__",
    }
)  # fmt: skip
#: what every tensor of its dtype, layout and device answers
KIND_METADATA = frozenset(
    {
        "dtype", "device", "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse",
        "is_quantized", "is_nested", "is_floating_point", "is_complex", "element_size",
        "itemsize",
    }
)  # fmt: skip
#: autograd state and hooks (reading ``.grad``, assigning it, registering hooks)
AUTOGRAD_STATE = frozenset(
    {
        "requires_grad", "requires_grad_", "is_leaf", "grad", "_grad", "grad_fn",
        "_grad_fn", "retains_grad", "retain_grad", "output_nr", "_base", "_version",
        "register_hook", "register_post_accumulate_grad_hook", "_backward_hooks",
        "_post_accumulate_grad_hooks",
    }
)  # fmt: skip
#: identity and plumbing that read no value: hashing, printing (a line naming it as
#: partitioned), the storage handle (empty), and ``.data``: an alias that refuses its
#: values the same way (assigning ``.data`` refuses: the next gather would undo it)
PLUMBING = frozenset(
    {"__hash__", "__repr__", "__format__", "__setstate__", "_cdata", "data_ptr",
     "untyped_storage", "storage_offset", "data"}
)  # fmt: skip
RELEASED_READS = WHOLE_METADATA | KIND_METADATA | AUTOGRAD_STATE | PLUMBING


def _op_name(func) -> str:
    """The op's name; for a property access, the property's (``Tensor.shape.__get__``
    is "shape"); setters are "__set__" (assigning ``.data`` / ``.grad`` is always fine)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


# what may touch a zero.Init parameter outside a gather (its storage is freed, its
# shape whole): the same reads, and the aliases _alias makes
_SEALED_METADATA = WHOLE_METADATA | KIND_METADATA | AUTOGRAD_STATE | {
    "names", "__hash__", "_cdata", "untyped_storage", "data_ptr", "storage_offset", "T",
    "_has_compatible_shallow_copy_type",
}  # fmt: skip
# ops that make an alias and read no data: allowed on a sealed parameter (e.g.
# ``state_dict()`` detaches every parameter); their result stays guarded
_VIEWS = frozenset(
    {
        "data", "detach", "view", "view_as", "reshape", "reshape_as", "t", "transpose",
        "permute", "expand", "expand_as", "narrow", "select", "unsqueeze", "squeeze",
        "flatten", "unflatten", "split", "chunk", "unbind", "__getitem__", "as_strided",
        "movedim", "mT", "T",
    }
)  # fmt: skip


def _released_error(name: str, op: str, encoded: str | None = None) -> PartitionedParameterError:
    if encoded:  # gathered in another form for its module (zero/params/codec.py)
        return PartitionedParameterError(
            f"parameter {name!r} is partitioned across ranks (ZeRO stage 3) and gathered "
            f"only {encoded} for its module's forward and backward, never as values, so "
            f"{op} cannot use it; read or change it inside `with zeroshard.zero."
            "GatheredParameters(params, modifier_rank=...)` outside the model's forward "
            "and backward"
        )
    return PartitionedParameterError(
        f"parameter {name!r} is partitioned across ranks (ZeRO stage 3) and only this "
        f"rank's shard is held here, so {op} cannot use it; read or change it inside "
        "`with zeroshard.zero.GatheredParameters(params, modifier_rank=...)` (changes "
        "persist with modifier_rank) or inside its module's forward"
    )


def _sealed_error(name: str, op: str) -> PartitionedParameterError:
    return PartitionedParameterError(
        f"parameter {name!r} was built under zeroshard.zero.Init: until "
        "zeroshard.initialize takes the model over, this rank holds only its slice of it, "
        f"so {op} cannot read it; use it inside `with zeroshard.zero.GatheredParameters("
        "params, modifier_rank=0)` (what that rank writes there reaches every rank's "
        "slice; modifier_rank=None: read only), or after initialize"
    )


def hollow(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is smaller than its shape needs (reading it would read
    freed memory): a zero.Init parameter outside a gather, or an alias of one."""
    with torch._C.DisableTorchFunctionSubclass():
        if t.numel() == 0:
            return False
        steps = zip(t.shape, t.stride(), strict=True)
        span = t.storage_offset() + sum((n - 1) * s for n, s in steps)
        return t.untyped_storage().nbytes() < (span + 1) * t.element_size()


_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}  # fmt: skip


def _stays(t: torch.Tensor, name: str, args, kwargs) -> bool:
    """Whether ``t.to(*args, **kwargs)`` (or ``t.float()``, ``t.cpu()``, ...: ``name``)
    would return ``t`` itself, moving and reading nothing."""
    if name in _CASTS:
        return not args and _CASTS[name] == t.dtype
    if name == "cpu":
        return not args and t.device.type == "cpu"
    if name != "to" or kwargs.get("copy"):
        return False
    try:
        kw = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kw)
    except (TypeError, RuntimeError):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        same_device = device is None or torch.device(device) == t.device
        if device is not None and torch.device(device).index is None:
            same_device = torch.device(device).type == t.device.type
        same_dtype = dtype is None or dtype == t.dtype
    return same_device and same_dtype and memory_format in (None, torch.preserve_format)


def _alias(func, args, kwargs, base: torch.Tensor, name: str):
    """Run a view-making op on a sealed tensor: making most views checks the storage is
    large enough, so give it its size for that moment (an allocation nobody writes to)."""
    with torch._C.DisableTorchFunctionSubclass():
        storage = base.untyped_storage()
        was = storage.nbytes()
        full = (base.storage_offset() + base.numel()) * base.element_size()
        if was < full:
            storage.resize_(int(full))
        try:
            out = func(*args, **kwargs)
        finally:
            if was < full:
                storage.resize_(was)
    return _sealed_views(out, name)


class SealedView(torch.Tensor):
    """An alias of a zero.Init parameter (``p.data``, ``p.detach()``, a view): refuses
    ops that read it while its storage is freed (outside ``GatheredParameters``)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        mine = [a for a in (*args, *kwargs.values()) if isinstance(a, SealedView)]
        freed = [a for a in mine if hollow(a)]
        if freed and name not in _SEALED_METADATA and name not in _VIEWS:
            raise _sealed_error(freed[0].__dict__.get("_zs_name", "?"), name or func)
        if name in _VIEWS and mine:
            return _alias(func, args, kwargs, mine[0], mine[0].__dict__.get("_zs_name", "?"))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _sealed_views(out, name: str):
    if isinstance(out, (tuple, list)):
        return type(out)(_sealed_views(o, name) for o in out)
    if torch.is_tensor(out) and not isinstance(out, SealedView):
        out = out.as_subclass(SealedView)
        out.__dict__["_zs_name"] = name
    return out


def _check_then_run(cls, func, types, args=(), kwargs=None):
    """A partitioned parameter's ``__torch_function__``: refuse ops on it while it is
    released, but for :data:`RELEASED_READS`; otherwise run the op as a plain tensor op
    (as ``nn.Parameter`` does)."""
    kwargs = kwargs or {}
    name = _op_name(func)
    for a in args:  # parameters are direct arguments: F.linear(x, w, b), w.clamp_()
        d = getattr(a, "__dict__", None)
        if not d:
            continue
        if not d.get("_zs_released"):
            if name == "data":  # an alias that edits go through unseen (zero/params/edits.py)
                d["_zs_data_read"] = True
            continue
        if not d.get("_zs_sealed"):  # released by the stage-3 gatherer: empty placeholder
            if name == "__set__":  # assigning .grad is fine; .data would be undone
                if _set_name(func) == "data":
                    raise _released_error(d.get("_zs_name"), "assigning .data", d.get("_zs_encoded"))  # fmt: skip
            elif a is not args[0] or name not in RELEASED_READS:
                raise _released_error(d.get("_zs_name"), name or func, d.get("_zs_encoded"))
            elif name in WHOLE_METADATA:
                return func(d["_zs_whole"], *args[1:], **kwargs)
            elif name == "data":
                return _released_alias(a)
            elif name == "__repr__":
                return _released_repr(a)
        elif name == "__set__":
            pass
        elif name in _VIEWS:
            return _alias(func, args, kwargs, a, d.get("_zs_name"))
        elif a is args[0] and _stays(a, name, args[1:], kwargs):
            return a  # ``module.to(its own device and dtype)``: nothing to move
        elif name not in _SEALED_METADATA:
            raise _sealed_error(d.get("_zs_name"), name or func)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _set_name(func) -> str:
    """The attribute a property setter sets (``Tensor.data.__set__``: "data")."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


class ReleasedData(torch.Tensor):
    """``p.data`` of a released stage-3 parameter: refuses its values as the parameter
    does (it aliases the empty placeholder, not the values a later gather brings)."""

    __torch_function__ = classmethod(_check_then_run)


def _released_alias(param: torch.Tensor) -> ReleasedData:
    with torch._C.DisableTorchFunctionSubclass():
        data = torch.Tensor.data.__get__(param)  # type: ignore[attr-defined]  # torch types the descriptor as a Tensor
        out = data.as_subclass(ReleasedData)
    for key in ("_zs_name", "_zs_whole", "_zs_released"):
        out.__dict__[key] = param.__dict__[key]
    if "_zs_encoded" in param.__dict__:
        out.__dict__["_zs_encoded"] = param.__dict__["_zs_encoded"]
    return out


def _released_repr(t: torch.Tensor) -> str:
    d = t.__dict__
    with torch._C.DisableTorchFunctionSubclass():
        where = f"dtype={t.dtype}, device={t.device}, requires_grad={t.requires_grad}"
    return (
        f"{type(t).__name__}({d.get('_zs_name')!r}, shape={tuple(d['_zs_whole'].shape)}, "
        f"{where}: partitioned, only this rank's shard held)"
    )


_GUARDED: dict[type, type] = {}


def _guarded(cls: type) -> type:
    if cls not in _GUARDED:
        _GUARDED[cls] = type(
            f"Partitioned{cls.__name__}",
            (cls,),
            {"__torch_function__": classmethod(_check_then_run), "__module__": __name__},
        )
        _GUARDED[_GUARDED[cls]] = _GUARDED[cls]
    return _GUARDED[cls]


def guard(param: torch.nn.Parameter, name: str, shape: tuple[int, ...] | None = None) -> None:
    """Make ``param`` refuse ops while released (see :func:`set_released`); ``shape``:
    its whole shape, which its metadata answers while released (default: its own)."""
    base = param.__dict__.setdefault("_zs_base", type(param))
    param.__class__ = _guarded(base)
    param.__dict__["_zs_name"] = name
    with torch._C.DisableTorchFunctionSubclass():
        whole = param.shape if shape is None else shape
        param.__dict__["_zs_whole"] = torch.empty(whole, dtype=param.dtype, device="meta")


def set_encoded(param: torch.Tensor, how: str | None) -> None:
    """Note that ``param``'s unit is gathered ``how`` (e.g. "in fp8 ..."), not as values,
    for its module (``codec.py``): its errors say so; None removes the note."""
    if how is None:
        param.__dict__.pop("_zs_encoded", None)
    else:
        param.__dict__["_zs_encoded"] = how


def set_released(param: torch.Tensor, released: bool) -> None:
    param.__dict__["_zs_released"] = released


def set_sealed(param: torch.Tensor, sealed: bool) -> None:
    """Mark ``param`` as built under zero.Init (full shape, storage freed while released)."""
    param.__dict__["_zs_sealed"] = sealed


def set_gathered(param: torch.Tensor, gathered: bool) -> None:
    """A stage-3 parameter guarded by :func:`guard` is gathered (whole) or released. A
    gathered one takes a class without ``__torch_function__``, one that only notes reads
    of ``.data`` (``zero/edits.py``'s :func:`watch`, what the guard does for a gathered
    parameter), so its ops cost no Python call and ``torch.compile`` traces them (the
    guard is not traceable); a released one takes the guard back."""
    set_released(param, not gathered)
    base = param.__dict__.get("_zs_base")
    if base is None:  # not guarded yet: guard() then calls this again
        return
    if gathered:
        param.__class__ = base
        watch(param)  # type: ignore[arg-type]  # a Parameter (its class is swapped in place)
    else:
        param.__class__ = _guarded(base)


def unguard(param: torch.Tensor) -> None:
    """Give ``param`` its own class back."""
    base = param.__dict__.pop("_zs_base", None)
    cls = type(param)
    if base is not None:
        param.__class__ = base
    elif cls.__module__ == __name__ and cls.__name__.startswith("Partitioned"):
        param.__class__ = cls.__mro__[1]
    param.__dict__.pop("_zs_name", None)
    param.__dict__.pop("_zs_encoded", None)
    param.__dict__.pop("_zs_whole", None)
    param.__dict__.pop("_zs_data_read", None)
    param.__dict__.pop("_zs_released", None)
    param.__dict__.pop("_zs_sealed", None)
