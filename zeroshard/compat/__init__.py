"""The DeepSpeed facade: DeepSpeed's module-level names over zeroshard's own modules
(``comm``, ``accelerator``, ``pipe``, ``utils``; the top-level ``zeroshard.comm`` and kin
re-export them), ``import deepspeed`` on zeroshard for Hugging Face
(``deepspeed_alias``, ``deepspeed_names``), and accelerate's view of a CPU job
(``accelerate_env``). No collectives of its own.
"""
