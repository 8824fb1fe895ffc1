"""Grouped expert compute: every local expert's rows through its own weights in one
batched matmul, not a Python loop over experts. No communication.

Rows arrive sorted by expert (``counts[e]`` rows for local expert ``e``). Three ways:

* ``"grouped_mm"``: ``torch._grouped_mm`` (``torch.nn.functional.grouped_mm`` where
  torch has it) with the row offsets: one call, no padding. Torch 2.13 runs it on CPU
  too (fp32 and bf16, with autograd) when rows of the input and the output are
  16-byte multiples (else ``"bmm"`` is taken);
* ``"bmm"``: rows scattered into a padded ``[experts, most rows, in]`` block, one
  ``torch.bmm``, the valid rows gathered back (padding costs ``experts x most rows -
  rows`` wasted rows);
* ``"loop"``: one matmul per expert (the reference the benchmark compares against).

For an arbitrary expert module (DeepSpeed's ``MoE(expert=...)``), :func:`vmap_experts`
runs the padded block through ``torch.func.vmap`` of the module over the experts'
stacked parameters: each ``Linear`` inside becomes one batched matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard import UsageError
from zeroshard.moe.errors import ExpertParallelError

WAYS = ("grouped_mm", "bmm", "loop")


def grouped_mm_available() -> bool:
    """Whether this torch has a grouped matmul (``torch._grouped_mm``)."""
    return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")


def default_way() -> str:
    return "grouped_mm" if grouped_mm_available() else "bmm"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (the grouped
    matmul's backward refuses expanded, stride-0 gradients, as ``out.sum()`` gives)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return _ContiguousGrad.apply(fn(x, w, offs=offsets))


def _aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (weight.shape[1] * size) % 16 == 0


def padded_slots(counts: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """For rows sorted by expert: each row's position in a padded ``[experts, most]``
    block (flattened), and ``most``, the largest count."""
    most = max(counts, default=0)
    sizes = torch.tensor(counts, dtype=torch.long, device=device)
    expert = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    within = torch.arange(int(sizes.sum()), device=device) - starts[expert]
    return expert * most + within, most


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: list[int], way: str = "grouped_mm"
) -> torch.Tensor:
    """``x[rows of e] @ weight[e].T`` for every expert ``e``: ``x`` is ``[rows, in]``
    sorted by expert, ``weight`` ``[experts, out, in]`` (``nn.Linear``'s layout);
    returns ``[rows, out]``."""
    if weight.dim() != 3 or len(counts) != weight.shape[0]:
        raise ExpertParallelError(
            f"grouped_linear: weight {tuple(weight.shape)} is not [experts={len(counts)}, out, in]"
        )
    if way == "grouped_mm" and not _aligned(x, weight):
        way = "bmm"  # the grouped kernel needs 16-byte aligned rows of x and of the output
    if way == "grouped_mm" and not x.shape[0]:
        way = "bmm"  # no rows: _grouped_mm's backward refuses them (torch 2.13)
    if way == "grouped_mm":
        if not grouped_mm_available():
            raise UsageError("grouped_linear: this torch has no torch._grouped_mm; use 'bmm'")
        offsets = torch.cumsum(torch.tensor(counts, device=x.device), 0).to(torch.int32)
        return _grouped_mm(x.contiguous(), weight.transpose(-2, -1), offsets)
    if way == "bmm":
        slots, most = padded_slots(counts, x.device)
        block = x.new_zeros(len(counts) * most, x.shape[1]).index_copy(0, slots, x)
        # explicit widths: no rows for any expert gives most == 0
        out = torch.bmm(block.view(len(counts), most, x.shape[1]), weight.transpose(-2, -1))
        return out.reshape(len(counts) * most, weight.shape[1]).index_select(0, slots)
    if way == "loop":
        parts = [F.linear(part, weight[e]) for e, part in enumerate(x.split(counts))]
        return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])
    raise ExpertParallelError(f"grouped_linear: way {way!r} is not one of {WAYS}")


def vmap_experts(experts: nn.ModuleList, block: torch.Tensor) -> torch.Tensor:
    """Run ``block[e]`` (``[experts, rows, in]``, padded) through ``experts[e]`` for every
    expert at once: ``torch.func.vmap`` over the experts' stacked parameters and buffers
    (one batched matmul per ``Linear``). Gradients reach each expert's own parameters
    through the stack. A tuple output keeps its first element (DeepSpeed's rule: a bias
    returned beside the output is ignored)."""
    from torch.func import functional_call, vmap

    template = experts[0]
    tensors = {}
    for name, _ in template.named_parameters():
        tensors[name] = torch.stack([e.get_parameter(name) for e in experts])
    for name, _ in template.named_buffers():
        tensors[name] = torch.stack([e.get_buffer(name) for e in experts])

    def one(params: dict, rows: torch.Tensor) -> torch.Tensor:
        out = functional_call(template, params, (rows,))
        return out[0] if isinstance(out, tuple) else out

    return vmap(one, randomness="different")(tensors, block)
