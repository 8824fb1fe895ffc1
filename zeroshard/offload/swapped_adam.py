"""Adam/AdamW with fp32 masters and moments in NVMe swap files. No communication.

``offload_optimizer: {device: "nvme"}``: this rank's fp32 master shard and both Adam
moments live in three files of a :class:`~zeroshard.offload.nvme.SwapSpace`. The step
walks the shard in *sub-groups* of ``sub_group_size`` elements: read the sub-group's
master and moments into aligned buffers, run torch's fused Adam kernel on them (each
param group's elements with that group's hyperparameters), hand the new masters to
the parameters, write all three back. With ``pipeline_read`` the next sub-group is read
while this one steps; with ``pipeline_write`` its writes finish while the next one
steps; RAM holds only the buffer sets (3 buffers of one sub-group each).

It is the NVMe store of the optimizer-state store protocol
(:class:`~zeroshard.offload.states.StateStore`; ``zero/optim/memory_store.py`` holds the
memory one): ``step(grads, factor)``, ``kinds``, ``read``/``write`` of a kind at shard
positions, ``buffers()`` and ``disk_bytes()``; and it quacks like a torch optimizer
where schedulers need it to (``param_groups``). It reads the flat parameters through
:class:`FlatShard` (``zero/layout/flat.FlatParams`` satisfies it); what it needs from
above, how a master takes an edited parameter and the progress bar of the swap files'
set-up, its builder hands it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from typing import Protocol

import torch
from torch.optim.adam import adam as adam_functional

from zeroshard.config.schema import ConfigError
from zeroshard.offload.layout import ChunkLayout
from zeroshard.offload.nvme import ALIGN, SwapSpace, aligned_empty
from zeroshard.offload.states import StepGrads
from zeroshard.offload.store import ShardStore

_KEYS = ("master", "exp_avg", "exp_avg_sq")


class FlatShard(Protocol):
    """What the NVMe Adam reads of the flat parameters: the layout, each param group's
    hyperparameters and pieces, and the parameter store its new masters go into."""

    @property
    def layout(self) -> ChunkLayout: ...

    @property
    def hyperparams(self) -> Sequence[dict]: ...

    @property
    def store(self) -> ShardStore: ...

    def group_pieces(self, group: int) -> list[tuple[int, int, int, int]]:
        """``(segment, lo, hi, parameter)`` of each of ``group``'s pieces in this rank's
        chunks."""


class SwappedAdam:
    """Adam (``decoupled=False``) or AdamW whose state is swapped to files."""

    def __init__(
        self,
        flat: FlatShard,
        space: SwapSpace,
        *,
        decoupled: bool,
        sub_group_numel: int,
        pipeline_read: bool,
        pipeline_write: bool,
        initial_master: Callable[[int, int], torch.Tensor],
        take_edits: Callable[[torch.Tensor, torch.Tensor], None],
        progress: Callable[[list[tuple[int, int]]], Iterable[tuple[int, int]]] = iter,
        start: int = 0,
    ) -> None:
        """``initial_master(a, b)``: the fp32 masters of shard positions ``[a, b)`` to
        start from; ``take_edits(master, values)``: ``master`` takes the elements of
        ``values`` that were edited (:meth:`refresh`); ``progress(subgroups)``: the
        sub-groups, wrapped in a progress bar while their masters are written.
        ``start``: the first shard position held (a segment's start; Twin-Flow keeps the
        positions before it on the device): the files hold ``[start, shard_numel)``."""
        self.flat, self.space, self.decoupled = flat, space, decoupled
        self.start = start
        self.take_edits = take_edits
        self.param_groups = [dict(h) for h in flat.hyperparams]
        for g in self.param_groups:
            if g.get("amsgrad"):
                raise ConfigError(
                    "optimizer.params.amsgrad: not supported with NVMe optimizer offload"
                )
        self.state: dict = {}
        # steps taken per parameter (torch's Adam counts them per tensor: a parameter
        # left without gradients is not stepped, and its bias correction waits)
        n = flat.layout.shard_numel
        elem = ALIGN // 2  # sub-group boundaries aligned for fp32 and 16-bit files alike
        size = max(elem, (min(sub_group_numel, max(n - start, 1)) // elem) * elem)
        self.subgroups = [(a, min(a + size, n)) for a in range(start, n, size)]
        self.runs = sorted(
            (
                flat.layout.segments[s].shard_start + lo,
                flat.layout.segments[s].shard_start + hi,
                g,
                pi,
            )
            for g in range(len(self.param_groups))
            for s, lo, hi, pi in flat.group_pieces(g)
            if flat.layout.segments[s].shard_start >= start
        )
        self.steps = {pi: 0 for *_, pi in self.runs}
        self.files = {k: space.file(k, (n - start) * 4) for k in _KEYS}
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        nsets = 2 if (pipeline_read or pipeline_write) else 1
        self.sets = [
            {k: aligned_empty(size * 4).view(torch.float32) for k in _KEYS} for _ in range(nsets)
        ]
        self._writes: list[list[Future]] = [[] for _ in range(nsets)]
        for a, b in progress(self.subgroups):  # masters from the parameters; moments start as zeros
            buf = self.sets[0]["master"]
            buf[: b - a].copy_(initial_master(a, b))
            self.files["master"].write(buf[: self._io(a, b)], (a - start) * 4)

    kinds = _KEYS
    separate = True  # the masters are files of their own

    @property
    def inner(self) -> SwappedAdam:
        return self

    def init_state(self, zero_grads) -> None:
        """The moments start as zeros in their files already."""

    def step(self, grads: StepGrads, factor: float, unused: AbstractSet[int] = frozenset()) -> None:
        """Step on the reduced gradient shard ``grads`` (``grads.range(a, b)``: positions
        ``[a, b)`` of it) scaled by ``factor``, skipping the parameters
        in ``unused``; each sub-group's new masters go into the parameter store as soon
        as they are computed."""
        writer = self.flat.store.writer()  # sub-groups come in shard order
        try:
            self.swapped_step(grads.range, factor, lambda a, b, m: writer.put(a, m), unused)
        finally:
            writer.close()

    def refresh(self, segments: list[int]) -> None:
        """Parameters of ``segments`` were changed from outside: the masters take the
        changed values (``take_edits``: unchanged elements keep their fp32 bits)."""
        for s in segments:
            seg = self.flat.layout.segments[s]
            master = self.read("master", seg.shard_start, seg.shard_start + seg.chunk)
            self.take_edits(master, self.flat.store.chunk(s))
            self.write("master", seg.shard_start, master)

    # -- the step -----------------------------------------------------------------------
    @staticmethod
    def _io(a: int, b: int) -> int:
        """Elements moved for sub-group [a, b): whole disk blocks (the file is padded)."""
        e = ALIGN // 4
        return -(-(b - a) // e) * e

    def _read(self, i: int, slot: int) -> list[Future]:
        a, b = self.subgroups[i]
        for f in self._writes[slot]:
            f.result()  # the buffers are free once their previous writes are done
        self._writes[slot] = []
        n = self._io(a, b)
        at = (a - self.start) * 4
        return [self.space.read_async(self.files[k], self.sets[slot][k][:n], at) for k in _KEYS]

    def swapped_step(
        self,
        grads: Callable[[int, int], torch.Tensor],
        factor: float,
        on_updated: Callable[[int, int, torch.Tensor], None],
        unused: AbstractSet[int] = frozenset(),
    ) -> None:
        """Step every sub-group. ``grads(a, b)``: this rank's gradient at shard positions
        ``[a, b)`` (CPU);
        ``factor``: unscale/clip multiplier; ``on_updated(a, b, masters)`` receives the
        new fp32 masters of shard range ``[a, b)``; parameters in ``unused`` keep their
        masters, moments and step counts."""
        nsets = len(self.sets)
        pending = self._read(0, 0)
        for i, (a, b) in enumerate(self.subgroups):
            slot = i % nsets
            for f in pending:
                f.result()
            if self.pipeline_read and i + 1 < len(self.subgroups):
                pending = self._read(i + 1, (i + 1) % nsets)
            bufs = {k: v[: b - a] for k, v in self.sets[slot].items()}
            g = grads(a, b).to(torch.float32)
            if factor != 1.0:
                g = g * factor
            self._apply(a, b, bufs, g, unused)
            on_updated(a, b, bufs["master"])
            n = self._io(a, b)
            at = (a - self.start) * 4
            writes = [
                self.space.write_async(self.files[k], self.sets[slot][k][:n], at) for k in _KEYS
            ]
            if self.pipeline_write:
                self._writes[slot] += writes
            else:
                for f in writes:
                    f.result()
            if not self.pipeline_read and i + 1 < len(self.subgroups):
                pending = self._read(i + 1, (i + 1) % nsets)
        for slot in range(nsets):
            for f in self._writes[slot]:
                f.result()
            self._writes[slot] = []
        for pi in self.steps:
            if pi not in unused:
                self.steps[pi] += 1

    def _apply(
        self, a: int, b: int, bufs: dict[str, torch.Tensor], g: torch.Tensor, unused
    ) -> None:
        """One fused Adam call per (param group, step count) over the runs in [a, b)."""
        batches: dict[tuple[int, int], list[slice]] = {}
        for lo, hi, gi, pi in self.runs:
            lo, hi = max(lo, a), min(hi, b)
            if lo < hi and pi not in unused:
                batches.setdefault((gi, self.steps[pi]), []).append(slice(lo - a, hi - a))
        for (gi, step), slices in batches.items():
            group = self.param_groups[gi]
            beta1, beta2 = group["betas"]
            adam_functional(
                [bufs["master"][sl] for sl in slices],
                [g[sl] for sl in slices],
                [bufs["exp_avg"][sl] for sl in slices],
                [bufs["exp_avg_sq"][sl] for sl in slices],
                [],
                # the kernel adds one, as a step does
                [torch.tensor(float(step)) for _ in slices],
                fused=True,
                decoupled_weight_decay=self.decoupled,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    # -- accounting / state ----------------------------------------------------------
    def buffers(self) -> list[torch.Tensor]:
        return [t for s in self.sets for t in s.values()]

    def disk_bytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def group_steps(self) -> list[float]:
        """Per group, the most steps any of its parameters took."""
        out = [0.0] * len(self.param_groups)
        for _, _, gi, pi in self.runs:
            out[gi] = max(out[gi], float(self.steps[pi]))
        return out

    def set_group_steps(self, steps: list[float]) -> None:
        for _, _, gi, pi in self.runs:
            self.steps[pi] = int(steps[gi])

    def read(self, key: str, a: int, b: int) -> torch.Tensor:
        """A copy of ``master``/``exp_avg``/``exp_avg_sq`` for shard range [a, b)."""
        a, b = a - self.start, b - self.start  # file positions
        lo, hi = (a // (ALIGN // 4)) * (ALIGN // 4), -(-b // (ALIGN // 4)) * (ALIGN // 4)
        buf = aligned_empty((hi - lo) * 4).view(torch.float32)
        self.files[key].read(buf, lo * 4)
        return buf[a - lo : b - lo].clone()

    def write(self, key: str, a: int, values: torch.Tensor) -> None:
        """Overwrite ``key`` at shard positions ``[a, a + len(values))`` (checkpoint load)."""
        a -= self.start  # file positions
        b, e = a + values.numel(), ALIGN // 4
        lo, hi = (a // e) * e, -(-b // e) * e
        buf = aligned_empty((hi - lo) * 4).view(torch.float32)
        self.files[key].read(buf, lo * 4)
        buf[a - lo : b - lo].copy_(values)
        self.files[key].write(buf, lo * 4)
