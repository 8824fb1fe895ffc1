"""The model before ZeRO lays it out, and the data the engine feeds it: moved to the
device and cast to the compute dtype, started from the same values on every rank, split
by expert, tensor and sequence parallelism, its Linear layers converted to fp8 (the
``fp8`` section); the data loader over the data-parallel ranks.

Communication: :func:`parallelize_model` broadcasts every parameter and buffer from the
first rank of the ``replicas`` group (of the ``stage`` group when tensor parallelism
slices the model next; expert parameters of MoE layers from the first rank of their
``expert_replicas`` / ``expert_stage`` group: they differ along ``ep``); the layers
expert, tensor and sequence parallelism install communicate in training (see
``parallel/apply.py`` and ``moe/``). Nothing else here communicates.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from zeroshard import NotBuiltError
from zeroshard.distributed.mesh import Mesh
from zeroshard.fp8 import Fp8Error, Fp8Model, check_fp8_device, convert_to_fp8, preconverted
from zeroshard.fp8.gather import Fp8AllGather, plan_fp8_all_gather
from zeroshard.moe.apply import bind_layers, convert_hf
from zeroshard.moe.marks import EXPERT_LIST_ATTR, is_expert
from zeroshard.parallel.apply import Parallelized, parallelize
from zeroshard.zero.params.init import is_sealed

log = logging.getLogger("zeroshard")


def cast_floating(obj, dtype: torch.dtype):
    """``obj``'s floating tensors (in lists, tuples and dicts too) cast to ``dtype``."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def move_module(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """``module.to(device)`` and floating tensors to ``dtype``, leaving parameters built
    under ``zero.Init`` (they hold no data here) for the flat layout to materialize."""
    with torch.no_grad():
        for m in module.modules():
            for p in m._parameters.values():
                if p is None or is_sealed(p):
                    continue
                target = dtype if p.is_floating_point() else p.dtype
                if p.device != device or p.dtype != target:
                    p.data = p.data.to(device=device, dtype=target)
            for name, b in m._buffers.items():
                if b is not None:
                    target = dtype if b.is_floating_point() else b.dtype
                    m._buffers[name] = b.to(device=device, dtype=target)


def _expert_buffers(module: nn.Module) -> set[int]:
    """Ids of the buffers of DeepSpeed ``Experts`` modules split over several
    expert-parallel ranks (they differ along ``ep`` as their parameters do)."""
    out: set[int] = set()
    for m in module.modules():
        if getattr(m, EXPERT_LIST_ATTR, None) and any(is_expert(p) for p in m.parameters()):
            out.update(id(b) for b in m.buffers())
    return out


def parallelize_model(
    module: nn.Module, mesh: Mesh, config, param_groups: list[dict]
) -> tuple[list[dict], Parallelized]:
    """Every rank starts from the same model: broadcast from the first rank of each
    replica group (of the whole world, first, when tensor parallelism slices the
    model next; DeepSpeed MoE layers' experts, bound to the ``ep`` group first, from
    the first rank holding the same experts); then expert, tensor and sequence
    parallelism. Returns ``param_groups`` holding the parameters that replaced sliced
    ones, and what tensor and sequence parallelism installed."""
    split = config.tensor_parallel.size > 1  # AutoTP (an mpu's model is split)
    experts_split = config.expert_parallel.enabled
    if (split or experts_split) and any(is_sealed(p) for p in module.parameters()):
        what = "tensor_parallel.autotp_size" if split else "expert_parallel.enabled"
        raise NotBuiltError(
            f"{what}: a model built under zero.Init with this parallelism is not built "
            "yet; build the model without zero.Init"
        )
    if any(is_sealed(p) and is_expert(p) for p in module.parameters()):
        raise NotBuiltError(
            "MoE(ep_size > 1) built under zero.Init is not built yet (zero.Init shards "
            "over the dense data-parallel group; experts differ along ep): build the "
            "model without zero.Init"
        )
    bind_layers(module, mesh)
    source = mesh.comm("stage" if split else "replicas")
    expert_source = mesh.comm("expert_stage" if split else "expert_replicas")
    for p in module.parameters():
        if not is_sealed(p):  # zero.Init slices are rank 0's values already
            (expert_source if is_expert(p) else source).broadcast(p.data, src=0)
    expert_buffers = _expert_buffers(module)
    for b in module.buffers():
        (expert_source if id(b) in expert_buffers else source).broadcast(b, src=0)
    names = {id(p): n for n, p in module.named_parameters()}
    converted = convert_hf(module, mesh, config)
    if not split and mesh.size("sp") == 1:
        parallel = Parallelized()
    else:
        parallel = parallelize(module, mesh, config)
    if not (converted or split or mesh.size("sp") > 1):
        return param_groups, parallel
    now = dict(module.named_parameters())
    groups = [{**g, "params": [now[names[id(p)]] for p in g["params"]]} for g in param_groups]
    return groups, parallel


def check_fp8_model(module: nn.Module, config, device: torch.device) -> None:
    """A model that arrives holding torchao's ``Float8Linear`` layers (accelerate's
    ``mixed_precision="fp8"`` converts before initialize(), which unwraps weights
    wrapped for FSDP2's fp8 all-gather) trains them, in bf16 compute; tensor
    parallelism would replace them with plain shards (refused)."""
    before = preconverted(module)
    if not before:
        return
    origin = f"the model holds torchao Float8Linear layers ({', '.join(before[:3])}{', ...' if len(before) > 3 else ''}), converted to fp8 before initialize() (accelerate's mixed_precision='fp8' does this)"  # fmt: skip
    if not config.bf16.enabled:
        raise Fp8Error(f"bf16.enabled: {origin}; fp8 layers compute in bf16: enable bf16")
    check_fp8_device(device)
    if config.tensor_parallel.size > 1:
        raise Fp8Error(
            f"tensor_parallel.autotp_size: {origin}; tensor parallelism would replace them "
            "with bf16 shards. Give initialize() a model of plain nn.Linear layers and "
            "the config's fp8 section instead (its tensor-parallel layers run fp8)"
        )


def convert_fp8(module: nn.Module, config, device: torch.device, rank: int) -> Fp8Model | None:
    """The ``fp8`` section: fp8 matmuls in the Linear layers (after tensor parallelism,
    before the flat layout); said once, from rank 0."""
    cfg = config.fp8
    if not cfg.enabled:
        before = preconverted(module)
        if before and rank == 0:
            log.warning(
                "zeroshard: fp8: %d torchao Float8Linear layer(s) converted before "
                "initialize() run fp8 matmuls (the config has no fp8 section)",
                len(before),
            )
        return None
    check_fp8_device(device)
    fp8 = convert_to_fp8(module, cfg)
    if rank == 0:
        (log.warning if fp8.kept else log.info)(fp8.summary())
    return fp8


def plan_fp8_gather(module: nn.Module, fp8: Fp8Model | None, config, rank: int) -> Fp8AllGather | None:  # fmt: skip
    """``fp8.enable_fsdp_float8_all_gather`` (stage 3; the config refused it elsewhere):
    which weights gather in fp8; said once, from rank 0."""
    if fp8 is None or not config.fp8.enable_fsdp_float8_all_gather:
        return None
    plan = plan_fp8_all_gather(module, fp8)
    if rank == 0:
        (log.warning if plan.kept else log.info)(plan.summary())
    return plan


def make_loader(config, mesh: Mesh, data, collate_fn):
    """The training data loader: ``data`` split over the data-parallel ranks (ranks that
    share a tensor, sequence or pipeline group get the same samples); None without
    ``data``."""
    if data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=mesh.size("dp"), rank=mesh.coord("dp")
    )
    return DataLoader(
        data,
        batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last,  # as DeepSpeed: the sampler still pads
    )
