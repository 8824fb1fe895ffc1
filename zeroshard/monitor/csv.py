"""DeepSpeed's ``csv_monitor``: one CSV file per event tag in one directory. No
collectives.

As DeepSpeed names them: the tag with ``/`` and spaces turned into ``_``
(``Train/Samples/train_loss`` -> ``Train_Samples_train_loss.csv``), two columns headed
``step`` and the tag's last part (``train_loss``), the step being the samples trained.
A file that exists already is appended to (a resumed run), its header kept.
"""

from __future__ import annotations

import csv
import os
from typing import Any, TextIO


def file_name(tag: str) -> str:
    return tag.replace("/", "_").replace(" ", "_") + ".csv"


class CSVWriter:
    """Appends ``(tag, value, step)`` events to ``log_dir/<tag>.csv``; files stay open
    and are flushed by :meth:`flush`."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self.files: dict[str, tuple[TextIO, Any]] = {}  # (file, csv.writer)

    def _writer(self, tag: str):
        if tag not in self.files:
            path = os.path.join(self.log_dir, file_name(tag))
            new = not os.path.exists(path) or os.path.getsize(path) == 0
            f = open(path, "a", newline="")  # noqa: SIM115  (kept open; closed in close())
            w = csv.writer(f)
            if new:
                w.writerow(["step", tag.split("/")[-1]])
            self.files[tag] = (f, w)
        return self.files[tag][1]

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for tag, value, step in events:
            self._writer(tag).writerow([step, value])

    def flush(self) -> None:
        for f, _ in self.files.values():
            f.flush()

    def close(self) -> None:
        for f, _ in self.files.values():
            f.close()
        self.files.clear()
