# ruff: noqa: RUF009  (fields are made by key(), which returns a dataclasses.field)
"""The monitoring sections of a DeepSpeed config (``tensorboard``, ``csv_monitor``,
``wandb``, ``comet``, ``comms_logger``, ``flops_profiler``, ``timers``), each a frozen
kw_only dataclass whose fields are the schema (see :mod:`zeroshard.config.schema`).
Part of :mod:`zeroshard.config`'s ``Config``; used by :mod:`zeroshard.monitor`. No
collectives, no devices.

Key names and defaults are DeepSpeed's (its ``deepspeed/monitor/config.py``,
``comm/config.py``, ``profiling/config.py`` and ``runtime/config.py``). One key is
zeroshard's own: ``all_ranks`` on the four writers (DeepSpeed writes from rank 0 only,
as zeroshard does by default). Checks that need the machine (a writable output
directory, the writer's package installed) happen when the engine is built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from zeroshard.config.schema import INERT, ConfigError, Section, key

# DeepSpeed's op names (its torch.distributed wrappers) -> zeroshard's ledger names
COMM_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "inference_all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_base": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_base": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
}

_ALL_RANKS = "zeroshard only: every rank writes (rank r > 0 under job_name/rank<r>); DeepSpeed, and false: rank 0 only."  # fmt: skip
_enabled = functools.partial(key, False)


def _known_ops(value: Any, at: str) -> None:
    for op in value if isinstance(value, list) else ():
        if isinstance(op, str) and op not in COMM_OPS:
            known = ", ".join(sorted(COMM_OPS))
            raise ConfigError(at, f"unknown collective {op!r}; one of {known}")


# fmt: off
@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig(Section):
    """``tensorboard``: event files through ``torch.utils.tensorboard`` (package
    ``tensorboard``), in ``output_path/job_name``."""

    enabled: bool = _enabled(doc="Write TensorBoard event files.")
    output_path: str = key("", doc="Directory of the job directories ('' = the working directory).")
    job_name: str = key("DeepSpeedJobName", doc="The job's directory under output_path.")
    all_ranks: bool = _enabled(doc=_ALL_RANKS)


@dataclass(frozen=True, kw_only=True)
class CSVMonitorConfig(Section):
    """``csv_monitor``: one CSV file per metric (DeepSpeed's names, e.g.
    ``Train_Samples_train_loss.csv``) and zeroshard's ``metrics.jsonl``, in
    ``output_path/job_name``."""

    enabled: bool = _enabled(doc="Write CSV files.")
    output_path: str = key("", doc="Directory of the job directories ('' = the working directory).")
    job_name: str = key("DeepSpeedJobName", doc="The job's directory under output_path.")
    all_ranks: bool = _enabled(doc=_ALL_RANKS)


@dataclass(frozen=True, kw_only=True)
class WandbConfig(Section):
    """``wandb``: Weights & Biases (package ``wandb``; ``WANDB_MODE=offline`` works with
    no network)."""

    enabled: bool = _enabled(doc="Log to Weights & Biases.")
    group: str | None = key(None, doc="Run group.")
    team: str | None = key(None, doc="Team (entity).")
    project: str = key("deepspeed", doc="Project.")
    all_ranks: bool = _enabled(doc="zeroshard only: every rank logs a run (named rank<r>, in the group); false: rank 0 only.")


@dataclass(frozen=True, kw_only=True)
class CometConfig(Section):
    """``comet``: Comet (package ``comet_ml``; ``online: false`` works with no network)."""

    enabled: bool = _enabled(doc="Log to Comet.")
    samples_log_interval: int = key(100, doc="Samples between two logs of one metric.", min=1)
    project: str | None = key(None, doc="Project.")
    workspace: str | None = key(None, doc="Workspace.")
    api_key: str | None = key(None, doc="API key (better: COMET_API_KEY).")
    experiment_name: str | None = key(None, doc="Experiment name.")
    experiment_key: str | None = key(None, doc="Experiment key (to resume one).")
    online: bool | None = key(None, doc="Log online (null: Comet's default, online).")
    mode: str | None = key(None, doc="get, create or get_or_create.", choices=("get", "create", "get_or_create"))
    all_ranks: bool = _enabled(doc="zeroshard only: every rank logs an experiment; false: rank 0 only.")


@dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig(Section):
    """``comms_logger``: every collective's time, size and bandwidth, from the ledger."""

    enabled: bool = _enabled(doc="Record collectives for the summary (zeroshard.comm.log_summary()).")
    verbose: bool = key(False, doc="Print every collective as it completes (rank 0).")
    prof_all: bool = key(True, doc="Record every collective (false: only those in prof_ops).")
    debug: bool = key(False, doc="Name the calling function with each op.")
    prof_ops: list[str] | None = key(None, doc="Collectives recorded when prof_all is false (DeepSpeed's or zeroshard's names).", check=_known_ops)


@dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig(Section):
    """``flops_profiler``: FLOPs (counted by torch's FlopCounterMode), parameters and
    latency per module at one step, model TFLOPS and MFU."""

    enabled: bool = _enabled(doc="Profile one step.")
    recompute_fwd_factor: float = key(0.0, INERT("backward FLOPs are counted, recomputed forwards included"), doc="Share of forward recomputed in backward.", min=0)
    profile_step: int = key(1, doc="Profile the step that starts with this many steps done.", min=0)
    module_depth: int = key(-1, doc="Deepest module level in the table (-1: all).", min=-1)
    top_modules: int = key(1, doc="Modules listed per level in the aggregated profile.", min=1)
    detailed: bool = key(True, doc="Print the per-module table.")
    output_file: str | None = key(None, doc="Write the profile to this file instead of stdout.")


@dataclass(frozen=True, kw_only=True)
class ThroughputTimerConfig(Section):
    """``timers.throughput``: DeepSpeed's samples/s line every steps_per_print steps."""

    enabled: bool = _enabled(doc="Print DeepSpeed's throughput line (DeepSpeed's default: on; zeroshard's step line already has samples/s). engine.tput_timer counts either way.")
    synchronized: bool = key(True, doc="Synchronize the device before reading the clock (when the line is on).")


@dataclass(frozen=True, kw_only=True)
class TimersConfig(Section):
    """``timers``."""

    throughput: ThroughputTimerConfig = key(doc="The throughput timer.", factory=ThroughputTimerConfig, nullable=True)


def monitor(cls: type, feature: str) -> Any:
    """The field of a top-level monitoring section."""
    return key(doc=f"DeepSpeed's {feature}.", factory=cls, nullable=True)
# fmt: on
