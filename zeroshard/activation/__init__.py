"""Activation memory: checkpointing, full or selective (``checkpointing``; DeepSpeed's
``deepspeed.checkpointing`` is ``zeroshard.checkpointing``), and activations kept for
backward offloaded to CPU memory (``offload``). No communication.
"""
