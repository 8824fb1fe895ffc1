"""Run one stage's schedule (``schedules.py``'s actions) for one batch.

:class:`StageRunner` walks the action list: ``RECV_*`` block until the neighbour's data
is here, ``SEND_*`` start asynchronously (completed at the end of the batch), ``F``
runs a model chunk on a micro-batch (on the last virtual stage also the loss), ``B``
runs its whole backward, ``BI`` only the gradient of the chunk's input
(``torch.autograd.grad`` keeping the graph) and ``BW`` only the parameters' gradients
(``torch.autograd.backward(..., inputs=parameters)``: autograd walks the graph again
down to the parameters, so the split costs some recomputed input gradients; the graph
is freed after ``BW``).

Every action is timed into :attr:`StageRunner.trace` (stage, kind, microbatch, chunk,
t_start, t_end; ``time.perf_counter`` seconds). Saved activations are counted with
``torch.autograd.graph.saved_tensors_hooks`` while forwards run: bytes of tensors
autograd keeps for backward (parameters excluded, a storage counted once) live at any
moment, and the peak; also the most micro-batches in flight (forwarded, backward not
finished).

Communication: only through :class:`~zeroshard.parallel.pipeline.p2p.StageLink`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from zeroshard import InternalError
from zeroshard.parallel.pipeline.p2p import StageLink, as_tuple
from zeroshard.parallel.pipeline.schedules import Action


class SavedActivations:
    """Bytes of saved activations alive now and at most (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.bytes = 0
        self.peak = 0

    def reset(self) -> None:
        self.peak = self.bytes

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or ptr == 0:
            return t
        entry = self._live.get(ptr)
        if entry is None:
            entry = self._live[ptr] = [0, storage.nbytes()]
            self.bytes += entry[1]
            self.peak = max(self.peak, self.bytes)
        entry[0] += 1
        return _Held(t, ptr, self)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self._live[ptr]


class _Held:
    __slots__ = ("counter", "ptr", "tensor")

    def __init__(self, tensor: torch.Tensor, ptr: int, counter: SavedActivations) -> None:
        self.tensor, self.ptr, self.counter = tensor, ptr, counter

    def __del__(self) -> None:
        self.counter.release(self.ptr)


class StageRunner:
    """One pipeline rank's executor (see the module docstring).

    ``forward(x, chunk)`` runs a model chunk; ``loss_fn(out, labels)`` the loss;
    ``backward(run)`` wraps a backward that accumulates parameter gradients (the
    engine's reducer hooks); ``loss_scale()`` the factor the last stage's loss is
    multiplied by before its backward (1 / micro-batches x the fp16 loss scale).
    """

    def __init__(
        self,
        *,
        stage: int,
        stages: int,
        chunks: int,
        link: StageLink | None,
        forward: Callable[[Any, int], Any],
        loss_fn: Callable | None,
        params: list[torch.Tensor],
        backward: Callable[[Callable[[], None]], None],
        device: torch.device,
    ) -> None:
        self.stage, self.stages, self.chunks = stage, stages, chunks
        self.link, self.forward, self.loss_fn = link, forward, loss_fn
        self.params, self.backward, self.device = params, backward, device
        self.trace: list[dict] = []
        self.saved = SavedActivations(params)
        self.peak_inflight = 0
        self._scaled: dict[tuple[int, int], torch.Tensor] = {}

    def _virtual(self, chunk: int) -> int:
        return chunk * self.stages + self.stage

    def _peer_link(self) -> StageLink:
        if self.link is None:
            raise InternalError("pipeline: a send/recv action on a stage without neighbours")
        return self.link

    def run(
        self,
        actions: list[Action],
        inputs: list[Any] | None,
        labels: list[Any] | None,
        *,
        train: bool = True,
        loss_scale: float = 1.0,
        keep_outputs: bool = False,
    ) -> tuple[list[torch.Tensor], list[Any]]:
        """Run ``actions``; ``inputs`` / ``labels`` per micro-batch (first / last virtual
        stage only). Returns the last stage's unscaled losses (detached) and, with
        ``keep_outputs``, its outputs."""
        last = self.stages * self.chunks - 1
        act_in: dict[tuple[int, int], tuple] = {}  # received activation (leaves)
        act_out: dict[tuple[int, int], Any] = {}  # the chunk's output (or loss)
        grads_out: dict[tuple[int, int], list] = {}  # gradients received for outputs
        grads_in: dict[tuple[int, int], list] = {}  # gradients of the inputs, to send
        losses: list[torch.Tensor] = []
        outputs: list[Any] = []
        self.trace = []
        self._scaled.clear()
        self.saved.reset()
        self.peak_inflight, inflight = 0, 0
        hooks = torch.autograd.graph.saved_tensors_hooks(self.saved.pack, self.saved.unpack)
        grad_mode = torch.enable_grad() if train else torch.no_grad()
        for a in actions:
            key, vs = (a.microbatch, a.chunk), self._virtual(a.chunk)
            t0 = time.perf_counter()
            if a.kind == "RECV_F":
                act_in[key] = self._peer_link().recv_activation(
                    (vs - 1) % self.stages, a.microbatch, vs
                )
            elif a.kind == "F":
                if vs > 0:
                    x = act_in.get(key)
                else:
                    assert inputs is not None  # the stage with the first chunk reads the batch
                    x = inputs[a.microbatch]
                if vs > 0 and isinstance(x, tuple) and len(x) == 1:
                    x = x[0]
                with grad_mode, hooks:
                    out = self.forward(x, a.chunk)
                    if vs == last:
                        if keep_outputs:
                            outputs.append(out.detach() if torch.is_tensor(out) else out)
                        if self.loss_fn is not None and labels is not None:
                            out = self.loss_fn(out, labels[a.microbatch])
                            losses.append(out.detach())
                if train:
                    act_out[key] = out
                    inflight += 1
                    self.peak_inflight = max(self.peak_inflight, inflight)
                elif vs < last:
                    act_out[key] = out
            elif a.kind == "SEND_F":
                out = act_out[key] if train else act_out.pop(key)
                self._peer_link().send_activation(out, (vs + 1) % self.stages, a.microbatch, vs + 1)
            elif a.kind == "RECV_B":
                like = self._with_grad(act_out[key])
                grads_out[key] = self._peer_link().recv_gradients(
                    like, (vs + 1) % self.stages, a.microbatch, vs + 1
                )
            elif a.kind in ("B", "BI", "BW"):
                done = self._backward(a.kind, key, vs == last, act_in, act_out, grads_out, grads_in, loss_scale)  # fmt: skip
                inflight -= done
            elif a.kind == "SEND_B":
                self._peer_link().send_gradients(
                    grads_in.pop(key), (vs - 1) % self.stages, a.microbatch, vs
                )
            self.trace.append(
                {
                    "stage": self.stage,
                    "kind": a.kind,
                    "microbatch": a.microbatch,
                    "chunk": a.chunk,
                    "t_start": t0,
                    "t_end": time.perf_counter(),
                }
            )
        if self.link is not None:
            self.link.wait_sends()
        return losses, outputs

    @staticmethod
    def _with_grad(out) -> list[torch.Tensor]:
        return [t for t in as_tuple(out) if t.is_floating_point() and t.requires_grad]

    def _backward(self, kind, key, is_last, act_in, act_out, grads_out, grads_in, scale) -> int:
        """One backward action; returns 1 when it ends the micro-batch's backward."""
        if is_last:  # the loss, scaled once (BI and BW of a micro-batch share it)
            if key not in self._scaled:
                self._scaled[key] = act_out[key] * scale
            outs, grads = [self._scaled[key]], None
        else:
            outs, grads = self._with_grad(act_out[key]), grads_out[key]
        leaves = [t for t in act_in.get(key, ()) if t.requires_grad]
        if kind == "BI":
            grads_in[key] = []
            if leaves:
                got = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)  # fmt: skip
                grads_in[key] = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, got, strict=True)]  # fmt: skip
            return 0
        if kind == "BW":
            params = [p for p in self.params if p.requires_grad]
            if params and any(o.requires_grad for o in outs):
                self.backward(lambda: torch.autograd.backward(outs, grads, inputs=params))
        else:  # B
            self.backward(lambda: torch.autograd.backward(outs, grads))
            grads_in[key] = [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]
        for d in (act_out, act_in, grads_out, self._scaled):
            d.pop(key, None)
        return 1
