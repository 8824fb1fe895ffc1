"""``python benchmarks/_cpu_of.py CMD ARGS...``: run a command, then print its wall time
and the CPU seconds of it and of every process under it.

``/usr/bin/time`` (the parent's rusage) misses the ranks the tests fork from
multiprocessing's forkserver: nobody waits for them, so their CPU never reaches the
parent. This polls ``/proc`` every 0.1 s instead and keeps each descendant's last
utime + stime (Linux only; a process that lives under 0.1 s may be missed, and the CPU
a process spends after its last poll is). No communication.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, list[tuple[int, float]]]:
    """parent pid -> [(pid, CPU seconds so far)] for every process now alive."""
    kids: dict[int, list[tuple[int, float]]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        kids.setdefault(int(fields[1]), []).append((int(name), cpu))
    return kids


def main(argv: list[str]) -> int:
    start = time.monotonic()
    proc = subprocess.Popen(argv)
    seen: dict[int, float] = {}
    while proc.poll() is None:
        kids = _processes()
        for pid, cpu in (x for group in kids.values() for x in group if x[0] == proc.pid):
            seen[pid] = max(seen.get(pid, 0.0), cpu)
        stack = [proc.pid]
        while stack:
            for pid, cpu in kids.get(stack.pop(), []):
                seen[pid] = max(seen.get(pid, 0.0), cpu)
                stack.append(pid)
        time.sleep(0.1)
    wall = time.monotonic() - start
    print(
        f"cpu_of: wall {wall:.1f} s, CPU {sum(seen.values()):.1f} s "
        f"(the command and {len(seen) - 1} processes under it)",
        file=sys.stderr,
    )
    return proc.returncode


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/_cpu_of.py CMD [ARGS...]")
    sys.exit(main(sys.argv[1:]))
