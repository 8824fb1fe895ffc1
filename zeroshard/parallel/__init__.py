"""Parallel axes beyond data parallelism, each over a mesh axis (``distributed/mesh.py``):
tensor parallelism (``tensor/``: Megatron's conjugate collectives, parallel layers,
AutoTP), sequence parallelism (``sequence/``: Ulysses, ring attention) and pipeline
parallelism (``pipeline/``: stages, schedules, point-to-point transfers, the engine).
``apply.py`` applies what the config asks for to a model.
"""
