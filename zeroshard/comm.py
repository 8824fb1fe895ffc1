"""``zeroshard.comm``: DeepSpeed's ``deepspeed.comm`` names (see ``compat/comm.py``)."""

from zeroshard.compat.comm import *  # noqa: F403
from zeroshard.compat.comm import __all__  # noqa: F401
