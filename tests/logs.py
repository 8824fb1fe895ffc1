"""A logging handler for tests: what a logger emitted, as records or their messages."""

from __future__ import annotations

import logging


class ListHandler(logging.Handler):
    """Appends each record it handles to ``out`` (its message, with ``messages``)."""

    def __init__(self, out: list, *, messages: bool = False, level: int = logging.NOTSET):
        super().__init__(level)
        self.out, self.messages = out, messages

    def emit(self, record: logging.LogRecord) -> None:
        self.out.append(record.getMessage() if self.messages else record)
