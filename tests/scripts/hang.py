"""Launcher test worker: report readiness and pid, then block until stopped.

Exits by itself if its launcher disappears, so a failed test leaves no stray processes.
"""

import os
import sys
import time

import torch.distributed as dist

dist.init_process_group("gloo")
parent = os.getppid()
sys.stdout.write(f"READY rank={dist.get_rank()} pid={os.getpid()}\n")
sys.stdout.flush()
deadline = time.monotonic() + 120
while os.getppid() == parent and time.monotonic() < deadline:
    time.sleep(0.2)
