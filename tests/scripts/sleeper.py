"""Launcher test worker that ignores its parent: prints its pid, then sleeps 60 s. Only
the launcher's death signal (PR_SET_PDEATHSIG) ends it early."""

import os
import time

print(f"SLEEPER pid={os.getpid()}", flush=True)
time.sleep(60)
