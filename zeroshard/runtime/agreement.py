"""Ranks must agree: at ``initialize`` every rank describes its model and config, and a
difference is an error naming the rank and the first thing that differs, raised on every
rank, before any collective on the model could hang or abort.

Communication: one all-gather of a 64-character digest per rank (over the whole world;
with pipeline stages, a second one over each stage's ranks, which alone hold the same
parameters); only when digests differ, a second all-gather of the descriptions themselves.
"""

from __future__ import annotations

import hashlib
import json

from torch import nn

from zeroshard import ZeroshardError
from zeroshard.distributed.comm import Comm


class RanksDisagreeError(ZeroshardError, RuntimeError):
    """Ranks started with different models or configs (raised on every rank)."""


def describe(module: nn.Module, config, parameters: bool = True) -> list[str]:
    """One line per thing ranks must agree on: every parameter (name, shape, dtype,
    trainable) unless ``parameters`` is false, then the settings that shape the step."""
    lines = [
        f"parameter {name}: shape {tuple(p.shape)}, {p.dtype}, requires_grad {p.requires_grad}"
        for name, p in (module.named_parameters() if parameters else ())
    ]
    zc = config.zero_optimization
    lines += [
        f"zero_optimization.stage: {zc.stage}",
        f"compute dtype: {config.compute_dtype}",
        f"train_micro_batch_size_per_gpu: {config.train_micro_batch_size_per_gpu}",
        f"gradient_accumulation_steps: {config.gradient_accumulation_steps}",
        f"gradient_clipping: {config.gradient_clipping}",
        f"zero_optimization.offload_optimizer.device: {zc.offload_optimizer.device}",
        f"zero_optimization.offload_param.device: {zc.offload_param.device}",
        f"zero_optimization.mics_shard_size: {zc.mics_shard_size}",
        f"tensor_parallel.autotp_size: {config.tensor_parallel.size}",
        f"sequence_parallel_size: {config.sequence_parallel_size}",
        f"pipeline: {config.pipeline_stages} stages, schedule {config.pipeline.schedule}",
    ]
    parts = getattr(module, "parts", None)  # a PipelineModule: where the layers are cut
    if parts is not None:
        lines.append(f"pipeline cut: {list(parts)}")
    return lines


def check_ranks_agree(comm: Comm, module: nn.Module, config, parameters: bool = True) -> None:
    """Raise :class:`RanksDisagreeError` on every rank unless all ranks of ``comm``
    describe the same model (its parameters only if ``parameters``) and config."""
    if comm.world_size == 1:
        return
    mine = describe(module, config, parameters)
    digest = hashlib.sha256(json.dumps(mine).encode()).hexdigest()
    digests = comm.all_gather_object(digest)
    if len(set(digests)) == 1:
        return
    every = comm.all_gather_object(mine)
    first = every[0]
    for rank, lines in enumerate(every):
        if lines == first:
            continue
        for i in range(max(len(lines), len(first))):
            a = first[i] if i < len(first) else "(nothing)"
            b = lines[i] if i < len(lines) else "(nothing)"
            if a != b:
                raise RanksDisagreeError(
                    f"initialize: rank {rank} differs from rank 0: rank 0 has {a!r}, rank "
                    f"{rank} has {b!r}. Every rank must build the same model and read the "
                    "same config"
                )
