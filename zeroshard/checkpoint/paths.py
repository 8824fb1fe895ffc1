"""Where checkpoints live in ``save_dir``, and what may be named there. No communication.

* A tag is a plain directory name: not empty, no path separator, not ``.``/``..``, not
  ``latest``, not hidden (``.tmp-*``, ``.trash-*`` and the lock are ours), not ending in
  ``.old`` (an overwrite's previous copy), without ``.tmp`` (temporary files), without
  control characters or line breaks (NUL, newline, tab, ...) and without whitespace at
  either end (``latest`` is one line, read stripped: such a tag would name another).
* ``latest`` holds one such tag.
* Nothing read on load may lead out of the checkpoint directory through a symlink (the
  tag directory, the manifest, the rank files).
* A save writes into a temporary directory private to it (a random id chosen by rank 0),
  and publishes under an exclusive lock on ``save_dir/.zeroshard.lock``, so two jobs
  saving into one directory never mix their files.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import time
import unicodedata

from zeroshard.checkpoint.format import CheckpointError

LATEST = "latest"
LOCK = ".zeroshard.lock"
_MAX_TAG = 255


def tag_problem(tag) -> str | None:
    """Why ``tag`` cannot name a checkpoint directory (None: it can)."""
    if not isinstance(tag, str) or not tag:
        return "a tag must be a non-empty string"
    if len(tag) > _MAX_TAG:
        return f"a tag must be at most {_MAX_TAG} characters"
    bad = [c for c in tag if unicodedata.category(c) in ("Cc", "Zl", "Zp")]
    if bad:
        return (
            f"a tag cannot hold control characters or line breaks (it holds {bad[0]!r}): "
            "it names a directory and is the one line of the 'latest' file"
        )
    if tag != tag.strip():
        return "a tag cannot start or end with whitespace (the 'latest' file is read stripped)"
    if os.path.isabs(tag) or "/" in tag or "\\" in tag:
        return "a tag must be a plain name, without path separators or an absolute path"
    if tag in (".", ".."):
        return "a tag cannot be '.' or '..'"
    if tag == LATEST:
        return "'latest' is the pointer file's name"
    if tag.startswith("."):
        return "a tag cannot start with '.' (hidden names are zeroshard's temporary files)"
    if tag.endswith(".old"):
        return "the suffix '.old' is reserved (the previous copy during an overwrite)"
    if ".tmp" in tag:
        return "'.tmp' is reserved for temporary files"
    return None


def check_tag(tag, what: str = "tag") -> str:
    """``tag`` if it is a plain tag, else ValueError saying why."""
    problem = tag_problem(tag)
    if problem:
        raise CheckpointError(f"{what} {tag!r} is not allowed: {problem}")
    return tag


def inside(root: str, path: str) -> bool:
    """Whether ``path``, symlinks resolved, is ``root`` or below it."""
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def new_save_id() -> int:
    """A random id for one save (62 bits: fits the int64 exchange)."""
    return secrets.randbits(62)


def tmp_dir(save_dir: str, tag: str, save_id: int) -> str:
    return os.path.join(save_dir, f".tmp-{tag}.{save_id:016x}")


def make_tmp_dir(save_dir: str, tag: str, save_id: int) -> str:
    """Create this save's private temporary directory (it must not exist) and record its
    owner, so a later save can tell a dead save's leftovers from a live one's."""
    path = tmp_dir(save_dir, tag, save_id)
    os.makedirs(path)
    owner = {"host": socket.gethostname(), "pid": os.getpid()}
    with open(os.path.join(path, ".owner"), "w") as f:
        json.dump(owner, f)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale(save_dir: str, tag: str) -> None:
    """Remove what killed saves of ``tag`` left: temporary directories whose owner was
    a process of this host that is gone (or the unowned name older versions used), and
    trash."""
    prefix, host = f".tmp-{tag}.", socket.gethostname()
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name == f".tmp-{tag}" or name.startswith(f".trash-{tag}."):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(prefix):
            try:
                with open(os.path.join(path, ".owner")) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                continue  # being created, or not ours to judge
            if owner.get("host") == host and not _pid_alive(int(owner.get("pid", 0))):
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def publish_lock(save_dir: str, timeout: float = 600.0):
    """Hold ``save_dir``'s publish lock (an exclusive ``flock``; released if the holder
    dies). Raises TimeoutError naming the lock after ``timeout`` seconds."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one job per directory
        yield
        return
    fd = os.open(os.path.join(save_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{os.path.join(save_dir, LOCK)}: held by another save for {timeout:.0f} s"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def trash_name(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".trash-{tag}.{secrets.token_hex(8)}")
