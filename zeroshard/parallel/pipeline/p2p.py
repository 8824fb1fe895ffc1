"""Point-to-point transfers between pipeline stages: activations forward, gradients back.

What travels is a tensor or a tuple of tensors (up to :data:`MAX_TENSORS`). Shapes are
agreed once: the first activation on a link for a given *input signature* (the first
stage's input shapes for that micro-batch, which every stage learns at the start of a
batch, ``begin_batch``) goes with a header (one int64 tensor of :data:`HEADER_LEN`
elements: per tensor its dtype, whether it carries a gradient, and its shape); both ends
keep it, and later activations with the same signature travel without one. A new
sequence length is a new signature, so variable lengths work, at one header per new
length and link. ``PipelineModule(dynamic_shape=True)`` (DeepSpeed's flag, for outputs
whose shapes depend on more than the input shapes) sends a header with every
activation. A gradient never needs a header: it has the shape of the activation it
belongs to, which that activation's sender kept.

With tensor parallelism and ``pipeline.pipe_partitioned`` (activations) /
``grad_partitioned`` (gradients), each tensor-parallel rank sends only its 1/t slice
of a tensor (all ranks of the group hold it whole) and the receiving stage all-gathers
the slices over its tensor-parallel group: 1/t of the bytes cross between stages.

Communication, per activation: a send of each tensor (its bytes, or 1/t of them
partitioned), plus the header (8 x 65 bytes) the first time a signature crosses the link, over the ``pp`` axis, the matching receives,
and with partitioning one all-gather per tensor over ``tp``; per gradient the same
without the header. Tags tell messages apart (micro-batch, model chunk, kind, tensor),
so order between a pair of stages does not matter on gloo. NCCL ignores tags and matches
messages between two ranks in posting order; both ends of a link post in schedule order,
which keeps them matched, but that path is untested (the tests run on gloo, on CPU). Sends are asynchronous:
:meth:`StageLink.wait_sends` completes them at the end of a batch.
"""

from __future__ import annotations

import torch

from zeroshard.distributed.comm import Comm, Handle
from zeroshard.parallel.pipeline.module import PipelineError

MAX_TENSORS = 8
MAX_DIMS = 6
_SLOT = 3 + MAX_DIMS  # dtype, carries-gradient, ndim, dims
HEADER_LEN = 1 + MAX_TENSORS * _SLOT
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
)
_HEADER, _ACT, _GRAD = 0, 1, 2


def as_tuple(x) -> tuple[torch.Tensor, ...]:
    """The tensors of an activation (a tensor or a tuple/list of tensors)."""
    items = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    for t in items:
        if not torch.is_tensor(t):
            raise TypeError(
                f"pipeline: a stage's output must be a tensor or a tuple of tensors to "
                f"go to the next stage, got {type(t).__name__}"
            )
    if len(items) > MAX_TENSORS:
        raise PipelineError(f"pipeline: at most {MAX_TENSORS} tensors between stages, got {len(items)}")  # fmt: skip
    return items


def _tag(microbatch: int, chunk: int, kind: int, index: int, chunks: int) -> int:
    return ((microbatch * chunks + chunk) * 3 + kind) * (MAX_TENSORS + 1) + index


def _header(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dim() > MAX_DIMS:
            raise PipelineError(f"pipeline: tensors of at most {MAX_DIMS} dims between stages")
        if t.dtype not in DTYPES:
            raise PipelineError(f"pipeline: dtype {t.dtype} cannot go between stages")
        o = 1 + i * _SLOT
        h[o] = DTYPES.index(t.dtype)
        h[o + 1] = int(t.is_floating_point() and t.requires_grad)
        h[o + 2] = t.dim()
        h[o + 3 : o + 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def header_of(x) -> torch.Tensor:
    """The header describing the activation (or input) ``x``."""
    return _header(as_tuple(x))


def _read_header(h: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    out = []
    values = h.tolist()
    for i in range(values[0]):
        o = 1 + i * _SLOT
        ndim = values[o + 2]
        out.append((DTYPES[values[o]], bool(values[o + 1]), tuple(values[o + 3 : o + 3 + ndim])))
    return out


class StageLink:
    """This rank's transfers to and from the neighbouring pipeline stages.

    ``pp``: the pipeline axis (group rank = stage); ``tp``: the tensor-parallel group
    (None or size 1: nothing partitioned); ``chunks``: model chunks per stage.
    """

    def __init__(
        self,
        pp: Comm,
        device: torch.device,
        *,
        chunks: int = 1,
        tp: Comm | None = None,
        pipe_partitioned: bool = True,
        grad_partitioned: bool = True,
    ) -> None:
        self.pp, self.device, self.chunks = pp, device, chunks
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.split_act = self.tp is not None and pipe_partitioned
        self.split_grad = self.tp is not None and grad_partitioned
        self._sends: list[tuple[Handle, torch.Tensor]] = []
        #: the agreed headers: (link, input signature) -> the header both ends know
        self._agreed: dict[tuple, torch.Tensor] = {}
        self._signatures: list[tuple] | None = None  # this batch's, per micro-batch
        self.headers_sent = self.headers_received = 0

    def begin_batch(self, signatures: list[tuple] | None) -> None:
        """This batch's input signature per micro-batch (the first stage's input shapes,
        the same on every stage), or None: every activation goes with its header
        (``PipelineModule(dynamic_shape=True)``: shapes that depend on more than the
        input shapes)."""
        self._signatures = signatures

    def _known(self, microbatch: int, link: int) -> tuple | None:
        if self._signatures is None:
            return None
        return (link, self._signatures[microbatch])

    # -- sending ------------------------------------------------------------------------
    def _send(self, t: torch.Tensor, dst: int, tag: int, split: bool) -> None:
        buf = t.detach().contiguous()
        if split:
            buf = self._slice(buf)
        self._sends.append((self.pp.send(buf, dst, tag), buf))

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        assert tp is not None  # split_act / split_grad need a tensor-parallel group
        flat = t.reshape(-1)
        n = -(-flat.numel() // tp.world_size)
        if flat.numel() % tp.world_size:
            flat = torch.nn.functional.pad(flat, (0, n * tp.world_size - flat.numel()))
        return flat[tp.rank * n : (tp.rank + 1) * n].clone()

    def send_activation(self, x, dst: int, microbatch: int, chunk: int) -> None:
        """Send the activation ``x`` of (micro-batch, this sender's chunk) to stage
        ``dst``; tagged with the receiver's chunk ``chunk``."""
        tensors = as_tuple(x)
        key = self._known(microbatch, chunk)
        if key is None or key not in self._agreed:
            h = _header(tensors).to(self.device)
            tag = _tag(microbatch, chunk, _HEADER, 0, self.chunks)
            self._sends.append((self.pp.send(h, dst, tag), h))
            self.headers_sent += 1
            if key is not None:
                self._agreed[key] = h.cpu()
        for i, t in enumerate(tensors):
            self._send(t, dst, _tag(microbatch, chunk, _ACT, i, self.chunks), self.split_act)

    def send_gradients(self, grads: list[torch.Tensor], dst: int, microbatch: int, chunk: int) -> None:  # fmt: skip
        """Send the gradients of the activation a stage received (one per tensor that
        carries a gradient, in order) back to its sender ``dst``."""
        for i, g in enumerate(grads):
            self._send(g, dst, _tag(microbatch, chunk, _GRAD, i, self.chunks), self.split_grad)

    def wait_sends(self) -> None:
        for handle, _ in self._sends:
            handle.wait()
        self._sends.clear()

    # -- receiving ----------------------------------------------------------------------
    def _recv(self, shape, dtype, src: int, tag: int, split: bool) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        if not split:
            out = torch.empty(shape, dtype=dtype, device=self.device)
            self.pp.recv(out, src, tag)
            return out
        tp = self.tp
        assert tp is not None  # split_act / split_grad need a tensor-parallel group
        n = -(-numel // tp.world_size)
        part = torch.empty(n, dtype=dtype, device=self.device)
        self.pp.recv(part, src, tag)
        whole = torch.empty(n * tp.world_size, dtype=dtype, device=self.device)
        tp.all_gather(whole, part)
        return whole[:numel].view(shape)

    def recv_activation(self, src: int, microbatch: int, chunk: int) -> tuple[torch.Tensor, ...]:
        """Receive (micro-batch, ``chunk``)'s activation from stage ``src``: tensors that
        carry a gradient come back as leaves requiring one."""
        key = self._known(microbatch, chunk)
        h = self._agreed.get(key) if key is not None else None
        if h is None:
            h = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            self.pp.recv(h, src, _tag(microbatch, chunk, _HEADER, 0, self.chunks))
            self.headers_received += 1
            if key is not None:
                self._agreed[key] = h.cpu()
        out = []
        for i, (dtype, grad, shape) in enumerate(_read_header(h.cpu())):
            t = self._recv(shape, dtype, src, _tag(microbatch, chunk, _ACT, i, self.chunks), self.split_act)  # fmt: skip
            out.append(t.requires_grad_(grad))
        return tuple(out)

    def recv_gradients(self, like: list[torch.Tensor], src: int, microbatch: int, chunk: int) -> list[torch.Tensor]:  # fmt: skip
        """Receive the gradients of the tensors ``like`` (this stage's outputs that carry
        one) from stage ``src``."""
        return [
            self._recv(
                t.shape,
                t.dtype,
                src,
                _tag(microbatch, chunk, _GRAD, i, self.chunks),
                self.split_grad,
            )
            for i, t in enumerate(like)
        ]
