"""``zeroshard.utils``: DeepSpeed's ``deepspeed.utils`` names (see ``compat/utils.py``)."""

from zeroshard.compat.utils import *  # noqa: F403
from zeroshard.compat.utils import (
    __all__,  # noqa: F401
    __getattr__,  # noqa: F401  (names not built: NotBuiltError at use)
)
