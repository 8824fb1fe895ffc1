"""DeepSpeed's ``wandb`` monitor: one Weights & Biases run (package ``wandb``). With
``WANDB_MODE=offline`` it writes its run directory under ``./wandb`` (or ``WANDB_DIR``)
and needs no network. No collectives."""

from __future__ import annotations


class WandbWriter:
    """Logs ``(tag, value, step)`` events to a run: held until :meth:`flush`, then one
    ``wandb.log`` per step value (each wakes wandb's thread: ~1-4 ms of wall time on a
    busy host). DeepSpeed logs ``train_loss`` at the samples before an optimizer step
    and the rest after it, so the latest step can get more values after a flush: wandb
    takes more values for the step it is on."""

    def __init__(self, project: str, group: str | None, team: str | None, name: str | None):
        import wandb

        self.run = wandb.init(project=project, group=group, entity=team, name=name)
        self.pending: dict[int, dict[str, float]] = {}

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for tag, value, step in events:
            self.pending.setdefault(step, {})[tag] = value

    def flush(self) -> None:
        for step in sorted(self.pending):  # wandb steps only go forward
            self.run.log(self.pending.pop(step), step=step)

    def close(self) -> None:
        self.flush()
        self.run.finish()
