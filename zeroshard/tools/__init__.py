"""The `zeroshard` command (``cli``) and its subcommands, one module each: ``run``
(``launch/``), ``report``, ``convert``, ``estimate``, ``plan``, ``generate`` and
``plot``. Modules here are imported only when their subcommand runs; this package
imports nothing (the launcher's workers start under ``launch/worker.py`` without torch).
"""
