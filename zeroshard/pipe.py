"""``zeroshard.pipe``: DeepSpeed's ``deepspeed.pipe`` names (see ``compat/pipe.py``)."""

from zeroshard.compat.pipe import *  # noqa: F403
from zeroshard.compat.pipe import __all__  # noqa: F401
