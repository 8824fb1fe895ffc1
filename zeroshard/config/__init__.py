"""The DeepSpeed-compatible config: :func:`load_config` reads a dict or a JSON file into a
frozen, validated :class:`Config` (``training.py``), whose sections are defined in
``sections.py``, ``monitors.py``, ``parallel.py`` and ``features.py`` with the schema of
``schema.py``; ``jsonc.py`` reads JSON with comments. ``python -m zeroshard.config``
prints the table of every key. No collectives, no devices.
"""

# the package's names are training.py's, listed once there (its __all__)
from zeroshard.config.training import *  # noqa: F403
from zeroshard.config.training import __all__ as __all__
