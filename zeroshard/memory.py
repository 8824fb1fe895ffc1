"""Memory: what a rank holds, measured (``measure``) and predicted (``estimate``,
``plan``). No communication.

Model states follow the ZeRO paper. With Ψ parameters, N data-parallel ranks and
mixed-precision Adam (2-byte parameters and gradients, K = 12 bytes of fp32 master,
momentum and variance per parameter): stage 0 holds 16Ψ per rank, stage 1
4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N. In fp32 training the parameters are
the master weights (K = 8). Offload moves the optimizer side (masters, moments and,
from stage 2, the gradient shard) to CPU memory or NVMe files, and at stage 3 the
parameter shard too. zeroshard's own buffers are included: the gradient staging
buckets (stages 2-3) and the gathered always-resident small parameters (stage 3).

Activations per micro-batch (s = sequence, b = micro-batch, h = hidden, L = layers,
V = vocabulary), counted for a pre-LN block with fused attention (no s² scores kept):
17 sbh elements per layer without checkpointing, 10 sbh with selective checkpointing
(matmul outputs and the block input kept), sbh with full checkpointing (the block
input only, plus one block's worth while it is recomputed); plus the logits (2 sbV for
the loss) and, without full checkpointing, 3 sbh around the embedding and final norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

PRECISIONS = {"fp32": (4, 4, 0, 8), "bf16": (2, 2, 4, 8), "fp16": (2, 2, 4, 8)}  # p, g, master, m+v
OFFLOADS = ("none", "cpu", "nvme")
POLICIES = ("none", "selective", "full")
_PER_LAYER = {"none": 17, "selective": 10, "full": 1}


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """Per-rank bytes of one layout."""

    stage: int
    offload: str
    precision: str
    params: int
    grads: int
    optimizer_states: int
    buffers: int = 0  # zeroshard's working buffers: gradient staging, persistent small params
    by_location: dict[str, int] = field(default_factory=dict)
    activations: int = 0
    comm_bytes_per_step: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def device(self) -> int:
        """Device bytes: model states left there, buffers and activations."""
        return self.by_location.get("device", 0) + self.activations


def estimate(
    params: int,
    nproc: int = 1,
    nnodes: int = 1,
    *,
    stage: int,
    precision: str = "bf16",
    offload: str = "none",
    offload_params: bool = False,
    bucket_numel: int | None = None,
    largest_unit: int = 0,
    persistent_numel: int = 0,
    activations: int = 0,
) -> Estimate:
    """Per-rank bytes for ``params`` parameters on ``nproc * nnodes`` data-parallel ranks.

    ``offload`` places the optimizer side ("cpu" or "nvme"); ``offload_params`` also the
    stage-3 parameter shard. ``bucket_numel`` (reduce bucket) sizes the gradient staging
    at stage 2, ``largest_unit`` at stage 3; ``persistent_numel`` is the small
    parameters stage 3 keeps whole.
    """
    if stage not in (0, 1, 2, 3) or offload not in OFFLOADS or precision not in PRECISIONS:
        raise ValueError(f"stage/offload/precision: got {stage}, {offload!r}, {precision!r}")
    n = nproc * nnodes
    psi = int(params)
    p_b, g_b, master_b, states_b = PRECISIONS[precision]
    if offload != "none" and master_b == 0:
        master_b = 4  # an offloaded optimizer keeps its own fp32 masters
    shard = psi / n
    param_bytes = round(p_b * (shard if stage == 3 else psi))
    grad_bytes = round(g_b * (shard if stage >= 2 else psi))
    opt_bytes = round((master_b + states_b) * (shard if stage >= 1 else psi))
    buffers = 0
    if stage == 2:
        buffers = g_b * min(bucket_numel or psi, psi)
    elif stage == 3:
        buffers = g_b * largest_unit + p_b * persistent_numel
    loc = {"device": param_bytes + grad_bytes + opt_bytes + buffers}
    if offload != "none" and stage >= 1:
        loc["device"] -= opt_bytes
        moved_grads = grad_bytes if stage >= 2 else 0
        loc["device"] -= moved_grads
        loc["cpu"] = moved_grads
        loc[offload] = loc.get(offload, 0) + opt_bytes
    if offload_params and stage == 3:
        loc["device"] -= param_bytes
        where = "nvme" if offload == "nvme" else "cpu"
        loc[where] = loc.get(where, 0) + param_bytes
    comm = (3 if stage == 3 else 2) * p_b * psi if n > 1 else 0
    return Estimate(
        stage=stage,
        offload=offload,
        precision=precision,
        params=param_bytes,
        grads=grad_bytes,
        optimizer_states=opt_bytes,
        buffers=buffers,
        by_location={k: v for k, v in loc.items() if v},
        activations=activations,
        comm_bytes_per_step=comm,
    )


def paper_bytes(params: int, n: int, stage: int, p: int = 2, g: int = 2, k: int = 12) -> float:
    """The ZeRO paper's per-rank model-state bytes: ``p``/``g`` bytes per parameter and
    gradient, ``k`` bytes of optimizer state (12 for mixed-precision Adam)."""
    psi = params
    return {
        0: (p + g + k) * psi,
        1: (p + g) * psi + k * psi / n,
        2: p * psi + (g + k) * psi / n,
        3: (p + g + k) * psi / n,
    }[stage]


def activation_bytes(
    *,
    layers: int,
    hidden: int,
    seq: int,
    micro_batch: int,
    vocab: int,
    policy: str = "none",
    dtype_bytes: int = 4,
) -> int:
    """Bytes kept for backward at the end of forward (see the module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    sbh = seq * micro_batch * hidden
    per_layer = _PER_LAYER[policy] * sbh
    recompute = 0 if policy == "none" else (_PER_LAYER["none"] - _PER_LAYER[policy]) * sbh
    # logits and their log-softmax; without full checkpointing also the embedding sum and
    # the final norm's input and output (with it, those are block inputs already counted)
    head = (0 if policy == "full" else 3 * sbh) + 2 * seq * micro_batch * vocab
    return dtype_bytes * (layers * per_layer + head) + (
        dtype_bytes * recompute if policy == "full" else 0
    )


def measure(engine) -> dict:
    """``engine.memory_stats()``: bytes of the persistent buffers this rank holds, by
    kind (params, grads, optimizer_states) and by location; storage shared by views is
    counted once."""
    flat_ids = {id(p) for p in engine.flat.params}
    kinds: dict[str, Iterable[torch.Tensor]] = {
        "params": [
            *engine.params.buffers(),
            *(p for p in engine.module.parameters() if id(p) not in flat_ids),
        ],
        "grads": engine.reducer.buffers(),
        "optimizer_states": engine.optimizer.buffers(),
    }
    out: dict = {"by_location": {}}
    seen: set[tuple[int, int]] = set()
    for kind, tensors in kinds.items():
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key in seen or t.numel() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
            loc = str(t.device)
            out["by_location"][loc] = out["by_location"].get(loc, 0) + storage.nbytes()
        out[kind] = total
    nvme = {"params": engine.flat.nvme_bytes(), "optimizer_states": engine.optimizer.nvme_bytes()}
    for kind, nbytes in nvme.items():
        if nbytes:
            out[kind] += nbytes
            out["by_location"]["nvme"] = out["by_location"].get("nvme", 0) + nbytes
    return out
