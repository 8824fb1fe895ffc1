"""``zeroshard.accelerator``: ``deepspeed.accelerator`` (see ``compat/accelerator.py``)."""

from zeroshard.compat.accelerator import *  # noqa: F403
from zeroshard.compat.accelerator import __all__  # noqa: F401
