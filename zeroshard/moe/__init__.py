"""Mixture-of-experts with expert parallelism.

* ``layer.py``: DeepSpeed's ``MoE`` (``deepspeed.moe.layer.MoE``), its gate and experts;
* ``gating.py``: top-1 / top-2 / top-k gating with DeepSpeed's capacity, drops, noise
  and load-balancing loss; ``sharded_moe.py``: the same in DeepSpeed's dense form;
* ``dispatch.py``: the token exchange (all-to-all) over the mesh's ``ep`` axis;
* ``grouped.py``: each rank's experts as one grouped (or padded batched) matmul;
* ``hf.py``: expert parallelism for Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE blocks;
* ``apply.py``: what ``initialize`` does to a model with experts;
* ``marks.py``: which parameters are experts, and their global names;
* ``utils.py``: DeepSpeed's ``deepspeed.moe.utils``.
"""

from zeroshard.moe.layer import MoE, MOELayer, TopKGate

__all__ = ["MOELayer", "MoE", "TopKGate"]
