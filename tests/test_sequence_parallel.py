"""Sequence parallelism (zeroshard/parallel/sequence/attention.py, sequence/ring.py): Ulysses and
ring attention on gloo ranks. Each rank runs its share of every sequence; the loss
(summed over ranks' shares) and the gradients (reduced over the sequence-parallel
ranks, as the engine's data-parallel reduction does) equal the unsplit single-process
model's to 2e-5 in fp32. The ledger equals the formulas: Ulysses moves four
all-to-alls of b·s·h/sp elements per layer forward; ring attention one key/value block
per step.
"""

from __future__ import annotations

from typing import Any

import cases
import multirank
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tp_parity import F32, TOL, grad_diffs, run_fwd_bwd, tiny_llama, twin

from zeroshard.distributed.comm import Comm
from zeroshard.models import GPT, GPTConfig
from zeroshard.parallel.sequence.attention import (
    apply_ring_attention,
    apply_ulysses,
    shard_sequence,
)
from zeroshard.parallel.sequence.ring import ring_attention, zigzag_positions
from zeroshard.parallel.tensor.autotp import apply_tensor_parallel

B, S = 2, 16


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=S, n_layer=2, n_head=4, d_model=32))


def _data(vocab=64):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (B, S), generator=g), torch.randint(
        0, vocab, (B, S), generator=g
    )


def _reduce_grads(model, comm: Comm, op: str) -> None:
    """What the engine does over the sequence-parallel ranks (a separate verification Comm)."""
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, op=op)


def test_zigzag_positions_cover_the_sequence_once():
    got = torch.cat([zigzag_positions(16, r, 4) for r in range(4)])
    assert sorted(got.tolist()) == list(range(16))
    assert zigzag_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="does not divide by 8"):
        zigzag_positions(12, 0, 4)


def test_ulysses_refuses_indivisible_heads():
    import types

    comm: Any = types.SimpleNamespace(world_size=3, rank=0)  # all apply_ulysses reads of a Comm
    with pytest.raises(ValueError, match="GPT's 4 heads do not divide by sequence_parallel_size 3"):
        apply_ulysses(_gpt(), comm)
    with pytest.raises(ValueError, match="num_key_value_heads = 2 does not divide"):
        apply_ulysses(
            tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=48), comm
        )


# -- attention kernels alone ----------------------------------------------------------------


def _ring_kernel_case(comm: Comm, vcomm: Comm) -> dict:
    """ring_attention against whole-sequence attention: out, dq, dk, dv (GQA, causal
    and not)."""
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, S, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, S, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, S, 8, generator=g, requires_grad=True)
    dout = torch.randn(2, 4, S, 8, generator=g)
    for causal in (True, False):
        for t in (q, k, v):
            t.grad = None
        ref = F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=causal
        )
        ref.backward(dout)
        pos = zigzag_positions(S, comm.rank, comm.world_size)
        lq, lk, lv = (t.detach()[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        comm.ledger.reset()
        o = ring_attention(lq, lk, lv, comm, causal=causal)
        fwd = comm.ledger.snapshot()
        o.backward(dout[:, :, pos])
        bwd = comm.ledger.snapshot()
        diffs = [(o - ref.detach()[:, :, pos]).abs().max().item()]
        diffs += [
            (_grad(lt) - _grad(t)[:, :, pos]).abs().max().item()
            for lt, t in ((lq, q), (lk, k), (lv, v))
        ]
        out["causal" if causal else "full"] = max(diffs)
        out["ledger"] = (fwd["send_recv"]["calls"], bwd["send_recv"]["calls"] - fwd["send_recv"]["calls"],
                         fwd["send_recv"]["bytes"])  # fmt: skip
    return out


# -- whole models ------------------------------------------------------------------------------


def _models_case(rank, world):
    comm, vcomm = Comm(), Comm()
    return cases.run_named(
        [
            ("ring_kernel", lambda: _ring_kernel_case(comm, vcomm)),
            ("ulysses", lambda: _model_case(comm, vcomm, "ulysses", apply_ulysses, False)),
            ("ring", lambda: _model_case(comm, vcomm, "ring", apply_ring_attention, True)),
        ]
    )


def _model_case(comm, vcomm, kind: str, apply, balanced: bool) -> dict:
    out = {}
    idx, tgt = _data()
    # built-in GPT: each rank's loss is the mean over its tokens; gradients averaged
    ref = _gpt()
    model = twin(ref)
    apply(model, comm)
    loss_ref = ref(idx, tgt)
    loss_ref.backward()
    li, lt = (shard_sequence(x, comm, load_balanced=balanced) for x in (idx, tgt))
    loss, fwd, bwd = run_fwd_bwd(model, comm, lambda m, li=li, lt=lt: m(li, lt))
    total = loss.detach().clone()
    vcomm.all_reduce(total, op="avg")
    _reduce_grads(model, vcomm, "avg")
    out[f"gpt_{kind}"] = {"loss": abs(total.item() - loss_ref.item()),
                          "grads": max(grad_diffs(ref, model, vcomm).values()), "fwd": fwd, "bwd": bwd}  # fmt: skip

    # transformers Llama (GQA): labels shifted for the whole sequence, then split;
    # the loss is normalized by the global token count, so gradients are summed
    ref = tiny_llama()
    model = twin(ref)
    apply(model, comm)
    loss_ref = ref(input_ids=idx, labels=idx, use_cache=False).loss
    loss_ref.backward()
    shift = torch.cat([idx[:, 1:], torch.full((B, 1), -100)], dim=1)
    n_items = (shift != -100).sum()
    li, ls = (shard_sequence(x, comm, load_balanced=balanced) for x in (idx, shift))

    def fn(m, li=li, ls=ls, n_items=n_items):
        return m(
            input_ids=li,
            labels=ls,
            shift_labels=ls,
            num_items_in_batch=n_items,
            use_cache=False,
        ).loss

    loss, fwd, bwd = run_fwd_bwd(model, comm, fn)
    total = loss.detach().clone()
    vcomm.all_reduce(total)
    _reduce_grads(model, vcomm, "sum")
    out[f"llama_{kind}"] = {"loss": abs(total.item() - loss_ref.item()),
                            "grads": max(grad_diffs(ref, model, vcomm).values()), "fwd": fwd, "bwd": bwd}  # fmt: skip
    return out


def _expected(sp: int, layers: int = 2, h: int = 32) -> dict:
    """(calls, bytes) forward; ring: the stacked k and v blocks."""
    kv_h = 2 * 8  # Llama: 2 key/value heads of 8
    return {
        "gpt_ulysses": (4 * layers, 4 * layers * B * S * h // sp * F32),
        "llama_ulysses": (4 * layers, 2 * layers * B * S * (h + kv_h) // sp * F32),
        "gpt_ring": (layers * (sp - 1), layers * (sp - 1) * 2 * B * S * h // sp * F32),
        "llama_ring": (layers * (sp - 1), layers * (sp - 1) * 2 * B * S * kv_h // sp * F32),
    }


def _tp_sp_case(rank, world):
    """4 ranks: TP2 inside, Ulysses SP2 across (tp groups {0,1},{2,3}; sp {0,2},{1,3})."""
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp = Comm(tp_groups[rank // 2])
    sp = Comm(sp_groups[rank % 2])
    vtp, vsp = Comm(tp_groups[rank // 2]), Comm(sp_groups[rank % 2])
    idx, tgt = _data()
    ref = _gpt()
    model = twin(ref)
    apply_tensor_parallel(model, tp)
    apply_ulysses(model, sp)
    loss_ref = ref(idx, tgt)
    loss_ref.backward()
    loss = model(shard_sequence(idx, sp), shard_sequence(tgt, sp))
    loss.backward()
    total = loss.detach().clone()
    vsp.all_reduce(total, op="avg")
    _reduce_grads(model, vsp, "avg")
    return {"loss": abs(total.item() - loss_ref.item()),
            "grads": max(grad_diffs(ref, model, vtp).values())}  # fmt: skip


def _check_ring_kernel(per_rank: list) -> None:
    for kernel in per_rank:
        assert kernel["causal"] <= TOL and kernel["full"] <= TOL
        # cp=2: forward passes the kv block once, backward once more plus its gradient twice
        kv_bytes = 2 * 2 * 2 * (S // 2) * 8 * F32
        assert kernel["ledger"] == [1, 3, kv_bytes]


def _check_models(kind: str, per_rank: list) -> None:
    expect = _expected(sp=2)
    for r in per_rank:
        for key in (f"gpt_{kind}", f"llama_{kind}"):
            c = r[key]
            assert c["loss"] <= TOL, (key, c["loss"])
            assert c["grads"] <= TOL, (key, c["grads"])
            op = "all_to_all" if "ulysses" in key else "send_recv"
            assert c["fwd"] == {op: list(expect[key])}, (key, c["fwd"])
            calls = c["fwd"][op][0]
            assert c["bwd"][op][0] == (calls if op == "all_to_all" else 3 * calls)


def test_sequence_parallel_on_two_ranks(subtests: pytest.Subtests) -> None:
    results = multirank.run(_models_case, 2, timeout=600)
    cases.check(subtests, results, "ring_kernel", _check_ring_kernel)
    cases.check_each(subtests, results, _check_models, names=["ulysses", "ring"])


def _four_rank_case(rank, world):
    comm = Comm()
    return cases.run_named(
        [
            ("ring_cp4", lambda: _ring_kernel_case(comm, Comm())),
            ("tp2_x_ulysses2", lambda: _tp_sp_case(rank, world)),
        ]
    )


def _check_cp4(per_rank: list) -> None:
    for r in per_rank:
        assert r["causal"] <= TOL and r["full"] <= TOL
        assert r["ledger"][:2] == [3, 7]  # cp-1 kv sends; backward cp-1 + cp


def _check_tp_sp(per_rank: list) -> None:
    for r in per_rank:
        assert r["loss"] <= TOL and r["grads"] <= TOL


def test_ring_cp4_and_tp2_times_ulysses2_on_four_ranks(subtests: pytest.Subtests) -> None:
    results = multirank.run(_four_rank_case, 4, timeout=600)
    cases.check(subtests, results, "ring_cp4", _check_cp4)
    cases.check(subtests, results, "tp2_x_ulysses2", _check_tp_sp)
