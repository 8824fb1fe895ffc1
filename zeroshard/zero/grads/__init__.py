"""ZeRO's gradients: the reducer that buckets them in a fixed global order and
all-reduces (stages 0-1) or reduce-scatters (stages 2-3) each bucket as it fills
(``reducer``, composing ``launch``: the collectives, ``buckets``, ``buffers`` and
``offload``: reduced chunks to the host), its named states (``states``), and which
parameters a backward will reach, read from its graph before it runs (``reached``).
"""
