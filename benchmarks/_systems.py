"""One rank of one benchmark run: build a system, train it, report times, bytes, RSS.

``bench_train.py`` starts this file as a fresh process per rank, per system, per
round (``python benchmarks/_systems.py SPEC.json RANK``), so no two systems share an
allocator, and ``ru_maxrss`` is that system's own peak. The ranks meet in a
``FileStore`` (no ports); each writes ``result<RANK>.json`` next to the spec.

The systems (all fp32, AdamW lr 3e-4 / betas 0.9, 0.95 / eps 1e-8 / wd 0.1):

- ``zeroshard-sN``: ``zeroshard.initialize`` with ``zero_optimization.stage`` N,
  ``overlap_comm``, reduce/all-gather buckets of ``--bucket`` elements (default:
  zeroshard's own, 25 MiB of gradients); its AdamW is torch's fused one.
  ``zeroshard-sN-offload`` adds ``offload_optimizer: {"device": "cpu"}``,
  ``zeroshard-sN-lap`` (stages 1-2) ``overlap_param_gather: true``.
- ``ddp``: ``DistributedDataParallel(gradient_as_bucket_view=True)`` + torch AdamW
  ``fused=True`` (the fair match for zeroshard's fused AdamW; there is no row with the
  default for-each AdamW).
- ``zero-redundancy``: the same DDP + ``ZeroRedundancyOptimizer(AdamW, fused=True)``.
- ``fsdp2``: ``fully_shard`` on each transformer block, then the root (mesh on CPU,
  gloo), torch AdamW ``fused=True`` over the DTensor parameters.
- ``deepspeed-sN``: ``deepspeed.initialize`` with the same optimizer and, given
  ``--bucket``, bucket settings (else DeepSpeed's defaults) from its config (``"optimizer": {"type": "AdamW"}``: on CPU its JIT-built FusedAdam;
  if that fails, torch's fused AdamW via ``torch_adam``, and the setup column says so).
  With ``--bucket``, stage 3 sets ``stage3_param_persistence_threshold: 0`` so every
  parameter is partitioned, as in zeroshard's stage 3. ``gradient_clipping: 0``:
  DeepSpeed 0.19 clips at 1.0 when the key is left out, which trained differently from
  every other system here (its final loss differed in RESULTS before 2026-11-26 12:30).

A system is a small object with ``fwd_bwd(x, y) -> loss``, ``opt_step()`` and
``tracked() -> {kind: bytes}`` (the model-state bytes it holds on this rank):

- zeroshard: ``engine.memory_stats()`` (params + grads + optimizer_states).
- everything else: :func:`tracked_bytes` walks the objects the system holds -- the
  module's parameters (DTensor -> its local shard; DeepSpeed stage 3 -> ``ds_tensor``),
  their ``.grad``, and the optimizer object's attributes recursively (torch optimizer
  ``state``, ZeroRedundancyOptimizer's local optimizer, DeepSpeed's fp32 partitions,
  flat bit16 groups, gradient partitions and reduce buckets) -- and adds up each
  distinct storage once. DDP runs with ``gradient_as_bucket_view=True``, so its
  all-reduce buckets are the storages of the grads and are counted once. A tensor
  found inside an object is classed by its attribute path (``*grad*`` -> grads;
  ``exp_avg``, ``state``, ``fp32``, ``hp_fragment`` -> optimizer_states; ``ipg``,
  ``bucket`` -> buffers, reported apart from model state). The JSON output lists each
  run's largest storages with the path they were found at, so the accounting can be
  checked. What it cannot see: C++-side buffers (e.g. DDP's without bucket views) and
  tensors held only in closures or autograd hooks.

Bytes are measured after the backward of the last timed step (grads present, optimizer
state from earlier steps present: the peak of model state), outside the timed window.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
import traceback
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Same hyperparameters for every system. No clipping: DDP/FSDP2 have none by default.
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


class NotAvailable(Exception):
    """The system cannot run here (not installed, not built); not a failure."""


# -- model and data ----------------------------------------------------------------------
def build_model(spec) -> nn.Module:
    from zeroshard.models import GPT, GPTConfig

    torch.manual_seed(spec["seed"])
    return GPT(GPTConfig.preset(spec["model"], seq_len=spec["seq"]))


def batch(spec, rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences ``(a + t*s) mod V``: the loss falls within a few steps, so the
    final-loss column checks the optimizer math, not only the initialization."""
    g = torch.Generator().manual_seed(spec["seed"] * 100_003 + step * world + rank)
    mb, seq, vocab = spec["micro_batch"], spec["seq"], 256
    a = torch.randint(0, vocab, (mb, 1), generator=g)
    s = torch.randint(1, 8, (mb, 1), generator=g)
    tokens = (a + s * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# -- byte accounting -----------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # DTensor -> this rank's shard
    return local if local is not None else t


# attribute-path keywords -> kind, for tensors found inside optimizer / DeepSpeed objects
_KINDS = (
    ("buffers", ("ipg", "bucket")),  # communication staging buffers (DeepSpeed's reduce buckets)
    ("grads", ("grad",)),
    ("optimizer_states", ("exp_avg", "state", "fp32", "hp_fragment", "optim_fragment", "master")),
)


def _classify(path: str, default: str) -> str:
    """The kind of a storage found at attribute path ``path`` (``default`` if no hint)."""
    tail = path.lower().partition("#")[2]  # the attributes past the root's name
    if default == "grads":
        return default
    for kind, words in _KINDS:
        if any(w in tail for w in words):
            return kind
    return default


class _Tally:
    def __init__(self) -> None:
        self.seen_storages: set[int] = set()
        self.seen_objects: set[int] = set()
        self.kinds: dict[str, int] = {}
        self.where: list[tuple[int, str]] = []  # (bytes, path) of each storage counted

    def tensor(self, t: torch.Tensor, kind: str, path: str = "") -> None:
        t = _local(t)
        if t.device.type == "meta":
            return
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in self.seen_storages:
            return
        self.seen_storages.add(s.data_ptr())
        kind = _classify(path, kind)
        self.kinds[kind] = self.kinds.get(kind, 0) + s.nbytes()
        self.where.append((s.nbytes(), path or kind))

    def walk(self, obj, kind: str, path: str = "", depth: int = 0) -> None:
        """Tensors reachable from ``obj`` through containers and the attributes of
        torch-optimizer / DeepSpeed objects; modules and other objects are not entered."""
        if depth > 10 or id(obj) in self.seen_objects:
            return
        self.seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.tensor(obj, kind, path)
            extra = getattr(_local(obj), "__dict__", {})  # e.g. DeepSpeed's ds_tensor
            for k, v in list(extra.items()):
                self.walk(v, kind, f"{path}.{k}", depth + 1)
        elif isinstance(obj, dict):
            for k, v in list(obj.items()):  # keys of optimizer.state are params: not walked
                self.walk(v, kind, f"{path}[{k if isinstance(k, (str, int)) else '.'}]", depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            for i, v in enumerate(list(obj)):
                self.walk(v, kind, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, nn.Module):
            return
        elif type(obj).__module__.split(".")[0] == "deepspeed" or isinstance(
            obj, torch.optim.Optimizer
        ):
            for k, v in list(vars(obj).items()):
                self.walk(v, kind, f"{path}.{k}", depth + 1)


def tracked_bytes(module: nn.Module, optimizer) -> tuple[dict[str, int], list]:
    """params (+ DeepSpeed's param partitions), grads, then whatever else the optimizer
    holds; each storage counted once, in the first kind it is met. Also returns the
    largest storages with the attribute path they were found at."""
    tally = _Tally()
    named = list(module.named_parameters())
    for name, p in named:
        tally.walk(p, "params", f"{name}#")
    for name, p in named:
        if p.grad is not None:
            tally.tensor(p.grad, "grads", f"{name}#.grad")
    tally.walk(optimizer, "optimizer_states", f"{type(optimizer).__name__}#")
    return tally.kinds, sorted(tally.where, reverse=True)[:8]


# -- the systems ----------------------------------------------------------------------------
class Zeroshard:
    def __init__(self, spec, stage: int, offload: bool = False, overlap: bool = False) -> None:
        import zeroshard
        from zeroshard.config import ConfigError

        bucket = spec["bucket"]  # None: zeroshard's defaults
        zero: dict = {"stage": stage, "overlap_comm": True}
        if bucket is not None:
            zero.update(reduce_bucket_size=int(bucket), allgather_bucket_size=int(bucket))
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        if overlap:
            zero["overlap_param_gather"] = True
        config = {
            "train_micro_batch_size_per_gpu": spec["micro_batch"],
            "gradient_accumulation_steps": 1,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
            },
            "zero_optimization": zero,
            "steps_per_print": 10**9,
        }
        model = build_model(spec)
        try:
            self.engine, *_ = zeroshard.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
        except ConfigError as e:
            if "not built" in str(e):
                raise NotAvailable(str(e)) from e
            raise
        inner = getattr(self.engine.optimizer, "inner", None)
        fused = ", fused" if inner is not None and inner.defaults.get("fused") else ""
        where = (", optimizer on CPU" if offload else "") + (
            ", gather overlapped" if overlap else ""
        )
        size = "default bucket" if bucket is None else f"bucket {bucket:.0e}"
        self.note = f"{type(inner).__name__} (torch{fused}){where}, {size}"

    def fwd_bwd(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss

    def opt_step(self):
        self.engine.step()

    def tracked(self):
        m = self.engine.memory_stats()
        return {k: m[k] for k in ("params", "grads", "optimizer_states")}

    def reset_comm(self):
        self.engine.reset_comm_stats()

    def comm(self):
        return self.engine.comm_stats()


class TorchSystem:
    """DDP, DDP + ZeroRedundancyOptimizer, or FSDP2 with torch AdamW (fused)."""

    def __init__(self, spec, kind: str) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = build_model(spec)
        hp: dict[str, Any] = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        self.opt: torch.optim.Optimizer
        bucket_mb = spec["bucket"] * 4 / 2**20 if spec["bucket"] else 25  # DDP's default 25 MiB
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in model.blocks:  # type: ignore[union-attr]
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model, self.opt = model, torch.optim.AdamW(model.parameters(), fused=True, **hp)
            self.note = "fully_shard(blocks + root), AdamW fused"
            return
        self.model = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)
        if kind == "ddp":
            self.opt = torch.optim.AdamW(model.parameters(), fused=True, **hp)
            self.note = f"AdamW fused, bucket views, {bucket_mb:.0f} MiB buckets"
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **hp
            )
            self.note = f"ZeRO-1 (torch) + DDP, AdamW fused, {bucket_mb:.0f} MiB buckets"

    def fwd_bwd(self, x, y):
        loss = self.model(x, y)
        loss.backward()
        return loss

    def opt_step(self):
        self.opt.step()
        self.opt.zero_grad()

    def tracked(self):
        kinds, self.largest = tracked_bytes(self.model, self.opt)
        return kinds


class DeepSpeed:
    def __init__(self, spec, stage: int) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed
        except ImportError as e:
            raise NotAvailable(f"deepspeed not installed ({e})") from e
        deepspeed.init_distributed(dist_backend="gloo")
        bucket = spec["bucket"]  # None: DeepSpeed's defaults
        params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}
        zero: dict = {"stage": stage, "overlap_comm": True}
        if bucket is not None:
            b = int(bucket)
            zero.update(reduce_bucket_size=b, allgather_bucket_size=b)
            if stage == 3:
                zero.update(stage3_prefetch_bucket_size=b, stage3_param_persistence_threshold=0)
        config = {
            "train_micro_batch_size_per_gpu": spec["micro_batch"],
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": params},
            "zero_optimization": zero,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            # DeepSpeed >= 0.19 clips at 1.0 unless told (#8068); nobody else here clips
            "gradient_clipping": 0.0,
        }
        self.ds_version = deepspeed.__version__
        torch_adam = {**params, "torch_adam": True, "fused": True}  # torch's fused AdamW
        fallback = ""
        if spec.get("ds_optimizer") == "torch":
            config["optimizer"]["params"] = torch_adam
        try:
            self._initialize(deepspeed, spec, config)
        except Exception as e:  # its FusedAdam is a C++ JIT build; fall back to torch's AdamW
            if config["optimizer"]["params"] is torch_adam:
                raise
            print(
                f"rank {dist.get_rank()}: DeepSpeed's own AdamW failed ({type(e).__name__}: {e}); "
                "falling back to torch AdamW",
                file=sys.stderr,
            )
            fallback = f" (FALLBACK: DeepSpeed's AdamW failed: {type(e).__name__})"
            config["optimizer"]["params"] = torch_adam
            self._initialize(deepspeed, spec, config)
        torch.set_num_threads(1)
        inner = getattr(self.opt, "optimizer", self.opt)
        kind = "torch, fused" if isinstance(inner, torch.optim.AdamW) else "DeepSpeed's"
        wrapper = "" if inner is self.opt else f"{type(self.opt).__name__} over "
        size = "default bucket" if bucket is None else f"bucket {bucket:.0e}"
        self.note = f"{wrapper}{type(inner).__name__} ({kind}), {size}{fallback}"

    def _initialize(self, deepspeed, spec, config) -> None:
        model = build_model(spec)
        self.engine, self.opt, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=config,
            dist_init_required=False,
        )

    def fwd_bwd(self, x, y):
        loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss

    def opt_step(self):
        self.engine.step()

    def tracked(self):
        kinds, self.largest = tracked_bytes(self.engine.module, self.opt)
        return kinds


def make_system(spec):
    name = spec["system"]
    if name.startswith("zeroshard-s"):
        stage = int(name[len("zeroshard-s")])
        return Zeroshard(
            spec, stage, offload=name.endswith("-offload"), overlap=name.endswith("-lap")
        )
    if name.startswith("deepspeed-s"):
        return DeepSpeed(spec, int(name[-1]))
    if name in ("ddp", "zero-redundancy", "fsdp2"):
        return TorchSystem(spec, name)
    raise ValueError(f"unknown system {name!r}")


# -- one rank ------------------------------------------------------------------------------
def measure_tracked(system, out: dict) -> None:
    try:
        out["tracked"] = system.tracked()
    except Exception as e:  # a broken accessor must not hide the timings
        out["tracked"], out["tracked_error"] = {}, f"{type(e).__name__}: {e}"
    if hasattr(system, "largest"):
        out["largest_storages"] = system.largest


def run_rank(spec, rank: int) -> dict:
    world = spec["world"]
    t0 = time.perf_counter()
    system = make_system(spec)
    setup_s = time.perf_counter() - t0
    times: list[float] = []
    losses: list[float] = []
    out: dict[str, Any] = {}
    last = spec["warmup"] + spec["steps"] - 1
    for i in range(last + 1):
        if i == spec["warmup"] and hasattr(system, "reset_comm"):
            system.reset_comm()
        x, y = batch(spec, rank, world, i)
        t0 = time.perf_counter()
        loss = system.fwd_bwd(x, y)
        dt = time.perf_counter() - t0
        if i == last:  # measure bytes after the last backward (grads + optimizer state
            measure_tracked(system, out)  # present), then resume in step, untimed
            dist.barrier()
        t0 = time.perf_counter()
        system.opt_step()
        dt += time.perf_counter() - t0
        losses.append(loss.item())
        if i >= spec["warmup"]:
            times.append(dt)
    out.update(
        status="ok",
        step_times=times,
        losses=losses,
        final_loss=losses[-1],
        note=system.note,
        threads=torch.get_num_threads(),
        setup_s=setup_s,
    )
    if hasattr(system, "comm"):
        stats = system.comm()
        out["comm"] = stats
        out["comm_bytes_per_step"] = sum(s["bytes"] for s in stats.values()) / max(1, spec["steps"])
    if hasattr(system, "ds_version"):
        out["deepspeed"] = system.ds_version
    out["median_step_s"] = statistics.median(times) if times else math.nan
    return out


def main() -> None:
    spec_path, rank = sys.argv[1], int(sys.argv[2])
    with open(spec_path) as f:
        spec = json.load(f)
    world, here = spec["world"], os.path.dirname(spec_path)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(here, "store"), world),
            rank=rank,
            world_size=world,
        )
        try:
            out = run_rank(spec, rank)
        except NotAvailable as e:
            out = {"status": "not available", "reason": str(e)}
        out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open(os.path.join(here, f"result{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(here, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
