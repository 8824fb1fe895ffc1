"""A DeepSpeed checkpoint as zeroshard's loader sees any checkpoint: a manifest (names,
shapes, param groups, state kinds, the pieces each rank's file holds) and a reader of
elements ``[a, b)`` of any parameter's kind. ``load.py`` and ``export.py`` then work on
it unchanged, and ``validate.py`` checks it against the engine before anything is
written. No communication.

Where DeepSpeed keeps a trained parameter's elements (its fp32 master, and each
elementwise optimizer state laid out the same way):

* ZeRO-1/2 (and ``BF16_Optimizer``): per param group, the parameters of
  ``param_shapes[g]`` are concatenated in that order, each followed by its
  ``param_alignment_paddings`` entry, and the group is padded at the end to split into
  ``world`` equal partitions of ``P`` elements; rank ``r`` holds ``[r P, (r + 1) P)``
  (``single_partition_of_fp32_groups``, saved without the tail padding by ZeRO, with it
  by ``BF16_Optimizer``; ``group_paddings``: each rank's share of the tail).
* ZeRO-3: per sub-group, each parameter of ``param_shapes[s]`` is padded to
  ``world * ceil(n / world)`` elements and rank ``r`` holds its ``r``-th slice; a rank's
  ``fp32_flat_groups[s]`` concatenates its slices in that order. The sub-groups of param
  group ``i`` are the next ``len(param_groups[i]["params"])`` of them.

Frozen parameters (``frozen_param_fragments``, whole at stages 1-2, per-rank slices at
stage 3, or the module's state dict) and persistent buffers are tensors saved whole.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.checkpoint.ds_files import DeepSpeedFiles, numel
from zeroshard.checkpoint.ds_pickle import LossScalerState
from zeroshard.checkpoint.format import CheckpointError
from zeroshard.checkpoint.safetensors_io import DTYPE_NAMES
from zeroshard.parallel.tensor.slices import TPSlice

#: top-level keys of DeepSpeed's model states that are DeepSpeed's own; the rest is the
#: client_state the user passed to save_checkpoint
_DS_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info",
}  # fmt: skip
#: optimizer hyperparameters a load restores (numbers, and amsgrad: it decides the kinds)
_HYPER = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening", "amsgrad")


@dataclass(frozen=True)
class Span:
    """Elements ``[lo, hi)`` of a parameter sit at ``offset`` in rank ``rank``'s flat
    tensor of group ``group`` (a param group, or a ZeRO-3 sub-group)."""

    rank: int
    group: int
    offset: int
    lo: int
    hi: int


class DeepSpeedReader:
    """Slices of a DeepSpeed checkpoint's tensors, by zeroshard's kinds: ``param`` and
    ``master`` read the fp32 masters, other kinds the optimizer state."""

    def __init__(self, path: str, spans, shapes, sources, whole) -> None:
        self.path = path
        self.spans: dict[str, list[Span]] = spans
        self.shapes: dict[str, list[int]] = shapes
        self.sources: dict[tuple[str, int, int], torch.Tensor] = sources
        self.wholes: dict[str, torch.Tensor] = whole

    def get(
        self, kind: str, name: str, a: int, b: int, dtype: torch.dtype, spec: TPSlice | None = None
    ) -> torch.Tensor:
        """Elements ``[a, b)`` of ``name``'s flattened ``kind``, whole or of the
        tensor-parallel slice ``spec`` (DeepSpeed saves parameters whole)."""
        if name not in self.spans:
            whole = self.whole(name)
        elif spec is not None:
            whole = self._read(kind, name, 0, numel(self.shapes[name])).view(self.shapes[name])
        else:
            return self._read(kind, name, a, b).to(dtype)
        return (spec.take(whole) if spec else whole).reshape(-1)[a:b].to(dtype)

    def _read(self, kind: str, name: str, a: int, b: int) -> torch.Tensor:
        src_kind = "master" if kind == "param" else kind
        out = torch.empty(b - a, dtype=torch.float32)
        filled = 0
        for sp in self.spans[name]:
            s, e = max(a, sp.lo), min(b, sp.hi)
            if s >= e:
                continue
            src = self.sources[(src_kind, sp.rank, sp.group)]
            out[s - a : e - a] = src[sp.offset + s - sp.lo : sp.offset + e - sp.lo]
            filled += e - s
        if filled != b - a:
            raise CheckpointError(f"{self.path}: {kind} of {name!r} does not cover [{a}, {b})")
        return out

    def whole(self, name: str) -> torch.Tensor:
        if name in self.spans:  # a trained parameter the loading engine keeps whole
            return self._read("master", name, 0, numel(self.shapes[name])).view(self.shapes[name])
        return self.wholes[name]


def _split(name: str, start: int, n: int, part: int, rank_len: list[int], group: int, where):
    """Spans of a parameter at flat positions ``[start, start + n)`` of a group split in
    partitions of ``part`` elements (rank ``r`` holding ``rank_len[r]`` of them)."""
    out, pos = [], start
    while pos < start + n:
        r, off = divmod(pos, part)
        take = min(start + n, (r + 1) * part) - pos
        if r >= len(rank_len) or off + take > rank_len[r]:
            raise CheckpointError(
                f"{where(r)}: {name!r} runs past the end of the rank's partition of group "
                f"{group} (holding {rank_len[r] if r < len(rank_len) else 0} elements)"
            )
        out.append(Span(r, group, off, pos - start, pos - start + take))
        pos += take
    return out


def _base(sd: dict) -> Any:
    """The inner torch optimizer's state dict in one rank's ZeRO optimizer state (a list
    of per-group states when ZeRO-1/2 saved it elastic)."""
    base = sd.get("base_optimizer_state", sd.get("optimizer_state_dict"))
    if base is None:
        raise KeyError("base_optimizer_state")
    return base


def _state_of(files: DeepSpeedFiles, r: int, g: int) -> dict:
    """Rank ``r``'s inner optimizer state of flat group ``g``."""
    base = _base(files.optim[r])
    if isinstance(base, list):  # ZeRO-1/2 elastic: one lean state per group
        return base[g] if g < len(base) else {}
    index = g
    if files.stage < 3:  # group g holds one flat parameter: its index
        index = base["param_groups"][g]["params"][0]
    return base.get("state", {}).get(index, {})


def _param_groups(files: DeepSpeedFiles) -> list[dict]:
    base = _base(files.optim[0])
    return [] if isinstance(base, list) else base["param_groups"]


def _zero12(files: DeepSpeedFiles, spans, shapes, group_of, flat_len, owner) -> None:
    first = files.first()
    aligns = files.optim[0].get("param_alignment_paddings")
    for g, group_shapes in enumerate(first["param_shapes"]):
        parts = [sd["single_partition_of_fp32_groups"][g] for sd in files.optim]
        pads = [int(sd["group_paddings"][g]) for sd in files.optim]
        lens = [int(p.numel()) for p in parts]
        sizes = {n if files.padded else n + pad for n, pad in zip(lens, pads, strict=True)}
        if len(sizes) != 1:
            raise CheckpointError(
                f"{files.path}: the ranks' partitions of param group {g} differ in size "
                f"({lens}, paddings {pads})"
            )
        part = sizes.pop()
        align = aligns[g] if aligns else [0] * len(group_shapes)
        pos = 0
        for k, (name, shape) in enumerate(group_shapes.items()):
            n = numel(shape)
            spans[name] = _split(
                name, pos, n, part, lens, g, lambda r: files.file(files.optim_files[r])
            )
            shapes[name], group_of[name] = [int(d) for d in shape], g
            pos += n + int(align[k])
        if pos != part * files.world - sum(pads):
            raise CheckpointError(
                f"{files.path}: param group {g}'s parameters (param_shapes) take {pos} "
                f"elements, its {files.world} partitions hold {part * files.world - sum(pads)}"
            )
        for r in range(files.world):
            flat_len[(r, g)] = part  # the inner optimizer's state keeps the padding
        owner[g] = g


def _zero3(files: DeepSpeedFiles, spans, shapes, group_of, flat_len, owner) -> None:
    first, world = files.first(), files.world
    listed = [i for i, grp in enumerate(_param_groups(files)) for _ in grp["params"]]
    subgroups = first["param_shapes"]
    if len(listed) != len(subgroups):
        raise CheckpointError(
            f"{files.path}: {len(subgroups)} sub-groups in param_shapes, but the optimizer's "
            f"param groups list {len(listed)}"
        )
    owner.update(enumerate(listed))
    for s, sub_shapes in enumerate(subgroups):
        pos = 0
        for name, shape in sub_shapes.items():
            n = numel(shape)
            each = math.ceil(n / world)
            spans[name] = [
                Span(r, s, pos, r * each, min(n, (r + 1) * each))
                for r in range(world)
                if r * each < n
            ]
            shapes[name], group_of[name] = [int(d) for d in shape], owner[s]
            pos += each
        for r, sd in enumerate(files.optim):
            got = int(sd["fp32_flat_groups"][s].numel())
            if got != pos:
                raise CheckpointError(
                    f"{files.file(files.optim_files[r])}: fp32_flat_groups[{s}] holds {got} "
                    f"elements, its parameters (param_shapes) need {pos}"
                )
            flat_len[(r, s)] = pos


def _sources(files: DeepSpeedFiles, flat_len) -> tuple[dict, list[str], dict[int, float]]:
    """Every rank's flat tensors by (kind, rank, flat group), the state kinds, and each
    flat group's optimizer step."""
    key = "fp32_flat_groups" if files.stage == 3 else "single_partition_of_fp32_groups"
    sources: dict = {}
    kinds: set[str] | None = None
    steps: dict[int, float] = {}
    for (r, g), length in sorted(flat_len.items()):
        where = files.file(files.optim_files[r])
        master = files.optim[r][key][g].reshape(-1)
        sources[("master", r, g)] = master
        state = _state_of(files, r, g)
        elastic = isinstance(files.optim[r].get("base_optimizer_state"), list)
        want = master.numel() if elastic or files.stage == 3 else length
        found = set()
        for kind, value in state.items():
            if kind == "step":
                step = float(value)
                if steps.setdefault(g, step) != step:
                    raise CheckpointError(
                        f"{where}: group {g} at step {step}, other ranks {steps[g]}"
                    )
            elif torch.is_tensor(value) and value.numel() == want:
                sources[(kind, r, g)] = value.reshape(-1)
                found.add(kind)
            elif torch.is_tensor(value) and value.dim() > 0:
                raise CheckpointError(
                    f"{where}: optimizer state {kind!r} of group {g} holds {value.numel()} "
                    f"elements, its partition {want}"
                )
        if elastic and "step" not in state and state:
            steps.setdefault(g, float(files.optim[r].get("base_optimizer_state_step", 0)))
        if kinds is not None and found != kinds:
            raise CheckpointError(
                f"{where}: optimizer state kinds {sorted(found)} in group {g}, "
                f"{sorted(kinds)} elsewhere"
            )
        kinds = found
    return sources, sorted(kinds or ()), steps


def _wholes(files: DeepSpeedFiles, trained: set[str]) -> tuple[dict, dict[str, str]]:
    """Tensors saved whole (frozen parameters, buffers) and aliases (tied names)."""
    first = files.first()
    module = first["module"]
    buffers = [n for n in first.get("buffer_names") or [] if n in module]
    aliases = dict(first.get("shared_params") or {})
    if files.stage == 0:  # tied names: the same storage twice in the state dict
        seen: dict = {}
        for name, t in module.items():
            if torch.is_tensor(t) and t.numel():
                k = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
                if k in seen:
                    aliases[name] = seen[k]
                seen.setdefault(k, name)
    out = {n: module[n] for n in buffers if torch.is_tensor(module[n])}
    fshapes = first.get("frozen_param_shapes")
    if fshapes:
        for name, shape in fshapes.items():
            frags = [m["frozen_param_fragments"][name].reshape(-1) for m in files.model]
            out[name] = torch.cat(frags)[: numel(shape)].view([int(d) for d in shape])
    elif files.stage < 3:  # frozen ones are in the module's state dict
        for name, t in module.items():  # (non-tensor entries: a module's extra state)
            if torch.is_tensor(t) and name not in trained and name not in aliases:
                out.setdefault(name, t)
    return out, aliases


def _groups(files: DeepSpeedFiles, steps: dict[int, float], owner: dict[int, int]) -> list[dict]:
    """Each param group's hyperparameters (none saved by elastic ZeRO-1/2) and step."""
    saved = _param_groups(files)
    groups = []
    for i in range(1 + max(owner.values(), default=-1)):
        src = saved[i] if i < len(saved) else {}
        g = {k: (list(v) if isinstance(v, tuple) else v) for k, v in src.items() if k in _HYPER}
        found = {steps[s] for s, o in owner.items() if o == i and s in steps}
        if len(found) > 1:
            raise CheckpointError(f"{files.path}: param group {i}'s sub-groups at steps {found}")
        g["step"] = int(found.pop()) if found else 0
        groups.append(g)
    return groups


def _loss_scaler(files: DeepSpeedFiles) -> dict:
    scaler = files.optim[0].get("loss_scaler") if files.optim else None
    if not isinstance(scaler, LossScalerState) or not getattr(scaler, "dynamic", False):
        return {}  # static (1.0 in fp32/bf16): the engine's config decides
    return {
        "scale": float(getattr(scaler, "cur_scale", 1.0)),
        "cur_hysteresis": int(getattr(scaler, "cur_hysteresis", 1)),
        "iteration": int(getattr(scaler, "cur_iter", 0)),
        "last_overflow_iter": int(getattr(scaler, "last_overflow_iter", -1)),
    }


def describe(files: DeepSpeedFiles, *, training: bool) -> tuple[dict, DeepSpeedReader]:
    """The manifest and reader of a read DeepSpeed checkpoint (``ds_files.read``)."""
    where = files.file(files.model_files[0])
    for key in ("data_sampler", "random_ltd"):
        if training and files.first().get(key) is not None:
            raise CheckpointError(
                f"{where}: holds DeepSpeed's {key} state, which zeroshard has no "
                "counterpart for; load with load_module_only=True"
            )
    try:
        return _describe(files, where)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(
            f"{files.path}: a DeepSpeed ZeRO-{files.stage} file lacks what its stage "
            f"records ({type(exc).__name__}: {exc})"
        ) from exc


def _describe(files: DeepSpeedFiles, where: str) -> tuple[dict, DeepSpeedReader]:
    first = files.first()
    spans: dict[str, list[Span]] = {}
    shapes: dict[str, list[int]] = {}
    group_of: dict[str, int] = {}
    flat_len: dict[tuple[int, int], int] = {}
    owner: dict[int, int] = {}  # flat group -> param group
    if files.stage == 3:
        _zero3(files, spans, shapes, group_of, flat_len, owner)
    elif files.stage > 0:
        _zero12(files, spans, shapes, group_of, flat_len, owner)
    sources, kinds, steps = _sources(files, flat_len)
    whole, aliases = _wholes(files, set(spans))
    module = first["module"]
    for name, shape in shapes.items():  # stages 1-2 also save the model whole: must agree
        t = module.get(name)
        if files.stage < 3 and t is not None and list(t.shape) != shape:
            raise CheckpointError(
                f"{where}: module[{name!r}] has shape {list(t.shape)}, param_shapes says {shape}"
            )
    listed = files.optim_files or files.model_files[:1]  # pieces name these by index
    compute = next((module[n].dtype for n in spans if n in module), torch.float32)
    manifest: dict[str, Any] = {
        "format": "deepspeed-checkpoint",
        "version": 2,
        "deepspeed_version": str(first.get("ds_version")),
        "tag": os.path.basename(os.path.normpath(files.path)),
        "world_size": len(listed),
        "zero_stage": files.stage,
        "compute_dtype": DTYPE_NAMES.get(compute, "F32"),
        "files": [{"name": n, "bytes": os.path.getsize(files.file(n))} for n in listed],
        "params": {
            name: {
                "shape": shapes[name],
                "group": group_of[name],
                "dtype": DTYPE_NAMES.get(compute, "F32"),
                "pieces": [[s.rank, s.lo, s.hi] for s in spans[name]],
            }
            for name in spans
        },
        "whole": {
            n: {
                "shape": list(t.shape),
                "dtype": DTYPE_NAMES[t.dtype],
                "buffer": n in (first.get("buffer_names") or []),
            }
            for n, t in whole.items()
        },
        "aliases": {a: n for a, n in aliases.items() if n in spans or n in whole},
        "kinds": ["param", "master", *kinds] if spans else ["param"],
        "optimizer": {
            "type": ((first.get("ds_config") or {}).get("optimizer") or {}).get("type"),
            "groups": _groups(files, steps, owner) if spans else [],
        },
        "scheduler": first.get("lr_scheduler"),
        "loss_scaler": _loss_scaler(files),
        "counters": {
            k: first.get(k, 0) for k in ("global_steps", "global_samples", "skipped_steps")
        },
        "client_state": {k: v for k, v in first.items() if k not in _DS_KEYS},
        "rng": False,  # DeepSpeed saves no random-number-generator states
    }
    reader = DeepSpeedReader(files.path, spans, shapes, sources, whole)
    return manifest, reader
