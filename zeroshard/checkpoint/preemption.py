"""Preemption: a SIGTERM saves a checkpoint at the next optimizer-step boundary, then the
process exits 0.

Cluster schedulers announce preemption with SIGTERM and kill a little later. With the
config's ``checkpoint.dir`` set (or :func:`enable` called), the handler only records the
signal; the engine's ``step()`` calls :meth:`Preemption.at_step_boundary` after each
optimizer step, where every rank learns whether any rank was signalled, and if so all save
``checkpoint.dir/global_stepN`` together (``latest`` names it) and exit with status 0.
Under ``zeroshard run``, a SIGTERM to the launcher reaches every worker (torchrun forwards
it, then waits ``--shutdown-timeout`` seconds before SIGKILL: make it longer than a step
plus a save), each worker leaves a marker in the launcher's run directory, and the
launcher exits 0 too.

Communication: while enabled, one all-reduce (max) of a one-element int64 tensor per
optimizer step, so the ranks save at the same step even when the signal reaches them at
different moments; then the save's own collectives.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import torch

from zeroshard import UsageError
from zeroshard.distributed.env import RUN_DIR_ENV  # where preempted workers say so

log = logging.getLogger("zeroshard")


class Preemption:
    """Saves ``engine`` to ``save_dir`` at the first step boundary after a SIGTERM."""

    def __init__(self, save_dir: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise UsageError(
                "checkpoint.dir: the SIGTERM handler can only be installed from the main "
                "thread; call initialize() there"
            )
        self.save_dir = save_dir
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = True  # acted on at the next step boundary, on every rank at once

    def close(self) -> None:
        """Give SIGTERM back its previous handler."""
        signal.signal(signal.SIGTERM, self._previous)

    def at_step_boundary(self, engine) -> None:
        """After an optimizer step: if any rank was signalled, save and exit 0."""
        flag = torch.tensor([int(self.requested)], dtype=torch.int64, device=engine.device)
        engine.comm.all_reduce(flag, op="max")
        if not int(flag.item()):
            return
        path = os.path.join(self.save_dir, f"global_step{engine.global_steps}")
        engine.save_checkpoint(self.save_dir)
        if engine.comm.rank == 0:
            log.warning("zeroshard: preempted (SIGTERM): saved %s; exiting", path)
        run_dir = os.environ.get(RUN_DIR_ENV)
        if run_dir and os.path.isdir(run_dir):
            with open(os.path.join(run_dir, f"preempted.{engine.comm.rank}"), "w") as f:
                f.write(path)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(0)


def enable(engine, save_dir: str) -> Preemption:
    """Install the SIGTERM handler for ``engine`` (what ``checkpoint.dir`` does)."""
    if getattr(engine, "preemption", None) is not None:
        engine.preemption.close()
    engine.preemption = Preemption(save_dir)
    return engine.preemption
