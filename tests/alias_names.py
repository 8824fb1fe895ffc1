"""Resolving dotted DeepSpeed names under the alias, for the scripts test_ds_compat_names.py
and test_hf_names.py run in fresh interpreters (after ``import zeroshard.as_deepspeed``)."""

from __future__ import annotations

import importlib


def unresolved(names: list[str]) -> list[str]:
    """``"name: why"`` for each dotted name (a module, then attributes) that does not resolve."""
    bad = []
    for name in names:
        parts = name.split(".")
        obj, i = None, len(parts)
        while i > 0:
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                i -= 1
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError as e:
            bad.append(f"{name}: {e}")
    return bad
