"""Sequence parallelism over the mesh's ``sp`` axis: Ulysses all-to-all attention,
Megatron-SP and the wiring of attention functions (``attention``), and ring attention
(``ring``).
"""
