"""Ring attention: exact attention over a sequence split across a context-parallel group.

With ``cp`` ranks the sequence is cut into ``2·cp`` equal chunks and rank ``i`` holds
chunks ``i`` and ``2·cp-1-i`` (:func:`zigzag_positions`). Under a causal mask every
rank then does the same work: at each ring step it attends its two query chunks to
one (or two half-masked) key/value chunks, never to a chunk entirely in its future.

Forward: each rank's key/value block travels once around the ring (``cp-1`` p2p steps,
each overlapped with the attention of the block in hand); partial results merge with
the online-softmax rule (running log-sum-exp). Backward recomputes each block's
probabilities from the saved log-sum-exp and sends the key/value blocks around again,
each followed by its gradient accumulator, which returns to its owner after ``cp``
steps.

Collectives (``Comm.send_recv``, filed as ``"send_recv"``), per call, with k and v of
B = b·h_kv·(2s/cp)·d elements each on every rank: forward ``cp-1`` sends of 2B;
backward ``cp-1`` sends of 2B (key/value) plus ``cp`` sends of 2B (their gradients).
"""

from __future__ import annotations

import torch

from zeroshard import ZeroshardError
from zeroshard.distributed.comm import Comm


class SequenceParallelError(ZeroshardError, ValueError):
    """A model or input that sequence parallelism cannot split as asked."""


def zigzag_positions(seq_len: int, rank: int, world: int, device=None) -> torch.Tensor:
    """Global positions of rank ``rank``'s tokens: chunks ``rank`` and ``2·world-1-rank``
    of ``2·world`` equal chunks of ``seq_len``."""
    if seq_len % (2 * world):
        raise SequenceParallelError(
            f"ring attention splits the sequence into 2 x {world} equal chunks: "
            f"sequence length {seq_len} does not divide by {2 * world}"
        )
    c = seq_len // (2 * world)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c, device=device)
    return torch.cat([first, last])


def _pairs(rank: int, src: int, world: int, causal: bool):
    """(query chunk slot, key chunk slot, diagonal) for blocks rank attends to src's kv."""
    mine = (rank, 2 * world - 1 - rank)
    theirs = (src, 2 * world - 1 - src)
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(theirs):
            if causal and kc > qc:
                continue
            yield qi, ki, causal and kc == qc


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _scores(q, k, scale, diag):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diag:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _exchange(comm: Comm, send: torch.Tensor):
    recv = torch.empty_like(send)
    w, r = comm.world_size, comm.rank
    handle = comm.send_recv(send, (r + 1) % w, recv, (r - 1) % w, async_op=True)
    return recv, handle


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, scale: float, causal: bool):
        w, r = comm.world_size, comm.rank
        groups = q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        qs = q.float().split(c, dim=2)
        out = [torch.zeros_like(x) for x in qs]
        lse = [torch.full(x.shape[:-1], float("-inf"), device=x.device) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        for step in range(w):
            src = (r - step) % w
            if step < w - 1:
                nxt, handle = _exchange(comm, kv)
            ks, vs = (_expand(x.float(), groups).split(c, dim=2) for x in kv.unbind(0))
            for qi, ki, diag in _pairs(r, src, w, causal):
                s = _scores(qs[qi], ks[ki], scale, diag)
                blk_lse = torch.logsumexp(s, dim=-1)
                blk_out = torch.matmul(torch.exp(s - blk_lse.unsqueeze(-1)), vs[ki])
                new_lse = torch.logaddexp(lse[qi], blk_lse)
                out[qi] = out[qi] * torch.exp(lse[qi] - new_lse).unsqueeze(
                    -1
                ) + blk_out * torch.exp(blk_lse - new_lse).unsqueeze(-1)
                lse[qi] = new_lse
            if step < w - 1:
                handle.wait()
                kv = nxt
        out_t, lse_t = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out_t, lse_t)
        ctx.comm, ctx.scale, ctx.causal = comm, scale, causal
        return out_t.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, scale, causal = ctx.comm, ctx.scale, ctx.causal
        w, r = comm.world_size, comm.rank
        groups = q.shape[1] // k.shape[1]
        c = q.shape[2] // 2
        dout = dout.float()
        delta = (dout * out).sum(dim=-1)  # rowsum(dO ∘ O)
        qs, dos = q.float().split(c, dim=2), dout.split(c, dim=2)
        lses, deltas = lse.split(c, dim=2), delta.split(c, dim=2)
        dq = [torch.zeros_like(x) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        b, hkv, _, d = k.shape
        for step in range(w):
            src = (r - step) % w
            if step < w - 1:
                nxt, handle = _exchange(comm, kv)
            ks, vs = (_expand(x.float(), groups).split(c, dim=2) for x in kv.unbind(0))
            dk = [torch.zeros_like(x) for x in ks]
            dv = [torch.zeros_like(x) for x in vs]
            for qi, ki, diag in _pairs(r, src, w, causal):
                p = torch.exp(_scores(qs[qi], ks[ki], scale, diag) - lses[qi].unsqueeze(-1))
                dv[ki] += torch.matmul(p.transpose(-1, -2), dos[qi])
                dp = torch.matmul(dos[qi], vs[ki].transpose(-1, -2))
                ds = p * (dp - deltas[qi].unsqueeze(-1)) * scale
                dq[qi] += torch.matmul(ds, ks[ki])
                dk[ki] += torch.matmul(ds.transpose(-1, -2), qs[qi])
            for i, grads in enumerate((dk, dv)):
                g = torch.cat(grads, dim=2)
                if groups > 1:  # sum over the query heads that shared each kv head
                    g = g.view(b, hkv, groups, 2 * c, d).sum(dim=2)
                dkv[i] += g
            dkv, dhandle = _exchange(comm, dkv)  # the accumulator moves with its block
            dhandle.wait()
            if step < w - 1:
                handle.wait()
                kv = nxt
        dq_t = torch.cat(dq, dim=2).to(q.dtype)
        return dq_t, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    *,
    scale: float | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of this rank's queries to the whole sequence's keys and values.

    ``q`` is (batch, heads, 2c, head_dim) and ``k``, ``v`` are (batch, kv_heads, 2c,
    head_dim): this rank's tokens in :func:`zigzag_positions` order (kv_heads divides
    heads: grouped-query attention). Returns (batch, heads, 2c, head_dim).
    """
    if q.shape[2] % 2 or q.shape[2] != k.shape[2]:
        raise SequenceParallelError(
            f"ring attention needs two equal local chunks, got q {tuple(q.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise SequenceParallelError(
            f"{q.shape[1]} query heads do not divide into {k.shape[1]} kv heads"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, comm, scale, causal)
