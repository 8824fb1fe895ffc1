"""Is every piece of a checkpoint there, and listed? Checks of the manifest against its
own files and against the engine that loads it. No communication, no tensor data read.

Against the files (``load`` and ``zeroshard convert``), after ``validate.py`` found every
tensor the manifest lists in its file: no file holds a tensor the manifest does not list
(a parameter, a state kind or a piece missing from it), the manifest says of each
parameter what the files that hold its pieces recorded at save time (whole shape, param
group, tensor-parallel split: ``format.param_record``), and the state kinds include the
ones the saving optimizer makes once it has stepped (Adam's two moments, ...).

Against the engine (``load`` with optimizer states): every parameter it trains was saved
with its optimizer state, in the same param group, and every state kind its optimizer
needs once stepped is there; whole tensors have the dtype kind (floating or not) of the
model's. These hold at any world size, stage, offload or tensor-parallel layout: they
compare names, shapes and kinds, never pieces.

Each check names the first missing or wrong entry and counts the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import json
import os

from zeroshard.checkpoint.format import (
    PARAMS_META,
    CheckpointError,
    parameter_names,
    piece_key,
)
from zeroshard.checkpoint.safetensors_io import DTYPES

#: the elementwise state a built-in optimizer makes in its first step, by class name
#: (a class or any of its bases); ``max_exp_avg_sq`` with ``amsgrad`` only
_ADAM = {"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "SwappedAdam"}
_KNOWN = _ADAM | {"SGD"}


def _first_and_rest(problems: list[str], unit: str = "more") -> str:
    more = len(problems) - 1
    return problems[0] + (f" (and {more} {unit})" if more else "")


def made_kinds(class_names: set[str], groups: list[dict]) -> set[str]:
    """The state kinds an optimizer (``class_names``: its class and bases) has made once
    it stepped with hyperparameters ``groups``; empty when unknown."""
    if class_names & _ADAM:
        kinds = {"exp_avg", "exp_avg_sq"}
        if any(g.get("amsgrad") for g in groups):
            kinds.add("max_exp_avg_sq")
        return kinds
    if "SGD" in class_names and any(g.get("momentum", 0) for g in groups):
        return {"momentum_buffer"}
    return set()


def _stepped(manifest: dict) -> int:
    """Optimizer steps taken before the save: the param groups' count, else the engine's
    applied steps (an optimizer that keeps no step count, as SGD)."""
    groups = manifest["optimizer"]["groups"]
    counted = max((int(float(g.get("step", 0))) for g in groups), default=0)
    counters = manifest["counters"]
    applied = int(counters.get("global_steps", 0)) - int(counters.get("skipped_steps", 0))
    return counted or max(applied, 0)


def check_files_agree(path: str, manifest: dict, headers: list[dict]) -> None:
    """The manifest lists every tensor in the files and says of each parameter what the
    files recorded; the saved state kinds are the saving optimizer's."""
    problems: list[str] = []
    params, kinds = manifest["params"], manifest["kinds"]
    expected: list[set[str]] = [set() for _ in manifest["files"]]
    for name, e in params.items():
        for rank, lo, _hi, *_ in e["pieces"]:
            for kind in kinds if e["group"] >= 0 else ["param"]:
                expected[rank].add(piece_key(kind, name, lo))
    for name, e in manifest["whole"].items():
        expected[e.get("rank", 0)].add(f"whole:{name}")
    for rank, header in enumerate(headers):
        fname = manifest["files"][rank]["name"]
        for key in header:
            if key == "__metadata__" or key.startswith("rng:") or key in expected[rank]:
                continue
            problems.append(f"{os.path.join(path, fname)}: holds {key!r}, {_why(key, manifest)}")
        meta = header.get("__metadata__") or {}
        if PARAMS_META not in meta:  # saved before zeroshard recorded it
            continue
        try:
            records = json.loads(meta[PARAMS_META])
        except ValueError as exc:
            raise CheckpointError(f"{os.path.join(path, fname)}: bad {PARAMS_META}: {exc}") from exc
        for name, rec in records.items():
            e = params.get(name)
            if e is None:
                continue  # its pieces are reported above
            for field in ("shape", "group", "tp", "ep"):
                if e.get(field) != rec.get(field):
                    problems.append(
                        f"{os.path.join(path, 'manifest.json')}: params[{name!r}].{field} is "
                        f"{e.get(field)!r}, but {fname} recorded {rec.get(field)!r} when saved"
                    )
    trained = [n for n, e in params.items() if e["group"] >= 0]
    groups = manifest["optimizer"]["groups"]
    steps = _stepped(manifest)
    if trained and steps:
        missing = made_kinds({str(manifest["optimizer"].get("type"))}, groups) - set(kinds)
        for kind in sorted(missing):
            problems.append(
                f"{os.path.join(path, 'manifest.json')}: no optimizer state {kind!r} for "
                f"{trained[0]!r} (and {len(trained) - 1} more parameters), which "
                f"{manifest['optimizer'].get('type')} made in its {steps} steps"
            )
    if problems:
        raise CheckpointError(
            "the checkpoint's manifest and its files disagree: "
            + _first_and_rest(problems, "more problems")
        )


def _why(key: str, manifest: dict) -> str:
    """Why tensor ``key`` of a rank file is not among those the manifest lists."""
    if key.startswith("whole:"):
        return f"but the manifest lists no tensor {key[6:]!r} saved whole"
    kind, _, rest = key.partition(":")
    name = rest.rpartition(":")[0]
    e = manifest["params"].get(name)
    if e is None:
        return f"but parameter {name!r} is missing from the manifest's params"
    if kind != "param" and e["group"] < 0:
        return f"but the manifest says {name!r} was saved frozen (group -1, no optimizer state)"
    if kind not in manifest["kinds"]:
        return f"but state kind {kind!r} is missing from the manifest's kinds {manifest['kinds']}"
    return f"a piece of {name!r} the manifest's pieces {e['pieces']} do not list"


def check_optimizer_fits(engine, path: str, manifest: dict, names: set[str]) -> None:
    """Every parameter ``engine`` trains (of ``names``, those loaded) was saved with
    its optimizer state, in the same param group; every state kind the engine's optimizer
    needs is saved once the checkpoint has stepped (a built-in optimizer: those it makes
    in a step with the saved hyperparameters; a client optimizer: those it holds)."""
    problems: list[str] = []
    flat = engine.flat
    saved = manifest["params"]
    for i, name in enumerate(parameter_names(engine)):
        group = flat.group_of[i]
        if group < 0 or name not in names:
            continue
        e = saved.get(name)
        if e is None or e["group"] < 0:
            problems.append(
                f"{name!r} is trained here but was saved frozen (without optimizer state)"
            )
        elif e["group"] != group:
            problems.append(
                f"{name!r} is in param group {group} here but was saved in group {e['group']}"
            )
    groups = manifest["optimizer"]["groups"]
    steps = _stepped(manifest)
    kinds = set(manifest["kinds"])
    if steps:
        inner = engine.optimizer.inner
        ours = engine.optimizer.param_groups
        live = [{**a, **b} for a, b in zip(ours, groups, strict=True)]  # as loaded
        classes = {c.__name__ for c in type(inner).__mro__}
        if classes & _KNOWN:  # what it makes with the hyperparameters it is about to load
            needed = made_kinds(classes, live)
        else:  # a client optimizer: what it holds already
            needed = {k for k in engine.optimizer.states.kinds if k != "master"}
        trained = [n for n, e in saved.items() if e["group"] >= 0 and n in names]
        if trained:
            for kind in sorted(needed - kinds):
                problems.append(
                    f"no optimizer state {kind!r} for {trained[0]!r} (nor for "
                    f"{len(trained) - 1} more parameters), which this engine's "
                    f"{type(inner).__name__} needs after {steps} steps (the checkpoint holds "
                    f"{sorted(kinds - {'param', 'master'})}, saved by "
                    f"{manifest['optimizer'].get('type')})"
                )
    if problems:
        raise CheckpointError(
            f"{path}: the checkpoint lacks optimizer state this engine needs: "
            + _first_and_rest(problems)
            + "; load with load_optimizer_states=False to start the optimizer afresh"
        )


def dtype_problems(manifest: dict, ours: dict[str, torch.dtype]) -> list[str]:
    """Tensors saved whole whose dtype kind (floating point or not) differs from the
    model's ``ours`` (name -> torch dtype): a copy would round or truncate them."""
    out = []
    for name, e in manifest["whole"].items():
        if name in ours and DTYPES[e["dtype"]].is_floating_point != ours[name].is_floating_point:
            out.append(f"{name} {e['dtype']} vs model {ours[name]}")
    return out
