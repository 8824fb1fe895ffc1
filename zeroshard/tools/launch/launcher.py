"""`zeroshard run`: start the training processes of one node, over `torch.distributed.run`.

This is a thin layer over torchrun's elastic agent (run in this process): it translates
zeroshard's and DeepSpeed's command-line spellings, reads a DeepSpeed hostfile, and
chooses the rendezvous:

* one node: a standalone c10d rendezvous on a free port (no fixed ports), unless
  ``--master-port`` is given;
* several nodes with a known node rank (``--node-rank`` or this host found in the
  hostfile): torchrun's static rendezvous, a TCP store at master_addr:master_port hosted by
  node 0, so global rank = node_rank * nproc_per_node + local_rank, as with DeepSpeed;
* several nodes without a node rank: torch's c10d rendezvous at master_addr:master_port
  (node ranks then come from the rendezvous).

Nothing is started on other machines (no ssh/pdsh): like torchrun, the same command is run
on every node.

Failures: every worker runs under a small bootstrap (``python -m
zeroshard.tools.launch.worker``) that records an uncaught exception into torchelastic's per-worker error file. The agent polls
the workers every 0.1 s; when one exits non-zero it stops the rest (SIGTERM, then SIGKILL
after ``--shutdown-timeout``) and this module prints the root-cause rank with its exception
and traceback, exiting with that rank's exit code; a rank that lost its connection to a peer
is said to have lost a process or node of the job. SIGINT/SIGTERM to the launcher stop every
worker (torchrun forwards them). This module issues no collectives itself.

No orphans: the bootstrap asks the kernel to SIGKILL each worker when the launcher dies,
by any signal (see ``worker.py``); torchrun starts workers in their own sessions,
so signals to the launcher's process group alone would not reach them.

Restarts and preemption: ``--max-restarts N`` lets torchrun restart the whole worker group
up to N times after a failure (the script resumes with ``zeroshard.resume`` or the config's
``checkpoint.dir``). Workers preempted by SIGTERM that saved a checkpoint and exited
(see ``zeroshard.checkpoint.preemption``) leave a marker in a run directory this launcher
owns; when every local worker did, the launcher exits 0 after a SIGTERM instead of 143.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from zeroshard.distributed.env import (
    AS_DEEPSPEED_ENV,
    LAUNCHER_PID_ENV,
    RUN_DIR_ENV,
    TIMEOUT_ENV,
)
from zeroshard.tools.launch import worker  # the bootstrap each worker runs under
from zeroshard.tools.launch.layout import (  # noqa: F401  (re-exported: the launcher's API)
    DEFAULT_MULTINODE_PORT,
    HostEntry,
    LaunchError,
    Layout,
    parse_host_filter,
    parse_hostfile,
    plan_layout,
)
from zeroshard.tools.launch.worker import EXEC_FLAG, FOLD_ENV, MODULE_FLAG, RANK_FLAG

_BOOTSTRAP = worker.__name__
_PEER_DIED = ("closed by peer", "reset by peer", "remote worker", "broken pipe", "aborted")

HELP_EPILOG = """\
multi-node: zeroshard does not log in to other machines; run this same command on every node
(like torchrun), each with its --node-rank or with a --hostfile that lists this host.

DeepSpeed spellings also work without the `run` word, e.g.
  zeroshard --num_gpus 2 train.py --deepspeed ds_config.json
That form passes --local_rank=N to the script, as DeepSpeed does (--no_local_rank: don't)."""


# ----------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser, deepspeed_style: bool = False) -> None:
    """Add the launcher's options (zeroshard, torchrun and DeepSpeed spellings) to `parser`."""
    parser.description = "Start the training processes of this node, over torch.distributed.run."
    parser.epilog = HELP_EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    a = parser.add_argument
    nproc = ("--nproc", "--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num-gpus")
    a(*nproc, type=int, help="processes on this node (default: CUDA devices, else 1)")
    a("--nnodes", "--num_nodes", "--num-nodes", type=int, help="nodes (default: hostfile, else 1)")
    a("--node-rank", "--node_rank", type=int, help="this node's rank (default: from hostfile)")
    a("--master-addr", "--master_addr", help="node 0's address (default: first hostfile host)")
    a("--master-port", "--master_port", type=int, help="node 0's port (default: free / 29500)")
    a("-H", "--hostfile", help="DeepSpeed hostfile: lines 'hostname slots=N', '#' comments")
    a("-i", "--include", default="", help="hosts/slots to use: 'host1:0,1@host2', 'localhost:0,1'")
    a("-e", "--exclude", default="", help="hosts/slots to leave out, same format as --include")
    a("-m", "--module", action="store_true", help="run the target as a module, like python -m")
    a("--no-python", "--no_python", action="store_true", help="run the target as an executable")
    a("--local-rank-arg", action="store_true", default=deepspeed_style, help="pass --local_rank=N")
    a("--no-local-rank", "--no_local_rank", dest="local_rank_arg", action="store_false")
    a("--log-dir", "--log_dir", "--enable_each_rank_log", help="per-rank log files; [rankN] echo")
    a("--rdzv-backend", choices=["static", "c10d"], help="default: static if node rank known")
    a("--rdzv-id", default="zeroshard", help="job id for the c10d rendezvous")
    a("--max-restarts", type=int, default=0, help="worker group restarts before failing")
    a(
        "--no-config-check",
        "--no_config_check",
        action="store_true",
        help="don't check the script's config (--deepspeed_config/--deepspeed/--config "
        "PATH) before starting the workers",
    )
    a("--shutdown-timeout", type=int, default=10, help="seconds from SIGTERM to SIGKILL")
    a(
        "--comm-timeout",
        type=float,
        help="seconds a rank may block in one collective before the watchdog reports every "
        "rank and stops the job (default 600; 0: off; the config's comm_timeout wins)",
    )
    a(
        "--as-deepspeed",
        "--as_deepspeed",
        action="store_true",
        help="`import deepspeed` gives zeroshard in every worker, so Hugging Face's "
        "Trainer(deepspeed=...) and accelerate's DeepSpeed plugin run on it (refused if a "
        "real DeepSpeed is installed)",
    )
    for flag in ("--launcher", "--launcher_args", "--ssh_port"):  # DeepSpeed's; unused here
        a(flag, help=argparse.SUPPRESS)
    a("--force_multi", action="store_true", help=argparse.SUPPRESS)
    a("script", help="training script (or module with -m, executable with --no-python)")
    a("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


# ----------------------------------------------------------------------------- launching


def _device_count() -> int:
    try:
        from zeroshard.distributed.device import runtime
        from zeroshard.distributed.process_group import use_cuda

        return runtime("cuda").device_count() if use_cuda() else 0
    except Exception:
        return 0


def torchrun_argv(args: argparse.Namespace, layout: Layout) -> list[str]:
    """The `torch.distributed.run` command line for this node."""
    from torch.distributed import run as torchrun

    argv = ["--nnodes", str(layout.nnodes), "--nproc-per-node", str(layout.nproc_per_node)]
    argv += ["--max-restarts", str(args.max_restarts), "--monitor-interval", "0.1"]
    backend = args.rdzv_backend or ("static" if layout.node_rank is not None else "c10d")
    if layout.nnodes == 1 and layout.master_port is None:
        argv += ["--standalone"]
    elif backend == "static":
        if layout.node_rank is None:
            raise LaunchError("--rdzv-backend static needs --node-rank")
        argv += ["--rdzv-backend", "static", "--master-addr", layout.master_addr]
        argv += ["--master-port", str(layout.master_port), "--node-rank", str(layout.node_rank)]
    else:
        host = f"[{layout.master_addr}]" if ":" in layout.master_addr else layout.master_addr
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{layout.master_port}"]
        argv += ["--rdzv-id", args.rdzv_id]
        if layout.node_rank is not None:
            # node 0's launcher hosts the rendezvous store, even when several nodes'
            # launchers run on the host that the endpoint names (else the first to bind
            # it does, and losing that node loses the store before its rank's failure
            # is reported)
            argv += ["--rdzv-conf", f"is_host={str(layout.node_rank == 0).lower()}"]
    if args.log_dir:
        argv += ["--log-dir", args.log_dir, "--tee", "3"]
    if "--shutdown-timeout" in torchrun.get_args_parser()._option_string_actions:
        argv += ["--shutdown-timeout", str(args.shutdown_timeout)]
    if args.no_python:  # still through the bootstrap, which execs the target
        return [*argv, "-m", _BOOTSTRAP, EXEC_FLAG, args.script, *args.script_args]
    flags = [MODULE_FLAG] * args.module + [RANK_FLAG] * args.local_rank_arg
    return [*argv, "-m", _BOOTSTRAP, *flags, args.script, *args.script_args]


def _set_child_environment(args: argparse.Namespace, layout: Layout) -> None:
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        os.environ["OMP_NUM_THREADS"] = str(
            max(1, (cores or os.cpu_count() or 1) // layout.nproc_per_node)
        )
    if layout.local_slots is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [str(i) for i in layout.local_slots]
        if visible:  # slot ids index into the devices already visible
            names = visible.split(",")
            ids = [names[i] if i < len(names) else str(i) for i in layout.local_slots]
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    if args.log_dir:
        os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    if getattr(args, "as_deepspeed", False):
        if args.no_python:
            raise LaunchError("--as-deepspeed needs a Python target (not --no-python)")
        os.environ[AS_DEEPSPEED_ENV] = "1"
    if args.comm_timeout is not None:
        os.environ[TIMEOUT_ENV] = str(args.comm_timeout)
    if args.max_restarts == 0 and not args.log_dir:  # else each rank prints its own
        os.environ[FOLD_ENV] = "1"
    if args.max_restarts > 0:
        # torch shares the rendezvous' TCP store with the workers and keeps it across
        # restarts, so a restarted group reads the dead group's gloo/NCCL addresses
        # (pytorch/pytorch#135712, still so in 2.13): give each group its own store
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def _failure_order(item):
    """Sort key putting the likely root cause first among a ChildFailedError's failures."""
    rank, failure = item
    message, _, when, _ = _failure_details(failure)
    stopped = failure.exitcode in (-signal.SIGTERM, -signal.SIGKILL)  # we stopped it
    victim = any(s in message.lower() for s in _PEER_DIED)  # died because a peer died
    return (stopped, victim, when, rank)


def _failure_details(failure) -> tuple[str, str, float, bool]:
    """(message, traceback, time, brief) of a torchelastic ProcessFailure; brief: the
    message says it all (a config error, a script's sys.exit), no traceback wanted."""
    data = failure.message
    if isinstance(data, dict):
        extra = data.get("extraInfo", {})
        when = float(extra.get("zeroshard_time", extra.get("timestamp", failure.timestamp)))
        brief = extra.get("zeroshard_brief") == "1"
        return str(data.get("message", "")), str(extra.get("py_callstack", "")), when, brief
    return str(data), "", float(failure.timestamp), False


def _short(failure) -> str:
    """One line for a rank that is not the root cause: its own error where it wrote one
    (also when the launcher stopped it afterwards, as it stops every rank once one
    fails: its error is news, the stop is not)."""
    message = _failure_details(failure)[0]
    own = bool(message) and "elastic/errors.html" not in message  # else torch's text, no file
    if failure.exitcode in (-signal.SIGTERM, -signal.SIGKILL):
        stopped = f"stopped by the launcher ({failure.signal_name()})"
        return f"{message.splitlines()[0]} (then {stopped})" if own else stopped
    return message.splitlines()[0] if own else f"exited with code {failure.exitcode}"


def _ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 1-3, 5'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{g[0]}-{g[-1]}" if len(g) > 2 else ", ".join(map(str, g)) for g in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def report_failure(err, log_dir: str | None = None) -> int:
    """Print the root-cause rank of a ChildFailedError, its error (every line of the
    message; the traceback unless the message says it all) and one line per other
    message (ranks with the same one grouped); return the exit status to use."""
    ordered = sorted(err.failures.items(), key=_failure_order)
    rank, root = ordered[0]
    message, tb, _, brief = _failure_details(root)
    code = root.exitcode
    how = f"was killed by {root.signal_name()}" if code < 0 else f"exited with code {code}"
    lines = [
        f"zeroshard: FAILED: rank {rank} (local rank {root.local_rank}, pid {root.pid},"
        f" host {socket.gethostname()}) {how}"
    ]
    if message and "elastic/errors.html" not in message:
        first, *rest = message.splitlines()
        lines.append(f"zeroshard: rank {rank} error: {first}")
        lines += rest
        if any(p in message.lower() for p in _PEER_DIED):
            lines.append(
                f"zeroshard: rank {rank} lost its connection to another rank: a process or "
                "node of this job died (on several nodes, see the other nodes' launchers)"
            )
    if tb and not brief:
        lines += [f"zeroshard: rank {rank} traceback:", tb.rstrip()]
    others: dict[str, list[int]] = {}
    for other_rank, other in ordered[1:]:
        others.setdefault(_short(other), []).append(other_rank)
    root_line = message.splitlines()[0] if message else None
    for text, ranks in others.items():
        said = "the same error" if text == root_line else text
        lines.append(f"zeroshard: also failed: {_ranks(ranks)}: {said}")
    if log_dir:
        lines.append(f"zeroshard: per-rank logs (and error.json files) under {log_dir}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code if code > 0 else (128 - code if code < 0 else 1)


class _QuietTorchrun(logging.Filter):
    """Drops torchrun's own lines about a failure or a signal (the failed rank, "closing
    signal" per worker, "death signal"): this module's summary says it once."""

    _SAID = ("failed (exitcode:", "Sending process %s closing signal", "Received %s death signal")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self._SAID)


_TORCHRUN_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


def main(args: argparse.Namespace) -> int:
    """Launch this node's workers; return the job's exit status."""
    try:
        if not (args.module or args.no_python) and not Path(args.script).is_file():
            raise LaunchError(f"script not found: {args.script}")
        if not args.no_config_check:  # before anything imports torch: a typo costs ~0.5 s
            from zeroshard.tools.launch.config import check_script_config

            report = check_script_config(args.script_args)
            if report:
                print("\n".join(report), file=sys.stderr)
                return 2
        if args.launcher or args.ssh_port or args.force_multi:
            print(
                "zeroshard: --launcher/--ssh_port/--force_multi ignored: zeroshard starts "
                "this node only; run the command on every node",
                file=sys.stderr,
            )
        devices = _device_count()
        layout = plan_layout(args, devices)
        if devices and layout.nproc_per_node > devices and not args.hostfile:
            # not an error: ranks may share a GPU through gloo; NCCL refuses (and
            # init_distributed says so on every rank)
            print(
                f"zeroshard: {layout.nproc_per_node} ranks on {devices} visible GPU(s): "
                "ranks share GPUs, which NCCL refuses (use gloo, or "
                "ZEROSHARD_ACCELERATOR=cpu for CPU ranks)",
                file=sys.stderr,
            )
        argv = torchrun_argv(args, layout)
    except LaunchError as e:
        print(f"zeroshard: error: {e}", file=sys.stderr)
        return 2
    _set_child_environment(args, layout)
    run_dir = tempfile.mkdtemp(prefix="zeroshard-run-")
    os.environ[RUN_DIR_ENV] = run_dir
    try:
        return _launch(argv, args, layout, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _launch(argv: list[str], args: argparse.Namespace, layout: Layout, run_dir: str) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet = _QuietTorchrun()
    for name in _TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        torchrun.run(torchrun.parse_args(argv))
    except ChildFailedError as e:
        return report_failure(e, args.log_dir)
    except SignalException as e:
        saved = sorted(n for n in os.listdir(run_dir) if n.startswith("preempted."))
        if e.sigval == signal.SIGTERM and len(saved) == layout.nproc_per_node:
            with open(os.path.join(run_dir, saved[0])) as f:
                where = f.read()
            print(
                f"zeroshard: preempted (SIGTERM): every worker of this node saved a "
                f"checkpoint ({where}) and exited",
                file=sys.stderr,
            )
            return 0
        print(f"zeroshard: stopped by {e.sigval.name}; workers stopped", file=sys.stderr)
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        print("zeroshard: interrupted; workers stopped", file=sys.stderr)
        return 130
    except Exception as e:  # rendezvous timeouts, unreachable master, ...
        print(f"zeroshard: launch failed: {type(e).__name__}: {e}", file=sys.stderr)
        if "Rendezvous" in type(e).__name__ and layout.nnodes > 1:
            where = f"{layout.master_addr}:{layout.master_port}"
            print(
                f"zeroshard: the rendezvous at {where} (node 0's launcher) cannot be reached: "
                "node 0's launcher died or never started",
                file=sys.stderr,
            )
        return 1
    return 0
