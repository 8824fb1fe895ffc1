"""DeepSpeed's ``wandb`` monitor: one Weights & Biases run (package ``wandb``). With
``WANDB_MODE=offline`` it writes its run directory under ``./wandb`` (or ``WANDB_DIR``)
and needs no network. No collectives."""

from __future__ import annotations


class WandbWriter:
    """Logs ``(tag, value, step)`` events to a run: one ``wandb.log`` per step value."""

    def __init__(self, project: str, group: str | None, team: str | None, name: str | None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team, name=name)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for tag, value, step in events:
            by_step.setdefault(step, {})[tag] = value
        for step in sorted(by_step):  # wandb steps only go forward
            self.run.log(by_step[step], step=step)

    def flush(self) -> None:
        pass  # wandb streams on its own

    def close(self) -> None:
        self.run.finish()
