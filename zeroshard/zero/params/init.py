"""``zero.Init``: build a model already partitioned, without ever holding it whole.

Inside the context every parameter a module registers is *sealed* right away: this rank
keeps an even 1/N slice of it (``Sealed.shard``) and the parameter's own storage is
shrunk to zero bytes, keeping its shape, dtype and identity. Construction code then runs
unchanged, because a ``TorchFunctionMode`` sees every torch call that touches a sealed
parameter (or an alias of it, e.g. ``p.data`` or a view):

* shape/metadata queries and view-making ops run as they are (no data is read);
* whole-tensor initializers (``nn.init.*``, ``normal_``, ``uniform_``, ``zero_``,
  ``fill_``, ...) run on a temporary full tensor, drawing exactly the random numbers the
  unpartitioned model would draw, and rank 0's result is kept (broadcast) as slices;
* anything else (reads, partial in-place updates) all-gathers the full value into a
  temporary, runs the op on it and, if the op wrote to the parameter, keeps the slice.

Peak memory is one parameter, not the model, and the values equal what the same code
would produce without ``Init`` from the same seed. No torch function is monkeypatched.

After the block, until ``initialize`` takes them over, sealed parameters keep their
shape but hold no data: ops that read them raise an error naming the parameter
(``hooks.guard``; aliases such as ``p.data`` or ``state_dict()`` values are guarded
too), and ``GatheredParameters`` gives them their whole value for a while (all-gather),
writing ``modifier_rank``'s values back into every rank's slice (broadcast) on leaving.

Communication: one broadcast per initializer call on a sealed parameter, one all-gather
per data-reading op on one (construction time only), plus one all-gather per parameter
when ``initialize`` re-slices them into the engine's layout; ``GatheredParameters``
before ``initialize``: one all-gather per parameter, and one broadcast per parameter
with ``modifier_rank``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from zeroshard import ArgumentError, NotBuiltError, UsageError
from zeroshard.distributed.comm import Comm
from zeroshard.distributed.device import runtime
from zeroshard.distributed.process_group import default_device, init_distributed
from zeroshard.offload.heap import HeapTrimmer, map_large_allocations
from zeroshard.zero.params.hooks import guard, set_released, set_sealed, unguard
from zeroshard.zero.params.init_ops import FILLS as _FILLS
from zeroshard.zero.params.init_ops import PartitionMode, storage_key


@dataclass
class Sealed:
    """This rank's slice of a sealed parameter."""

    param: weakref.ref
    shard: torch.Tensor  # elements [rank*chunk, (rank+1)*chunk) of the flat value, padded
    numel: int
    # the dtype the construction code made the parameter in: whole-tensor initializers
    # run in it (then the kept slice is cast), so Init(dtype=bf16) equals building the
    # model as usual and casting it
    build_dtype: torch.dtype = torch.float32
    owner: weakref.ref | None = None  # the module it was registered on, and its name there
    local_name: str = ""
    gathered: int = 0  # open GatheredParameters blocks holding it whole


class Init:
    """Context manager (DeepSpeed's ``deepspeed.zero.Init``): parameters created inside
    are partitioned across the data-parallel ranks as soon as they are registered.

    DeepSpeed's keyword arguments: ``dtype`` is the dtype of the parameters made
    inside (floating ones; default: the 16-bit dtype the config given as
    ``config_dict_or_path`` enables in its ``bf16`` / ``fp16`` section, else the dtype
    the construction code chose). Initializers (``nn.init.*``, ``normal_``, ...) draw in
    the dtype the code made the parameter in and the kept slice is cast, so the model
    equals the same model built without ``Init`` and then cast (DeepSpeed draws in the
    half dtype directly; zeroshard keeps the numbers of the usual fp32 construction).
    ``enabled`` turns it off; ``remote_device="cpu"`` keeps the slices in CPU memory
    (pinned with ``pin_memory``).
    Parameters are partitioned over the ranks that hold the same parameters: the
    data-parallel group of ``mpu`` or ``data_parallel_group``, or the ``replicas`` group
    of ``mesh`` (a :class:`~zeroshard.distributed.mesh.Mesh`), else every rank (the engine
    re-slices them into its own layout at ``initialize``). ``module=`` (partitioning an
    already built model) is not supported: pass the model to ``initialize`` with a
    stage-3 config instead. ``mem_efficient_linear`` changes nothing (stage 3 needs no
    special linear layer); of the config only the dtype is read here (the rest is read
    by ``initialize``).
    """

    def __init__(
        self,
        module=None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device=None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu=None,
        mesh=None,
        **kwargs,
    ) -> None:
        if module is not None:
            raise NotBuiltError(
                "zero.Init(module=...): partitioning a built model is done by initialize() "
                "with a stage-3 config"
            )
        refused = {k: v for k, v in kwargs.items() if v not in (None, False)}
        if refused:
            raise NotBuiltError(
                f"zero.Init: {', '.join(sorted(refused))} is not built yet in zeroshard"
            )
        remote = str(remote_device).lower() if remote_device is not None else "none"
        if remote not in ("none", "cpu", "cuda"):
            raise NotBuiltError(
                f"zero.Init(remote_device={remote_device!r}): only None, 'cpu' and the "
                "compute device are built; NVMe-partitioned construction is not built yet"
            )
        self.remote_cpu, self.pin_memory = remote == "cpu", pin_memory
        if config is not None and config_dict_or_path is not None:
            raise ArgumentError(
                "zero.Init: config and config_dict_or_path are the same argument (config is "
                "DeepSpeed's deprecated name); give one"
            )
        source = config_dict_or_path if config_dict_or_path is not None else config
        if dtype is None and source is not None:
            dtype = config_dtype(source)
        # NVMe offload: RAM is the limit, and the heap this construction leaves behind
        # would be reused, and kept, by training's large buffers (offload/heap.py)
        self._map_large = source is not None and config_swaps(source)
        self.enabled, self.dtype = enabled, dtype
        if mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        elif mesh is not None and data_parallel_group is None:
            data_parallel_group = mesh.comm("replicas").group
        self.group = data_parallel_group
        self._sealed: dict[int, Sealed] = {}  # storage id -> slice
        self._parent: dict[int, tuple[weakref.ref, str]] = {}  # id(module) -> its parent
        self._mode: PartitionMode | None = None
        self._hook: RemovableHandle | None = None
        self._module_hook: RemovableHandle | None = None
        # each parameter's full value is freed once its slice is kept: give the holes
        # back as they add up (offload/heap.py), or the host holds about twice the shards
        self._trimmer = HeapTrimmer()

    # -- context ------------------------------------------------------------------
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        init_distributed()
        if self._map_large:
            map_large_allocations()
        self.comm = Comm(self.group)
        self.device = default_device()
        self._keep_on = torch.device("cpu") if self.remote_cpu else self.device
        self._hook = register_module_parameter_registration_hook(self._on_register)
        self._module_hook = register_module_module_registration_hook(self._on_module)
        self._mode = mode = PartitionMode(self)
        mode.__enter__()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        assert self._mode is not None and self._hook is not None and self._module_hook is not None
        self._mode.__exit__(*exc)
        self._hook.remove()
        self._module_hook.remove()
        for entry in self._sealed.values():  # name them for errors, as named_parameters()
            param = entry.param()
            if param is not None:
                param.__dict__["_zs_name"] = self._full_name(entry)
        self._parent.clear()
        self._trimmer.flush()

    def _on_module(self, parent, name, child):
        if child is not None:
            self._parent.setdefault(id(child), (weakref.ref(parent), name))

    def _full_name(self, entry: Sealed) -> str:
        parts, m = [entry.local_name], entry.owner() if entry.owner else None
        while m is not None and id(m) in self._parent:
            up, name = self._parent[id(m)]
            parts.insert(0, name)
            m = up()
        return ".".join(parts)

    # -- sealing --------------------------------------------------------------------
    def _chunk(self, numel: int) -> int:
        return -(-numel // self.comm.world_size)

    def _on_register(self, module, name, param):
        # sealed already, by this Init or by another one active around it (nested
        # zero.Init contexts: the first to see a parameter keeps it; its storage is gone)
        if param is None or self.lookup(param) is not None or is_sealed(param):
            return None
        with torch._C.DisableTorchFunction():
            self._seal(param)
        if self._keep_on.type == "cpu":
            self._trimmer.freed(param.numel() * param.element_size())
        entry = self.entry(param)
        entry.owner, entry.local_name = weakref.ref(module), name
        guard(param, f"{name} (of a {type(module).__name__})")
        set_sealed(param, True)
        set_released(param, True)
        return None

    def _seal(self, param: torch.Tensor) -> None:
        numel, build_dtype = param.numel(), param.dtype
        dtype = self.dtype if self.dtype is not None and param.is_floating_point() else param.dtype
        value = param.detach().reshape(-1).to(dtype).clone()
        if dtype != param.dtype:
            param.data = torch.empty(param.shape, dtype=dtype, device=param.device)
        pin = self.pin_memory and self._keep_on.type == "cpu" and runtime(self.device).pin
        shard = torch.zeros(self._chunk(numel), dtype=dtype, device=self._keep_on, pin_memory=pin)
        key = storage_key(param)
        self._sealed[key] = Sealed(weakref.ref(param), shard, numel, build_dtype)
        self._keep_slice(key, value)
        param.untyped_storage().resize_(0)

    def _keep_slice(self, key: int, full: torch.Tensor, src: int = 0) -> None:
        entry = self._sealed[key]
        flat = full.reshape(-1).to(entry.shard.dtype)
        if self.comm.world_size > 1:
            flat = flat.to(self.device).contiguous()
            self.comm.broadcast(flat, src=src)  # rank 0's values win, as without Init
        r, c = self.comm.rank, entry.shard.numel()
        piece = flat[r * c : min((r + 1) * c, entry.numel)]
        entry.shard.zero_()
        entry.shard[: piece.numel()].copy_(piece)

    def lookup(self, t: torch.Tensor) -> Sealed | None:
        if not self._sealed:
            return None
        entry = self._sealed.get(storage_key(t))
        if entry is not None and entry.param() is None:
            return None
        return entry

    def entry(self, t: torch.Tensor) -> Sealed:
        """``t``'s entry; ``t`` must be sealed by this ``zero.Init``."""
        entry = self.lookup(t)
        if entry is None:
            raise UsageError("zero.Init: the tensor is not a parameter sealed by this context")
        return entry

    def hidden(self, t: torch.Tensor) -> Sealed | None:
        """``t``'s entry if it is sealed and not held whole by ``GatheredParameters``."""
        entry = self.lookup(t)
        return entry if entry is not None and not entry.gathered else None

    def full_value(self, entry: Sealed) -> torch.Tensor:
        """All-gather a sealed parameter's slices into a temporary full flat tensor."""
        c = entry.shard.numel()
        out = torch.empty(c * self.comm.world_size, dtype=entry.shard.dtype, device=self.device)
        self.comm.all_gather(out, entry.shard.to(self.device))
        return out[: entry.numel]

    def run_on_full(self, func, name: str, args, kwargs):
        """Run ``func`` with every sealed alias replaced by an alias of a temporary full value."""
        temps: dict[int, torch.Tensor] = {}
        writes_first = (name.endswith("_") and not name.startswith("__")) or name in (
            "__setitem__",
            "copy_",
        )
        # the tensor an in-place op or initializer writes (nn.init passes it as `tensor=`)
        first = args[0] if args else kwargs.get("tensor", kwargs.get("input", kwargs.get("self")))
        is_init_fn = getattr(func, "__module__", "") == "torch.nn.init"
        fill = (name in _FILLS or is_init_fn) and torch.is_tensor(first)

        def swap(t):
            if not torch.is_tensor(t):
                return t
            entry = self.hidden(t)
            if entry is None:
                return t
            key = storage_key(t)
            param = entry.param()
            if key not in temps:
                whole = fill and t is first and _covers(t, param)
                base = (
                    torch.empty(entry.numel, dtype=entry.build_dtype, device=self.device)
                    if whole
                    else self.full_value(entry).clone()
                )
                temps[key] = base
            return temps[key].as_strided(t.size(), t.stride(), t.storage_offset())

        out = func(*tree_map(swap, args), **tree_map(swap, kwargs))
        if writes_first and torch.is_tensor(first):
            key = storage_key(first)
            if key in temps:
                self._keep_slice(key, temps[key])
                if torch.is_tensor(out) and out.data_ptr() == temps[key].data_ptr():
                    return first
        return out

    # -- GatheredParameters before initialize -------------------------------------------
    def gather(self, param: torch.Tensor) -> None:
        """Give sealed ``param`` its whole value on this rank until :meth:`release`
        (collective: one all-gather, on the first of nested blocks)."""
        entry = self.entry(param)
        entry.gathered += 1
        if entry.gathered > 1:
            return
        full = self.full_value(entry)
        with torch._C.DisableTorchFunction(), torch.no_grad():
            param.untyped_storage().resize_(entry.numel * entry.shard.element_size())
            param.detach().copy_(full.view(param.shape))
        set_released(param, False)

    def release(self, param: torch.Tensor, modifier_rank: int | None) -> None:
        """End a :meth:`gather`: with ``modifier_rank``, that rank's values become every
        rank's slice (one broadcast); the storage is freed when the last block ends."""
        entry = self.entry(param)
        with torch._C.DisableTorchFunction(), torch.no_grad():
            if modifier_rank is not None:
                self._keep_slice(storage_key(param), param.detach(), src=modifier_rank)
            entry.gathered -= 1
            if entry.gathered == 0:
                param.untyped_storage().resize_(0)
                set_released(param, True)

    # -- hand-over to the engine ------------------------------------------------------
    def hand_over(self, param: torch.Tensor) -> None:
        """The engine has taken ``param`` over."""
        if self._sealed.pop(storage_key(param), None) is not None:
            unguard(param)
        if not self._sealed and self in _ACTIVE:
            _ACTIVE.remove(self)


_ACTIVE: list[Init] = []  # Init contexts whose sealed parameters await initialize()


def config_dtype(source) -> torch.dtype | None:
    """The 16-bit dtype a DeepSpeed config (a dict or a JSON path) enables: bf16 (section
    ``bf16`` or ``bfloat16``), fp16, or None (neither, or ``"auto"`` not filled in yet)."""
    from collections.abc import Mapping

    from zeroshard.config import ConfigError, read_config_file

    data = source if isinstance(source, Mapping) else read_config_file(source)
    if not isinstance(data, Mapping):
        raise ConfigError("config", f"expected an object {{...}}, got {type(data).__name__}")
    on = []
    for key, dtype in (
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
    ):
        section = data.get(key)
        if isinstance(section, Mapping) and section.get("enabled") is True:
            on.append((key, dtype))
    if len({d for _, d in on}) > 1:
        raise ConfigError(
            f"{on[0][0]}.enabled", f"and {on[-1][0]}.enabled are both true; enable one"
        )
    return on[0][1] if on else None


def config_swaps(source) -> bool:
    """Whether a DeepSpeed config (a dict or a JSON path) puts parameters or the
    optimizer in NVMe swap files."""
    from collections.abc import Mapping

    from zeroshard.config import read_config_file

    data = source if isinstance(source, Mapping) else read_config_file(source)
    zero = data.get("zero_optimization") if isinstance(data, Mapping) else None
    if not isinstance(zero, Mapping):
        return False
    return any(
        isinstance(zero.get(k), Mapping) and zero[k].get("device") == "nvme"
        for k in ("offload_param", "offload_optimizer")
    )


def _covers(t: torch.Tensor, param: torch.Tensor | None) -> bool:
    return (
        param is not None
        and t.numel() == param.numel()
        and t.is_contiguous()
        and t.storage_offset() == 0
    )


def _owner(param: torch.Tensor) -> tuple[Init, Sealed] | None:
    for init in reversed(_ACTIVE):
        entry = init.lookup(param)
        if entry is not None:
            return init, entry
    return None


def sealing_init(param: torch.Tensor) -> Init | None:
    """The ``zero.Init`` context holding ``param`` sealed, or None."""
    found = _owner(param)
    return found[0] if found is not None else None


def is_sealed(param: torch.Tensor) -> bool:
    """Whether ``param`` was built under ``zero.Init`` and not yet taken over."""
    return _owner(param) is not None


def take_value(param: torch.Tensor) -> torch.Tensor:
    """The whole flat value of ``param`` (all-gathered if sealed; collective then).
    A sealed parameter is handed over: the caller now owns its data."""
    found = _owner(param)
    if found is None:
        return param.detach().reshape(-1)
    init, entry = found
    value = init.full_value(entry)
    init.hand_over(param)
    return value
