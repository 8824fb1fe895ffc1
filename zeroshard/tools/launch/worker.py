"""The bootstrap every ``zeroshard run`` worker runs under (``python -m
zeroshard.tools.launch.worker [flags] target args``). No collectives.

* It ties the worker's life to the launcher's: ``PR_SET_PDEATHSIG`` (Linux) makes the
  kernel SIGKILL the worker when the launcher dies by any signal, SIGKILL and the OOM
  killer included; it is set before the script runs or, with ``--no-python``, before the
  executable is exec'd (the setting survives exec). Elsewhere a thread watches the parent
  pid. A worker whose launcher is already gone exits at once.
* With ``--as-deepspeed`` (``ZEROSHARD_AS_DEEPSPEED=1``) it makes ``import deepspeed``
  give zeroshard first (``zeroshard.compat.deepspeed_alias``).
* It runs the target like ``python script.py`` / ``python -m module`` would and records an
  uncaught exception (message, traceback, precise time) in torchelastic's per-worker
  error file, so the launcher can name the root-cause rank. With ``ZEROSHARD_FOLD_ERRORS=1``
  (the launcher sets it unless ``--max-restarts`` or ``--log-dir`` want each rank's
  traceback on its own stderr) the worker does not print the traceback itself: the
  launcher's summary prints the root cause's once. A nonzero ``sys.exit`` is recorded
  with the last line the script wrote to stderr (argparse's "error: ..." message), and
  Ctrl-C (KeyboardInterrupt) prints one line saying where the rank was.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import faulthandler
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

from zeroshard.distributed.env import AS_DEEPSPEED_ENV, LAUNCHER_PID_ENV

MODULE_FLAG, RANK_FLAG = "--zeroshard-module", "--zeroshard-local-rank"
EXEC_FLAG = "--zeroshard-exec"  # exec the target (--no-python)
FOLD_ENV = "ZEROSHARD_FOLD_ERRORS"  # 1: the launcher prints the failure, not the worker
_PR_SET_PDEATHSIG = 1


class StderrTail:
    """A stand-in for ``sys.stderr`` that writes through and remembers the last lines
    written (with when), so that a rank's failure can be quoted (argparse prints its
    error, then exits 2)."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._lines: collections.deque[tuple[float, str]] = collections.deque(maxlen=8)
        self._partial = ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        *done, self._partial = (self._partial + text).split("\n")
        now = time.monotonic()
        self._lines.extend((now, line.strip()) for line in done if line.strip())
        self._partial = self._partial[-4096:]
        return written

    def last_line(self, within: float = 5.0) -> str:
        """The last non-blank line written in the last ``within`` seconds, '' if none (an
        older line is not what the exit is about)."""
        if self._partial.strip():
            return self._partial.strip()
        if self._lines and time.monotonic() - self._lines[-1][0] <= within:
            return self._lines[-1][1]
        return ""

    def __getattr__(self, name: str):  # fileno, flush, isatty, buffer, encoding, ...
        return getattr(self._stream, name)


def _user_frames(tb):
    """Skip the bootstrap's own frames (this file, runpy) at the top of a traceback."""
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in (__file__, runpy.__file__) and not name.startswith("<frozen runpy"):
            break
        tb = tb.tb_next
    return tb


def _record_failure(exc: BaseException, tb, message: str | None = None) -> bool:
    """Write `exc` to torchelastic's error file (its JSON layout, plus a precise time and,
    where the message says it all, ``zeroshard_brief``); True if it was written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    now = time.time()
    stack = "".join(traceback.format_exception(type(exc), exc, tb))
    extra = {"py_callstack": stack, "timestamp": str(int(now)), "zeroshard_time": repr(now)}
    config = sys.modules.get("zeroshard.config")  # a config error names its keys: no stack
    if message is not None or (config is not None and isinstance(exc, config.ConfigError)):
        extra["zeroshard_brief"] = "1"
    text = message if message is not None else f"{type(exc).__name__}: {exc}"
    data = {"message": {"message": text, "extraInfo": extra}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


def _where(tb) -> str:
    """Where a traceback ends: the script's innermost frame and the innermost one."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "at start-up"

    def at(frame) -> str:
        name = os.path.relpath(frame.filename)
        name = frame.filename if name.startswith("..") else name
        return f"{name}:{frame.lineno} in {frame.name}"

    script = [f for f in frames if f.filename == frames[0].filename]
    text = f"at {at(script[-1])}"
    return text if script[-1] is frames[-1] else f"{text} (innermost: {at(frames[-1])})"


def _stopped(code) -> str:
    """The error-file message of a nonzero ``sys.exit(code)``."""
    if isinstance(code, str):
        return code
    said = sys.stderr.last_line() if isinstance(sys.stderr, StderrTail) else ""
    return f"{said} (exit code {code})" if said else f"SystemExit: {code}"


def die_with_launcher() -> None:
    """Make the kernel SIGKILL this worker when its launcher dies, by any signal (SIGKILL
    and the OOM killer included); exit now if the launcher is already gone."""
    want = os.environ.get(LAUNCHER_PID_ENV)
    if not want:
        return
    launcher = int(want)
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != launcher:  # it died before the request took effect
        os._exit(1)
    if not armed:  # no prctl: watch the parent pid instead

        def watch() -> None:
            while os.getppid() == launcher:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="zeroshard-launcher-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    """Bootstrap of one worker: ``[--zeroshard-module] [--zeroshard-local-rank] target args``
    or ``--zeroshard-exec executable args``.

    Ties the worker's life to the launcher's, then runs the target like ``python
    script.py`` / ``python -m module`` would (or execs it), and records an uncaught
    exception in torchelastic's error file so the launcher can name the root cause.
    """
    die_with_launcher()
    if argv and argv[0] == EXEC_FLAG:
        target = argv[1]
        os.execvp(target, argv[1:])  # the death signal survives exec
    flags = set()
    while argv and argv[0] in (MODULE_FLAG, RANK_FLAG):
        flags.add(argv.pop(0))
    target, *script_args = argv
    if RANK_FLAG in flags:
        script_args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *script_args]
    faulthandler.enable(all_threads=True)
    sys.argv = [target, *script_args]
    sys.stderr = StderrTail(sys.stderr)
    try:
        if os.environ.get(AS_DEEPSPEED_ENV) == "1":  # zeroshard run --as-deepspeed
            from zeroshard.compat.deepspeed_alias import register

            register()
        if MODULE_FLAG in flags:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            _record_failure(e, _user_frames(e.__traceback__), _stopped(e.code))
        raise
    except KeyboardInterrupt as e:  # Ctrl-C: the launcher forwarded SIGINT; one line
        tb = _user_frames(e.__traceback__)
        _record_failure(e, tb)
        # one write of the whole line: print() writes the text and its newline apart, and
        # two ranks sharing the launcher's stderr pipe then interleave (seen under load)
        sys.stderr.write(f"[rank{os.environ.get('RANK', '0')}]: interrupted {_where(tb)}\n")
        sys.stderr.flush()
        sys.exit(130)
    except BaseException as e:
        tb = _user_frames(e.__traceback__)
        if not (_record_failure(e, tb) and os.environ.get(FOLD_ENV) == "1"):
            # print what python would, minus the bootstrap's frames (torch's hook adds
            # [rankN]); folded, the launcher prints the root cause's once
            sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.stderr.flush()
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
