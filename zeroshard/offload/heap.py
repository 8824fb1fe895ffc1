"""Giving freed host memory back to the operating system (glibc). No communication.

glibc's ``malloc`` serves allocations under its mmap threshold (adjusted at run time, up
to 32 MiB on 64-bit hosts) from heaps that shrink only from the top on their own. Building
a model under ``zero.Init`` interleaves freed temporaries (each parameter's full value)
with the shards it keeps, and handing those shards to the engine's store frees them in
another order, so the holes stay resident: a 350M GPT on one rank held 2.62 GiB after
construction, of which 1.26 GiB were free holes (``malloc_trim`` gave them back), and
training peaked at 3.84 GiB for 1.95 GiB of live buffers. ``malloc_trim(0)`` releases
every free page wherever it sits (``madvise``), at the cost of a walk over the free
chunks (milliseconds). :class:`HeapTrimmer` calls it after every ``every`` bytes freed,
so the holes never add up; elsewhere than glibc it does nothing.

Training with NVMe offload makes the same holes out of the units gathered and freed in
every forward and backward (and their gradients): those under 32 MiB come from the heap,
in varying sizes, and a 1B GPT's heap grew to 1.1 GiB over the 5 GiB of live buffers.
:func:`map_large_allocations` fixes glibc's threshold (``mallopt(M_MMAP_THRESHOLD)``,
as ``MALLOC_MMAP_THRESHOLD_`` does) so that every allocation of 4 MiB or more gets a
mapping of its own, returned whole when freed; the heap keeps the small ones. The
price is a page fault per 4 KiB of each such allocation (zeroing it), small next to the
swap I/O of the same bytes. NVMe offload turns it on (RAM is what limits those runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

_TRIM_EVERY = 256 << 20  # bytes freed between two trims
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 4 << 20  # allocations from here up get their own mapping


def _load(name: str) -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, name)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


_MALLOC_TRIM = _load("malloc_trim")
_MALLOPT = _load("mallopt")
_mapped = False


def map_large_allocations() -> bool:
    """From now on, allocations of ``MMAP_THRESHOLD`` bytes or more are mapped on their
    own and given back when freed (see the module docstring; process-wide, once).
    False where glibc's ``mallopt`` is not available."""
    global _mapped
    if not _mapped and _MALLOPT is not None:
        _mapped = bool(_MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _mapped


def release_free_heap() -> None:
    """Return the heap's free pages to the OS now (no-op without glibc)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class HeapTrimmer:
    """Trims after every ``every`` bytes reported freed (see the module docstring)."""

    def __init__(self, every: int = _TRIM_EVERY) -> None:
        self.every, self.pending = every, 0

    def freed(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            release_free_heap()
        self.pending = 0
