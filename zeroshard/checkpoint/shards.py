"""This rank's slices of every trainable parameter, in layout-free terms. No communication.

A checkpoint stores, per parameter, *pieces*: elements ``[lo, hi)`` of the flattened
parameter, of one *kind*: ``param`` (the working dtype), ``master`` (fp32 master, when
it differs from the parameters) and each elementwise optimizer state (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, ...). :class:`ShardAccess` reads and writes those
kinds for the pieces this rank owns through the two shard stores of an engine, the
parameter store (``engine.flat.store``) and the optimizer-state store
(``engine.optimizer.states``), wherever they keep them (device, CPU, NVMe), so any
layout can save and any other can load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OwnedPiece:
    param: int  # index into flat.params
    lo: int  # element range of the flattened parameter
    hi: int
    shard_lo: int  # where it sits in this rank's shard
    group: int
    segment: int


class ShardAccess:
    """Get and set this rank's pieces of each kind for one engine."""

    def __init__(self, engine) -> None:
        from zeroshard.zero.optim.memory_store import NO_STATES

        self.flat = engine.flat
        # an engine without an optimizer (inference) has parameters only
        self.states = engine.optimizer.states if engine.optimizer is not None else NO_STATES
        layout = self.flat.layout
        # every owned piece; frozen ones (group < 0, stage 3) have only the "param" kind
        self.pieces = [
            OwnedPiece(
                p.param, p.param_lo, p.param_hi, p.shard_lo, self.flat.group_of[p.param], p.segment
            )
            for p in layout.pieces(self.flat.rank)
        ]

    def has_master(self) -> bool:
        return "master" in self.states.kinds

    def kinds(self) -> list[str]:
        """``param`` and the optimizer store's kinds (the same on every rank)."""
        return ["param", *self.states.kinds]

    def get(self, kind: str, a: int, b: int) -> torch.Tensor:
        """A CPU copy of ``kind`` at shard positions ``[a, b)``."""
        if kind == "param":  # the store may keep the shard as fp32 masters
            values = self.flat.store.read("param", a, b).to(self.flat.dtype)
        else:
            values = self.states.read(kind, a, b)
        return values.to("cpu", copy=True)

    def set(self, kind: str, a: int, values: torch.Tensor) -> None:
        store = self.flat.store if kind == "param" else self.states
        store.write(kind, a, values)

    def group_steps(self) -> list[float]:
        return self.states.group_steps()

    def set_group_steps(self, steps: list[float]) -> None:
        self.states.set_group_steps(steps)
