"""Hugging Face ``transformers`` / ``accelerate`` / ``peft`` on zeroshard.

``zeroshard.integrations.deepspeed_alias``: makes ``import deepspeed`` give zeroshard's
DeepSpeed-compatible names (opt-in; see its docstring and the README's "Using it from
Hugging Face"). ``accelerate_env``: accelerate's view of a multi-rank CPU job.
"""
