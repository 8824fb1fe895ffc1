"""Helpers the transition-table tests share (tests/test_grad_states.py,
tests/test_param_states.py): a printable key for a table row, and the error a call
raises, as data a rank can send back."""

from __future__ import annotations


def row_key(machine: str, key: tuple) -> str:
    """``machine:STATE,...,EVENT``: one row of a transition table, by name."""
    return machine + ":" + ",".join(k.name for k in key)


def error_of(fn) -> list[str]:
    """``[type name, message]`` of what ``fn()`` raises, or ``["no error", ""]``."""
    try:
        fn()
    except Exception as exc:  # the type and message are what the tests check
        return [type(exc).__name__, str(exc)]
    return ["no error", ""]
