"""``initialize`` and the argparse helper: the DeepSpeed-compatible entry points.

Communication: initializes ``torch.distributed`` if needed (see ``distributed/process_group.py``);
the engine then broadcasts rank 0's initial parameters.
"""

from __future__ import annotations

import argparse
import logging
import random
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard import ArgumentError, NotBuiltError
from zeroshard.config import ConfigError, load_config
from zeroshard.distributed.mesh import Mesh, MeshShape
from zeroshard.distributed.process_group import default_device, init_distributed
from zeroshard.fp8 import unwrap_fp8_weights
from zeroshard.moe.apply import expert_parallel_size
from zeroshard.parallel.pipeline.engine import PipelineEngine
from zeroshard.parallel.pipeline.module import PipelineModule
from zeroshard.runtime.engine import Engine
from zeroshard.runtime.optim import hyperparams
from zeroshard.zero.optim.optimizer import ShardedOptimizer

log = logging.getLogger("zeroshard")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` / ``--deepspeed_config`` flags to ``parser``.

    ``--deepspeed`` takes an optional value, so both DeepSpeed's flag form
    (``--deepspeed --deepspeed_config cfg.json``) and Hugging Face's
    ``--deepspeed cfg.json`` work. Like DeepSpeed's, it does not add ``--local_rank``
    (scripts launched with DeepSpeed's spelling declare it themselves).
    """
    group = parser.add_argument_group("zeroshard", "zeroshard / DeepSpeed configuration")
    group.add_argument(
        "--deepspeed",
        nargs="?",
        const=True,
        default=False,
        help="enable zeroshard; optionally the config path (Hugging Face style)",
    )
    group.add_argument("--deepspeed_config", default=None, help="path to the DeepSpeed JSON config")
    return parser


def _config_from_args(args, config, config_params):
    given = [c for c in (config, config_params) if c is not None]
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None)
        ds = getattr(args, "deepspeed", None)
        if from_args is None and isinstance(ds, str):
            from_args = ds
        if from_args is not None:
            given.append(from_args)
    if len(given) > 1:
        raise ConfigError(
            "config: given more than once (config=, config_params= or args.deepspeed_config); "
            "pass exactly one"
        )
    if not given:
        raise ConfigError(
            "config: no configuration; pass config='ds_config.json' (or a dict) to initialize()"
        )
    return given[0]


def _collect_groups(
    module: nn.Module, optimizer, model_parameters, opt_cfg, alias: dict[int, nn.Parameter]
):
    """Param groups as ``[{"params": [...], **hyperparams}]`` plus the client optimizer;
    a tensor whose id ``alias`` maps stands for that parameter. ``(None, None)`` when
    there is no optimizer (neither ``optimizer=`` nor a config section): the engine then
    runs forward / evaluation only."""
    if optimizer is not None and opt_cfg is not None:
        raise ConfigError(
            "optimizer: the config has an 'optimizer' section and an optimizer was passed "
            "to initialize(); remove one"
        )
    client = None
    if optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            client = optimizer
        elif callable(optimizer):
            client = optimizer(
                model_parameters if model_parameters is not None else module.parameters()
            )
        else:
            raise TypeError(
                f"initialize: optimizer must be a torch optimizer or a callable, got {type(optimizer)}"
            )
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
            for g in client.param_groups
        ]
    elif opt_cfg is not None:
        defaults = hyperparams(opt_cfg)
        source: list[Any] = (
            list(model_parameters) if model_parameters is not None else list(module.parameters())
        )
        if source and isinstance(source[0], dict):
            groups = [
                {
                    **defaults,
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": list(g["params"]),
                }
                for g in source
            ]
        else:
            groups = [{**defaults, "params": source}]
    else:  # no optimizer: an engine for inference and evaluation (as DeepSpeed's)
        return None, None
    groups = [{**g, "params": [alias.get(id(p), p) for p in g["params"]]} for g in groups]
    owned = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    for gi, g in enumerate(groups):
        for p in g["params"]:
            if id(p) not in owned:
                raise ArgumentError(
                    f"initialize: param group {gi} holds a tensor that is not a parameter of the model"
                )
            if id(p) in seen:
                raise ArgumentError(
                    f"initialize: a parameter appears in more than one param group (group {gi})"
                )
            seen.add(id(p))
    return groups, client


def as_pipeline_module(model: nn.Module, cfg) -> PipelineModule:
    """A model that is not a PipelineModule, cut by the Hugging Face decoder splitter
    (``parallel/pipeline/split.py``; it takes an ``nn.Sequential`` too)."""
    virtual = cfg.pipeline.virtual_stages or 1
    from zeroshard.parallel.pipeline.split import split_for_pipeline

    split = split_for_pipeline(model)  # an nn.Sequential or a known family, else ValueError
    return PipelineModule(
        split.layers, num_stages=cfg.pipeline_stages, loss_fn=split.loss_fn, virtual_stages=virtual
    )


def _stage_parameters(module: nn.Module, model_parameters):
    """``model_parameters`` of a whole model, kept to those of this pipeline stage."""
    if model_parameters is None:
        return None
    mine = {id(p) for p in module.parameters()}
    source = list(model_parameters)
    if source and isinstance(source[0], dict):
        return [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in source]
    return [p for p in source if id(p) in mine]


def _announce() -> None:
    """Running as ``deepspeed`` (the alias registered): rank 0 logs the start-up line
    DeepSpeed's ``initialize`` logs, which tools and tests look for."""
    from zeroshard.compat.deepspeed_alias import registered

    if registered() and dist.get_rank() == 0:
        from zeroshard.compat.ds_version import startup_line

        log.info(startup_line())


def initialize(
    args=None,
    model: nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = 29500,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
) -> tuple[Engine, ShardedOptimizer | None, Any, Any]:
    """Wrap ``model`` for sharded training; returns ``(engine, optimizer, loader, scheduler)``.

    Same signature and return value as ``deepspeed.initialize``. ``config`` is a dict or a
    JSON path (or comes from ``args.deepspeed_config``). Without an optimizer (no
    ``optimizer=``, no ``optimizer`` section) the engine is for inference and evaluation
    and the optimizer returned is None, as DeepSpeed's; ``zeroshard.init_inference`` is
    the engine built for generation (quantized weights, KV cache, weights streamed from
    CPU or NVMe).
    """
    if model is None:
        raise ArgumentError("initialize: model is required")
    if mesh_param is not None:
        raise NotBuiltError(
            "initialize: mesh_param is not built yet in zeroshard; give the parallel sizes "
            "in the config (zero_optimization.mics_shard_size) or pass mpu="
        )
    source = _config_from_args(args, config, config_params)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    _announce()
    world = dist.get_world_size()
    module_stages = model.num_stages if isinstance(model, PipelineModule) else None
    # the user feeds the batches: their size can be seen (not through a pipeline engine)
    own = training_data is None and module_stages is None
    if mpu is not None:
        mesh = Mesh.from_mpu(mpu)
        cfg = load_config(
            source,
            dp_world_size=mesh.size("dp"),
            micro_batch_from_data=own,
            module_stages=module_stages,
        )
        if expert_parallel_size(model, cfg) > 1:
            raise NotBuiltError(
                "initialize(mpu=...) with expert parallelism (MoE ep_size > 1 or "
                "expert_parallel.enabled) is not built yet; give the parallel sizes in the "
                "config instead of an mpu"
            )
    else:
        cfg = load_config(
            source, world_size=world, micro_batch_from_data=own, module_stages=module_stages
        )
        shape = MeshShape.for_world(
            world,
            tp=cfg.tensor_parallel.size,
            sp=cfg.sequence_parallel_size,
            pp=cfg.pipeline_stages,
            shard_size=cfg.zero_optimization.mics_shard_size,
            ep=expert_parallel_size(model, cfg),
        )
        mesh = Mesh.build(shape, device_type=default_device().type)
    if cfg.seed is not None:
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
    # accelerate's fp8 wraps weights for FSDP2's fp8 all-gather, after the optimizer was
    # built over the plain ones: the model gets those back (zeroshard/fp8/convert.py)
    fp8_weights = unwrap_fp8_weights(model)
    if fp8_weights and dist.get_rank() == 0:
        log.warning(
            "zeroshard: fp8: %d Float8Linear weight(s) were wrapped for FSDP2's fp8 all-gather "
            "(torchao's enable_fsdp_float8_all_gather, on in accelerate's default fp8 recipe): "
            "they train as plain Parameters; at ZeRO stage 3 the config's "
            "fp8.enable_fsdp_float8_all_gather gathers them in fp8",
            len(fp8_weights),
        )
    engine_class: type[Engine] = Engine
    if cfg.pipeline_stages > 1 or module_stages is not None:
        engine_class = PipelineEngine
        if module_stages is None:
            model = as_pipeline_module(model, cfg)
        model_parameters = _stage_parameters(model, model_parameters)
    groups, client = _collect_groups(model, optimizer, model_parameters, cfg.optimizer, fp8_weights)
    if groups is None and engine_class is PipelineEngine:
        raise ConfigError(
            "optimizer",
            "a pipeline engine without an optimizer (inference) is not built yet; add an "
            '"optimizer" section or pass optimizer= to initialize()',
        )
    engine = engine_class(
        model,
        cfg,
        mesh,
        param_groups=groups,
        client_optimizer=client,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
    )
    if cfg.checkpoint.dir:  # resume from it; save there on SIGTERM
        from zeroshard.checkpoint.resume import auto_resume

        auto_resume(engine, cfg.checkpoint.dir)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
