"""Launcher test worker: a script with its own argparse options and no --local_rank (so
the DeepSpeed spelling's --local_rank=N makes argparse exit 2 on every rank).

A refused rank waits until every rank has been refused (a file per rank in the folder
torchelastic gives this attempt's ranks) before it exits: otherwise
a rank that is slow to start, as on a loaded machine, is stopped by the launcher before
argparse runs, and the test sees "stopped by the launcher" instead of the error."""

import argparse
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--flag", default="x")
try:
    parser.parse_args()
except SystemExit:
    attempt = os.path.dirname(os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"]))
    open(os.path.join(attempt, f"refused{os.environ['RANK']}"), "w").close()
    world, deadline = int(os.environ["WORLD_SIZE"]), time.monotonic() + 60
    while time.monotonic() < deadline and world > sum(
        name.startswith("refused") for name in os.listdir(attempt)
    ):
        time.sleep(0.001)
    raise
print("parsed (unexpected)", flush=True)
