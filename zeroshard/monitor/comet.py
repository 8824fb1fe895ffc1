"""DeepSpeed's ``comet`` monitor: one Comet experiment (package ``comet_ml``), each
metric logged at most once per ``samples_log_interval`` samples. ``online: false``
keeps an offline archive (``COMET_OFFLINE_DIRECTORY``, default ``./.cometml-runs``)
and needs no network. No collectives."""

from __future__ import annotations


class CometWriter:
    """Logs ``(tag, value, step)`` events to a Comet experiment."""

    def __init__(self, cfg, name: str | None) -> None:
        import comet_ml

        self.interval = cfg.samples_log_interval
        self.last: dict[str, int] = {}  # tag -> samples when last logged
        self.pending: list[tuple[str, float, int]] = []
        self.experiment = comet_ml.start(
            api_key=cfg.api_key,
            project=cfg.project,
            workspace=cfg.workspace,
            experiment_key=cfg.experiment_key,
            mode=cfg.mode,
            online=cfg.online,
        )
        title = cfg.experiment_name if name is None else f"{cfg.experiment_name or 'run'}-{name}"
        if title is not None:
            self.experiment.set_name(title)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        for tag, value, step in events:
            if tag in self.last and step - self.last[tag] < self.interval:
                continue
            self.last[tag] = step
            self.pending.append((tag, value, step))

    def flush(self) -> None:
        for tag, value, step in self.pending:
            self.experiment.log_metric(tag, value, step=step)
        self.pending.clear()

    def close(self) -> None:
        self.flush()
        self.experiment.end()
