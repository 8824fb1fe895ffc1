"""Models built in: a small reference GPT (``gpt.py``) and its attention with local heads
for tensor and sequence parallelism (``gpt_attention.py``). No communication.

``zeroshard.models.GPT`` is the name checkpoint manifests record for the built-in GPT
(``checkpoint/model_config.py``): it stays importable from here.
"""

from zeroshard.models.gpt import GPT, MLP, Attention, Block, GPTConfig, preset_names

__all__ = ["GPT", "MLP", "Attention", "Block", "GPTConfig", "preset_names"]
