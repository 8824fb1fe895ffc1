"""``zeroshard.checkpointing``: ``deepspeed.checkpointing`` (see ``activation/checkpointing.py``)."""

from zeroshard.activation.checkpointing import *  # noqa: F403
from zeroshard.activation.checkpointing import __all__  # noqa: F401
