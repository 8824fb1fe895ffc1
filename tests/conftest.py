"""The suite computes on the CPU (gloo) unless told otherwise, also on a machine with
GPUs, so it checks the same thing everywhere; ``test_cuda.py`` asks for CUDA itself.
``ZEROSHARD_ACCELERATOR=cuda pytest tests`` runs everything on the GPU instead."""

import os

import pytest

os.environ.setdefault("ZEROSHARD_ACCELERATOR", "cpu")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that builds an engine in the pytest process itself gets a one-rank process
    group (as DeepSpeed's initialize makes one); it ends with the test, so that the next
    test sees torch.distributed as it was (test_pipeline_schedules checks an
    uninitialized world)."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
