"""Tensor-parallel inference: a model's layers split over ranks that generate together.

:func:`shard_for_inference` reuses the training AutoTP (``parallel/tensor/autotp.py``): the
same plans (the built-in GPT's, transformers GPT-2's, Llama's own ``base_model_tp_plan``,
or a ``tp_plan`` override), the same checks (heads, key/value heads or a vocabulary that
do not divide by the TP size are refused before anything changes, naming the module and
the fix) and the same column/row/vocab-parallel layers. For generation:

* the head stays ``column_gather``: every rank ends a forward with the whole logits,
  bitwise equal across ranks (they come out of the same all-gather), so greedy decoding
  picks the same token everywhere with no extra collective, and sampling does too when
  every rank seeds its generator alike;
* caches hold this rank's heads only (the attention modules see local head counts), so a
  KV cache shrinks by the TP size as the weights do;
* Megatron-SP and a vocabulary-parallel loss are training-only and refused;
* every rank must start from the same whole weights (they slice their own copy):
  :func:`check_same_weights` compares a digest per parameter (shape, dtype and a sample
  of its values) across the group first.

Weight-only quantization composes after sharding: :func:`quantize_sharded` quantizes the
local slice held by each column/row-parallel layer (the collectives are unchanged).

Collectives per forward of a transformer layer (b·s·h activations): 2 all-reduces (the
attention and MLP outputs), plus one all-reduce for the vocabulary-parallel embedding
and an all-gather of b·s·V/t per rank for the head. At setup: one all-gather of a small
digest per rank (:func:`check_same_weights`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import types
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.config.schema import ConfigError
from zeroshard.distributed.comm import Comm
from zeroshard.distributed.mesh import Mesh, MeshShape
from zeroshard.inference.config import InferenceError
from zeroshard.parallel.tensor.autotp import TPSharding, apply_tensor_parallel
from zeroshard.parallel.tensor.linear import ColumnParallelLinear, RowParallelLinear


@dataclass
class TPInference:
    """What :func:`shard_for_inference` did: the group and the sharding summary."""

    comm: Comm
    sharding: TPSharding

    @property
    def size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank


def inference_mesh(tp_size: int, device_type: str = "cpu") -> Mesh:
    """The mesh for ``tp_size``-way inference over the initialized world: groups of
    ``tp_size`` adjacent ranks each run one copy of the model (the others replicate it
    and serve their own prompts). Every rank must call this."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp_size < 1 or world % tp_size:
        raise ConfigError(
            f"tensor_parallel.tp_size: {tp_size} does not divide the world size {world}; "
            f"launch a multiple of {tp_size} ranks (zeroshard generate --nproc {tp_size})"
        )
    return Mesh.build(MeshShape.for_world(world, tp=tp_size), device_type)


_SAMPLE = 1 << 16  # elements of each tensor digested: evenly spaced, the first included


def weight_digest(model: nn.Module) -> list[tuple[str, str]]:
    """(name, digest) for every parameter and buffer, in order: shape, dtype and up to
    65536 evenly spaced elements (weights from another seed or checkpoint differ almost
    everywhere; hashing every byte of a large model would cost seconds per rank)."""
    out = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE)].contiguous().cpu()
        h = hashlib.blake2b(f"{tuple(t.shape)} {t.dtype}".encode(), digest_size=8)
        h.update(sample.view(torch.uint8).numpy().tobytes())
        out.append((name, h.hexdigest()))
    return out


def check_same_weights(model: nn.Module, comm: Comm) -> None:
    """Raise on every rank unless all ranks of ``comm`` hold the same weights, naming the
    first parameter that differs and the rank. One all-gather of a digest per rank."""
    mine = weight_digest(model)
    whole = hashlib.blake2b(repr(mine).encode(), digest_size=16).hexdigest()
    others = comm.all_gather_object(whole)
    if all(d == others[0] for d in others):
        return
    digests = comm.all_gather_object(mine)
    for r, theirs in enumerate(digests):
        if theirs == digests[0]:
            continue
        names0 = dict(digests[0])
        diff = next((n for n, d in theirs if names0.get(n) != d), "the list of parameter names")
        raise InferenceError(
            f"tensor-parallel inference: rank {r} of the tensor-parallel group holds "
            f"different weights than rank 0 ({diff} differs); every rank must load the "
            "same checkpoint (or build the model under the same seed) before sharding"
        )


def shard_for_inference(
    model: nn.Module,
    comm: Comm,
    *,
    tp_plan: dict | None = None,
    check_weights: bool = True,
) -> TPInference:
    """Split ``model`` in place over ``comm`` for generation (every rank calls this with
    its own copy of the same whole model). ``tp_plan`` overrides the model's plan, as in
    training's ``tensor_parallel.tp_plan``. Works on the built-in GPT, transformers
    GPT-2, Llama and any model with a ``base_model_tp_plan``."""
    if check_weights and comm.world_size > 1:
        check_same_weights(model, comm)
    was_training = model.training
    try:
        sharding = apply_tensor_parallel(model, comm, tp_plan=tp_plan)
    except ValueError as exc:  # training's key -> inference's key in the suggested fix
        raise InferenceError(
            str(exc).replace("an autotp_size", "a tensor_parallel.tp_size")
        ) from exc
    model.train(was_training)
    return TPInference(comm=comm, sharding=sharding)


def quantize_sharded(
    model: nn.Module,
    *,
    bits: int,
    group_size: int = 128,
    symmetric: bool = True,
    skip: tuple[str, ...] | list[str] = (),
) -> list[str]:
    """Quantize the local weight slice of every column- and row-parallel layer of a
    sharded model (weight-only int8 per output channel, int4 in groups along the input,
    ``quantize.py``'s :class:`QuantLinear`); their collectives are unchanged. Layers
    sharing their weight (a head tied to the embedding) or matching ``skip`` keep it.
    Under int4, a layer whose local share of the input features ``group_size`` does not
    divide takes the next group size that does (said once, by rank 0). Returns the
    names quantized."""
    from zeroshard.inference.quantize import QuantLinear, fit_group_size, warn_refitted

    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    chosen = []
    for name, layer in parallel_layers(model):
        if counts.get(id(layer.weight), 0) > 1 or any(
            fnmatch.fnmatchcase(name, pat) for pat in skip
        ):
            continue
        w: torch.Tensor = layer.weight.t() if layer.transposed else layer.weight  # type: ignore[operator, assignment]  # [out, in] local
        chosen.append((name, layer, w))
    refitted = []
    for name, layer, w in chosen:
        k = int(w.shape[1])  # this rank's share of the inputs
        group = fit_group_size(k, group_size) if bits == 4 else group_size
        if group != group_size:
            refitted.append((name, k, group))
        q = QuantLinear.from_float(
            w.detach(),
            None,
            bits=bits,
            group_size=group,
            symmetric=symmetric,
            name=name,
        )
        del layer.weight
        layer.weight_only = q  # a submodule: moves with .to(), counted by weight_bytes
        layer._matmul = types.MethodType(_quantized_matmul, layer)  # type: ignore[assignment]
    if refitted and chosen[0][1].comm.rank == 0:  # type: ignore[union-attr]
        warn_refitted(refitted, group_size)
    return [name for name, _, _ in chosen]


def _quantized_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = self.weight_only(x)
    return y if bias is None else y + bias


def parallel_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The column- and row-parallel layers of a sharded model, by name."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
