"""DeepSpeed's ``comms_logger``, fed by the ledger: per collective and message size, the
calls, bytes, latency, algorithm bandwidth and bus bandwidth.

It observes the mesh's ledger (``Ledger.observers``): each completed collective arrives
as an :class:`~zeroshard.distributed.ledger.OpEvent`. No collectives of its own.

Bandwidths are DeepSpeed's (``deepspeed/utils/comms_logging.py``, after nccl-tests'
PERFORMANCE.md), in Gbps (1e9 bits/s), for a group of n ranks and a time t:

* all-reduce: algbw = 2S/t and busbw = (S/t)·2(n-1)/n, S the buffer;
* all-gather and reduce-scatter: algbw = S/t and busbw = algbw·(n-1)/n, S the whole
  (gathered, or unreduced) buffer: n times one rank's part;
* all-to-all: algbw = S/t, busbw = algbw·(n-1)/n; broadcast: algbw = busbw = S/t.

With the ledger's byte convention (all-reduce counts 2x the buffer, all-gather the
gathered output, reduce-scatter the whole input) algbw is ledger bytes / t for every op.
The message size shown is the buffer (all-reduce, broadcast, all-to-all) or one rank's
part (all-gather, reduce-scatter), as DeepSpeed shows it.

The time is what the ledger measures: how long the caller was blocked (issue plus
``wait()``). DeepSpeed synchronizes the device around every op when its logger is on;
zeroshard does not, so a collective overlapped with compute shows less time than it
took and its bandwidths are upper bounds. Averages are DeepSpeed's (10%-trimmed means)
over the last 1000 calls of an op and size; counts, bytes and total latency cover all.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict, deque
from datetime import datetime
from typing import TYPE_CHECKING

from zeroshard import NotBuiltError, UsageError
from zeroshard.config.monitors import COMM_OPS

if TYPE_CHECKING:
    from zeroshard.distributed.ledger import Ledger, OpEvent

_ACTIVE: list[weakref.ref] = []  # the latest logger, for zeroshard.comm.log_summary()
KEEP = 1000  # latencies kept per op and size for the averages (counts, totals: all calls)
_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)", "busbw_avg (Gbps)")  # fmt: skip


def convert_size(nbytes: float) -> str:
    """``678.86 MB``-style sizes (powers of 1024, DeepSpeed's names)."""
    if nbytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(math.floor(math.log(nbytes, 1024)), len(names) - 1)
    return f"{round(nbytes / 1024**i, 2)} {names[i]}"


def message_size(op: str, nbytes: int, n: int) -> int:
    """The size DeepSpeed shows for an op from the ledger's byte count."""
    if op == "all_reduce":
        return nbytes // 2
    if op in ("all_gather", "reduce_scatter"):
        return nbytes // max(n, 1)
    return nbytes


def bandwidths(op: str, nbytes: int, n: int, seconds: float) -> tuple[float, float]:
    """(algbw, busbw) in Gbps from the ledger's bytes for one op on ``n`` ranks."""
    if seconds <= 0:
        return 0.0, 0.0
    algbw = nbytes * 8 / seconds / 1e9
    bus = {"all_reduce": (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    bus["all_to_all"] = (n - 1) / n
    return algbw, algbw * bus.get(op, 1.0)


def _trim_mean(values, trim: float = 0.1) -> float:
    """DeepSpeed's summary average: the mean without the top and bottom 10%."""
    if not values:
        return 0.0
    data, k = sorted(values), round(len(values) * trim)
    kept = data[k : len(data) - k] or data
    return sum(kept) / len(kept)


class CommsLogger:
    """Records completed collectives; ``log_all`` prints DeepSpeed's summary table.

    ``echo`` prints a line (the monitor's logger); ``rank`` is this rank's (lines and
    tables from rank 0 only).
    """

    def __init__(self, cfg, ledger: Ledger, rank: int, echo) -> None:
        self.verbose, self.debug = cfg.verbose, cfg.debug
        self.prof_all = cfg.prof_all
        self.prof_ops = {COMM_OPS[op] for op in cfg.prof_ops or ()}
        self.rank, self._echo, self._ledger = rank, echo, ledger
        # record name -> message size -> [count, total ms, latencies ms, algbws, busbws,
        # ledger bytes]; the three lists keep the last KEEP calls (DeepSpeed keeps all)
        self.comms: dict[str, dict[int, list]] = defaultdict(dict)
        ledger.observers.append(self.observe)
        _ACTIVE[:] = [weakref.ref(self)]

    def observe(self, e: OpEvent) -> None:
        if not self.prof_all and e.op not in self.prof_ops:
            return
        size = message_size(e.op, e.nbytes, e.group_size)
        algbw, busbw = bandwidths(e.op, e.nbytes, e.group_size, e.seconds)
        name = f"{e.op} | [Caller Func: {e.caller}]" if self.debug else e.op
        ms = e.seconds * 1e3
        record = self.comms[name].get(size)
        if record is None:
            lists: list[deque[float]] = [deque(maxlen=KEEP) for _ in range(3)]
            record = self.comms[name][size] = [0, 0.0, *lists, 0]
        record[0] += 1
        record[1] += ms
        record[2].append(ms)
        record[3].append(algbw)
        record[4].append(busbw)
        record[5] += e.nbytes
        if self.verbose and self.rank == 0:
            self._echo(
                f"comm op: {name} | time (ms): {ms:.2f} | msg size: {convert_size(size)} | "
                f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f} | axis: {e.axis}"
            )

    def summary(self) -> dict:
        """``{op: {message bytes: {count, bytes, total_latency_ms, avg_latency_ms,
        tput_avg_gbps, busbw_avg_gbps, msg_size_str}}}`` (DeepSpeed's keys, plus bytes:
        what the ledger counted for them)."""
        out: dict = {}
        for name, sizes in self.comms.items():
            out[name] = {}
            for size, (count, total, lat, alg, bus, nbytes) in sorted(sizes.items()):
                out[name][size] = {
                    "count": count,
                    "bytes": nbytes,
                    "total_latency_ms": total,
                    "avg_latency_ms": _trim_mean(lat),
                    "tput_avg_gbps": _trim_mean(alg),
                    "busbw_avg_gbps": _trim_mean(bus),
                    "msg_size_bytes": size,
                    "msg_size_str": convert_size(size),
                }
        return out

    def log_all(self, print_log: bool = True, return_dict: bool = False) -> dict | None:
        summary = self.summary()
        if print_log and self.rank == 0:
            lines = ["".join(f"{c: <20}" for c in _COLUMNS)]
            for name, sizes in summary.items():
                lines.append(name)
                for s in sizes.values():
                    lines.append(
                        f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}"
                        f"{s['total_latency_ms']: <20.2f}{s['avg_latency_ms']: <20.2f}"
                        f"{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}"
                    )
            self._echo("\n".join(lines))
        if not return_dict:
            return None
        meta = {"rank": self.rank, "timestamp": datetime.now().isoformat()}
        return {"summary": summary, "straggler_analysis": None, "metadata": meta}

    def reset(self) -> None:
        self.comms.clear()

    def close(self) -> None:
        if self.observe in self._ledger.observers:
            self._ledger.observers.remove(self.observe)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """The table of the latest engine's comms logger (see :func:`zeroshard.comm.log_summary`)."""
    if show_straggler:
        raise NotBuiltError(
            "log_summary(show_straggler=True): the straggler breakdown is not built yet in "
            "zeroshard"
        )
    logger = _ACTIVE[0]() if _ACTIVE else None
    if logger is None:
        raise UsageError(
            "log_summary: no engine records collectives; enable the config's comms_logger "
            '("comms_logger": {"enabled": true})'
        )
    return logger.log_all(return_dict=return_dict)
