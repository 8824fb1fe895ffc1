"""Progress bars for the library's long work (tqdm, an optional dependency). No
collectives.

:func:`progress` wraps an iterable in a tqdm bar on stderr when tqdm is installed and
stderr is a terminal; the bar shows only once the work has taken ``delay`` seconds, so
small models and quick commands print nothing. ``ZEROSHARD_PROGRESS=0`` turns bars off,
``ZEROSHARD_PROGRESS=1`` on (also when stderr is not a terminal, with no delay). Used by
checkpoint save and load, ``zeroshard convert``, NVMe swap-file setup and
``zeroshard report``; callers pass ``enabled=False`` on ranks other than 0.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(
    iterable: Iterable[T],
    *,
    desc: str,
    total: int | None = None,
    unit: str = "it",
    enabled: bool = True,
    delay: float = 2.0,
) -> Iterator[T] | Iterable[T]:
    """``iterable``, with a bar when bars are on (see the module docstring)."""
    switch = os.environ.get("ZEROSHARD_PROGRESS", "")
    if not enabled or switch == "0":
        return iterable
    forced = switch == "1"
    if not forced and not sys.stderr.isatty():
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        delay=0.0 if forced else delay,
        file=sys.stderr,
        leave=False,
        dynamic_ncols=True,
    )
