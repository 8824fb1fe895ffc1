"""DeepSpeed-compatible learning-rate schedules.

Same class names, parameter names, defaults and per-step values as DeepSpeed's
``deepspeed.runtime.lr_schedules`` (checked against DeepSpeed 0.19.8, see
``tests/data/make_lr_reference.py``).

Step semantics (as in DeepSpeed): ``last_batch_iteration`` starts at -1.  Construction
(with the default ``last_batch_iteration=-1``) writes the lr used by the *first* optimizer
step; the engine then calls ``step()`` once after every applied optimizer step, which
increments ``last_batch_iteration`` and writes ``get_lr()`` into ``param_groups[i]["lr"]``.
So the k-th optimizer step (k >= 2) runs with the lr for ``last_batch_iteration == k - 2``.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import torch

from zeroshard import ArgumentError, UsageError
from zeroshard.config.schema import ConfigError

logger = logging.getLogger("zeroshard.schedulers")  # its name before the move

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"


def _per_group(optimizer, value, name: str) -> list:
    """Broadcast a scalar to every param group, or check a per-group list/tuple."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ArgumentError(f"expected {n} values for {name}, got {len(value)}")
        return list(value)
    return [value] * n


class _Schedule:
    """Shared plumbing: iteration counter, writing lrs, state dict."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: list[float] | None = None

    def _write_lrs(self, lrs) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]

    def get_lr(self) -> list[float]:
        raise NotImplementedError  # each schedule's own

    def _apply(self) -> None:
        self._write_lrs(self.get_lr())

    def _apply_initial(self) -> None:
        self._apply()

    def _start(self) -> None:
        # DeepSpeed writes the first step's lr at construction only for a fresh schedule
        if self.last_batch_iteration == -1:
            self._apply_initial()

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise UsageError("need to call step() first")
        return list(self._last_lr)

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": int(self.last_batch_iteration)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # DeepSpeed only restores the counter; we also rewrite the param groups with the
        # lr that counter implies (the value a restored optimizer already holds).
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        (self._apply_initial if self.last_batch_iteration == -1 else self._apply)()


class LRRangeTest(_Schedule):
    """LR range test: ``lr = min_lr * (1 + step_rate * interval)`` where
    ``interval = (last_batch_iteration + 1) / step_size``, floored when ``staircase``.
    After construction lr is ``lr_range_test_min_lr``."""

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr: float = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ArgumentError(
                f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size}"
            )
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        self._start()

    def _apply_initial(self) -> None:
        self._write_lrs(self.min_lr)

    def get_lr(self) -> list[float]:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [min_lr * increase for min_lr in self.min_lr]


class OneCycle(_Schedule):
    """1Cycle lr (and momentum) policy.

    With ``t = last_batch_iteration + 1``, ``T = first + second`` (second defaults to
    first), ``x = t/T - floor(t/T)`` and ``r = first/T``: ``s = x/r`` if ``x <= r`` else
    ``(x-1)/(r-1)``; a stair count ``c > 0`` for that half quantises ``s`` to
    ``floor(offset * c / half_size) / c`` (offset from the cycle start or end).
    While ``last_batch_iteration < T``: ``lr = min_lr + (max_lr - min_lr) * s`` and
    ``mom = max_mom - (max_mom - min_mom) * s``.  Afterwards, with
    ``d = (last_batch_iteration - T + 1) / decay_step_size``:
    ``lr = min_lr / (1 + decay_lr_rate * d)`` and ``mom = max_mom * (1 + decay_mom_rate * d)``
    (no decay, i.e. ``min_lr``/``max_mom``, when the step size or the rate is 0).
    After construction lr is ``cycle_min_lr`` and momentum ``cycle_min_mom``.

    Momentum goes to ``betas[0]`` (Adam-style groups; like DeepSpeed, ``betas`` is set
    to ``(mom, 0.99)``) or to ``momentum`` (SGD-style groups; DeepSpeed skips these).
    """

    def __init__(
        self,
        optimizer,
        cycle_min_lr,
        cycle_max_lr,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ArgumentError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ArgumentError(f"cycle_second_step_size must be non-negative, got {second}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count
            if cycle_second_stair_count is None
            else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        groups = optimizer.param_groups
        self.momentum_key: str | None = None
        if cycle_momentum:
            if all("betas" in g for g in groups):
                self.momentum_key = "betas"
            elif all("momentum" in g for g in groups):
                self.momentum_key = "momentum"
            else:
                logger.warning("cycle_momentum disabled: optimizer has no betas/momentum")
        self.cycle_momentum = self.momentum_key is not None
        self._start()

    def _scale_factor(self) -> float:
        t = self.last_batch_iteration + 1
        cycle = math.floor(1 + t / self.total_size)
        x = 1.0 + t / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # quantise from the integer offset, not from the float scale
            offset = t % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            pairs = zip(self.min_lrs, self.max_lrs, strict=True)
            return [lo + (hi - lo) * scale for lo, hi in pairs]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def _moms(self) -> list[float]:
        """The momentum (``betas[0]`` or SGD's ``momentum``) of each group now."""
        if self.last_batch_iteration < self.total_size:
            scale = self._scale_factor()
            pairs = zip(self.min_moms, self.max_moms, strict=True)
            return [hi - (hi - lo) * scale for lo, hi in pairs]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval()
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | list[float] | None:
        """Each group's momentum for the current iteration, or None when not cycled. For
        an optimizer with ``betas`` it is what is written to the groups, as DeepSpeed's:
        ``(beta1, 0.99)`` per group; for SGD (``momentum``; DeepSpeed does not cycle it)
        the momentum alone."""
        if not self.cycle_momentum:
            return None
        if self.momentum_key == "betas":
            return [(m, 0.99) for m in self._moms()]
        return self._moms()

    def _write_moms(self, moms: list[float]) -> None:
        if self.momentum_key is None:
            return
        for group, mom in zip(self.optimizer.param_groups, moms, strict=True):
            group[self.momentum_key] = (mom, 0.99) if self.momentum_key == "betas" else mom

    def _apply(self) -> None:
        self._write_lrs(self.get_lr())
        self._write_moms(self._moms())

    def _apply_initial(self) -> None:
        self._write_lrs(self.min_lrs)
        self._write_moms(self.min_moms)


class _Warmup(_Schedule):
    """Warmup bookkeeping shared by WarmupLR, WarmupDecayLR and WarmupCosineLR."""

    def _init_warmup(self, warmup_num_steps, warmup_type: str) -> None:
        steps = warmup_num_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ArgumentError(f"warmup_num_steps must be an integer >= 0, got {steps!r}")
        # log warmup divides by log(n): DeepSpeed raises n to at least 2 (0 and 1 alike)
        self.warmup_num_steps = max(2, steps)
        if warmup_type not in (WARMUP_LOG, WARMUP_LINEAR):
            logger.warning("unknown warmup_type %r; using 'log'", warmup_type)
            warmup_type = WARMUP_LOG
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        total = getattr(self, "total_num_steps", None)
        if total is not None and total < self.warmup_num_steps:
            logger.warning("total_num_steps %s < warmup_num_steps %s", total, warmup_num_steps)

    def _warmup_gamma(self) -> float:
        if self.warmup_type == WARMUP_LOG:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps


class WarmupLR(_Warmup):
    """Warm up then hold: ``lr = min_lr + (max_lr - min_lr) * g`` with, for
    ``0 <= i = last_batch_iteration < n`` (``n = max(2, warmup_num_steps)``),
    ``g = log(i + 1) / log(n)`` ('log') or ``g = i / n`` ('linear'), and ``g = 1`` after.
    After construction lr is ``warmup_min_lr``; ``warmup_max_lr=None`` means each group's
    current lr."""

    def __init__(
        self,
        optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self._init_warmup(warmup_num_steps, warmup_type)
        self._start()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``: after warmup
    ``g = max(0, (total_num_steps - i) / max(1, total_num_steps - n))``."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = total_num_steps
        args = (warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        super().__init__(optimizer, *args)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Warmup):
    """Ratio of each group's construction-time lr: during warmup (``i < n``)
    ``r = warmup_min_ratio + (1 - warmup_min_ratio) * g`` (``g`` as in WarmupLR); after,
    with ``p = min(1, (i - n + 1) / max(1, total_num_steps - n))``,
    ``r = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)``.
    After construction lr is 0."""

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self._init_warmup(warmup_num_steps, warmup_type)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self._start()

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            ratio = self._warmup_gamma()
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


SCHEDULERS: dict[str, type[_Schedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
    "LRRangeTest": LRRangeTest,
}

_TOTAL_AUTO_MSG = (
    "scheduler.params.total_num_steps: 'auto' needs the number of training steps, "
    "which zeroshard cannot infer; set it"
)


def _resolve_auto(key: str, optimizer):
    if key in ("warmup_max_lr", "cycle_max_lr"):
        return float(optimizer.param_groups[0]["lr"])
    if key in ("warmup_min_lr", "warmup_num_steps"):
        return {"warmup_min_lr": 0.0, "warmup_num_steps": 0}[key]
    if key == "total_num_steps":
        raise ConfigError(_TOTAL_AUTO_MSG)
    raise ConfigError(f"scheduler.params.{key}: 'auto' is not supported for this parameter; set it")


def build_scheduler(type_name: str, params: dict | None, optimizer) -> _Schedule:
    """Build ``SCHEDULERS[type_name](optimizer, **params)``, resolving "auto" values."""
    cls = SCHEDULERS.get(type_name)
    if cls is None:
        raise ConfigError(
            f"scheduler.type: unknown scheduler {type_name!r}; expected one of {sorted(SCHEDULERS)}"
        )
    signature = inspect.signature(cls.__init__)
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    kwargs = {}
    for key, value in (params or {}).items():
        if key not in accepted:
            raise ConfigError(
                f"scheduler.params.{key}: not a parameter of {type_name} ({accepted})"
            )
        kwargs[key] = _resolve_auto(key, optimizer) if value == "auto" else value
    for name in accepted:
        if signature.parameters[name].default is inspect.Parameter.empty and name not in kwargs:
            raise ConfigError(f"scheduler.params.{name}: required by {type_name}")
    return cls(optimizer, **kwargs)
