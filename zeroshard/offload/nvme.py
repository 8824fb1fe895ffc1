"""Swap space on fast disk (ZeRO-Infinity's NVMe tier). No communication.

A :class:`SwapSpace` is a private directory under ``nvme_path`` holding one file per
swapped tensor. I/O goes through page-aligned CPU buffers with ``O_DIRECT`` where the
filesystem allows it (bypassing the page cache, so RAM holds only the buffers), on a
small thread pool so reads and writes overlap compute (``os.preadv``/``os.pwritev``
release the GIL). Offsets and lengths are multiples of :data:`ALIGN` bytes; callers lay
their data out so (see ``FlatLayout(align=...)``).

Lifetime: the directory has a fresh unique name per process, so files left by a
crashed run are never read by a restart; it is removed when the space is closed or
the process exits normally. Stale directories of dead processes on this host are
removed when a new space is created in the same ``nvme_path``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zeroshard import ZeroshardError

ALIGN = 4096
_PREFIX = "zeroshard-swap-"


class OffloadError(ZeroshardError, ValueError):
    """Offloaded state that cannot be placed or moved as asked (swap buffers, swap
    file I/O, the delayed update's stores)."""


def round_up(n: int, multiple: int = ALIGN) -> int:
    return -(-n // multiple) * multiple


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose data pointer is ``ALIGN``-aligned."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


class BufferPool:
    """``count`` aligned host buffers of ``nbytes`` each (allocated on first use), lent
    out for swap I/O: NVMe offload's RAM footprint is this pool, not the swapped data.

    ``what`` names the config keys in errors (e.g. ``offload_param.buffer_size``).
    """

    def __init__(self, count: int, nbytes: int, what: str) -> None:
        if count < 1:
            raise OffloadError(f"{what.replace('size', 'count')}: must be >= 1, got {count}")
        self.count, self.nbytes, self.what = count, round_up(nbytes), what
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr -> whole buffer
        self.allocated = 0

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 view of ``nbytes`` (rounded up to ``ALIGN``) of a free buffer, or None
        when all ``count`` buffers are lent out."""
        need = round_up(nbytes)
        if need > self.nbytes:
            raise OffloadError(
                f"{self.what}: a swap transfer needs {need} bytes but buffers hold "
                f"{self.nbytes}; raise {self.what}"
            )
        if not self._free:
            if self.allocated == self.count:
                return None
            self._free.append(aligned_empty(self.nbytes))
            self.allocated += 1
        whole = self._free.pop()
        self._lent[whole.data_ptr()] = whole
        return whole[:need]

    def give_back(self, view: torch.Tensor) -> None:
        self._free.append(self._lent.pop(view.data_ptr()))

    @property
    def lent(self) -> int:
        return len(self._lent)

    def buffers(self) -> list[torch.Tensor]:
        return self._free + list(self._lent.values())


def _as_bytes(t: torch.Tensor) -> memoryview:
    return t.view(torch.uint8).reshape(-1).numpy().data


def _probe_direct(directory: str) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, ".probe")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            buf = aligned_empty(ALIGN)
            buf.zero_()
            os.pwritev(fd, [_as_bytes(buf)], 0)
            os.preadv(fd, [_as_bytes(buf)], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.remove(path)


def _remove_stale(root: str) -> None:
    """Delete swap directories of processes on this host that no longer exist."""
    host = socket.gethostname()
    for name in os.listdir(root):
        if not name.startswith(_PREFIX):
            continue
        # "{host}-{pid}-{tag}-{random}": the host name may itself contain dashes
        parts = name[len(_PREFIX) :].rsplit("-", 3)
        if len(parts) < 4 or parts[0] != host or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:
            pass


class SwapFile:
    """A fixed-size file in a :class:`SwapSpace`; byte offsets and lengths are aligned."""

    def __init__(self, path: str, nbytes: int, direct: bool) -> None:
        self.path, self.nbytes = path, round_up(nbytes)
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        os.ftruncate(self.fd, self.nbytes)  # sparse: reads as zeros until written

    def _check(self, buf: torch.Tensor, offset: int) -> int:
        n = buf.numel() * buf.element_size()
        if offset % ALIGN or n % ALIGN or buf.data_ptr() % ALIGN:
            raise OffloadError(f"{self.path}: unaligned swap I/O (offset {offset}, {n} bytes)")
        if offset + n > self.nbytes:
            raise OffloadError(f"{self.path}: I/O past the end ({offset + n} > {self.nbytes})")
        return n

    def read(self, buf: torch.Tensor, offset: int) -> None:
        n = self._check(buf, offset)
        done = os.preadv(self.fd, [_as_bytes(buf)], offset)
        if done != n:
            raise OSError(f"{self.path}: short read ({done} of {n} bytes at {offset})")

    def write(self, buf: torch.Tensor, offset: int) -> None:
        n = self._check(buf, offset)
        done = os.pwritev(self.fd, [_as_bytes(buf)], offset)
        if done != n:
            raise OSError(f"{self.path}: short write ({done} of {n} bytes at {offset})")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SwapSpace:
    """A private swap directory with asynchronous, aligned file I/O.

    Args:
        root: the configured ``nvme_path`` (created if missing).
        tag: part of the directory name (e.g. ``rank0``).
        threads: I/O threads.
    """

    def __init__(self, root: str, tag: str, *, threads: int = 2) -> None:
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise OSError(f"nvme_path {root!r}: cannot create the swap directory: {exc}") from exc
        _remove_stale(root)
        prefix = f"{_PREFIX}{socket.gethostname()}-{os.getpid()}-{tag}-"
        self.dir = tempfile.mkdtemp(prefix=prefix, dir=root)
        self.direct = _probe_direct(self.dir)
        self.files: dict[str, SwapFile] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zeroshard-io")
        self._closed = False
        atexit.register(self.close)

    def file(self, name: str, nbytes: int) -> SwapFile:
        if name not in self.files:
            self.files[name] = SwapFile(os.path.join(self.dir, name), nbytes, self.direct)
        return self.files[name]

    def read_async(self, f: SwapFile, buf: torch.Tensor, offset: int) -> Future:
        return self._pool.submit(f.read, buf, offset)

    def write_async(self, f: SwapFile, buf: torch.Tensor, offset: int) -> Future:
        return self._pool.submit(f.write, buf, offset)

    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def close(self) -> None:
        """Finish pending I/O and delete the files."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for f in self.files.values():
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.close)
