"""What ``engine.backward`` and ``engine.step`` do to the ZeRO parts, as functions of
the parts they touch (the engine keeps the counters, the monitors and the calls'
bookkeeping): the scaled loss, the backward into the gradient reducer, the optimizer
step at an accumulation boundary, and the landing of a delayed update.

Communication: none of its own; the reducer reduces during the backward and at its
``finalize()``, the sharded optimizer's step issues its flags and norm all-reduces, and
the parameter manager re-assembles whole parameters after it (stages 1-2: the
all-gather); see their module docstrings.
"""

from __future__ import annotations

import logging

import torch

from zeroshard import UsageError
from zeroshard.monitor.hub import EngineMonitor
from zeroshard.offload.delayed import DelayedUpdate
from zeroshard.runtime.precision import LossScaler
from zeroshard.zero.grads.reducer import GradReducer
from zeroshard.zero.optim.optimizer import ShardedOptimizer
from zeroshard.zero.params.manager import ParamManager

log = logging.getLogger("zeroshard")


def check_frozen(frozen: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Refuse a backward once a parameter frozen at ``initialize`` requires grad."""
    for name, p in frozen:
        if p.requires_grad:
            raise UsageError(
                f"parameter {name!r} was frozen (requires_grad=False) when initialize() "
                "ran and now requires grad: zeroshard laid out its gradient and optimizer "
                "storage then. Call engine.destroy() and initialize() again after "
                "changing requires_grad, or unfreeze it before initialize()"
            )


def scaled_loss(loss: torch.Tensor, gas: int, scale: float, scale_wrt_gas: bool) -> torch.Tensor:
    """``loss`` divided by the accumulation steps (``scale_wrt_gas``), times the loss
    scale (fp16)."""
    scaled = loss
    if scale_wrt_gas and gas > 1:
        scaled = scaled / gas
    if scale != 1.0:
        scaled = scaled * scale
    return scaled


def run_backward(
    scaled: torch.Tensor,
    *,
    boundary: bool,
    retain_graph: bool,
    reducer: GradReducer,
    params: ParamManager,
    monitor: EngineMonitor,
    delayed: DelayedUpdate | None,
) -> None:
    """Backward of ``scaled``, its gradients reduced while it runs (on the reducing
    micro-steps: ``boundary``, or every one with sharded gradients)."""
    if delayed is not None:  # the step in flight has copied the last gradients
        delayed.release_gradients()
    reducer.begin(boundary, [scaled])
    params.begin_backward()
    try:
        scaled.backward(retain_graph=retain_graph)
        monitor.backward_inner_end()
    except BaseException:
        reducer.abandon()  # no backward runs any more; the window keeps its state
        raise
    else:
        reducer.finish()
    finally:
        params.end_backward()


def land_delayed(delayed: DelayedUpdate | None, params: ParamManager) -> None:
    """offload_optimizer.delayed_update: wait for the optimizer step in flight, write
    its masters into the parameters and re-assemble them (stages 1-2: all-gather)."""
    if delayed is None or not delayed.in_flight:
        return
    if params.edited():
        log.warning(
            "zeroshard: parameters were changed in place while a delayed optimizer "
            "step was in flight (offload_optimizer.delayed_update); the step's values "
            "overwrite the change (use GatheredParameters(..., modifier_rank=...))"
        )
    delayed.wait()
    params.after_step()
    delayed.in_flight = False


def optimizer_step(
    *,
    optimizer: ShardedOptimizer,
    reducer: GradReducer,
    params: ParamManager,
    delayed: DelayedUpdate | None,
    global_steps: int,
    loss_finite: bool,
) -> bool:
    """The update at an accumulation boundary (``global_steps`` steps done so far):
    masters take edits made since, the reducer's window is finalized, the optimizer steps
    (or skips: False) and the parameters are made whole again (unless delayed)."""
    land_delayed(delayed, params)
    if delayed is not None:
        delayed.armed = global_steps >= delayed.after
    # e.g. p.clamp_() after the last step: the masters take it (zero/params/edits.py)
    optimizer.refresh_masters(params.take_edits())
    grads = reducer.finalize()  # reduces a window of local sums first
    applied = optimizer.apply_step(grads, loss_finite)
    if applied and (delayed is None or not delayed.in_flight):
        params.after_step()
    return applied


def say_skipped(step: int, skipped: int, scaler: LossScaler) -> None:
    """Rank 0's warning for a step skipped on every rank (step ``step``, 1-based)."""
    what = "fp16 overflow" if scaler.dynamic else "inf/nan gradients or loss"
    log.warning(
        "zeroshard: step %d skipped on every rank (%s on some rank; %d skipped so far)%s",
        step,
        what,
        skipped,
        f"; loss scale now {scaler.scale:g}" if scaler.dynamic else "",
    )
