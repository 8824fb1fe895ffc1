"""The suite computes on the CPU (gloo) unless told otherwise, also on a machine with
GPUs, so it checks the same thing everywhere; ``test_cuda.py`` asks for CUDA itself.
``ZEROSHARD_ACCELERATOR=cuda pytest tests`` runs everything on the GPU instead."""

import os

os.environ.setdefault("ZEROSHARD_ACCELERATOR", "cpu")
