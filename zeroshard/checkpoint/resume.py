"""Resuming a restarted job: ``zeroshard.resume(engine, dir)`` loads the checkpoint
``dir/latest`` names when there is one, and does nothing on a first start.

``zeroshard run --max-restarts N`` restarts every worker after a failure; the script
calls ``resume`` once after ``initialize`` (or sets the config's ``checkpoint.dir``,
which does it inside ``initialize`` and also saves there on SIGTERM:
``zeroshard.checkpoint.preemption``), then continues from ``engine.global_steps``.

Communication: one all-reduce of a tiny int64 table (does each rank see a checkpoint?),
so the ranks agree to load or not; then the load's own.
"""

from __future__ import annotations

import os

from zeroshard.checkpoint.format import exchange
from zeroshard.checkpoint.paths import LATEST
from zeroshard.checkpoint.validate import CheckpointError


def resume(engine, load_dir: str, **kwargs) -> tuple[str | None, dict]:
    """Load the checkpoint ``load_dir/latest`` names, if any: returns ``(path,
    client_state)``, or ``(None, {})`` when ``load_dir`` holds no checkpoint yet (no
    ``latest``). ``kwargs`` go to ``engine.load_checkpoint``. A checkpoint that exists but
    cannot be loaded raises, as ``load_checkpoint`` does."""
    has = int(os.path.isfile(os.path.join(load_dir, LATEST)))
    _, seen = exchange(engine.comm, engine.device, None, (has,))
    ranks = [r for r, v in enumerate(seen) if v[0]]
    if not ranks:
        return None, {}
    if len(ranks) != len(seen):
        missing = [r for r, v in enumerate(seen) if not v[0]]
        raise CheckpointError(
            f"resume({load_dir!r}): ranks {ranks} see {LATEST!r} there, ranks {missing} do "
            "not (is the directory on a file system every node shares?)"
        )
    return engine.load_checkpoint(load_dir, **kwargs)


def auto_resume(engine, checkpoint_dir: str) -> tuple[str | None, dict]:
    """What the config's ``checkpoint.dir`` does at ``initialize``: resume from it, and
    save there on SIGTERM (at the next step boundary), then exit 0."""
    from zeroshard.checkpoint.preemption import enable

    out = resume(engine, checkpoint_dir)
    enable(engine, checkpoint_dir)
    return out
