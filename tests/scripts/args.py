"""Launcher test worker: a script with its own argparse options and no --local_rank (so
the DeepSpeed spelling's --local_rank=N makes argparse exit 2 on every rank)."""

import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--flag", default="x")
parser.parse_args()
print("parsed (unexpected)", flush=True)
