"""The only door to ``torch.distributed`` collectives, and the ledger that counts them.

Every collective zeroshard issues goes through a :class:`Comm` (a process group, the
name of the mesh axis it spans, and a :class:`Ledger`). The ledger records, per axis
and op, the number of calls, the bytes moved and the seconds the caller was blocked
(issue time plus time spent in ``wait()``; work that overlaps compute therefore shows
up as little time). The Comms of one mesh share one ledger, so ``snapshot()`` totals
per op and ``by_axis()`` splits them by axis.

Byte convention (the ZeRO paper's): all-reduce counts 2x the buffer (it is a
reduce-scatter plus an all-gather), reduce-scatter counts the full unsharded input,
all-gather the full gathered output, broadcast / all-to-all / send / recv the buffer
(pipeline stages' point-to-point ``send`` and ``recv`` are filed as two ops).

With world size 1 every collective is a local copy (or nothing) and nothing is recorded:
no bytes leave the process.

The ledger's bookkeeping lives in ``ledger.py``. Observers (``Ledger.observers``, e.g.
the comms logger) get an :class:`~zeroshard.distributed.ledger.OpEvent` when a
collective completes: its bytes, blocked seconds, group size and the calling function.
With no observer the ledger costs what it did. DeepSpeed's module-level
``deepspeed.comm`` functions (``get_rank``, ``all_reduce``, ``log_summary``...) are in
``compat/comm.py`` (``zeroshard.comm``), over this module.

Gloo gaps filled here: ``ReduceOp.AVG`` (sum then divide), and the ``*_single`` names
introduced in torch 2.13 versus the ``*_tensor`` names older torch has.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from zeroshard import ArgumentError, UsageError
from zeroshard.distributed import watchdog
from zeroshard.distributed.ledger import Ledger, OpEvent

# what a collective's ``then`` returns is dropped (in-place ops return their tensor)
Then = Callable[[], object]
_T = TypeVar("_T")

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Handle:
    """An in-flight collective. ``wait()`` blocks until it is done, then runs ``then``
    (and tells the ledger's observers, when ``event`` holds what they need)."""

    def __init__(
        self,
        work: dist.Work | _Works | None,
        ledger: Ledger | None,
        op: str,
        then: Then | None = None,
        axis: str = "world",
        nbytes: int = 0,
        event: tuple[int, float, int, str] | None = None,  # nbytes, issue s, group, caller
    ) -> None:
        self._work, self._ledger, self._op, self._then = work, ledger, op, then
        self._axis, self._nbytes, self._event = axis, nbytes, event
        self.done = work is None and then is None and event is None

    def wait(self) -> None:
        if self.done:
            return
        t0 = time.perf_counter()
        if self._work is not None:
            wd = watchdog.current()
            if wd is not None:
                wd.block(self._op, self._axis, self._nbytes)
            self._work.wait()
            if wd is not None:
                wd.unblock()
        if self._then is not None:
            self._then()
        if self._ledger is not None:
            waited = time.perf_counter() - t0
            self._ledger.add_seconds(self._op, waited, self._axis)
            if self._event is not None:
                nbytes, issued, group, caller = self._event
                done = OpEvent(self._axis, self._op, nbytes, issued + waited, group, caller)
                for observe in self._ledger.observers:
                    observe(done)
        self.done = True
        self._work = self._then = self._event = None  # no reference into backend threads


# tags of the point-to-point all-gather, apart from the pipeline's small ones
_P2P_TAG_START, _P2P_TAG_END = 1 << 20, 1 << 30


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_sizes(op: str, whole: int, part: int, world: int) -> None:
    """The backends refuse a whole buffer that is not ``world`` parts; so do our paths."""
    if whole != part * world:
        raise ArgumentError(
            f"Comm.{op}: {whole} elements are not {world} ranks x {part} (the part's size)"
        )


def _sum_parts(parts: list[torch.Tensor], output: torch.Tensor) -> None:
    """``output`` = the sum of ``parts`` (one per rank, in rank order), accumulated in at
    least fp32 and rounded once to ``output``'s dtype."""
    out = output.view(-1)
    if len(parts) == 2:  # one addition: computed exactly, rounded once
        torch.add(parts[0], parts[1], out=out)
        return
    # accumulate in place only if ``output`` is none of the parts (it may be this
    # rank's own chunk of the input) and is wide enough
    wide = parts[0].dtype in (torch.float32, torch.float64)
    alias = any(p.data_ptr() == out.data_ptr() for p in parts)
    acc = (
        out
        if wide and not alias
        else torch.empty_like(out, dtype=torch.float32 if not wide else out.dtype)
    )
    acc.copy_(parts[0])
    for p in parts[1:]:
        acc.add_(p)
    if acc is not out:
        out.copy_(acc)


class Comm:
    """A process group with a ledger. All zeroshard collectives go through here.

    ``axis`` names the mesh axis (or axes, joined by ``"+"``) the group spans; the
    ledger files this Comm's bytes under it. ``async_op=True`` returns a
    :class:`Handle` in flight; otherwise the op completes before returning (and the
    :class:`Handle` returned is done).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        ledger: Ledger | None = None,
        axis: str = "world",
    ):
        self.group = group
        self.axis = axis
        self.ledger = ledger if ledger is not None else Ledger()
        initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialized else 1
        self.rank = dist.get_rank(group) if initialized else 0
        #: the process group's backend ("gloo", "nccl", ...; "local" for one process)
        self.backend = dist.get_backend(group) if initialized else "local"
        self._avg_native = self.backend == "nccl"
        #: how :meth:`reduce_scatter` reduces host tensors by default: gloo's own
        #: reduce-scatter is slower than its all-reduce, sends plus a local sum beat both
        self.reduce_scatter_via = "send_recv" if self.backend == "gloo" else "native"
        #: how :meth:`all_gather` gathers host tensors by default (gloo: point to point)
        self.all_gather_via = "send_recv" if self.backend == "gloo" else "native"
        self._p2p_tag = _P2P_TAG_START

    # -- helpers --------------------------------------------------------------------
    def _run(
        self,
        op: str,
        nbytes: int,
        fn: Callable[[], dist.Work | _Works | None],
        async_op: bool,
        then: Then | None = None,
    ) -> Handle:
        t0 = time.perf_counter()
        wd = watchdog.current()
        if wd is not None:  # a hang here becomes a report (watchdog.py)
            wd.block(op, self.axis, nbytes)
        work = fn()
        if wd is not None:
            wd.unblock()
        issued = time.perf_counter() - t0
        self.ledger.record(op, nbytes, issued, self.axis)
        event = None
        if self.ledger.observers:  # frames: 0 this, 1 the Comm method, 2 its caller
            event = (nbytes, issued, self.world_size, sys._getframe(2).f_code.co_name)
        handle = Handle(work, self.ledger, op, then, self.axis, nbytes, event)
        if not async_op:
            handle.wait()
        return handle

    @staticmethod
    def _local(then: Then | None, async_op: bool) -> Handle:
        if then is not None:
            then()
        return Handle(None, None, "")  # done

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        """In-place all-reduce; ``op`` is "sum", "avg" or "max". Counts 2x the buffer."""
        if self.world_size == 1:
            return self._local(None, async_op)
        then: Then | None = None
        if op == "avg" and not self._avg_native:
            red, then = dist.ReduceOp.SUM, lambda: tensor.div_(self.world_size)
        else:
            red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}[op]
        return self._run(
            "all_reduce",
            2 * _nbytes(tensor),
            lambda: dist.all_reduce(tensor, op=red, group=self.group, async_op=async_op),
            async_op,
            then,
        )

    def all_reduce_many(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` in place over the group with one all-reduce of their
        concatenation (2x their bytes on the ledger, as one call)."""
        if not tensors or self.world_size == 1:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(flat)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        via: str | None = None,
        scratch: torch.Tensor | None = None,
    ) -> Handle:
        """Sum ``input`` (world_size equal chunks) across ranks; this rank's chunk to ``output``.

        ``via`` (None: :attr:`reduce_scatter_via`, chosen per backend):

        * ``"native"``: the backend's reduce-scatter (bucket bytes on the ledger);
        * ``"all_reduce"``: all-reduce ``input`` in place and keep this rank's chunk
          (filed as the all-reduce it is: 2x the bytes);
        * ``"send_recv"``: chunk j sent to rank j point to point, the other ranks'
          chunks of this rank's part received into ``scratch`` (at least (world - 1) /
          world of ``input``'s size; allocated when None), then summed with this rank's
          own chunk in rank order (in at least fp32, rounded once);
        * ``"all_to_all"``: the same exchange as one all-to-all (``scratch`` at least
          ``input``'s size: it also receives this rank's own chunk).

        The last two move what a reduce-scatter moves. On gloo, point to point takes
        about 0.45x the time of its all-reduce of the buffer, and gloo's own
        reduce-scatter is slower than that all-reduce (``benchmarks/RESULTS.md``, "gloo
        collectives"), so gloo defaults to it. ``input`` is read, not changed, until the
        sum is written (``output`` may be a view of it).
        """
        if self.world_size == 1:
            return self._local(lambda: output.copy_(input.view_as(output)), async_op)
        via = via or self.reduce_scatter_path(input.device)
        if via == "all_reduce":
            n = input.numel() // self.world_size
            mine = input[self.rank * n : (self.rank + 1) * n]
            same = output.data_ptr() == mine.data_ptr()
            then = None if same else (lambda: output.copy_(mine.view_as(output)))
            return self._run(
                "all_reduce",
                2 * _nbytes(input),
                lambda: dist.all_reduce(input, group=self.group, async_op=async_op),
                async_op,
                then,
            )
        if via in ("all_to_all", "send_recv"):
            flat, world = input.reshape(-1), self.world_size
            _check_sizes("reduce_scatter", flat.numel(), output.numel(), world)
            n, need = flat.numel() // world, self.reduce_scatter_scratch(flat.numel(), via)
            if scratch is None:
                recv = torch.empty(need, dtype=flat.dtype, device=flat.device)
            else:
                recv = scratch.view(-1)[:need]
            a2a = via == "all_to_all"

            def start() -> dist.Work | _Works | None:
                if a2a:
                    return dist.all_to_all_single(recv, flat, group=self.group, async_op=async_op)
                return self._p2p_scatter(recv, flat)

            def sum_parts() -> None:
                parts = list(recv.view(world, n)) if a2a else self._with_own(recv, flat)
                _sum_parts(parts, output)

            return self._run("reduce_scatter", _nbytes(input), start, async_op, sum_parts)
        if via != "native":
            raise ArgumentError(
                f"Comm.reduce_scatter: via={via!r} is not native, all_reduce, send_recv or all_to_all"
            )
        return self._run(
            "reduce_scatter",
            _nbytes(input),
            lambda: _reduce_scatter_flat(output, input, group=self.group, async_op=async_op),
            async_op,
        )

    def reduce_scatter_path(self, device: torch.device) -> str:
        """The ``via`` :meth:`reduce_scatter` takes when given none, for tensors on
        ``device``: gloo's faster paths are for host memory; on CUDA tensors (ranks
        sharing a GPU) gloo keeps the all-reduce it was measured with."""
        if device.type == "cpu" or self.backend != "gloo":
            return self.reduce_scatter_via
        return "all_reduce"

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        via: str | None = None,
    ) -> Handle:
        """Concatenate every rank's ``input`` into ``output`` (rank order).

        ``via`` (None: :attr:`all_gather_via`): ``"native"``, the backend's all-gather;
        ``"send_recv"``, ``input`` sent to every other rank and each rank's part received
        straight into ``output`` (no staging copy), point to point under a tag unique
        to this call. On gloo the second is the faster (``benchmarks/RESULTS.md``)."""
        if self.world_size == 1:
            if output.data_ptr() == input.data_ptr():
                return self._local(None, async_op)
            return self._local(lambda: output.copy_(input.view_as(output)), async_op)
        if via is None:
            cpu = input.device.type == "cpu"
            via = self.all_gather_via if cpu else "native"
        if via == "send_recv":
            _check_sizes("all_gather", output.numel(), input.numel(), self.world_size)
            return self._run(
                "all_gather", _nbytes(output), lambda: self._p2p_gather(output, input), async_op
            )
        if via != "native":
            raise ArgumentError(f"Comm.all_gather: via={via!r} is not native or send_recv")
        return self._run(
            "all_gather",
            _nbytes(output),
            lambda: _all_gather_flat(output, input, group=self.group, async_op=async_op),
            async_op,
        )

    def _next_tag(self) -> int:
        # every rank issues its collectives in the same order, so the counter agrees
        self._p2p_tag = self._p2p_tag + 1 if self._p2p_tag < _P2P_TAG_END else _P2P_TAG_START
        return self._p2p_tag

    def _p2p(
        self,
        send_to: Callable[[int], torch.Tensor],
        recv_into: Callable[[int], torch.Tensor],
    ) -> _Works:
        """One isend of ``send_to(r)`` and one irecv into ``recv_into(r)`` per other rank
        r, under a tag unique to this call."""
        tag, works = self._next_tag(), list[dist.Work | None]()
        for r in range(self.world_size):
            if r != self.rank:
                peer = self._peer(r)
                works.append(dist.isend(send_to(r), peer, group=self.group, tag=tag))
                works.append(dist.irecv(recv_into(r), peer, group=self.group, tag=tag))
        return _Works(works)

    def _p2p_scatter(self, recv: torch.Tensor, flat: torch.Tensor) -> _Works:
        """Send chunk r of ``flat`` to each rank r; receive the other ranks' chunks of
        this rank's part into ``recv`` (in rank order, this rank's own skipped)."""
        n = flat.numel() // self.world_size

        def into(r: int) -> torch.Tensor:
            k = r - (r > self.rank)  # recv holds no chunk of this rank's own
            return recv[k * n : (k + 1) * n]

        return self._p2p(lambda r: flat[r * n : (r + 1) * n], into)

    def _with_own(self, recv: torch.Tensor, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's chunk of this rank's part, in rank order (own chunk from ``flat``)."""
        n = flat.numel() // self.world_size
        others = list(recv.view(self.world_size - 1, n))
        return [
            *others[: self.rank],
            flat[self.rank * n : (self.rank + 1) * n],
            *others[self.rank :],
        ]

    def _p2p_gather(self, output: torch.Tensor, input: torch.Tensor) -> _Works:
        n, flat, out = input.numel(), input.reshape(-1), output.view(-1)
        works = self._p2p(lambda r: flat, lambda r: out[r * n : (r + 1) * n])
        mine = out[self.rank * n : (self.rank + 1) * n]
        if mine.data_ptr() != flat.data_ptr():
            mine.copy_(flat)
        return works

    def reduce_scatter_scratch(self, numel: int, via: str) -> int:
        """Elements of the receive buffer :meth:`reduce_scatter` needs for an input of
        ``numel`` elements by ``via`` (0: none)."""
        if via == "all_to_all":
            return numel
        if via == "send_recv":
            return numel // self.world_size * (self.world_size - 1)
        return 0

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Handle:
        """Broadcast from group rank ``src`` (the global rank is looked up here)."""
        if self.world_size == 1:
            return self._local(None, async_op)
        gsrc = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._run(
            "broadcast",
            _nbytes(tensor),
            lambda: dist.broadcast(tensor, gsrc, group=self.group, async_op=async_op),
            async_op,
        )

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        *,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
    ) -> Handle:
        """All-to-all along dim 0: part j of ``input`` goes to rank j, and rank j's part
        for this rank lands at part j of ``output``. Equal parts unless the split sizes
        (rows of dim 0, one per rank; both or neither) are given. Counts the input
        buffer's bytes (the part a rank keeps included)."""
        if (output_splits is None) != (input_splits is None):
            raise ArgumentError(
                "Comm.all_to_all: give both output_splits and input_splits, or neither"
            )
        if input_splits is not None and output_splits is not None:
            for what, splits, t in (
                ("input", input_splits, input),
                ("output", output_splits, output),
            ):
                if len(splits) != self.world_size or sum(splits) != (t.shape[0] if t.dim() else 0):
                    raise ArgumentError(
                        f"Comm.all_to_all: {what}_splits {splits} are not {self.world_size} "
                        f"rank parts of dim 0 ({tuple(t.shape)})"
                    )
        if self.world_size == 1:
            return self._local(lambda: output.copy_(input), async_op)
        return self._run(
            "all_to_all",
            _nbytes(input),
            lambda: dist.all_to_all_single(
                output,
                input,
                output_split_sizes=output_splits,
                input_split_sizes=input_splits,
                group=self.group,
                async_op=async_op,
            ),
            async_op,
        )

    def _watched(self, op: str, fn: Callable[[], object]) -> object:
        wd = watchdog.current()
        if wd is not None:
            wd.block(op, self.axis, 0)
        try:
            return fn()
        finally:
            if wd is not None:
                wd.unblock()

    def barrier(self) -> None:
        if self.world_size > 1:
            self._watched("barrier", lambda: dist.barrier(group=self.group))

    def all_gather_object(self, obj: _T) -> list[_T]:
        """Gather a small picklable object from every rank (used for consistency checks)."""
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        self._watched(
            "all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group)
        )
        return out

    def send_recv(
        self,
        send: torch.Tensor,
        dst: int,
        recv: torch.Tensor,
        src: int,
        async_op: bool = False,
    ) -> Handle:
        """Send ``send`` to group rank ``dst`` while receiving ``recv`` from group rank
        ``src``, as one batch of point-to-point ops (a ring step). Filed as op
        ``"send_recv"`` with the bytes sent (send/recv count the buffer; in a ring every
        rank sends and receives as many)."""
        if self.world_size == 1:
            return self._local(lambda: recv.copy_(send), async_op)

        def start() -> _Works:
            def peer(r: int) -> int:
                return dist.get_global_rank(self.group, r) if self.group is not None else r

            ops = [
                dist.P2POp(dist.isend, send, peer(dst), group=self.group),
                dist.P2POp(dist.irecv, recv, peer(src), group=self.group),
            ]
            return _Works(dist.batch_isend_irecv(ops))

        return self._run("send_recv", _nbytes(send), start, async_op)

    def _peer(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Start sending ``tensor`` to group rank ``dst`` (point to point, pipeline
        stages); returns the :class:`Handle` to wait on before reusing the buffer.
        Filed as op ``"send"`` with the buffer's bytes."""
        if self.world_size == 1:
            raise UsageError("Comm.send: a group of one rank has no peer")
        return self._run(
            "send",
            _nbytes(tensor),
            lambda: dist.isend(tensor, self._peer(dst), group=self.group, tag=tag),
            True,
        )

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, async_op: bool = False) -> Handle:
        """Receive into ``tensor`` from group rank ``src`` (the sender's ``tag``). Filed
        as op ``"recv"`` with the buffer's bytes."""
        if self.world_size == 1:
            raise UsageError("Comm.recv: a group of one rank has no peer")
        return self._run(
            "recv",
            _nbytes(tensor),
            lambda: dist.irecv(tensor, self._peer(src), group=self.group, tag=tag),
            async_op,
        )


class _Works:
    """Several in-flight works behind the one ``wait()`` a :class:`Handle` calls."""

    def __init__(self, works: Sequence[dist.Work | None]) -> None:
        self._works = works

    def wait(self) -> bool:
        for w in self._works:
            if w is not None:  # torch types isend/irecv as Work | None
                w.wait()
        return True
