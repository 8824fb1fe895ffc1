"""The device mesh: one named process grid, built once and passed explicitly.

Axes, outermost first: ``pp`` (pipeline stages), ``dp_replicate`` (data-parallel
replicas of a sharded model: MiCS / HSDP), ``dp_shard`` (data-parallel ranks that shard
ZeRO state), ``ep`` (expert parallel: data-parallel ranks that hold different experts
of each mixture-of-experts layer and exchange tokens; DeepSpeed's default order, the
ranks of an expert-parallel group adjacent), ``sp`` (sequence parallel) and ``tp``
(tensor parallel, innermost: adjacent ranks, the fastest links). Every axis has size 1
unless configured, so plain data parallelism is the mesh ``dp_shard = world``. A rank's
coordinates follow from its rank in row-major order over the axes.

Named groups of axes, used by the engine and ZeRO:

* ``dp`` = dp_replicate x dp_shard x ep: the ranks that see different samples (the
  batch rule divides by its size; the data sampler splits over it);
* ``zero_shard`` = dp_shard x ep x sp: the ranks ZeRO shards optimizer state, gradients
  and parameters across (sequence-parallel ranks hold the same parameters, so they
  shard them too); expert parameters are sharded over ``expert_shard`` instead;
* ``zero_replicate`` = dp_replicate: shards are replicated across it (gradient shards
  are all-reduced over it);
* ``replicas`` = dp_replicate x dp_shard x ep x sp: the ranks that start from identical
  dense parameters (the initial broadcast) and whose gradients are averaged;
* ``expert_shard`` = dp_shard x sp and ``expert_replicas`` = dp_replicate x dp_shard x
  sp: the same for expert parameters, which differ along ``ep`` (DeepSpeed's
  expert-data-parallel group is ``expert_replicas``; ``expert_stage`` adds ``tp``);
* ``stage`` = every axis but pp: the ranks of one pipeline stage (they hold the same
  layers; tensor parallelism slices them from the same whole values).

Each axis (or named group) has one :class:`~zeroshard.distributed.comm.Comm`; all of a mesh's Comms
share one ledger, which files bytes per axis. The single axes come from torch's
``DeviceMesh`` (it serves on gloo and NCCL alike and is what DTensor code needs); a
group spanning several axes of size > 1 is made with ``new_group`` over the same
row-major layout, because ``DeviceMesh`` offers that only through a private method.

Communication: building a mesh creates process groups (every rank takes part); no data
moves. :meth:`Mesh.release` destroys the groups the mesh created (never the default group
nor groups handed in through an ``mpu``): each idle gloo group keeps backend threads that
wake every few milliseconds, so a process that builds engine after engine would otherwise
spend more CPU the more engines it has built. ``Engine.destroy()`` calls it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields

import torch.distributed as dist

from zeroshard import ZeroshardError
from zeroshard.distributed.comm import Comm
from zeroshard.distributed.device import claim_device
from zeroshard.distributed.ledger import Ledger
from zeroshard.distributed.process_group import local_rank

AXES = ("pp", "dp_replicate", "dp_shard", "ep", "sp", "tp")
GROUPS = {
    "dp": ("dp_replicate", "dp_shard", "ep"),
    "zero_shard": ("dp_shard", "ep", "sp"),
    "zero_replicate": ("dp_replicate",),
    "replicas": ("dp_replicate", "dp_shard", "ep", "sp"),
    "expert_shard": ("dp_shard", "sp"),
    "expert_replicas": ("dp_replicate", "dp_shard", "sp"),
    "expert_stage": ("dp_replicate", "dp_shard", "sp", "tp"),
    "stage": ("dp_replicate", "dp_shard", "ep", "sp", "tp"),
    "world": AXES,
}


class MeshError(ZeroshardError, ValueError):
    """A mesh that cannot be built; the message names the config key."""


@dataclass(frozen=True, kw_only=True)
class MeshShape:
    """Size of each axis."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    sp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshError(f"mesh axis {f.name}: expected a whole number >= 1, got {value!r}")

    def size(self, *axes: str) -> int:
        return math.prod(getattr(self, a) for a in axes)

    @property
    def world(self) -> int:
        return self.size(*AXES)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` (row-major: tp varies fastest)."""
        out = {}
        for axis in reversed(AXES):
            n = getattr(self, axis)
            out[axis] = rank % n
            rank //= n
        return {a: out[a] for a in AXES}

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for axis in AXES:
            rank = rank * getattr(self, axis) + coords.get(axis, 0)
        return rank

    def partitions(self, axes: tuple[str, ...]) -> list[list[int]]:
        """The groups of ranks that differ only along ``axes``, each in rank order."""
        others = [a for a in AXES if a not in axes]
        out = []
        for fixed in itertools.product(*(range(getattr(self, a)) for a in others)):
            base = dict(zip(others, fixed, strict=True))
            members = [
                self.rank_of({**base, **dict(zip(axes, varying, strict=True))})
                for varying in itertools.product(*(range(getattr(self, a)) for a in axes))
            ]
            out.append(sorted(members))
        return out

    @classmethod
    def for_world(
        cls,
        world: int,
        *,
        tp: int = 1,
        sp: int = 1,
        pp: int = 1,
        shard_size: int = 0,
        ep: int = 1,
    ) -> MeshShape:
        """The mesh for ``world`` ranks: data parallelism takes what tp x sp x pp leave;
        with ``shard_size`` (MiCS / HSDP) it is split into replicas of that many shards;
        ``ep`` expert-parallel ranks are carved out of it (they see different samples)."""
        other = tp * sp * pp
        if world % other:
            raise MeshError(
                f"tensor_parallel.autotp_size ({tp}) x sequence_parallel_size ({sp}) x "
                f"pipeline.stages ({pp}) = {other} does not divide the world size ({world})"
            )
        dp = world // other
        if ep > 1:
            if dp % ep:
                raise MeshError(
                    f"expert parallelism: the expert-parallel size ({ep}: a MoE layer's "
                    f"ep_size or expert_parallel.autoep_size) does not divide the "
                    f"data-parallel size ({dp} = world {world} / (tp x sp x pp) {other})"
                )
            if shard_size > 0 and shard_size != dp:
                raise MeshError(
                    "zero_optimization.mics_shard_size with expert parallelism is not built "
                    "yet; leave mics_shard_size out"
                )
            return cls(pp=pp, dp_shard=dp // ep, ep=ep, sp=sp, tp=tp)
        if shard_size <= 0 or shard_size == dp:
            return cls(pp=pp, dp_shard=dp, sp=sp, tp=tp)
        if dp % shard_size:
            raise MeshError(
                f"zero_optimization.mics_shard_size: {shard_size} does not divide the "
                f"data-parallel size ({dp} = world {world} / (tp x sp x pp) {other})"
            )
        return cls(pp=pp, dp_replicate=dp // shard_size, dp_shard=shard_size, sp=sp, tp=tp)


class Mesh:
    """This rank's view of the process grid: coordinates and one Comm per axis/group.

    Build it with :meth:`build` (from a shape, on an initialized default group) or
    :meth:`from_mpu` (from a Megatron-style model-parallel unit's groups).
    """

    def __init__(
        self,
        shape: MeshShape,
        rank: int,
        groups: dict[tuple[str, ...], dist.ProcessGroup | None],
        *,
        ledger: Ledger | None = None,
        device_mesh=None,
    ) -> None:
        self.shape, self.rank = shape, rank
        self.coords = shape.coords(rank)
        self.ledger = ledger if ledger is not None else Ledger()
        self.device_mesh = device_mesh  # torch DeviceMesh over AXES, when built from a shape
        self._groups = groups
        self._comms: dict[tuple[str, ...], Comm] = {}
        # the process groups this mesh created (release() destroys them); an mpu's groups
        # and the default group belong to the caller
        self._owned: list[dist.ProcessGroup] = []
        self.released = False

    # -- construction -------------------------------------------------------------------
    @classmethod
    def build(cls, shape: MeshShape, device_type: str = "cpu", ledger: Ledger | None = None):
        """Create the groups of ``shape`` (every rank must call this, in the same order)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if shape.world != world:
            raise MeshError(
                f"the mesh {describe(shape)} has {shape.world} ranks but the world has {world}"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        owned: list[dist.ProcessGroup] = []
        device_mesh = None
        if dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh

            # DeviceMesh makes device LOCAL_RANK current itself when the runtime is not
            # initialized yet: with ranks sharing a GPU (gloo) that ordinal may not exist.
            # This rank's device (LOCAL_RANK modulo the visible devices, as the engine's)
            # is made current first, and DeviceMesh keeps it.
            claim_device(device_type, local_rank())
            sizes = tuple(getattr(shape, a) for a in AXES)
            device_mesh = init_device_mesh(device_type, sizes, mesh_dim_names=AXES)
            for axis in AXES:
                groups[(axis,)] = device_mesh.get_group(axis)
                _own(owned, groups[(axis,)])
            for axes in GROUPS.values():
                cls._combined(shape, rank, axes, groups, owned)
        mesh = cls(shape, rank, groups, ledger=ledger, device_mesh=device_mesh)
        mesh._owned = owned
        return mesh

    @staticmethod
    def _combined(
        shape: MeshShape, rank: int, axes: tuple[str, ...], groups: dict, owned: list
    ) -> None:
        """The group over several axes: reuse an axis group when only one of them has
        size > 1, the default group when it spans the world, else ``new_group`` (all
        ranks create every partition's group, in order)."""
        if axes in groups:
            return
        big = [a for a in axes if getattr(shape, a) > 1]
        if len(big) <= 1:
            groups[axes] = groups[(big[0] if big else axes[0],)]
            return
        if shape.size(*axes) == shape.world:
            groups[axes] = None  # the default group
            return
        for members in shape.partitions(axes):
            group = dist.new_group(members)
            if rank in members:
                groups[axes] = group
                _own(owned, group)

    @classmethod
    def from_mpu(cls, mpu, ledger: Ledger | None = None) -> Mesh:
        """A mesh from a Megatron-style ``mpu`` (DeepSpeed's ``initialize(mpu=...)``): its
        data-parallel, tensor(model)-parallel and, if it has one, pipeline groups."""

        def group(*names):
            for name in names:
                fn = getattr(mpu, name, None)
                if fn is not None:
                    return fn()
            return None

        dp = group("get_data_parallel_group")
        if dp is None:
            raise MeshError("initialize(mpu=...): the mpu has no get_data_parallel_group()")
        tp = group("get_tensor_model_parallel_group", "get_model_parallel_group")
        pp = group("get_pipeline_model_parallel_group")
        size = {"dp_shard": dist.get_world_size(dp)}
        size["tp"] = dist.get_world_size(tp) if tp is not None else 1
        size["pp"] = dist.get_world_size(pp) if pp is not None else 1
        shape = MeshShape(**size)
        if shape.world != dist.get_world_size():
            raise MeshError(
                f"initialize(mpu=...): data ({size['dp_shard']}) x tensor ({size['tp']}) x "
                f"pipeline ({size['pp']}) parallel sizes do not multiply to the world size "
                f"({dist.get_world_size()})"
            )
        # this rank's coordinates from its rank inside each group (Megatron's layout
        # need not be ours, so the mesh rank is recomputed from them)
        coords = {
            "dp_shard": dist.get_rank(dp),
            "tp": dist.get_rank(tp) if tp is not None else 0,
            "pp": dist.get_rank(pp) if pp is not None else 0,
        }
        singles = {a: dist.new_group([dist.get_rank()]) for a in ("dp_replicate", "ep", "sp")}
        groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {
            ("dp_shard",): dp,
            ("dp_replicate",): singles["dp_replicate"],
            ("ep",): singles["ep"],
            ("sp",): singles["sp"],
            ("tp",): tp if tp is not None else dist.new_group([dist.get_rank()]),
            ("pp",): pp if pp is not None else dist.new_group([dist.get_rank()]),
        }
        for axes in GROUPS.values():
            big = [a for a in axes if getattr(shape, a) > 1]
            if len(big) <= 1:
                groups[axes] = groups[(big[0] if big else axes[0],)]
            elif shape.size(*axes) == shape.world:
                groups[axes] = None
            else:
                raise MeshError(
                    "initialize(mpu=...): a group spanning several mpu axes is needed here "
                    f"({'+'.join(axes)}); not supported with an mpu"
                )
        mesh = cls(shape, shape.rank_of(coords), groups, ledger=ledger)
        for g in (*singles.values(), groups[("tp",)], groups[("pp",)]):
            if g is not tp and g is not pp:  # the ones made here, not the mpu's
                _own(mesh._owned, g)
        return mesh

    def pipeline_subgroup(self, stages: list[int], name: str) -> Comm:
        """A Comm over the ranks at pipeline ``stages`` that share this rank's other
        coordinates (e.g. the stages holding a tied embedding). Every rank must call it
        with the same arguments, in the same order; a rank outside ``stages`` gets a
        Comm it must not use."""
        stages = sorted(stages)
        if stages == list(range(self.shape.pp)):
            comm = self.comm("pp")
            return Comm(comm.group, self.ledger, axis=name)
        mine = None
        if dist.is_initialized():
            for members in self.shape.partitions(("pp",)):  # rank order = stage order
                chosen = [members[s] for s in stages]
                group = dist.new_group(chosen)
                if self.rank in chosen:
                    mine = group
                    _own(self._owned, group)
        return Comm(mine, self.ledger, axis=name)

    # -- queries --------------------------------------------------------------------------
    def size(self, name: str) -> int:
        """Ranks along an axis or a named group (``dp``, ``zero_shard``, ...)."""
        return self.shape.size(*self._axes(name))

    def coord(self, name: str, rank: int | None = None) -> int:
        """This rank's (or mesh rank ``rank``'s) index along an axis or a named group
        (row-major over its axes)."""
        coords = self.coords if rank is None else self.shape.coords(rank)
        index = 0
        for axis in self._axes(name):
            index = index * getattr(self.shape, axis) + coords[axis]
        return index

    def comm(self, name: str) -> Comm:
        """The Comm over an axis or a named group; its ledger entries carry ``name``."""
        axes = self._axes(name)
        if self.released:
            raise MeshError(
                f"mesh.comm({name!r}): this mesh's process groups were released (the engine "
                "that owned it was destroyed); use the engine the latest initialize() returned"
            )
        if axes not in self._comms:
            group = self._groups[axes] if self._groups else None  # None: one process
            self._comms[axes] = Comm(group, self.ledger, axis=name)
        return self._comms[axes]

    def twin(self, name: str) -> Comm:
        """A second Comm over the ranks of ``name`` with a process group of its own; the
        same ledger axis. Two streams of collectives whose relative order may differ
        between ranks (stage 3's parameter gathers and gradient reductions in backward)
        each keep their own order on their own group, instead of meeting in one group in
        a different order on each rank. Every rank must call it, in the same order (one
        all-gather of the group's members over the world, then ``new_group``)."""
        comm = self.comm(name)
        if comm.world_size == 1 or not dist.is_initialized():
            return comm  # no collective crosses processes
        mine = sorted(dist.get_process_group_ranks(comm.group or dist.group.WORLD))
        twin = None
        for members in sorted({tuple(m) for m in self.comm("world").all_gather_object(mine)}):
            group = dist.new_group(list(members))
            if dist.get_rank() in members:
                twin = group
                _own(self._owned, group)
        return Comm(twin, self.ledger, axis=name)

    def owned_groups(self) -> list[dist.ProcessGroup]:
        """The process groups this mesh created (what :meth:`release` destroys)."""
        return list(self._owned)

    def release(self) -> None:
        """Destroy the process groups this mesh created and drop its references to them
        (a gloo group's threads end only when nothing holds it any more); idempotent. Local:
        no collective, so ranks may call it at different times. The mesh refuses
        :meth:`comm` afterwards; Comms handed out before must not be used again."""
        if self.released:
            return
        self.released = True
        owned, self._owned = self._owned, []
        self._groups, self._comms, self.device_mesh = {}, {}, None
        if not dist.is_initialized():
            return  # the world (and every group with it) is gone already
        for group in owned:
            dist.destroy_process_group(group)

    @staticmethod
    def _axes(name: str) -> tuple[str, ...]:
        if name in GROUPS:
            return GROUPS[name]
        if name in AXES:
            return (name,)
        raise KeyError(
            f"no mesh axis or group named {name!r} (axes {AXES}, groups {tuple(GROUPS)})"
        )

    def describe(self) -> str:
        return describe(self.shape)


def _own(owned: list, group) -> None:
    """Record ``group`` as created by the mesh, unless it is the default group (a mesh
    axis spanning the world reuses it) or already recorded."""
    if group is None or group is dist.group.WORLD or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    if not any(group is g for g in owned):
        owned.append(group)


def describe(shape: MeshShape) -> str:
    """``pp1 x dp_replicate2 x dp_shard2 x sp1 x tp1``-style text (sizes > 1 only)."""
    parts = [f"{a}{getattr(shape, a)}" for a in AXES if getattr(shape, a) > 1]
    return " x ".join(parts) or "one rank"
