"""Peak-RSS measurement of a small GPT trained for two steps, for the memory tests.

Run inside a spawned rank (``multirank.run``) with ``MALLOC_MMAP_THRESHOLD_`` fixed, so
freed tensors go back to the OS and RSS follows live memory.
"""

from __future__ import annotations

import resource

import torch


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def current_mib() -> float:
    """Resident set now, MiB."""
    return _status_mib("VmRSS")


def peak_mib() -> float:
    """Peak resident set of this process's own memory since it started, MiB.

    ``VmHWM``, not ``ru_maxrss``: a spawned rank is forked from the test process and then
    exec'd, and Linux carries the forked copy's high-water mark (the whole pytest
    process, hundreds of MiB late in a run) into ``ru_maxrss`` across the exec."""
    try:
        return _status_mib("VmHWM")
    except (OSError, RuntimeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_gpt(cfg, zero_optimization: dict, *, partitioned: bool, extra: dict | None = None):
    """Build ``GPT(cfg)`` (under ``zero.Init`` when ``partitioned``), train two steps with
    AdamW (fp32 unless ``extra``, more top-level config keys, says otherwise); return
    ``(engine, peak RSS above the baseline in MiB)``.

    The baseline is the resident set just before the model is built, not the peak so
    far: importing torch and starting the process group peak higher than where they
    settle, and subtracting that transient would understate what training adds."""
    import zeroshard
    from zeroshard.models import GPT

    # the first optimizer step imports ~70 MB of torch modules: not the model's memory
    warm = torch.nn.Parameter(torch.zeros(1))
    warm.grad = torch.zeros(1)
    torch.optim.AdamW([warm], fused=True).step()
    base = current_mib()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero_optimization,
        "steps_per_print": 10**6,
        **(extra or {}),
    }
    torch.manual_seed(0)
    if partitioned:
        with zeroshard.zero.Init():
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1))
    for _ in range(2):
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
        engine.step()
    return engine, peak_mib() - base
