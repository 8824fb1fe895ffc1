"""The views of this rank's per-segment tensors (masters, gradients) that an optimizer's
param groups hold, one per parameter piece, and the fused kernels' gradient scale. No
communication."""

from __future__ import annotations

import torch

from zeroshard.zero.layout.flat import FlatParams

_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def held_pieces(flat: FlatParams, segments: int) -> list[list[tuple[int, int, int, int]]]:
    """Per param group, its pieces (``FlatParams.group_pieces``) in the first
    ``segments`` segments."""
    return [
        [piece for piece in flat.group_pieces(g) if piece[0] < segments]
        for g in range(len(flat.hyperparams))
    ]


def group_views(
    per_segment: list[torch.Tensor], pieces: list[tuple[int, int, int, int]]
) -> list[torch.Tensor]:
    """``FlatParams.group_views`` over ``pieces`` (one group's, maybe some only): one view
    per piece, or one empty view for none (optimizers refuse empty param lists)."""
    views = [per_segment[s][lo:hi] for s, lo, hi, _ in pieces]
    return views or [per_segment[0][:0] if per_segment else torch.empty(0)]


def fold_scale(optimizer: torch.optim.Optimizer, device: torch.device, factor: float) -> bool:
    """Let torch's fused kernel scale the gradients (unscale and clip) inside its one
    pass over memory, as AMP's GradScaler does, instead of a separate multiply that
    reads and writes every gradient once more. Fused Adam/AdamW/SGD only: sets
    ``optimizer.grad_scale`` (the caller deletes it after the step) and returns True."""
    if type(optimizer) not in _ELEMENTWISE:
        return False
    if not all(g.get("fused") for g in optimizer.param_groups):
        return False  # a non-fused group refuses grad_scale
    # the kernel divides by grad_scale (within an ulp of multiplying by factor); a
    # zero factor (an infinite norm) or one whose inverse overflows fp32 is applied
    # as a plain multiply
    if not factor > 0.0 or 1.0 / factor > torch.finfo(torch.float32).max:
        return False
    optimizer.grad_scale = torch.tensor(1.0 / factor, dtype=torch.float32, device=device)  # type: ignore[attr-defined]  # read by getattr
    return True
