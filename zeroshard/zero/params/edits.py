"""Edits made to whole parameters outside the engine (after ``step()``, between steps),
found when the engine next needs the masters, so that the fp32 masters and offloaded
copies take them, as torch's optimizer sees an edited parameter. No communication.

Whole parameters are views of a buffer the engine writes: the flat buffer at stages
0-2, a persistent unit's buffer at stage 3 (parameters of at most
``stage3_param_persistence_threshold`` elements, whole on every rank). Three ways to
change one, and how each is seen:

* in place on the parameter or a view of it (``p.clamp_()`` under ``no_grad``,
  ``load_state_dict``'s ``copy_``, ``p[0] = 1``): its version counter;
* in place on ``p.data`` (``p.data.clamp_()``, WGAN's weight clipping as usually
  written): ``.data`` is an alias with a version counter of its own, so reading it is
  noted (stages 0-2: :func:`watch` gives the parameter a subclass whose ``data``
  property notes it, at no cost per op; stage 3: its guard, ``hooks.py``) and a noted
  parameter counts as edited;
* assigning ``p.data = t``: the parameter stops viewing the buffer; its values are
  copied in and it views the buffer again (another shape or dtype is an error naming
  the parameter).

Masters take what counts as edited element by element (:func:`take_edits`): where a
value still equals its master rounded to the parameter's dtype the master keeps its
own bits, so a parameter that was only read, or a bf16 parameter that was clamped,
leaves the fp32 masters of its other elements untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard import ArgumentError

_DATA = torch.Tensor.data  # the C property
_WATCHED: dict[type, type] = {}


def _get_data(self: torch.Tensor) -> torch.Tensor:
    self.__dict__["_zs_data_read"] = True
    return _DATA.__get__(self)  # type: ignore[attr-defined]  # torch types the .data descriptor as a Tensor


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    _DATA.__set__(self, value)  # type: ignore[attr-defined]  # (the descriptor, see above)


def watch(param: torch.nn.Parameter) -> None:
    """Note reads of ``param.data`` (see the module docstring); ops cost nothing more."""
    cls = type(param)
    if cls not in _WATCHED:
        body = {"data": property(_get_data, _set_data), "__module__": __name__}
        _WATCHED[cls] = type(f"Watched{cls.__name__}", (cls,), body)
        _WATCHED[_WATCHED[cls]] = _WATCHED[cls]
    param.__class__ = _WATCHED[cls]


def unwatch(param: torch.nn.Parameter) -> None:
    """Give ``param`` its own class back."""
    cls = type(param)
    if cls.__module__ == __name__ and cls.__name__.startswith("Watched"):
        param.__class__ = cls.__mro__[1]
    param.__dict__.pop("_zs_data_read", None)


def take_edits(master: torch.Tensor, values: torch.Tensor) -> None:
    """``master`` takes ``values`` where they differ from it rounded to their dtype (an
    edit), and keeps its own bits elsewhere."""
    values = values.to(master.device)
    if values.dtype == master.dtype:
        master.copy_(values)
        return
    edited = values != master.to(values.dtype)
    master.copy_(torch.where(edited, values.to(master.dtype), master))


class WholeEdits:
    """Watches whole parameters ``params[i]``, each meant to be ``views[i]``; ``names``
    for errors."""

    def __init__(
        self, params: Sequence[torch.Tensor], views: list[torch.Tensor], names: list[str]
    ) -> None:
        self.params, self.views, self.names = params, views, names
        self._clean: list[int] = []
        self.mark_clean()

    def mark_clean(self) -> None:
        """The parameters and the masters agree now."""
        with torch._C.DisableTorchFunctionSubclass():  # plain reads (stage 3's guard)
            for p in self.params:
                p.__dict__.pop("_zs_data_read", None)
            self._clean = [p._version for p in self.params]

    def _touched(self) -> list[int]:
        with torch._C.DisableTorchFunctionSubclass():
            return [
                i
                for i, p in enumerate(self.params)
                if p._version != self._clean[i]
                or "_zs_data_read" in p.__dict__
                or moved(p, self.views[i])
            ]

    def pending(self) -> bool:
        """Whether some parameter may have been changed since :meth:`mark_clean`."""
        return bool(self._touched())

    def take(self) -> list[int]:
        """The parameters that may have changed (positions in ``params``); each one
        given another tensor gets its values copied into its view and views it again.
        Then clean."""
        touched = self._touched()
        for i in touched:
            if moved(self.params[i], self.views[i]):
                view_again(self.params[i], self.views[i], self.names[i])
        self.mark_clean()
        return touched


def moved(param: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``param`` was given another tensor than ``view`` (``p.data = t``)."""
    with torch._C.DisableTorchFunctionSubclass():
        if param.numel() == 0 and view.numel() == 0:
            return False
        mine = (param.data_ptr(), param.shape, param.stride())
        return mine != (view.data_ptr(), view.shape, view.stride())


def view_again(param: torch.Tensor, view: torch.Tensor, name: str) -> None:
    """``param`` was given another tensor: copy its values into ``view``, its place in
    the engine's buffer, and make it view that again."""
    with torch._C.DisableTorchFunctionSubclass():
        value = _DATA.__get__(param)  # type: ignore[attr-defined]  # (the descriptor, see above)
        if value.shape != view.shape or value.dtype != view.dtype:
            raise ArgumentError(
                f"parameter {name!r} was given a tensor of shape {tuple(value.shape)} and "
                f"dtype {value.dtype} (p.data = ...), but the engine laid it out as "
                f"{tuple(view.shape)} {view.dtype}: assign values of the same shape and "
                "dtype, or call engine.destroy() and zeroshard.initialize() again"
            )
        with torch.no_grad():
            view.copy_(value)
        _DATA.__set__(param, view)  # type: ignore[attr-defined]  # (the descriptor, see above)
