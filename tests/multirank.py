"""Run a function on N ranks (gloo, CPU) in spawned processes, with a hard timeout.

Each rank joins a process group backed by a FileStore in a temp dir (no ports): NCCL
when the ranks compute on CUDA and each has its own GPU, else gloo. It uses one thread, runs ``fn(rank, world_size, *args)`` and writes its JSON-serializable
return value to a file the parent reads back. A rank that raises fails the call with
that rank's traceback; a hang past ``timeout`` kills every rank and fails.

Ranks start from a forkserver that has imported torch, its distributed and compiler
stacks and zeroshard once (``PRELOAD``): a 2-rank job then starts in about 2 s instead
of 15-18 s under load, each rank still a process of its own. The server was started
with the environment and working directory of the first job, so every job hands its
own to its ranks. ``ZEROSHARD_TEST_START=spawn`` starts fresh interpreters instead
(to bisect a problem that preloading could hide).

:func:`run_script` runs a Python script as ``python SCRIPT ARGS`` would (its own process,
``__main__``, its folder first on ``sys.path``, its own stdout/stderr, environment and
working directory, its exit status), forked from the same server: the torch and zeroshard
imports it would repeat are already done (about 2 s of CPU per script saved).
"""

from __future__ import annotations

import atexit
import gc
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

START = os.environ.get("ZEROSHARD_TEST_START", "forkserver")
# what every rank imports anyway: loaded once in the server, inherited by each fork
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.device_mesh",
    "torch.utils.checkpoint",
    "zeroshard.api",
    "zeroshard.runtime.engine",
    "zeroshard.zero",
    "multirank",
    "parity",
]
if START == "forkserver":
    multiprocessing.set_forkserver_preload(PRELOAD)


def _entry(
    rank: int, world_size: int, tmp: str, fn, args, env=None, cwd=None, forked: bool = True
) -> None:
    import faulthandler

    import torch.distributed as dist

    if env is not None:  # a forked rank has the server's environment: take the job's
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)

    faulthandler.enable(open(os.path.join(tmp, f"fault{rank}.txt"), "w"), all_threads=True)  # noqa: SIM115
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    from zeroshard.distributed.process_group import default_backend, default_device

    try:
        backend = default_backend()
        if backend == "nccl" and world_size > torch.cuda.device_count():
            backend = "gloo"  # ranks share a GPU: NCCL refuses that, gloo copies via host
        if backend == "nccl":
            torch.cuda.set_device(default_device())
        dist.init_process_group(
            backend,
            store=dist.FileStore(os.path.join(tmp, "store"), world_size),
            rank=rank,
            world_size=world_size,
        )
        result = fn(rank, world_size, *args)
        with open(os.path.join(tmp, f"result{rank}.json"), "w") as f:
            json.dump(result, f)
        del result
        gc.collect()  # engines live in reference cycles: free them while the group exists
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if forked:
            # a forked child leaves through os._exit, which skips atexit: run the exit
            # handlers a spawned interpreter runs (swap directories, watchdogs)
            atexit._run_exitfuncs()


def run(fn, world_size: int, *args, timeout: float = 300.0, start: str | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    ``start="spawn"``: fresh interpreters even when the forkserver is the default, for
    what only a process's start reads (glibc's ``MALLOC_*`` settings) and a peak RSS
    measured from an interpreter's own baseline, not the server's preloaded pages."""
    method = start or START
    with tempfile.TemporaryDirectory(prefix="zs-test-") as tmp:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, tmp, fn, args, dict(os.environ), os.getcwd(), method != "spawn"),
            nprocs=world_size,
            join=False,
            start_method=method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout:.0f} s")
        except Exception as exc:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            errors = []
            for r in range(world_size):
                for name in (f"error{r}.txt", f"fault{r}.txt"):
                    path = os.path.join(tmp, name)
                    if os.path.exists(path) and os.path.getsize(path):
                        with open(path) as f:
                            errors.append(f"--- rank {r} ({name}) ---\n" + f.read())
            raise AssertionError("\n".join(errors) or str(exc)) from exc
        out = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"result{r}.json")) as f:
                out.append(json.load(f))
        return out


def _script_entry(path: str, args: list[str], env: dict, cwd: str, out: str, err: str) -> None:
    """A forked child that becomes ``python PATH ARGS``: stdout/stderr into files, the
    job's environment, folder and thread count, then the script as ``__main__``."""
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # torch read OMP_NUM_THREADS when the server imported it: apply the job's
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    sys.argv = [path, *args]
    # a fresh interpreter's sys.path: the script's folder, then $PYTHONPATH, then the rest
    first = [os.path.dirname(os.path.abspath(path))]
    first += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = first + [p for p in sys.path if p not in first]
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:  # sys.exit("message"), as the interpreter prints it
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # what a fresh interpreter runs on its way out
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_script(
    argv: list[str], *, env: dict[str, str], cwd: str, timeout: float
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)`` for a Python script ``argv[0]``, started from the
    preloaded forkserver (a fresh interpreter with ``ZEROSHARD_TEST_START=spawn``)."""
    if START != "forkserver":
        cmd = [sys.executable, *argv]
        return subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    with tempfile.TemporaryDirectory(prefix="zs-script-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = multiprocessing.get_context("forkserver").Process(
            target=_script_entry, args=(argv[0], argv[1:], env, cwd, out, err)
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(argv, timeout)
        texts = []
        for name in (out, err):
            with open(name, errors="replace") as f:
                texts.append(f.read())
        code = proc.exitcode if proc.exitcode is not None else -1
        return subprocess.CompletedProcess(argv, code, texts[0], texts[1])
