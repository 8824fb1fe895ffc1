"""Parallel axes beyond data parallelism (the device mesh is ``distributed/mesh.py``)."""
