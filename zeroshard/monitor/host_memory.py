"""Host memory and disk of a run, predicted: each rank process's peak resident set
(RSS) and its swap-file bytes. No communication.

``memory.estimate`` says where the model states and zeroshard's buffers live; this
module adds what a *process* holds on the host on top of them, which is what decides
whether a run fits a machine:

* ``baseline``: the interpreter, torch, zeroshard and the gloo process group
  (``RANK_BASELINE``, measured: torch 2.13 CPU build, one rank);
* on a CPU-only host everything the estimate puts on the "device" is in RAM too: the
  gradient staging buckets, parameters kept gathered (``stage3_max_reuse_distance``),
  activations, and at stage 3 the units gathered right now (the one computing and those
  prefetched, ``stage3_prefetch_bucket_size``, within ``offload_param.buffer_count``
  buffers when they come from swap files) and the gradients autograd hands over for
  the largest unit before they are copied into a bucket;
* NVMe offload's buffers (:class:`SwapTuning`): the optimizer's sub-group sets (master,
  exp_avg, exp_avg_sq; two sets with ``pipeline_read``/``pipeline_write``) and the
  parameter pool (``offload_param.buffer_count`` buffers of the largest chunk).

Building comes first and peaks on its own: under ``zero.Init`` a rank keeps its slice
of every parameter (in the compute dtype) on the device, which on a CPU-only host is
RAM, until ``initialize`` moves them into the engine's store, plus one parameter's full
value as built (fp32) and its copy at a time. :attr:`HostPeak.rss` is the larger of
the two peaks. Freed temporaries are given back as they go (``offload/heap.py``);
without that, glibc's holes added up to a third of a 350M GPT's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroshard.monitor.memory import PRECISIONS, Estimate

GiB = 2**30
#: RSS of a rank once torch, zeroshard and its gloo group are up (measured, 1 rank,
#: torch 2.13.0 CPU: 0.21 GiB after imports; the engine's threads and maps add the rest)
RANK_BASELINE = round(0.25 * GiB)


@dataclass(frozen=True, kw_only=True)
class SwapTuning:
    """The config keys that size NVMe offload's and stage 3's host buffers."""

    sub_group_numel: int = 1_000_000_000  # zero_optimization.sub_group_size
    pipelined: bool = False  # offload_optimizer.pipeline_read or pipeline_write
    param_buffers: int = 5  # offload_param.buffer_count
    prefetch_numel: int = 50_000_000  # stage3_prefetch_bucket_size


@dataclass(frozen=True, kw_only=True)
class HostPeak:
    """Per rank: the peak RSS (the larger of building and training) and swap bytes."""

    ranks: int
    build_rss: int
    train_rss: int
    disk: int
    parts: dict[str, int] = field(default_factory=dict)  # the training peak, by part

    @property
    def rss(self) -> int:
        return max(self.build_rss, self.train_rss)

    @property
    def total_rss(self) -> int:
        return self.ranks * self.rss

    @property
    def total_disk(self) -> int:
        return self.ranks * self.disk


def host_peak(
    e: Estimate,
    *,
    params: int,
    ranks: int,
    cpu_only: bool,
    largest_unit: int,
    largest_param: int = 0,
    swap: SwapTuning | None = None,
) -> HostPeak:
    """The host side of estimate ``e`` for one of ``ranks`` ranks on a node (``params``
    parameters sharded over the ZeRO group the estimate assumed; ``largest_unit``: the
    largest module's own parameters; ``largest_param``: the largest parameter, 0 for
    ``largest_unit``). ``cpu_only``: the device is the host (its bytes are RSS too)."""
    swap = swap or SwapTuning()
    shard, chunk = e.shard_numel, -(-largest_unit // e.zero_ranks)
    p_b, g_b, _, _ = PRECISIONS[e.precision]
    parts = {"baseline": RANK_BASELINE, "cpu": e.by_location.get("cpu", 0)}
    if e.offload == "nvme":
        sets = 2 if swap.pipelined else 1
        parts["optimizer swap buffers"] = sets * 3 * 4 * min(swap.sub_group_numel, shard)
    if e.stage == 3 and "nvme" in e.by_location and e.by_location["nvme"] > e.optimizer_states:
        parts["parameter swap buffers"] = swap.param_buffers * p_b * chunk
    if cpu_only:
        parts["device"] = e.by_location.get("device", 0) + e.gathered + e.activations
        if e.stage == 3:
            ahead = -(-swap.prefetch_numel // max(largest_unit, 1))
            if "parameter swap buffers" in parts:
                ahead = min(ahead, swap.param_buffers)
            live = min(params, largest_unit * (1 + ahead))
            parts["gathered units"] = p_b * live
            if not e.activations:  # else counted there (its weight-gradient temporaries)
                parts["unit gradients"] = g_b * largest_unit
    train = sum(parts.values())
    # zero.Init: this rank's slices in the compute dtype, and one parameter whole, as
    # built (fp32) and in that dtype
    build = RANK_BASELINE + p_b * shard + (4 + p_b) * (largest_param or largest_unit)
    on_host = e.stage == 3 and cpu_only  # else on the device (remote_device="cpu": host)
    return HostPeak(
        ranks=ranks,
        build_rss=build if on_host else 0,
        train_rss=train,
        disk=e.by_location.get("nvme", 0),
        parts=parts,
    )
