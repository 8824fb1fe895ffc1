"""Finding a DeepSpeed checkpoint directory and reading its files (ZeRO stages 0-3).

A DeepSpeed checkpoint is ``DIR/latest`` naming a tag directory (``global_stepN``) that
holds, per model-parallel rank 0 (the only one read here):

* model states: ``mp_rank_00_model_states.pt`` (stages 0-2), or one
  ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per data-parallel rank (stage 3): the
  module's state dict, ``param_shapes`` (the flat order of the trained parameters, per
  param group or ZeRO-3 sub-group), ``frozen_param_shapes``/``frozen_param_fragments``,
  ``shared_params`` (tied names), ``buffer_names``, ``lr_scheduler``, the counters and
  ``dp_world_size``;
* one ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank: that
  rank's fp32 partition of each flat group and the inner torch optimizer's state of it.

Layouts DeepSpeed also writes and zeroshard refuses by name: pipeline-parallel
(``layer_*-model_states.pt``), tensor/model-parallel (``mp_rank_01_*``), MoE experts
(``*expert_*``, ``expp_rank_*``), universal checkpoints (``zero/`` per-parameter
folders), NVMe-offloaded optimizer state (``offloaded_tensors/``).

Everything is read through ``ds_pickle.load_pt`` (no code runs). No communication.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroshard.checkpoint.ds_pickle import ZeroStage, check_zip, load_pt
from zeroshard.checkpoint.format import MANIFEST, CheckpointError
from zeroshard.checkpoint.paths import LATEST, inside
from zeroshard.checkpoint.validate import resolve_tag

MODEL_FILE = "mp_rank_00_model_states.pt"
_MODEL = re.compile(r"^(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")
_REFUSED = [  # (file name pattern, what it is)
    (re.compile(r"^layer_\d+-model_\d+-model_states\.pt$|^layer_\d+-model_states\.pt$"),
     "a pipeline-parallel checkpoint (PipelineModule's per-layer files)"),
    (re.compile(r"^(.*_)?mp_rank_(0[1-9]|[1-9]\d+)_.*\.pt$"),
     "a tensor/model-parallel checkpoint (mp_rank above 00)"),
    (re.compile(r"expert_\d+_mp_rank_|^expp_rank_\d+_"),
     "a mixture-of-experts checkpoint (per-expert files)"),
]  # fmt: skip


def _optim_name(prefix: str, rank: int) -> str:
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _model_file(path: str) -> bool:
    return any(_MODEL.match(n) for n in os.listdir(path))


def is_deepspeed_dir(path: str) -> bool:
    """Whether ``path`` is a DeepSpeed tag directory (model-state ``.pt`` files, or a
    layout refused by name, and no zeroshard manifest)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, MANIFEST)):
        return False
    names = os.listdir(path)
    return any(_MODEL.match(n) or any(p.search(n) for p, _ in _REFUSED) for n in names)


def deepspeed_path(load_dir: str, tag: str | None) -> str | None:
    """The DeepSpeed tag directory ``load_dir`` (with ``tag``, or ``latest``) names, or
    None when it is not a DeepSpeed checkpoint."""
    if tag is None and is_deepspeed_dir(load_dir):
        return load_dir
    if tag is None and not os.path.isfile(os.path.join(load_dir, LATEST)):
        return None
    try:
        path = os.path.join(load_dir, resolve_tag(load_dir, tag))
    except CheckpointError:
        return None  # the zeroshard path reports it
    if not is_deepspeed_dir(path):
        return None
    if not inside(load_dir, path):
        raise CheckpointError(f"{path}: a symlink leading out of {load_dir}; refused")
    return path


@dataclass
class DeepSpeedFiles:
    """What a DeepSpeed tag directory holds, read and checked for shape."""

    path: str
    stage: int  # ZeRO stage of the save (0: no ZeRO optimizer files)
    world: int  # data-parallel ranks of the save
    model: list[dict]  # model states: one file (stages 0-2) or one per rank (stage 3)
    model_files: list[str]
    optim: list[dict] = field(default_factory=list)  # optimizer_state_dict per rank
    optim_files: list[str] = field(default_factory=list)
    padded: bool = False  # BF16_Optimizer: partitions saved with their tail padding

    def first(self) -> dict:
        return self.model[0]

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)


def _refuse_layouts(path: str) -> None:
    names = os.listdir(path)
    for pattern, what in _REFUSED:
        hits = sorted(n for n in names if pattern.search(n))
        if hits:
            raise CheckpointError(
                f"{os.path.join(path, hits[0])}: {what}; loading DeepSpeed checkpoints of this "
                "layout is not built yet (ZeRO stages 0-3 on data-parallel ranks are)"
            )
    for sub, what in (
        ("zero", "a DeepSpeed universal checkpoint (ds_to_universal's zero/ folders)"),
        ("offloaded_tensors", "optimizer state offloaded to NVMe (offloaded_tensors/)"),
    ):
        if os.path.isdir(os.path.join(path, sub)):
            raise CheckpointError(f"{os.path.join(path, sub)}: {what}; loading it is not built yet")


def _need(obj: Any, key: str, kinds: type | tuple, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointError(f"{where}: no {key!r} entry (not a DeepSpeed checkpoint file?)")
    value = obj[key]
    if not isinstance(value, kinds):
        raise CheckpointError(f"{where}: {key!r} is a {type(value).__name__}, expected {kinds}")
    return value


def read(path: str) -> DeepSpeedFiles:
    """Read and check the files of DeepSpeed tag directory ``path``: which exist, that
    each is a DeepSpeed file of the expected kind, and that the ranks agree. At stages
    1-3 every rank's optimizer file is needed, also for the weights alone: the fp32
    weights live there."""
    _refuse_layouts(path)
    z3 = os.path.join(path, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    single = os.path.join(path, MODEL_FILE)
    if os.path.isfile(single):
        model_files = [MODEL_FILE]
    elif os.path.isfile(z3):
        model_files = ["zero_pp_rank_0_mp_rank_00_model_states.pt"]
    else:
        found = sorted(os.listdir(path))[:6]
        raise CheckpointError(
            f"{path}: no {MODEL_FILE} nor zero_pp_rank_0_mp_rank_00_model_states.pt "
            f"(it holds {found}): not a DeepSpeed checkpoint zeroshard can read"
        )
    first = load_pt(os.path.join(path, model_files[0]))
    where = os.path.join(path, model_files[0])
    _need(first, "module", dict, where)
    world = _need(first, "dp_world_size", int, where)
    if world < 1:
        raise CheckpointError(f"{where}: dp_world_size {world}")
    if first.get("mp_world_size", 1) != 1:
        raise CheckpointError(
            f"{where}: saved with mp_world_size {first['mp_world_size']} (tensor/model "
            "parallel); loading it is not built yet"
        )
    model = [first]
    if model_files[0] != MODEL_FILE:  # stage 3: one model-state file per rank
        for r in range(1, world):
            name = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            model_files.append(name)
            model.append(load_pt(os.path.join(path, name)))
    files = DeepSpeedFiles(path, 0, world, model, model_files)
    if first.get("param_shapes") is None:  # no ZeRO: a torch optimizer state dict, if any
        return files
    prefix = next(
        (
            p
            for p in ("", "bf16_", "fp16_")
            if os.path.isfile(os.path.join(path, _optim_name(p, 0)))
        ),
        None,
    )
    if prefix is None:
        raise CheckpointError(
            f"{os.path.join(path, _optim_name('', 0))}: missing (nor a bf16_ one): the "
            f"checkpoint's {model_files[0]} records ZeRO param_shapes, so its fp32 weights "
            "and optimizer state are in these files"
        )
    for r in range(world):
        name = _optim_name(prefix, r)
        sd = _need(load_pt(os.path.join(path, name)), "optimizer_state_dict", dict, name)
        files.optim.append(sd)
        files.optim_files.append(name)
    stray = sorted(
        n for n in os.listdir(path)
        if n.endswith("_optim_states.pt") and n not in files.optim_files
    )  # fmt: skip
    if stray:
        raise CheckpointError(
            f"{os.path.join(path, stray[0])}: not one of the {world} ranks' files the model "
            f"states record (dp_world_size {world}): a directory mixing two saves?"
        )
    _stage(files)
    return files


def _stage(files: DeepSpeedFiles) -> None:
    """The ZeRO stage, the same in every rank's file; BF16_Optimizer files (no stage
    recorded) partition like stage 1 and keep their padding."""
    stages = set()
    for name, sd in zip(files.optim_files, files.optim, strict=True):
        stage = sd.get("zero_stage")
        if stage is None:
            files.padded = True
            stage = ZeroStage(1)
        if not isinstance(stage, int) or not 1 <= int(stage) <= 3:
            raise CheckpointError(f"{files.file(name)}: zero_stage {stage!r}")
        stages.add(int(stage))
        counts = sd.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(c != files.world for c in counts):
            raise CheckpointError(
                f"{files.file(name)}: partition_count {sd.get('partition_count')!r}, but "
                f"dp_world_size is {files.world} (DeepSpeed's expert-parallel partitions: loading "
                "them is not built yet)"
            )
    if len(stages) != 1:
        raise CheckpointError(f"{files.path}: the ranks' files record stages {sorted(stages)}")
    files.stage = stages.pop()
    if (files.stage == 3) != (files.model_files[0] != MODEL_FILE):
        raise CheckpointError(
            f"{files.file(files.model_files[0])}: model-state files of "
            f"{'stage 3' if files.stage != 3 else 'stages 0-2'}, optimizer files of stage "
            f"{files.stage}"
        )


def scan(files: DeepSpeedFiles, indices, *, verify: bool, allow_nonfinite: bool) -> None:
    """Check files ``indices`` (of model files then optimizer files): the CRC-32 of every
    zip member (``verify``) and no NaN/inf in floating tensors (unless
    ``allow_nonfinite``)."""
    names = files.model_files + files.optim_files
    objs = files.model + files.optim
    for i in indices:
        if i >= len(names):
            continue
        fpath = files.file(names[i])
        if verify:
            check_zip(fpath)
        if not allow_nonfinite:
            bad = _nonfinite(objs[i], "")
            if bad:
                raise CheckpointError(
                    f"{fpath}: non-finite values (NaN or inf) in {', '.join(bad[:4])}"
                    f"{' and more' if len(bad) > 4 else ''}; load with allow_nonfinite=True "
                    "(zeroshard convert --allow-nonfinite) to accept them"
                )


def _nonfinite(obj: Any, where: str) -> list[str]:
    if torch.is_tensor(obj):
        if obj.is_floating_point() and obj.numel() and not bool(torch.isfinite(obj).all()):
            return [where or "a tensor"]
        return []
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _nonfinite(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += _nonfinite(v, f"{where}[{i}]")
    return out


def numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)
