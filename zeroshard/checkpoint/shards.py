"""This rank's slices of every trainable parameter, in layout-free terms. No communication.

A checkpoint stores, per parameter, *pieces*: elements ``[lo, hi)`` of the flattened
parameter, of one *kind*: ``param`` (the working dtype), ``master`` (fp32 master, when
it is a separate copy) and each elementwise optimizer state (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, ...). :class:`ShardAccess` reads and writes those
kinds for the pieces this rank owns, wherever they live (the full buffer, the stage-3
shard, CPU offload, NVMe files), so any layout can save and any other can load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.offload.swapped_adam import SwappedAdam


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
        self.flat = engine.flat
        self.opt = engine.optimizer
        layout = self.flat.layout
        # every owned piece; frozen ones (group < 0, stage 3) have only the "param" kind
        self.pieces = [
            OwnedPiece(
                p.param, p.param_lo, p.param_hi, p.shard_lo, self.flat.group_of[p.param], p.segment
            )
            for p in layout.pieces(self.flat.rank)
        ]
        self.swapped = isinstance(self.opt.inner, SwappedAdam)
        # (group, shard_lo, shard_hi, master view) of every inner-optimizer tensor
        self._views: list[tuple[int, int, int, torch.Tensor]] = []
        if not self.swapped:
            for g, group in enumerate(self.opt.inner.param_groups):
                spans = self.flat._spans[g]
                for (s, lo, hi), view in zip(spans, group["params"], strict=False):
                    start = layout.segments[s].shard_start
                    self._views.append((g, start + lo, start + hi, view))

    # -- which kinds exist ----------------------------------------------------------
    def state_keys(self) -> list[str]:
        """Elementwise optimizer-state names present (same on every rank)."""
        if self.swapped:
            return ["exp_avg", "exp_avg_sq"]
        keys: set[str] = set()
        for _, _, _, view in self._views:
            for k, v in self.opt.inner.state.get(view, {}).items():
                if torch.is_tensor(v) and v.numel() == view.numel() and v.dim() > 0:
                    keys.add(k)
        return sorted(keys)

    def has_master(self) -> bool:
        return self.swapped or self.opt.separate_masters

    def kinds(self) -> list[str]:
        return ["param", *(["master"] if self.has_master() else []), *self.state_keys()]

    # -- element access --------------------------------------------------------------
    def _view_at(self, a: int) -> tuple[int, int, torch.Tensor]:
        for _, lo, hi, view in self._views:
            if lo <= a < hi:
                return lo, hi, view
        raise KeyError(f"shard position {a} is in no optimizer tensor")

    def get(self, kind: str, a: int, b: int) -> torch.Tensor:
        """A CPU copy of ``kind`` at shard positions ``[a, b)``."""
        if kind == "param":
            return self.flat.read_range(a, b).cpu().clone()
        if self.swapped:
            return self.opt.inner.read_state(kind, a, b)
        if kind == "master":
            seg = self._segment_at(a)
            return (
                self.opt.masters[seg.index][a - seg.shard_start : b - seg.shard_start].cpu().clone()
            )
        lo, _, view = self._view_at(a)
        return self.opt.inner.state[view][kind][a - lo : b - lo].cpu().clone()

    def set(self, kind: str, a: int, values: torch.Tensor) -> None:
        b = a + values.numel()
        if kind == "param":
            self.flat.write_range(a, b, values)
        elif self.swapped:
            self.opt.inner.write_state(kind, a, values)
        elif kind == "master":
            seg = self._segment_at(a)
            self.opt.masters[seg.index][a - seg.shard_start : b - seg.shard_start].copy_(values)
        else:
            lo, _, view = self._view_at(a)
            state = self.opt.inner.state.setdefault(view, {})
            if kind not in state:
                state[kind] = torch.zeros_like(view)
            state[kind][a - lo : b - lo].copy_(values)

    def _segment_at(self, a: int):
        for seg in self.flat.layout.segments:
            if seg.shard_start <= a < seg.shard_start + seg.chunk:
                return seg
        raise KeyError(f"shard position {a} is in no segment")

    # -- per-group scalars ----------------------------------------------------------
    def group_steps(self) -> list[float]:
        if self.swapped:
            return [float(s) for s in self.opt.inner.steps]
        steps = []
        for g in range(len(self.opt.inner.param_groups)):
            views = [v for gi, _, _, v in self._views if gi == g]
            st = self.opt.inner.state.get(views[0], {}) if views else {}
            step = st.get("step")
            steps.append(float(step) if step is not None else 0.0)
        return steps

    def set_group_steps(self, steps: list[float]) -> None:
        if self.swapped:
            self.opt.inner.steps = [int(s) for s in steps]
            return
        for gi, _, _, view in self._views:
            st = self.opt.inner.state.setdefault(view, {})
            old = st.get("step")
            if torch.is_tensor(old):
                old.fill_(steps[gi])
            elif steps[gi] or old is not None:
                st["step"] = torch.tensor(float(steps[gi]))
