"""``GatheredParameters``: whole parameters for user code, outside the training step.

Communication: at stage 3, entering all-gathers the units holding the given parameters
(stages 0-2: nothing, they are whole). With ``modifier_rank``, leaving broadcasts each
parameter from that rank and every rank keeps its own slice of the new values (and
refreshes its fp32 master copy), so the change survives the next gather and step.

Parameters built under ``zero.Init`` and not yet taken over by ``initialize`` (as when
Hugging Face ``from_pretrained`` loads a checkpoint under DeepSpeed ZeRO-3) are gathered
the same way, over the group that ``Init`` partitioned them across: one all-gather per
parameter on entering, one broadcast per parameter on leaving with ``modifier_rank``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Protocol

import torch

from zeroshard.zero.params.init import Init, sealing_init


class GatherOwner(Protocol):
    """What ``GatheredParameters`` asks of the engine that owns a parameter (the engine
    registers itself; this module does not import it: the engine sits above zero/)."""

    def open_gathered(self, params: list[torch.Tensor]) -> None: ...

    def close_gathered(self, params: list[torch.Tensor], modifier_rank: int | None) -> None: ...


# id(parameter) -> (weakref to it, weakref to the engine owning it). Set by the engine;
# lets the DeepSpeed-style context manager find the shards from the parameters alone.
# (Tensors compare elementwise, so they cannot be WeakKeyDictionary keys.)
_OWNER: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register_owner(params: Iterable[torch.nn.Parameter], owner: GatherOwner) -> None:
    for k in [k for k, (p, o) in _OWNER.items() if p() is None or o() is None]:
        del _OWNER[k]
    for p in params:
        _OWNER[id(p)] = (weakref.ref(p), weakref.ref(owner))


def unregister_owner(owner) -> None:
    """Forget every parameter ``owner`` manages (its teardown)."""
    for k in [k for k, (_, o) in _OWNER.items() if o() is None or o() is owner]:
        del _OWNER[k]


def owner_of(param: torch.Tensor) -> GatherOwner | None:
    """The engine managing ``param``, or None."""
    entry = _OWNER.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _as_list(params) -> list[torch.Tensor]:
    if params is None:
        return []
    if torch.is_tensor(params):
        return [params]
    return [p for p in params if p is not None]


class GatheredParameters:
    """Context manager: inside it, ``params`` are whole on every rank.

    Args:
        params: a parameter or an iterable of parameters (of engine-managed modules;
            others pass through untouched).
        modifier_rank: if not None, the values this rank holds when the block exits
            are written back to every rank's shard (as in DeepSpeed).
        fwd_module: accepted for DeepSpeed compatibility; unused.
        enabled: False makes it a no-op.
    """

    def __init__(
        self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True
    ):
        self.params = _as_list(params) if enabled else []
        self.modifier_rank = modifier_rank
        self._by_owner: dict[int, tuple[GatherOwner, list[torch.Tensor]]] = {}
        self._sealed: list[tuple[Init, torch.Tensor]] = []  # built under zero.Init
        for p in {id(p): p for p in self.params}.values():
            owner = owner_of(p)
            if owner is not None:
                self._by_owner.setdefault(id(owner), (owner, []))[1].append(p)
                continue
            init = sealing_init(p)
            if init is not None:
                self._sealed.append((init, p))

    def __enter__(self) -> GatheredParameters:
        for owner, ps in self._by_owner.values():
            owner.open_gathered(ps)
        for init, p in self._sealed:
            init.gather(p)
        return self

    def __exit__(self, *exc) -> None:
        rank = None if exc[0] is not None else self.modifier_rank
        for owner, ps in self._by_owner.values():
            owner.close_gathered(ps, rank)
        for init, p in self._sealed:
            init.release(p, rank)
