"""The error of a mixture-of-experts layer or expert-parallel setup that cannot be built
as asked (the message names the argument, config key or layer)."""

from __future__ import annotations

from zeroshard import ZeroshardError


class ExpertParallelError(ZeroshardError, ValueError):
    """A MoE layer's argument, an expert-parallel size or a model that expert parallelism
    cannot take; the message names it."""
