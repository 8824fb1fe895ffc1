"""Memory: what a rank holds, measured (``measure``) and predicted (``estimate``,
``plan``). No communication.

Model states follow the ZeRO paper. With Ψ parameters, N data-parallel ranks and
mixed-precision Adam (2-byte parameters and gradients, K = 12 bytes of fp32 master,
momentum and variance per parameter): stage 0 holds 16Ψ per rank, stage 1
4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N. In fp32 training the parameters are
the master weights (K = 8). zeroshard's stage 3 keeps the parameter shard in fp32 where
the optimizer states live too, so it is the master: 4 + 2 + 8 = 14Ψ/N in mixed
precision. Offload moves the optimizer side (masters, moments and,
from stage 2, the gradient shard) to CPU memory or NVMe files, and at stage 3 the
parameter shard too. zeroshard's own buffers are included: the gradient staging
buckets (stages 2-3, two at most), the receive buffers of gloo's point-to-point
reduction (``p2p_reduce``) and the gathered always-resident small parameters (stage 3).
Stage 3 also holds gathered parameters between a unit's forward and its backward
(``stage3_max_reuse_distance``: a unit is kept when its next use comes within that many
gathered elements, about 2x its distance from the turn of forward to backward, so
min(Ψ, distance / 2, ``stage3_max_live_parameters``) elements in the compute dtype,
``Estimate.gathered``; DeepSpeed's defaults, 1e9 each, keep a model under 5e8
parameters whole), and each kept element is one the backward does not all-gather again.

Activations (``activation_bytes``), per micro-batch of the built-in GPT (pre-LN blocks,
fused attention that keeps no s×s scores, dropout off), in elements of the activation
dtype with s = sequence, b = micro-batch, h = hidden, L = layers, V = vocabulary and
m = MLP ratio (4). Derived op by op and checked against measurement (the tests measure
every tensor storage alive during forward and backward, ``ActivationTracker``):

* kept for backward per block: (8 + 2m)·sbh = 16 sbh without checkpointing (block
  input, ln1 output, qkv 3, attention output, mid-block residual, ln2 output, MLP
  hidden m, GELU output m); with ``selective``, the block input and the matmul outputs,
  (6 + m)·sbh = 10 sbh (qkv 3, attention projection, MLP hidden m, MLP projection);
  with ``full``, the block input, sbh;
* around the blocks: the final norm's input and output, 2 sbh, and the fp32
  log-probabilities of the loss, sbV (always 4 bytes: the loss is computed in fp32);
* the peak is the larger of two moments. (A) Backward of the loss: all the above plus
  two more fp32 sbV (the gradients of the log-probabilities and of the logits).
  (B) Backward of the last block: the blocks' kept bytes, the incoming gradient (sbh), what
  recomputation brings back (selective: (3 + m)·sbh — the (4 + m)·sbh it recomputes,
  less the attention projection output it drops once used; full: (7 + 2m)·sbh, the
  block's 16 sbh less its input), the gradient of the MLP hidden (m·sbh), and two
  weight-gradient temporaries: the MLP weight's (m·h²) and, with tied embeddings, the
  output projection's (V·h), which waits for the embedding's to be summed with it.

Dropout adds a 1-byte mask per element of each dropout (and PyTorch's CPU attention
with dropout falls back to a kernel that keeps the b·heads·s² probabilities); the
estimate leaves both out. Measured on CPU for the small GPT at s 256, b 2 (fp32):
peak 18.07 / 13.39 / 6.39 MiB for none / selective / full, estimated 18.00 / 13.38 /
6.38 MiB.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zeroshard import ArgumentError

PRECISIONS = {"fp32": (4, 4, 0, 8), "bf16": (2, 2, 4, 8), "fp16": (2, 2, 4, 8)}  # p, g, master, m+v
OFFLOADS = ("none", "cpu", "nvme")
POLICIES = ("none", "selective", "full")
_LOSS_BYTES = 4  # the GPT computes its loss in fp32: log-probabilities and their gradients


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
    gathered: int = 0  # stage 3: parameters kept gathered from forward to backward
    by_location: dict[str, int] = field(default_factory=dict)
    activations: int = 0
    comm_bytes_per_step: int = 0
    #: offload_optimizer.ratio: the share of the optimizer side offloaded (Twin-Flow)
    offload_ratio: float = 1.0
    zero_ranks: int = 1  # the ranks ZeRO shards over
    offload_params: bool = False  # stage 3's parameter shard offloaded with the optimizer
    shard_numel: int = 0  # parameters in one rank's shard (after tensor parallelism)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def device(self) -> int:
        """Device bytes: model states left there, buffers, parameters kept gathered from
        forward to backward (stage 3) and activations."""
        return self.by_location.get("device", 0) + self.gathered + self.activations


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
    tp: int = 1,
    sp: int = 1,
    tp_activation_numel: int = 0,
    reuse_numel: int = 10**9,
    max_live_numel: int = 10**9,
    p2p_reduce: bool = False,
    gradient_accumulation: int = 1,
    offload_ratio: float = 1.0,
) -> Estimate:
    """Per-rank bytes for ``params`` parameters on ``nproc * nnodes`` ranks, ``tp``
    tensor-parallel and ``sp`` sequence-parallel ranks among them (ZeRO shards over the
    other ``nproc * nnodes / tp`` ranks: data- and sequence-parallel).

    ``offload`` places the optimizer side ("cpu" or "nvme"); ``offload_params`` also the
    stage-3 parameter shard. ``bucket_numel`` (reduce bucket) sizes the gradient staging
    at stage 2, ``largest_unit`` at stage 3; ``persistent_numel`` is the small
    parameters stage 3 keeps whole. Tensor parallelism divides every parameter by ``tp``
    (the few replicated ones, norms and biases, are counted split too); its traffic per
    step is 4 all-reduces (8 buffers' bytes) of ``tp_activation_numel`` = b·s·h per
    layer, times the layers, in the compute dtype. ``reuse_numel`` and ``max_live_numel``
    are stage 3's ``stage3_max_reuse_distance`` and ``stage3_max_live_parameters``
    (DeepSpeed's defaults): the parameters kept gathered from forward to backward, and
    so not all-gathered again in backward (see the module docstring). ``p2p_reduce``:
    gradients are reduce-scattered point to point (gloo's default), with receive
    buffers of (n - 1) / n of a bucket, two at most, like the staging buckets.
    ``gradient_accumulation`` above 1 with the optimizer offloaded at stages 2-3: the
    micro-steps before the boundary add up on the device, in an fp32 gradient shard
    (4 bytes per shard element, counted in ``buffers``).
    ``offload_ratio`` (``offload_optimizer.ratio``, CPU or NVMe offload without parameter
    offload): Twin-Flow keeps ``1 - offload_ratio`` of the masters, optimizer states and
    (stages 2-3) the reduced gradient shard, in the gradient dtype, on the device; the
    rest is offloaded (the gradients in fp32).
    The engine splits at segment boundaries, never above ``1 - offload_ratio`` on the
    device, so this is the most it holds there.
    """
    if stage not in (0, 1, 2, 3) or offload not in OFFLOADS or precision not in PRECISIONS:
        raise ArgumentError(f"stage/offload/precision: got {stage}, {offload!r}, {precision!r}")
    if not 0 <= offload_ratio <= 1 or (offload_ratio < 1 and (offload == "none" or offload_params)):
        raise ArgumentError(
            f"offload_ratio {offload_ratio}: a share between 0 and 1; below 1 it needs "
            "optimizer offload without parameter offload (offload 'cpu' or 'nvme', "
            "offload_params=False)"
        )
    world = nproc * nnodes
    if tp < 1 or sp < 1 or world % (tp * sp):
        raise ArgumentError(f"tp ({tp}) x sp ({sp}) must divide the {world} ranks")
    n = world // tp  # ZeRO shards over data- and sequence-parallel ranks
    psi = int(params) // tp
    p_b, g_b, master_b, states_b = PRECISIONS[precision]
    compute_b = p_b  # gathered parameters
    if offload != "none" and master_b == 0:
        master_b = 4  # an offloaded optimizer keeps its own fp32 masters
    # a stage-3 shard kept where its optimizer states are (both on the device, or both
    # in CPU memory) is the fp32 master itself: 4 bytes of parameters, no separate master
    if stage == 3 and master_b and (offload == "cpu") == offload_params and offload != "nvme":
        p_b, master_b = 4, 0
    shard = psi / n
    param_bytes = round(p_b * (shard if stage == 3 else psi))
    grad_bytes = round(g_b * (shard if stage >= 2 else psi))
    opt_bytes = round((master_b + states_b) * (shard if stage >= 1 else psi))
    buffers = 0
    # reductions in flight: two at most, each with a staging bucket (stages 2-3) and,
    # with point-to-point reduction (gloo), a receive buffer of (n - 1) / n of one
    bucket = min(bucket_numel or psi, psi) if stage < 3 else largest_unit
    in_flight = 1 if stage < 3 and bucket >= psi else 2
    if stage == 2:
        buffers = in_flight * g_b * bucket
    elif stage == 3:
        buffers = in_flight * g_b * largest_unit + compute_b * persistent_numel
    if p2p_reduce and stage >= 1 and n > 1:
        buffers += round(in_flight * g_b * bucket * (n - 1) / n)
    loc = {"device": param_bytes + grad_bytes + opt_bytes + buffers}
    if offload != "none" and stage >= 1:
        r = offload_ratio  # Twin-Flow: 1 - r of the optimizer side stays on the device
        away = round(opt_bytes * r)
        loc["device"] -= away
        # the owned gradient shard is accumulated in CPU memory, in fp32 (stage 1: a
        # copy there at the boundary, besides the full gradient on the device); the
        # device's share keeps its shard there, in the gradient dtype (stage 1: in the
        # full gradient)
        host_grads = round(4 * shard * r)
        own = stage >= 2 and gradient_accumulation == 1  # else read from the device's sum
        kept_grads = round(g_b * shard * (1 - r)) if own else 0
        if stage >= 2:
            loc["device"] += kept_grads - grad_bytes
            grad_bytes = host_grads + kept_grads
        else:
            grad_bytes += host_grads
        loc["cpu"] = host_grads
        loc[offload] = loc.get(offload, 0) + away
        if stage >= 2 and gradient_accumulation > 1:  # the device's fp32 sum
            acc = round(4 * shard)
            buffers += acc
            loc["device"] += acc
    if offload_params and stage == 3:
        loc["device"] -= param_bytes
        where = "nvme" if offload == "nvme" else "cpu"
        loc[where] = loc.get(where, 0) + param_bytes
    kept = min(psi, reuse_numel // 2, max_live_numel) if stage == 3 and reuse_numel else 0
    # stage 3: all-gather in forward, again in backward but for the kept, reduce-scatter
    comm = ((3 * psi - kept) if stage == 3 else 2 * psi) * compute_b if n > 1 else 0
    if tp > 1:
        comm += 8 * compute_b * tp_activation_numel
    return Estimate(
        stage=stage,
        offload=offload,
        precision=precision,
        params=param_bytes,
        grads=grad_bytes,
        optimizer_states=opt_bytes,
        buffers=buffers,
        gathered=compute_b * kept,
        by_location={k: v for k, v in loc.items() if v},
        activations=activations,
        comm_bytes_per_step=comm,
        offload_ratio=offload_ratio,
        zero_ranks=n,
        offload_params=offload_params and stage == 3 and offload != "none",
        shard_numel=-(-psi // n),
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
    mlp_ratio: int = 4,
    tied_embeddings: bool = True,
    peak: bool = True,
    tp: int = 1,
    sequence_parallel: bool = False,
    sp: int = 1,
) -> int:
    """Activation bytes of one micro-batch of the built-in GPT (see the module
    docstring): the peak over forward and backward (``peak=True``), or what is kept for
    backward when forward ends (``peak=False``), on one rank of ``tp`` tensor-parallel
    ranks (``sequence_parallel``: Megatron-SP) and ``sp`` sequence-parallel ones.

    Tensor parallelism divides by ``tp`` what the column and row layers keep (q, k, v,
    the attention output, the MLP hidden and GELU outputs: (4 + 2m) sbh per block
    without checkpointing); the residual stream and the norms' outputs (4 sbh) stay
    whole. Megatron-SP also splits the residual stream (block input, mid-block
    residual); the norms' outputs stay whole because a column layer keeps its gathered
    input for its weight gradient. Ulysses and ring attention divide everything by
    ``sp`` (each rank holds s/sp tokens). Measured on 2 ranks, GPT 4 x 128 at s 256
    (fp32, no checkpointing, end of forward, per sbh): 68.3 / 44.2 / 39.7 for none / TP2
    / TP2 with Megatron-SP, estimated 68 / 44 / 40."""
    if policy not in POLICIES:
        raise ArgumentError(f"policy: expected one of {POLICIES}, got {policy!r}")
    e, m = dtype_bytes, mlp_ratio
    sbh = seq * micro_batch * hidden / sp
    sbv = seq * micro_batch * vocab / sp
    # per block: (kept whole, kept split by tp); residual-stream part of "whole"
    whole, split, stream = {"none": (4, 4 + 2 * m, 2), "selective": (3, 3 + m, 1), "full": (1, 0, 1)}[policy]  # fmt: skip
    if sequence_parallel and tp > 1:
        whole, split = whole - stream, split + stream
    kept = whole + split / tp
    recompute = {"none": 0, "selective": 3 + m, "full": 7 + 2 * m}[policy] / tp
    saved = round(e * sbh * (layers * kept + 2) + _LOSS_BYTES * sbv)
    if not peak:
        return saved
    loss_backward = saved + 2 * _LOSS_BYTES * sbv
    weight_grads = e * (m * hidden * hidden + (vocab * hidden if tied_embeddings else 0)) / tp
    last_block = e * sbh * (layers * kept + 1 + recompute + m / tp) + weight_grads
    return round(max(loss_backward, last_block))


def measure(engine) -> dict:
    """``engine.memory_stats()``: bytes of the persistent buffers this rank holds, by
    kind (params, grads, optimizer_states) and by location; storage shared by views is
    counted once. A model with MoE layers also gets ``experts``: the part of each kind
    that holds expert parameters."""
    flat_ids = {id(p) for p in engine.flat.params}
    kinds: dict[str, Iterable[torch.Tensor]] = {
        "params": [
            *engine.params.buffers(),
            *(p for p in engine.module.parameters() if id(p) not in flat_ids),
        ],
        "grads": engine.reducer.buffers(),
        "optimizer_states": engine.optimizer.buffers() if engine.optimizer is not None else [],
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
    nvme = {
        "params": engine.flat.store.disk_bytes(),
        "optimizer_states": engine.optimizer.states.disk_bytes()
        if engine.optimizer is not None
        else 0,
    }
    for kind, nbytes in nvme.items():
        if nbytes:
            out[kind] += nbytes
            out["by_location"]["nvme"] = out["by_location"].get("nvme", 0) + nbytes
    experts = _expert_bytes(engine)
    if experts is not None:
        out["experts"] = experts
    twin = _twin_flow_bytes(engine)
    if twin is not None:
        out["twin_flow"] = twin
    return out


def _twin_flow_bytes(engine) -> dict | None:
    """``offload_optimizer.ratio`` below 1 (Twin-Flow): the optimizer side by where it
    is, ``device`` (the share stepped there) or ``host``: masters and optimizer states
    (``optimizer_states``), the reduced gradient shard (``grads``: stages 2-3; stage 1
    reads the device's share from its full gradient buffer), and ``device_share``, the
    fraction of this rank's shard kept on the device. Apart from ``by_location`` because
    the CPU-only rehearsal of the GPU path (``ZEROSHARD_STAGE_ON_CPU=1``) has both in
    CPU memory. None without a split."""
    if engine.optimizer is None:
        return None
    states = engine.optimizer.states
    if not getattr(states, "device_segments", 0):
        return None
    places = states.buffers_by_place()
    reducer = engine.reducer
    grads = {"device": reducer.twin_shard, "host": reducer.grad_shard}
    return {
        "device_share": states.device_numel / max(1, engine.flat.layout.shard_numel),
        "optimizer_states": {
            k: sum(t.numel() * t.element_size() for t in v) for k, v in places.items()
        },
        "grads": {k: 0 if t is None else t.numel() * t.element_size() for k, t in grads.items()},
    }


def _expert_bytes(engine) -> dict[str, int] | None:
    """The part of params, grads and optimizer_states that holds expert parameters of
    MoE layers (the layout's expert segments: whole ones where parameters or gradients
    are whole, this rank's chunks where sharded). None without experts."""
    layout = engine.flat.layout
    segs = [seg for seg in layout.segments if seg.kind]
    if not segs:
        return None
    flat, reducer = engine.flat, engine.reducer
    whole = sum(seg.numel for seg in segs)
    chunks = sum(seg.chunk for seg in segs)
    if flat.full is not None:
        params = whole * flat.full.element_size()
    else:
        params = chunks * getattr(flat.store, "dtype", flat.dtype).itemsize
    if reducer.grad_full is not None:
        grads = whole * reducer.grad_full.element_size()
    else:
        grads = chunks * reducer.grad_shard.element_size() if reducer.grad_shard is not None else 0
    return {"params": params, "grads": grads, "optimizer_states": _expert_states(engine)}


def _expert_states(engine) -> int:
    """Bytes of the optimizer states (and separate masters) of expert parameters: each
    inner optimizer tensor belongs to one piece of one segment (``FlatParams.group_views``);
    stores that keep them elsewhere (NVMe, a delayed twin) count the expert share of the
    shard, which their state buffers span."""
    flat, states = engine.flat, engine.optimizer.states
    layout = flat.layout
    inner = getattr(states, "inner", None)
    if not (isinstance(inner, torch.optim.Optimizer) and hasattr(states, "masters")):
        chunks = sum(seg.chunk for seg in layout.segments if seg.kind)
        share = chunks / layout.shard_numel if layout.shard_numel else 0.0
        return round(share * sum(t.untyped_storage().nbytes() for t in states.buffers()))
    out = 0
    for g, group in enumerate(inner.param_groups):
        for (s, lo, hi, _), view in zip(flat.group_pieces(g), group["params"], strict=False):
            if not layout.segments[s].kind:
                continue
            state = inner.state.get(view, {})
            out += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
            if states.separate:
                out += (hi - lo) * view.element_size()
    return out


class ActivationTracker(TorchDispatchMode):
    """Measured activation bytes, on any device (CPU included): while active, every
    tensor storage an op creates is counted until it is freed, each storage once.
    Storages of the tensors in ``exclude`` (parameters, gradient buffers, inputs) are
    not counted. ``current`` is the bytes alive now, ``peak`` the most alive at once
    (checked after every op)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._alive: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _freed(self, ptr: int) -> None:
        self.current -= self._alive.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if not nbytes or ptr in self._alive or ptr in self._excluded:
                continue
            self._alive[ptr] = nbytes
            self.current += nbytes
            weakref.finalize(storage, self._freed, ptr)
        self.peak = max(self.peak, self.current)
        return out
