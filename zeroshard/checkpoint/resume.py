"""Resuming a job: ``zeroshard.resume(engine, dir)`` loads the checkpoint ``dir/latest``
names and says so; the config's ``checkpoint.dir`` does it inside ``initialize``.

What a resume says (rank 0), so that a relaunch never silently trains from somewhere
else than the user thinks:

* ``zeroshard: resumed from DIR/global_step21 (step 21, 336 samples)`` (stdout);
* ``zeroshard: no checkpoint in DIR: starting fresh`` (a warning) when DIR exists and
  holds none;
* DIR missing is an error (a mistyped path would train from scratch) unless the caller
  says it may be absent: ``resume(engine, DIR, missing_ok=True)``, which the config's
  ``checkpoint.dir`` uses and which then creates DIR (so that an unwritable one fails now,
  not at the first save);
* DIR holding complete checkpoints but no ``latest`` is an error naming them (load one
  with ``engine.load_checkpoint(DIR, tag=...)``); DIR being a checkpoint itself (its
  ``manifest.json``) loads it.

With ``checkpoint.dir`` the run also saves there at its end: ``engine.destroy()`` saves
``global_step<N>`` when the engine stepped since its last save or load and no exception
is on its way (see :func:`save_at_end`), so that the next launch continues from the end,
not from the last preemption save. SIGTERM saves there too (``zeroshard.checkpoint.preemption``).

Communication: one all-reduce of a tiny int64 table (what each rank sees in DIR), so the
ranks agree to load, start fresh or fail; then the load's or save's own.
"""

from __future__ import annotations

import logging
import os
import sys

from zeroshard.checkpoint.format import MANIFEST, exchange
from zeroshard.checkpoint.paths import LATEST
from zeroshard.checkpoint.validate import CheckpointError

log = logging.getLogger("zeroshard")


def _complete_tags(load_dir: str) -> list[str]:
    """The checkpoints in ``load_dir`` that a ``latest`` could name (with a manifest)."""
    try:
        names = sorted(os.listdir(load_dir))
    except OSError:
        return []
    return [n for n in names if os.path.isfile(os.path.join(load_dir, n, MANIFEST))]


def resume(engine, load_dir: str, *, missing_ok: bool = False, **kwargs) -> tuple[str | None, dict]:  # fmt: skip
    """Load the checkpoint ``load_dir/latest`` names (or ``load_dir`` itself when it is
    a checkpoint): returns ``(path, client_state)`` and prints where it resumed; or
    ``(None, {})`` with a warning when ``load_dir`` holds no checkpoint yet. A
    ``load_dir`` that does not exist raises :class:`CheckpointError` unless
    ``missing_ok`` (then it is created, and the run starts fresh). ``kwargs`` go to
    ``engine.load_checkpoint``; a checkpoint that cannot be loaded raises as it does."""
    exists = os.path.isdir(load_dir)
    has = os.path.isfile(os.path.join(load_dir, LATEST)) or os.path.isfile(
        os.path.join(load_dir, MANIFEST)
    )
    tags = len(_complete_tags(load_dir)) if exists and not has else 0
    _, seen = exchange(engine.comm, engine.device, None, (int(exists), int(has), tags))
    rank0 = engine.comm.rank == 0
    if len({tuple(v[:2]) for v in seen}) > 1:
        differ = [r for r, v in enumerate(seen) if v[:2] != seen[0][:2]]
        raise CheckpointError(
            f"resume({load_dir!r}): ranks {differ} see something else there than rank 0 "
            f"(a directory: {[bool(v[0]) for v in seen]}, a checkpoint: "
            f"{[bool(v[1]) for v in seen]}); is it on a file system every node shares?"
        )
    if not seen[0][0]:
        if not missing_ok:
            raise CheckpointError(
                f"resume({load_dir!r}): no such directory (a mistyped path would train from "
                "scratch); pass missing_ok=True where it may not exist yet (a first launch)"
            )
        os.makedirs(load_dir, exist_ok=True)
        if rank0:
            log.warning("zeroshard: no checkpoint in %s: starting fresh (created it)", load_dir)
        return None, {}
    if not seen[0][1]:
        if max(v[2] for v in seen):
            found = _complete_tags(load_dir)
            raise CheckpointError(
                f"resume({load_dir!r}): it holds checkpoints ({', '.join(found[:5])}"
                f"{', ...' if len(found) > 5 else ''}) but no 'latest' file naming one; load one "
                f"with engine.load_checkpoint({load_dir!r}, tag=...) or write its tag into "
                f"{os.path.join(load_dir, LATEST)}"
            )
        if rank0:
            log.warning("zeroshard: no checkpoint in %s: starting fresh", load_dir)
        return None, {}
    path, client_state = engine.load_checkpoint(load_dir, **kwargs)
    if rank0:
        from zeroshard.monitor.steplog import echo, monitor_logger

        monitor_logger()  # stdout, like the step lines
        echo(
            f"zeroshard: resumed from {path} (step {engine.global_steps}, "
            f"{engine.global_samples} samples)"
        )
    return path, client_state


def auto_resume(engine, checkpoint_dir: str) -> tuple[str | None, dict]:
    """What the config's ``checkpoint.dir`` does at ``initialize``: resume from it (it
    may not exist yet: it is created), save there on SIGTERM (at the next step
    boundary, then exit 0) and at ``engine.destroy()``."""
    from zeroshard.checkpoint.preemption import enable

    out = resume(engine, checkpoint_dir, missing_ok=True)
    enable(engine, checkpoint_dir)
    return out


def save_at_end(engine) -> str | None:
    """``engine.destroy()`` with the config's ``checkpoint.dir``: save ``global_step<N>``
    there if the engine stepped since its last save or load, unless an exception is on
    its way (a ``finally:`` after a failure: the other ranks may not be here, and the
    last good save stays ``latest``). Returns the path saved, or None."""
    directory = engine._config.checkpoint.dir
    if not directory or engine.global_steps == engine.checkpointed_step:
        return None
    if sys.exc_info()[0] is not None:
        return None
    engine.save_checkpoint(directory)
    path = os.path.join(directory, f"global_step{engine.global_steps}")
    if engine.comm.rank == 0:
        from zeroshard.monitor.steplog import echo, monitor_logger

        monitor_logger()
        echo(f"zeroshard: saved the run's last step: {path} (checkpoint.dir)")
    return path
