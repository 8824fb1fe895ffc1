"""DeepSpeed's ``tensorboard`` monitor: scalar events through
``torch.utils.tensorboard.SummaryWriter`` (package ``tensorboard``) in one directory.
No collectives."""

from __future__ import annotations


class TensorBoardWriter:
    """Writes ``(tag, value, step)`` events as TensorBoard scalars in ``log_dir``."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
