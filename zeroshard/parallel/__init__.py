"""Parallel axes beyond data parallelism: the device mesh (``mesh.py``)."""
