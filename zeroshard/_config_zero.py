"""The ``zero_optimization`` section and its ``offload_param`` / ``offload_optimizer``
subsections. Frozen, validated dataclasses; built by ``zeroshard._config_parse`` and
re-exported by :mod:`zeroshard.config`. Private: no collectives, no devices.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from zeroshard._config_fields import check

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """``zero_optimization.offload_param`` or ``offload_optimizer``: where a ZeRO shard
    lives (device memory, CPU memory or NVMe files).

    ``kind`` says which of the two it is; some fields matter for one kind only (noted).
    """

    #: "param" (offload_param) or "optimizer" (offload_optimizer).
    kind: str
    #: "none" (stay on the device), "cpu" or "nvme".
    device: str = "none"
    #: Directory for NVMe swap files; required with device "nvme".
    nvme_path: str | None = None
    #: Page-locked CPU memory for what is copied to the GPU (the fp32 masters), so the
    #: copies run without blocking the host. None (not given): pinned on CUDA. DeepSpeed's
    #: default is false; false here keeps them pageable (the uploads then block).
    pin_memory: bool | None = None
    #: NVMe buffer-pool size; None resolves to DeepSpeed's default, 5 (param) / 4
    #: (optimizer). Optimizer: 3 buffers of ``sub_group_size`` per sub-group in flight
    #: (one; two with pipeline_read/write), so at least 3 / 6; more are not allocated.
    buffer_count: int | None = None
    #: param only: elements per NVMe buffer.
    buffer_size: int = 100_000_000
    #: param only: parameter elements kept in CPU memory with NVMe offload.
    max_in_cpu: int = 1_000_000_000
    #: optimizer only: fast optimizer-state initialization with NVMe offload.
    fast_init: bool = False
    #: optimizer only: fraction of the optimizer step done on CPU (< 1 needs stage 3).
    ratio: float = 1.0
    #: optimizer only: overlap reading the next tile with the current tile's step.
    pipeline_read: bool = False
    #: optimizer only: overlap writing the previous tile with the current tile's step.
    pipeline_write: bool = False
    #: optimizer only: DeepSpeed's SuperOffload for superchips (stage 3).
    super_offload: bool = False
    #: optimizer only: convert gradients to fp32 on the CPU rather than the device.
    convert_grad_on_cpu: bool = True
    #: optimizer only: fraction of CPU cores for the CPU optimizer (SuperOffload).
    cpuadam_cores_perc: float = 0.8

    def __post_init__(self) -> None:
        check(self.kind in ("param", "optimizer"), "kind", "expected 'param' or 'optimizer'")
        check(self.device in OFFLOAD_DEVICES, "device", f"expected one of {OFFLOAD_DEVICES}")
        check(
            self.device != "nvme" or bool(self.nvme_path),
            "nvme_path",
            'device "nvme" needs nvme_path, the directory for the swap files',
        )
        if self.buffer_count is None:
            object.__setattr__(self, "buffer_count", 5 if self.kind == "param" else 4)
        for name in ("buffer_count", "buffer_size", "max_in_cpu"):
            check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("ratio", "cpuadam_cores_perc"):
            value = getattr(self, name)
            check(0.0 <= value <= 1.0, name, f"must be in [0, 1], got {value}")

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def _no_offload(kind: str) -> Callable[[], OffloadConfig]:
    return lambda: OffloadConfig(kind=kind)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` section. Every DeepSpeed key is parsed; stage-3 settings
    use their ``stage3_`` names here and accept the unprefixed names as aliases. Sizes
    are element counts."""

    #: 0 = plain data parallel, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters.
    stage: int = 0
    #: Copy gradients into one contiguous buffer as they are produced.
    contiguous_gradients: bool = True
    #: Reduce gradients with reduce-scatter rather than all-reduce.
    reduce_scatter: bool = True
    #: Elements reduced per bucket.
    reduce_bucket_size: int = 500_000_000
    #: Reduce several ranks' buckets with one all-reduce.
    use_multi_rank_bucket_allreduce: bool = True
    #: Gather updated parameters with all-gather rather than broadcasts.
    allgather_partitions: bool = True
    #: Elements all-gathered per bucket.
    allgather_bucket_size: int = 500_000_000
    #: Overlap gradient reduction with the backward pass; None = True at stage 3 only.
    overlap_comm: bool | None = None
    #: On load, take fp32 master weights from the checkpoint's fp32 copies.
    load_from_fp32_weights: bool = True
    #: Legacy elastic checkpoints (ours are always resharding).
    elastic_checkpoint: bool = False
    #: Parameter offload (stage 3).
    offload_param: OffloadConfig = field(default_factory=_no_offload("param"))
    #: Optimizer-state offload and CPU optimizer step (stages 1-3).
    offload_optimizer: OffloadConfig = field(default_factory=_no_offload("optimizer"))
    #: Elements per optimizer-step tile (ZeRO-Offload/Infinity).
    sub_group_size: int = 1_000_000_000
    #: Deprecated: true = offload_optimizer on CPU (as given; folded into offload_optimizer).
    cpu_offload: bool | None = None
    #: Deprecated: true = offload_param on CPU (as given; folded into offload_param).
    cpu_offload_param: bool | None = None
    #: Deprecated: pin memory for the deprecated cpu_offload switches.
    cpu_offload_use_pin_memory: bool | None = None
    #: Stage 3: elements fetched ahead of use (alias prefetch_bucket_size).
    stage3_prefetch_bucket_size: int = 50_000_000
    #: Stage 3: parameters smaller than this stay unpartitioned (alias param_persistence_threshold).
    stage3_param_persistence_threshold: int = 100_000
    #: Stage 3: cap on unpartitioned elements (alias model_persistence_threshold).
    stage3_model_persistence_threshold: int = sys.maxsize
    #: Stage 3: gathered elements kept resident per rank (alias max_live_parameters).
    stage3_max_live_parameters: int = 1_000_000_000
    #: Stage 3: keep a parameter gathered if reused within this many elements (alias max_reuse_distance).
    stage3_max_reuse_distance: int = 1_000_000_000
    #: Stage 3: gather full 16-bit weights when saving the model (aliases
    #: gather_16bit_weights_on_model_save, stage3_gather_fp16_weights_on_model_save).
    stage3_gather_16bit_weights_on_model_save: bool = False
    #: Stage 3: modules finer than this are fetched as one unit (alias module_granularity_threshold).
    stage3_module_granularity_threshold: int = 0
    #: Stage 3: fetch parameters with all-reduce (alias use_all_reduce_for_fetch_params).
    stage3_use_all_reduce_for_fetch_params: bool = False
    #: Stage 3: all-gather parameters one by one, unbucketed (alias allgather_sequential).
    stage3_allgather_sequential: bool = False
    #: Stage 3: stream partitioning of huge parameters in chunks of this size, 0 = off
    #: (alias partition_stream_chunk_size).
    stage3_partition_stream_chunk_size: int = 0
    #: Tolerate parameters that get no gradient.
    ignore_unused_parameters: bool = True
    #: DeepSpeed's old stage-1 implementation (no effect here).
    legacy_stage1: bool = False
    #: Spread gradient copies to CPU across ranks round-robin (offload).
    round_robin_gradients: bool = False
    #: Stages 1/2: compute the global gradient norm at every step.
    compute_grad_norm: bool = True
    #: Stages 1/2: align each parameter in the flat buffers to 16 bytes.
    parameter_alignment: bool = False
    #: ZeRO++ hpZ: ranks in the secondary parameter partition group (1 = off).
    zero_hpz_partition_size: int = 1
    #: ZeRO++ qwZ: quantize weights for all-gather.
    zero_quantized_weights: bool = False
    #: ZeRO++: store frozen weights quantized.
    zero_quantized_nontrainable_weights: bool = False
    #: ZeRO++ qgZ: quantize gradients for reduction.
    zero_quantized_gradients: bool = False
    #: ZeRO++ LoCo error feedback ({"err_beta": float, "reset_T": int}) or None.
    zeropp_loco_param: dict[str, Any] | None = None
    #: MiCS: ranks per parameter shard group (-1 or 0 = off).
    mics_shard_size: int = -1
    #: MiCS: hierarchical parameter all-gather.
    mics_hierarchical_params_gather: bool = False
    #: Stage 3: memory-efficient linear layer.
    memory_efficient_linear: bool = True
    #: Stage 3: load checkpoints in pipeline mode.
    pipeline_loading_checkpoint: bool = False
    #: Stage 3: patch nn.Module.apply to gather parameters.
    override_module_apply: bool = True
    #: Stage 3: log trace-cache invalidations.
    log_trace_cache_warnings: bool = False
    #: Run internal sanity checks.
    enable_sanity_checks: bool = False
    #: Stage 3 + NVMe: keep the Muon momentum buffer in memory.
    save_muon_momentum_buffer_in_memory: bool = False
    #: Stage 3 leaf-module settings, kept as given.
    leaf_module: dict[str, Any] | None = None
    #: ZenFlow settings, kept as given (not built).
    zenflow: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check(self.stage in (0, 1, 2, 3), "stage", f"expected one of 0, 1, 2, 3, got {self.stage}")
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage == 3)
        check(self.offload_param.kind == "param", "offload_param", "expected kind 'param'")
        check(
            self.offload_optimizer.kind == "optimizer",
            "offload_optimizer",
            "expected kind 'optimizer'",
        )
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.type == "int" and spec.name not in ("stage", "mics_shard_size"):
                check(value >= 0, spec.name, f"must be >= 0, got {value}")
        check(self.mics_shard_size >= -1, "mics_shard_size", "must be -1 (off) or >= 0")
        if self.offload_param.enabled:
            check(
                self.stage == 3,
                "offload_param.device",
                f"parameter offload needs ZeRO stage 3 (stage is {self.stage})",
            )
        opt = self.offload_optimizer
        if opt.enabled:
            check(
                self.stage >= 1,
                "offload_optimizer.device",
                "optimizer offload needs ZeRO stage 1, 2 or 3 (stage is 0)",
            )
            check(
                opt.device != "nvme" or self.stage == 3,
                "offload_optimizer.device",
                f"NVMe optimizer offload needs ZeRO stage 3 (stage is {self.stage})",
            )
            if opt.device == "nvme":
                # a sub-group in flight holds its master and both moments (the gradient
                # stays in CPU memory); pipeline_read/write keep a second one in flight
                piped = opt.pipeline_read or opt.pipeline_write
                need = 3 * (2 if piped else 1)
                two = " for two sub-groups, with pipeline_read/pipeline_write" if piped else ""
                check(
                    opt.buffer_count >= need,
                    "offload_optimizer.buffer_count",
                    f"NVMe optimizer offload needs {need} sub-group buffers (master, "
                    f"exp_avg, exp_avg_sq{two}), got {opt.buffer_count}",
                )
            check(
                opt.ratio == 1.0 or self.stage == 3,
                "offload_optimizer.ratio",
                f"partial offload (ratio < 1) needs ZeRO stage 3 (stage is {self.stage})",
            )
