"""The event writers of a config (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``),
behind DeepSpeed's ``write_events([(tag, value, samples), ...])``. No collectives.

Checked when the engine is built, on every rank alike (so all ranks fail together and
none waits in a collective for one that raised): the writer's package is installed and
its output directory can be created and written. Only rank 0 writes, as in DeepSpeed,
unless the section's ``all_ranks`` is true: then rank r > 0 writes under
``job_name/rank<r>`` (wandb and Comet: a run named ``rank<r>``).

Files are opened at the run's first event, after :meth:`EventWriters.open_run` has made
each directory this run's (``zeroshard.monitor.rundir``: an earlier run's files move to
``previous/``, a resumed run continues its own).
"""

from __future__ import annotations

import importlib.util
import os

from zeroshard.config import ConfigError
from zeroshard.monitor.rundir import open_run

# section -> (package, what to install)
_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", "comet_ml>=3.41"),
}


def check_writable(path: str, key: str) -> None:
    """``path`` exists as a writable directory, or can be created: its nearest existing
    ancestor is a writable directory. Raises ConfigError naming ``key``."""
    target = os.path.abspath(path or ".")
    probe = target
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(key, f"cannot create the output directory {target!r}: {probe!r} is not a directory")  # fmt: skip
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "write to" if probe == target else f"create {target!r} in"
        raise ConfigError(key, f"cannot {what} {probe!r}: permission denied")


def check_package(section: str) -> None:
    package, install = _PACKAGES[section]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"{section}.enabled",
            f"needs the {package!r} package, which is not installed: pip install '{install}' "
            "(or zeroshard[monitor])",
        )


def log_dir(section, rank: int) -> str:
    base = os.path.join(section.output_path, section.job_name)
    return base if rank == 0 else os.path.join(base, f"rank{rank}")


class EventWriters:
    """The configured writers of this rank; ``enabled`` is DeepSpeed's
    ``monitor.enabled`` (any writer configured, on any rank)."""

    def __init__(self, config, rank: int) -> None:
        tb, csv, wb, comet = config.tensorboard, config.csv_monitor, config.wandb, config.comet
        self.enabled = any(s.enabled for s in (tb, csv, wb, comet))
        for name, section in (("tensorboard", tb), ("csv_monitor", csv)):
            if section.enabled:  # rank 0's directory on every rank: all fail alike
                check_writable(log_dir(section, 0), f"{name}.output_path")
                if section.all_ranks:
                    check_writable(log_dir(section, rank), f"{name}.output_path")
        for name, section in (("tensorboard", tb), ("wandb", wb), ("comet", comet)):
            if section.enabled:
                check_package(name)
        self.writers: list = []
        self.csv_dir: str | None = None  # where this rank's CSV files (and metrics) go
        mine = lambda s: s.enabled and (rank == 0 or s.all_ranks)  # noqa: E731
        if mine(tb):
            from zeroshard.monitor.tensorboard import TensorBoardWriter

            self.writers.append(TensorBoardWriter(log_dir(tb, rank)))
        if mine(csv):
            from zeroshard.monitor.csv import CSVWriter

            self.csv_dir = log_dir(csv, rank)
            self.writers.append(CSVWriter(self.csv_dir))
        run_name = None if rank == 0 else f"rank{rank}"
        if mine(wb):
            from zeroshard.monitor.wandb import WandbWriter

            self.writers.append(WandbWriter(wb.project, wb.group, wb.team, run_name))
        if mine(comet):
            from zeroshard.monitor.comet import CometWriter

            self.writers.append(CometWriter(comet, run_name))

    def open_run(self, step: int, samples: int) -> list[str]:
        """Make this rank's output directories this run's (the run starts after step
        ``step``, ``samples`` samples); returns what was done, as lines to print."""
        said = []
        dirs = {w.log_dir for w in self.writers if hasattr(w, "log_dir")}
        for directory in sorted(dirs):
            line = open_run(directory, step, samples)
            if line is not None:
                said.append(line)
        for writer in self.writers:
            if hasattr(writer, "start"):
                writer.start(purge_step=samples if step > 0 else None)
        return said

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for writer in self.writers:
            writer.write_events(events)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []
