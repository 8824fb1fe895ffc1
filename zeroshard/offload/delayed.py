"""ZeRO-Offload's one-step delayed parameter update (DPU): the CPU optimizer step of
step *t* runs in a background thread while the device computes step *t+1*'s forward and
backward. No communication: the thread only steps host tensors; every collective (the
all-gather of the updated parameters) stays on the engine's thread.

``zero_optimization.offload_optimizer.delayed_update`` (a zeroshard key). With masters
``m`` (fp32, host) and ``w_t`` the parameters step *t*'s gradient ``g_t`` is taken at::

    m_{t+1} = m_t + U_t(g_t)               (the optimizer's update, applied in order)
    w_t     = m_t       for t <= W         (W = delayed_update_after: exact warm-up)
    w_t     = m_{t-1}   for t >  W         (one update late)

At step *t* >= W (``global_steps`` counts), the engine takes every decision on ``g_t``
first (clipping norm, non-finite check, fp16 loss-scale skip: a skipped step is never
launched), then :meth:`DelayedUpdate.step` starts a thread that copies ``g_t`` (this
rank's reduced shard, already in host memory) into a buffer of its own and steps the
masters; the next backward waits for the copy (:meth:`release_gradients`, hidden behind
the forward) before it writes the reducer's shard again. The parameters are left
as they are (``m_t``). At the next step boundary, or before anything reads or writes the
parameters, masters or optimizer states (checkpoints, ``GatheredParameters``, an eval
forward, ``engine.wait_param_gather()``, ``destroy()``), the engine calls
:meth:`DelayedUpdate.wait` (join, then write the masters into the parameter store) and
re-assembles the parameters (``after_step``: the stage 1-2 all-gather). A landing
before the next boundary (a checkpoint, an eval forward) makes the next step exact:
``w_{t+1} = m_{t+1}``. Parameters changed in place between steps (outside
``GatheredParameters``) are overwritten when the step lands (a warning says so).

The thread steps a shallow twin of the torch optimizer whose param groups are copies
taken at launch: it shares the tensors and the state, but the learning-rate scheduler
stepping right after the launch changes the live groups, not the ones the thread reads.
So step *t* uses the lr of step *t*, as without the delay.

On a GPU the landing uploads every master (non-blocking, from pinned memory) at the
boundary, so the next forward waits on the device for the upload: unlike the exact
offloaded step, the upload does not overlap a segment's step. The thread of the next
step waits for those uploads (an event) before it rewrites the masters; the host does
not.

Memory: the masters are always apart from the parameters (on a CPU-only run too), plus
one fp32 host copy of this rank's gradient shard.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import torch

from zeroshard import ZeroshardError
from zeroshard.distributed.device import Runtime
from zeroshard.offload.nvme import OffloadError
from zeroshard.offload.states import StateStore, StepGrads


class DelayedStepError(ZeroshardError, RuntimeError):
    """The delayed optimizer step, run in its thread, failed (the cause is chained)."""


class MemoryStore(StateStore, Protocol):
    """What the delayed update calls on the store it wraps, beyond the state-store
    protocol: ``zero/optim/memory_store.MemoryStates`` satisfies it."""

    @property
    def inner(self) -> torch.optim.Optimizer: ...

    @property
    def masters(self) -> list[torch.Tensor]:
        """This rank's fp32 master chunks, one per segment."""

    @property
    def rt(self) -> Runtime:
        """The device runtime of the parameters (``distributed/device.py``)."""

    def take_upload_event(self) -> Any:
        """The event after the last non-blocking uploads of the masters, or None."""

    def prepare_step(
        self,
        optimizer: torch.optim.Optimizer,
        chunks: list[torch.Tensor],
        factor: float,
        unused: AbstractSet[int] = frozenset(),
    ) -> bool:
        """Give ``optimizer``'s masters their gradients from ``chunks``, scaled by
        ``factor``; True when the scale is left to the fused kernel (``grad_scale``)."""

    def clear_grads(self, optimizer: torch.optim.Optimizer) -> None: ...

    def write_masters(self) -> None:
        """Write the masters into the parameter store."""


class DelayedUpdate:
    """The memory store of ``zero/optim/memory_store.py`` with its step run one step late.

    Answers the same protocol (:class:`~zeroshard.offload.states.StateStore`: ``step``,
    ``read``/``write``, ``kinds``, ...) and shows the wrapped store's ``masters``; every
    call that touches masters or states waits for the step in flight first (the engine
    does so earlier, at its own synchronization points; these waits are a safety net).
    ``armed``: set by the engine before each step, whether this step may be delayed
    (False during the warm-up: the step is the exact one of the wrapped store)."""

    def __init__(self, states: MemoryStore, *, after: int) -> None:
        if not states.separate:
            raise OffloadError("internal: the delayed update needs masters apart from parameters")
        self.states, self.after = states, after
        self.armed = False
        #: a step was launched whose values the engine has not re-assembled yet
        self.in_flight = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._written = True  # the masters are in the parameter store
        self._grads: list[torch.Tensor] | None = None
        self._copied = threading.Event()  # the thread holds its copy of the gradients
        self._copied.set()

    # -- the step -----------------------------------------------------------------------
    def step(self, grads: StepGrads, factor: float, unused: AbstractSet[int] = frozenset()) -> None:
        """Exact step (not armed), or copy the gradients and start the step in a thread."""
        self.wait()
        if not self.armed:
            self.states.step(grads, factor, unused)
            return
        st = self.states
        # GPU: the uploads of the last landed masters may still be running; the thread
        # waits for them before it rewrites the masters (the host goes on at once)
        uploading = st.take_upload_event()
        if self._grads is None:  # (a segment of frozen parameters has no gradient)
            self._grads = [
                torch.empty(g.shape, dtype=m.dtype, device=m.device)
                for m, g in zip(st.masters, grads.chunks, strict=True)
            ]
        self._copied.clear()
        twin = object.__new__(type(st.inner))
        twin.__dict__.update(st.inner.__dict__)
        # a torch LR scheduler wraps ``step`` on the instance, bound to the live optimizer
        twin.__dict__.pop("step", None)
        twin.param_groups = [dict(g) for g in st.inner.param_groups]
        self._error = None
        self._written = False
        self.in_flight = True
        self._thread = threading.Thread(
            target=self._run,
            args=(twin, list(grads.chunks), factor, frozenset(unused), uploading),
            name="zeroshard-delayed-update",
        )
        self._thread.start()

    def _run(self, twin, reduced: list[torch.Tensor], factor: float, unused, uploading) -> None:
        try:
            chunks = self._grads
            assert chunks is not None  # step() allocated them before starting this thread
            try:  # to the masters' dtype and place, as the exact step does
                for dst, src in zip(chunks, reduced, strict=True):
                    dst.copy_(src)
            finally:
                self._copied.set()  # the next backward may write the reducer's shard
            self.states.rt.sync_event(uploading)  # the device has read the masters
            self.states.prepare_step(twin, chunks, factor, unused)  # grad_scale: twin's own
            twin.step()
            self.states.clear_grads(twin)
        except BaseException as e:  # re-raised on the engine's thread by wait()
            self._error = e

    def release_gradients(self) -> None:
        """Wait until the step in flight has copied the reduced gradients (the engine
        calls it before a backward writes the reducer's gradient shard again)."""
        self._copied.wait()

    def wait(self) -> bool:
        """Wait for the step in flight and write its masters into the parameter store;
        True if it wrote them now. Re-raises an error of the step."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            self._written = True
            raise DelayedStepError("zeroshard: the delayed optimizer step failed") from error
        if self._written:
            return False
        self.states.write_masters()  # the next step waits for their uploads (GPU)
        self._written = True
        return True

    # -- the store protocol (waits first) ---------------------------------------------------
    @property
    def inner(self) -> torch.optim.Optimizer:
        return self.states.inner

    @property
    def separate(self) -> bool:
        return self.states.separate  # always (see __init__)

    @property
    def masters(self) -> list[torch.Tensor]:
        """The wrapped store's master chunks (read-only use; no wait: the memory report
        reads their sizes)."""
        return self.states.masters

    @property
    def param_groups(self) -> list[dict]:
        return self.states.param_groups

    @property
    def state(self) -> Any:
        self.wait()
        return self.states.state

    @property
    def kinds(self) -> Sequence[str]:
        self.wait()
        return self.states.kinds

    def init_state(self, zero_grads: list[torch.Tensor]) -> None:
        self.states.init_state(zero_grads)

    def read(self, kind: str, a: int, b: int) -> torch.Tensor:
        self.wait()
        return self.states.read(kind, a, b)

    def write(self, kind: str, a: int, values: torch.Tensor) -> None:
        self.wait()
        self.states.write(kind, a, values)

    def refresh(self, segments: list[int]) -> None:
        self.wait()
        self.states.refresh(segments)

    def group_steps(self) -> list[float]:
        self.wait()
        return self.states.group_steps()

    def set_group_steps(self, steps: list[float]) -> None:
        self.wait()
        self.states.set_group_steps(steps)

    def buffers(self) -> list[torch.Tensor]:
        """The wrapped store's, plus the gradient copy (once made)."""
        return self.states.buffers() + list(self._grads or [])

    def disk_bytes(self) -> int:
        return 0
