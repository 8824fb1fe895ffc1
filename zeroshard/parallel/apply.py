"""Tensor and sequence parallelism applied to a model at ``initialize``, in torchtitan's
order: tensor parallelism first (AutoTP slices each rank's whole copy), then sequence
parallelism, then (by the engine) ZeRO over the data-parallel axis.

Issues no collectives itself; the layers it installs communicate in training over the
mesh's ``tp`` and ``sp`` groups (``tensor/collectives.py``, ``sequence/attention.py``: two
all-reduces of b·s·h per transformer layer each way for TP; four all-to-alls of b·s·h/sp per layer
forward for Ulysses). Under sequence parallelism every rank of an ``sp`` group gets the
same batch from the data loader; a pre-forward hook keeps this rank's share of each
sequence (and, for Hugging Face causal LMs, passes labels shifted over the whole
sequence first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard import ArgumentError
from zeroshard.config.schema import ConfigError
from zeroshard.distributed.comm import Comm
from zeroshard.distributed.mesh import Mesh
from zeroshard.parallel.sequence.attention import (
    SEQ_DIM,
    apply_ring_attention,
    apply_ulysses,
    is_transformers_model,
    shard_sequence,
)
from zeroshard.parallel.tensor.autotp import TPSharding, apply_tensor_parallel
from zeroshard.parallel.tensor.slices import has_partial_grad, tp_slice_of


@dataclass
class Parallelized:
    """What :func:`parallelize` did to a model."""

    tp: TPSharding | None = None
    hooks: list[RemovableHandle] = field(default_factory=list)

    def remove(self) -> None:
        """Remove every hook (the swapped-in parallel layers stay)."""
        if self.tp is not None:
            self.tp.remove_hooks()
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


def is_tp_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` holds one tensor-parallel rank's slice (else every rank holds it):
    AutoTP's, or a Megatron model's (``tensor_model_parallel``, DeepSpeed's
    ``model_parallel``) with ``initialize(mpu=...)``."""
    return (
        tp_slice_of(p) is not None
        or bool(getattr(p, "tensor_model_parallel", False))
        or bool(getattr(p, "model_parallel", False))
    )


def gradient_summed_over_tp(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient is a partial sum across the tensor-parallel group."""
    return has_partial_grad(p)


def parallelize(model: nn.Module, mesh: Mesh, config) -> Parallelized:
    """Apply the config's tensor and sequence parallelism to ``model`` over ``mesh``.
    Every rank must hold the same whole model before (the engine broadcasts it)."""
    tp_cfg = config.tensor_parallel
    out = Parallelized()
    if tp_cfg.size > 1:
        out.tp = apply_tensor_parallel(
            model,
            mesh.comm("tp"),
            tp_plan=tp_cfg.tp_plan,
            sequence_parallel=tp_cfg.sequence_parallel,
            loss_parallel=tp_cfg.vocab_parallel_lm_head,
        )
    else:
        for name in ("sequence_parallel", "vocab_parallel_lm_head"):
            if getattr(tp_cfg, name):
                raise ConfigError(
                    f"tensor_parallel.{name}: acts inside the tensor-parallel group; set "
                    "tensor_parallel.autotp_size > 1 too"
                )
    if mesh.size("sp") > 1:
        ring = config.sequence_parallel_mode == "ring"
        comm = mesh.comm("sp")
        out.hooks += (apply_ring_attention if ring else apply_ulysses)(model, comm)
        # first of the pre-forward hooks: the position hooks size from the local share
        hook = _shard_inputs(model, comm, ring)
        out.hooks.append(model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
    return out


def _shard_inputs(model: nn.Module, comm: Comm, load_balanced: bool):
    """A pre-forward hook: this rank's share of each sequence of the batch. The built-in
    GPT's ``(idx, targets)`` are both cut; a Hugging Face causal LM's ``labels`` are
    shifted over the whole sequence first and passed as ``shift_labels``."""
    hf = is_transformers_model(model)

    def cut(t):
        if torch.is_tensor(t) and t.dim() > SEQ_DIM:
            return shard_sequence(t, comm, load_balanced=load_balanced)
        return t

    def hook(module, args, kwargs):
        if hf and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            shifted = F.pad(kwargs["labels"], (0, 1), value=-100)[:, 1:]
            kwargs["labels"] = kwargs["shift_labels"] = shifted
            if kwargs.get("num_items_in_batch") is None:
                # each rank's loss is its tokens' share of the whole sequence's mean, so
                # that averaging gradients over the group gives the whole mean's gradient
                valid = (shifted != -100).sum()
                kwargs["num_items_in_batch"] = valid / comm.world_size
        if hf and kwargs.get("attention_mask") is not None:
            raise ArgumentError(
                "sequence parallelism: attention_mask is not supported (causal attention "
                "over unpadded sequences only); pass batches without padding"
            )
        return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}

    return hook
