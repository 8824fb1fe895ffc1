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
  error file, so the launcher can name the root-cause rank.
"""

from __future__ import annotations

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
_PR_SET_PDEATHSIG = 1


def _user_frames(tb):
    """Skip the bootstrap's own frames (this file, runpy) at the top of a traceback."""
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in (__file__, runpy.__file__) and not name.startswith("<frozen runpy"):
            break
        tb = tb.tb_next
    return tb


def _record_failure(exc: BaseException, tb) -> None:
    """Write `exc` to torchelastic's error file (its JSON layout, plus a precise time)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    stack = "".join(traceback.format_exception(type(exc), exc, tb))
    extra = {"py_callstack": stack, "timestamp": str(int(now)), "zeroshard_time": repr(now)}
    data = {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": extra}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


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
            _record_failure(e, _user_frames(e.__traceback__))
        raise
    except BaseException as e:
        tb = _user_frames(e.__traceback__)
        _record_failure(e, tb)
        # print what python would, minus the bootstrap's frames (torch's hook adds [rankN])
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.stderr.flush()
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
