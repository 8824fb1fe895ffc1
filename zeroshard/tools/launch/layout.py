"""Where the ranks of a `zeroshard run` go: the DeepSpeed hostfile, ``--include`` /
``--exclude`` filters, and the node layout (node count, processes per node, this node's
rank, rendezvous address, which devices). Pure: reads files and the command line, starts
nothing, issues no collectives. Used by :mod:`zeroshard.tools.launch.launcher`.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from zeroshard import ZeroshardError

DEFAULT_MULTINODE_PORT = 29500


class LaunchError(ZeroshardError):
    """A mistake in the launch command or hostfile; printed as one line, exit status 2."""


# ----------------------------------------------------------------------------- hostfile


@dataclass(frozen=True)
class HostEntry:
    """One hostfile line: a host and its process slots."""

    host: str
    slots: int
    line: int


def parse_hostfile(path: str | os.PathLike) -> list[HostEntry]:
    """Read a DeepSpeed hostfile (``hostname slots=N`` per line, ``#`` comments)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise LaunchError(f"hostfile {path}: cannot read it ({e.strerror or e})") from None
    entries: list[HostEntry] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = parts[1][len("slots=") :] if len(parts) == 2 else ""
        if len(parts) != 2 or not parts[1].startswith("slots=") or not slots.isdigit():
            raise LaunchError(
                f"hostfile {path}, line {lineno}: expected 'hostname slots=N', got {raw.strip()!r}"
            )
        if int(slots) < 1:
            raise LaunchError(f"hostfile {path}, line {lineno}: slots must be >= 1")
        if any(e.host == parts[0] for e in entries):
            raise LaunchError(f"hostfile {path}, line {lineno}: host {parts[0]} listed twice")
        entries.append(HostEntry(parts[0], int(slots), lineno))
    if not entries:
        raise LaunchError(f"hostfile {path}: no hosts in it")
    return entries


def parse_host_filter(spec: str, flag: str) -> dict[str, list[int] | None]:
    """Parse DeepSpeed's ``host1:0,1@host2`` filter; None means every slot of the host."""
    result: dict[str, list[int] | None] = {}
    for item in filter(None, spec.split("@")):
        host, _, ids = item.partition(":")
        try:
            result[host] = sorted({int(s) for s in ids.split(",")}) if ids else None
        except ValueError:
            raise LaunchError(f"{flag} {spec!r}: slot ids must be integers") from None
    return result


def _is_local(host: str) -> bool:
    """True when `host` names this machine: its name, loopback, or an address we can bind."""
    names = {"localhost", socket.gethostname(), socket.gethostname().split(".")[0]}
    if host in names or host.startswith("127.") or host == "::1":
        return True
    try:
        addrs = {
            str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
        }
    except (OSError, UnicodeError):
        return False
    for addr in addrs:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0))  # only succeeds for an address of this machine
            return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class Layout:
    """Where the job runs: node count, processes per node, and this node's place."""

    nnodes: int
    nproc_per_node: int
    node_rank: int | None
    master_addr: str
    master_port: int | None
    local_slots: list[int] | None = None  # device ids for this node, when chosen explicitly


def plan_layout(args: argparse.Namespace, device_count: int) -> Layout:
    """Resolve the command line (and hostfile) into a `Layout`; raises `LaunchError`."""
    for name in ("nproc", "nnodes"):  # DeepSpeed's -1 means "the default"
        value = getattr(args, name)
        if value is not None and value < 1:
            if value != -1:
                raise LaunchError(f"--{name} must be >= 1, got {value}")
            setattr(args, name, None)
    if (args.include or args.exclude) and (args.nproc is not None or args.nnodes is not None):
        raise LaunchError("--include/--exclude cannot be combined with --nproc/--nnodes")
    if args.include and args.exclude:
        raise LaunchError("use --include or --exclude, not both")
    spec = args.include or args.exclude
    flag = "--include" if args.include else "--exclude"
    selected = parse_host_filter(spec, flag) if spec else {}
    explicit_ids = any(ids is not None for ids in selected.values())
    if args.hostfile:
        entries = parse_hostfile(args.hostfile)
        where = {e.host: f"hostfile {args.hostfile}, line {e.line}" for e in entries}
        pool = {e.host: list(range(e.slots)) for e in entries}
    else:
        n = args.nproc or device_count or 1
        if len(selected) > 1:
            raise LaunchError(f"{flag} names several hosts; that needs a --hostfile")
        host = next(iter(selected), "localhost")
        included = selected[host] if args.include else None
        if included and not device_count:
            n = max(included) + 1  # CPU: the include list itself sets the count
        where, pool = {host: "this node"}, {host: list(range(n))}
    for host, ids in selected.items():
        if host not in pool:
            raise LaunchError(f"{flag}: host {host} is not in the hostfile")
        bad = [i for i in ids or [] if i not in pool[host]]
        if bad:
            raise LaunchError(f"{flag}: {host} has no slot {bad[0]} ({where[host]})")
    if args.include:
        pool = {h: selected[h] or pool[h] for h in pool if h in selected}  # hostfile order
    elif args.exclude:
        for h, ids in selected.items():
            pool[h] = [i for i in pool[h] if i not in ids] if ids is not None else []
        pool = {h: ids for h, ids in pool.items() if ids}
    if args.hostfile and args.nnodes is not None:
        if args.nnodes > len(pool):
            raise LaunchError(
                f"--nnodes {args.nnodes} but hostfile {args.hostfile} lists {len(pool)} hosts"
            )
        pool = dict(list(pool.items())[: args.nnodes])
    if args.hostfile and args.nproc is not None:
        for h, ids in pool.items():
            if len(ids) < args.nproc:
                raise LaunchError(f"--nproc {args.nproc} but {where[h]}: {h} has {len(ids)} slots")
            pool[h] = ids[: args.nproc]
    if not pool:
        raise LaunchError(f"{flag} leaves no hosts")
    hosts = list(pool)
    counts = {len(ids) for ids in pool.values()}
    if len(counts) > 1:
        odd = next(h for h in hosts if len(pool[h]) != len(pool[hosts[0]]))
        raise LaunchError(
            f"{where[odd]}: {odd} gets {len(pool[odd])} processes but {hosts[0]} gets "
            f"{len(pool[hosts[0]])}; every node must run the same number"
        )
    nnodes = len(hosts) if args.hostfile else (args.nnodes or 1)
    nproc = len(pool[hosts[0]])
    node_rank = args.node_rank
    if node_rank is None and nnodes == 1:
        node_rank = 0
    if node_rank is None and args.hostfile:
        local = [i for i, h in enumerate(hosts) if _is_local(h)]
        if len(local) != 1:
            found = "none" if not local else ", ".join(hosts[i] for i in local)
            raise LaunchError(
                f"cannot tell which host of hostfile {args.hostfile} this machine "
                f"({socket.gethostname()}) is (matches: {found}); pass --node-rank"
            )
        node_rank = local[0]
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is outside 0..{nnodes - 1}")
    master_addr = args.master_addr
    if master_addr is None:
        if nnodes > 1 and not args.hostfile:
            raise LaunchError("several nodes need --master-addr (or a --hostfile)")
        master_addr = hosts[0] if nnodes > 1 else "127.0.0.1"
    master_port = args.master_port
    if master_port is None and nnodes > 1:
        master_port = DEFAULT_MULTINODE_PORT
    slots = pool[hosts[node_rank]] if node_rank is not None and args.hostfile else pool[hosts[0]]
    pick = device_count and (explicit_ids or slots != list(range(nproc)))
    local_slots = slots if pick else None  # -> CUDA_VISIBLE_DEVICES
    return Layout(nnodes, nproc, node_rank, master_addr, master_port, local_slots)
