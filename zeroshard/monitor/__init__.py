"""Watching a run: DeepSpeed's monitoring sections, the step line and the metrics file.

``engine.monitor`` is a :class:`~zeroshard.monitor.hub.EngineMonitor`; the modules here
are its parts (see each docstring for what it writes and which collectives it issues).
It never holds the engine: what it reads comes as records (``readings``).
Optional packages (tensorboard, wandb, comet_ml) are imported only when their section
is enabled. Also here: what a rank's memory holds, measured and predicted (``memory``),
and the progress bars of the library's long work (``progress``).
"""
