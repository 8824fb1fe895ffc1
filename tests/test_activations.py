"""Activation checkpointing and offload (zeroshard.checkpointing,
zeroshard.activation.offload): gradients equal the plain run with dropout on, memory
actually drops, the DeepSpeed config section is honoured. Single process except the
engine test (one rank)."""

from __future__ import annotations

import copy
import logging
import weakref

import multirank
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.activation import checkpointing
from zeroshard.activation import offload as activation_offload
from zeroshard.activation.checkpointing import (
    apply_activation_checkpointing,
    apply_activation_offload,
    checkpoint,
    configure,
)
from zeroshard.distributed import device
from zeroshard.distributed.fake_device import FakeRuntime
from zeroshard.models import GPT, Block, GPTConfig
from zeroshard.monitor.memory import ActivationTracker, activation_bytes

TOL = 1e-6


@pytest.fixture(autouse=True)
def _defaults():
    checkpointing.reset()
    yield
    checkpointing.reset()


class Spy:
    """Counts (and records the shapes of) what goes through the offload pack/unpack."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.packed: list[tuple[int, ...]] = []
        self.unpacked = 0
        to_host, to_device = activation_offload.to_host, activation_offload.to_device

        def pack(t):
            self.packed.append(tuple(t.shape))
            return to_host(t)

        def unpack(p):
            self.unpacked += 1
            return to_device(p)

        monkeypatch.setattr(activation_offload, "to_host", pack)
        monkeypatch.setattr(activation_offload, "to_device", unpack)


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# -- checkpoint() -------------------------------------------------------------------------
def _fn_with_dropout(w1: torch.Tensor, w2: torch.Tensor):
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(x @ w1), p=0.5, training=True)
        return F.dropout(F.gelu(h @ w2), p=0.3, training=True)

    return fn


def _grads_of(run, seed: int = 7) -> list[torch.Tensor]:
    torch.manual_seed(0)
    w1 = torch.randn(16, 32, requires_grad=True)
    w2 = torch.randn(32, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(seed)
    run(_fn_with_dropout(w1, w2), x * 1.0).square().sum().backward()
    return [_grad(w1), _grad(w2), _grad(x)]


def test_checkpoint_with_dropout_matches_plain() -> None:
    plain = _grads_of(lambda fn, x: fn(x))
    ckpt = _grads_of(lambda fn, x: checkpoint(fn, x))
    assert _max_diff(plain, ckpt) <= TOL
    # the check can fail: a recompute that draws fresh dropout masks is caught
    fresh = _grads_of(
        lambda fn, x: torch.utils.checkpoint.checkpoint(
            fn, x, use_reentrant=False, preserve_rng_state=False
        )
    )
    assert _max_diff(plain, fresh) > 1e-2


def _gpt(dropout: float = 0.1, preset: str = "tiny", seq: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset(preset, seq_len=seq, dropout=dropout))


def _gpt_grads(model: GPT, ids: torch.Tensor, seed: int = 3) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.item(), [_grad(p).clone() for p in model.parameters()]


@pytest.mark.parametrize("offload", [False, True], ids=["kept", "offloaded"])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_gpt_gradients_equal_with_dropout(policy: str, offload: bool) -> None:
    ref = _gpt(dropout=0.1)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    loss0, g0 = _gpt_grads(ref, ids)
    _, g_other_seed = _gpt_grads(ref, ids, seed=4)
    assert _max_diff(g0, g_other_seed) > 1e-3  # dropout is on: masks change the gradients
    model = copy.deepcopy(ref)
    assert apply_activation_checkpointing(model, Block, policy, offload=offload) == 2
    loss1, g1 = _gpt_grads(model, ids)
    assert abs(loss0 - loss1) <= TOL
    assert _max_diff(g0, g1) <= TOL


# -- memory ---------------------------------------------------------------------------------
SEQ, BATCH = 256, 2


def _activation_memory(policy: str) -> tuple[int, int, GPTConfig]:
    """(bytes kept for backward when forward ends, peak over forward + backward)."""
    model = _gpt(dropout=0.0, preset="small", seq=SEQ)
    if policy != "none":
        apply_activation_checkpointing(model, Block, policy)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradient buffers exist, as in the engine
    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    grads = [_grad(p) for p in model.parameters()]
    with ActivationTracker(exclude=[*model.parameters(), *grads, x, y]) as tracker:
        loss = model(x, y)
        kept = tracker.current
        loss.backward()
    return kept, tracker.peak, model.cfg


def test_checkpointing_reduces_activation_memory() -> None:
    kept, peak = {}, {}
    for policy in ("none", "selective", "full"):
        kept[policy], peak[policy], cfg = _activation_memory(policy)
    assert kept["full"] < kept["selective"] < kept["none"]
    assert peak["full"] < peak["selective"] < peak["none"]
    # by the expected factor: what the estimator says is kept (within 5%)
    for policy, measured in kept.items():
        expected = activation_bytes(
            layers=cfg.n_layer,
            hidden=cfg.d_model,
            seq=SEQ,
            micro_batch=BATCH,
            vocab=cfg.vocab_size,
            policy=policy,
            peak=False,
        )
        assert abs(measured - expected) <= 0.05 * measured, (policy, measured, expected)
    assert kept["none"] / kept["full"] > 6 and kept["none"] / kept["selective"] > 1.4


# -- offload ------------------------------------------------------------------------------
def test_offload_is_per_block_and_covers_selective_kept_matmuls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = Spy(monkeypatch)
    ref = _gpt(dropout=0.1)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    _, g0 = _gpt_grads(ref, ids)
    model = copy.deepcopy(ref)
    n = apply_activation_checkpointing(
        model, lambda name, m: name == "blocks.0", "selective", offload=True
    )
    assert n == 1
    _, g1 = _gpt_grads(model, ids)
    assert _max_diff(g0, g1) <= TOL
    b, s, h = 2, 32, model.cfg.d_model
    # block 0 only: its input, then the outputs of qkv, attention projection, MLP up and
    # down projections (addmm on the flattened tokens)
    assert spy.packed == [(b, s, h), (b * s, 3 * h), (b * s, h), (b * s, 4 * h), (b * s, h)]
    assert spy.unpacked >= 2  # the input and the kept outputs the recompute needed


def test_offload_without_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    ref = _gpt(dropout=0.1)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    _, g0 = _gpt_grads(ref, ids)
    model = copy.deepcopy(ref)
    assert apply_activation_offload(model, lambda name, m: name == "blocks.1") == 1
    _, g1 = _gpt_grads(model, ids)
    assert _max_diff(g0, g1) <= TOL
    assert len(spy.packed) >= 10 and spy.unpacked == len(spy.packed)


class FakeEvent:
    def __init__(self, n: int) -> None:
        self.n, self.done = n, False


class FakeMover:
    """Stands in for the stream mover on CPU: "copies" by cloning, moves CPU tensors too,
    records every call by pack index; a copy to host completes only when the test says so
    (or when the queue waits on it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.d2h: list[FakeEvent] = []
        self.index: dict[int, int] = {}  # id(host copy) -> its pack index

    def moves(self, t: torch.Tensor) -> bool:
        return True

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, FakeEvent]:
        n = len(self.d2h)
        host = t.detach().clone()
        self.index[id(host)] = n
        self.calls.append(("d2h", n))
        self.d2h.append(FakeEvent(n))
        return host, self.d2h[-1]

    def to_device(self, host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, FakeEvent]:
        self.calls.append(("h2d", self.index[id(host)]))
        event = FakeEvent(self.index[id(host)])
        event.done = True
        return host.clone(), event

    def use(self, dev: torch.Tensor, event: FakeEvent) -> None:
        self.calls.append(("use", event.n))

    def done(self, event: FakeEvent, device: torch.device) -> bool:
        return event.done

    def wait(self, event: FakeEvent, device: torch.device) -> None:
        self.calls.append(("wait", event.n))
        event.done = True

    def complete(self, upto: int | None = None) -> None:
        for event in self.d2h[:upto]:
            event.done = True

    def of(self, kind: str) -> list[int]:
        return [n for k, n in self.calls if k == kind]


class Recorder:
    """A fake-mover queue installed as the module's queue, with every entry packed (weakly:
    the graph owns them) and every unpack (by pack index) recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **kwargs) -> None:
        self.mover = FakeMover()
        self.queue = q = activation_offload._OffloadQueue(self.mover, **kwargs)
        self.refs: list[weakref.ref] = []
        self.groups: list[int] = []  # the group (block) of each entry, numbered
        pack, unpack = q.pack, q.unpack
        numbers: dict[int, int] = {}

        def recording_pack(t):
            entry = pack(t)
            self.refs.append(weakref.ref(entry))
            self.groups.append(numbers.setdefault(id(entry.group), len(numbers)))
            return entry

        def recording_unpack(entry):
            self.mover.calls.append(("unpack", self.mover.index[id(entry.host)]))
            return unpack(entry)

        monkeypatch.setattr(q, "pack", recording_pack)
        monkeypatch.setattr(q, "unpack", recording_unpack)
        monkeypatch.setattr(activation_offload, "_QUEUE", q)

    @property
    def entries(self) -> list:
        return [r() for r in self.refs]

    def assert_empty(self) -> None:
        """Nothing outlives the backward: no source held, no entry left alive."""
        q = self.queue
        assert not q.pending and q.inflight_bytes == 0
        assert [r for r in self.refs if r() is not None] == []


def _mlp(blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks)))


def _mlp_grads(model: nn.Module, x: torch.Tensor, before_backward=lambda: None):
    model.zero_grad(set_to_none=True)
    out = model(x).square().sum()
    before_backward()
    out.backward()
    return [_grad(p).clone() for p in model.parameters()]


def _offload_mlp(monkeypatch: pytest.MonkeyPatch, select):
    """(input, reference grads, an offloaded copy of the MLP, blocks wrapped, recorder)."""
    ref = _mlp()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    g0 = _mlp_grads(ref, x)
    model = copy.deepcopy(ref)
    wrapped = apply_activation_offload(model, select)
    return x, g0, model, wrapped, Recorder(monkeypatch)


def test_offload_queue_copies_each_tensor_once_each_way_and_prefetches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, g0, model, wrapped, rec = _offload_mlp(
        monkeypatch, lambda name, m: name in {"0", "1", "2", "3"}
    )
    assert wrapped == 4
    mover = rec.mover

    def after_forward() -> None:
        n = len(rec.entries)
        assert mover.of("d2h") == list(range(n)) and n >= 8
        # copies not complete: every source is held (nothing released early)
        assert all(e.src is not None for e in rec.entries) and len(rec.queue.pending) == n
        mover.complete()
        # complete but not yet observed: still held until the queue polls
        assert all(e.src is not None for e in rec.entries)

    g1 = _mlp_grads(model, x, after_forward)
    assert _max_diff(g0, g1) <= TOL
    n = len(rec.refs)
    assert sorted(mover.of("d2h")) == list(range(n))  # once to host
    assert sorted(mover.of("h2d")) == list(range(n))  # once back (sources were released)
    assert sorted(mover.of("unpack")) == list(range(n))
    calls = mover.calls
    for i in range(n):
        # the compute stream is made to wait on each copy back before it uses the result
        assert calls.index(("h2d", i)) < calls.index(("use", i))
    # backward unpacks in (roughly) reverse pack order: all but the first tensor unpacked
    # were already on their way back when their unpack came
    first = mover.of("unpack")[0]
    assert first == n - 1
    late = [i for i in range(n) if calls.index(("h2d", i)) > calls.index(("unpack", i))]
    assert late == [first]
    rec.assert_empty()


def test_offload_queue_unfinished_copies_skip_the_copy_back_and_are_drained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, g0, model, _, rec = _offload_mlp(monkeypatch, nn.Tanh)  # the tanh outputs only
    g1 = _mlp_grads(model, x)  # no copy to host ever completes on its own
    assert _max_diff(g0, g1) <= TOL
    n = len(rec.refs)
    assert n == 4 and rec.mover.of("h2d") == []  # the sources were still there: used as is
    # the end of backward waited for the copies and released the sources
    assert sorted(rec.mover.of("wait")) == list(range(n))
    rec.assert_empty()


def test_offload_queue_bounds_the_sources_held(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch, max_inflight_bytes=2 * 64 * 4)
    kept = [activation_offload.to_host(torch.randn(64)) for _ in range(5)]
    assert rec.mover.of("wait") == [0, 1, 2]  # the oldest copies, waited for in order
    assert [e.src is None for e in kept] == [True, True, True, False, False]
    assert rec.queue.inflight_bytes == 2 * 64 * 4
    rec.mover.complete()
    activation_offload._QUEUE.reap()
    assert all(e.src is None for e in kept) and not rec.queue.pending


def test_offload_queue_second_backward_fetches_again(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder(monkeypatch)
    w = torch.randn(16, 16, requires_grad=True)
    with checkpointing.offload_saved_tensors():
        y = torch.tanh(torch.randn(4, 16) @ w).sum()
    rec.mover.complete()
    y.backward(retain_graph=True)
    g = _grad(w).clone()
    y.backward()
    assert torch.allclose(_grad(w), 2 * g)
    n = len(rec.refs)
    assert sorted(rec.mover.of("d2h")) == list(range(n))
    assert sorted(rec.mover.of("h2d")) == sorted(2 * list(range(n)))
    rec.assert_empty()


def test_offload_queue_refuses_a_source_modified_while_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Recorder(monkeypatch)
    x = torch.randn(4, requires_grad=True)
    with checkpointing.offload_saved_tensors():
        y = x * 2
        z = y.sin()  # saves y
        y.add_(1)  # while y's copy to host may still be reading it
    with pytest.raises(RuntimeError, match="modified in place"):
        z.sum().backward()


@pytest.mark.parametrize("policy", [None, "full", "selective"])
def test_offload_queue_on_gpt(monkeypatch: pytest.MonkeyPatch, policy: str | None) -> None:
    ref = _gpt(dropout=0.1)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    _, g0 = _gpt_grads(ref, ids)
    model = copy.deepcopy(ref)
    if policy is None:
        apply_activation_offload(model, Block)
    else:
        apply_activation_checkpointing(model, Block, policy, offload=True)
    rec = Recorder(monkeypatch)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = model(ids[:, :-1], ids[:, 1:])
    rec.mover.complete()
    loss.backward()
    g1 = [_grad(p) for p in model.parameters()]
    assert _max_diff(g0, g1) <= TOL
    n = len(rec.refs)
    assert sorted(rec.mover.of("d2h")) == list(range(n))
    assert sorted(rec.mover.of("h2d")) == list(range(n))
    calls = rec.mover.calls
    late = [i for i in range(n) if calls.index(("h2d", i)) > calls.index(("unpack", i))]
    # all were prefetched but some of the block unpacked first (nothing was before it)
    assert {rec.groups[i] for i in late} == {rec.groups[-1]}
    assert len(late) <= max(1, n // 10)
    rec.assert_empty()


def test_stream_mover_orders_the_streams() -> None:
    """The real mover's stream protocol, on CPU, through the device seam's fake runtime
    (side-stream copies run only once waited for): wait for compute, copy on the side
    stream, protect, record; and on the way back the compute stream waits on the copy's
    event."""
    fake = FakeRuntime()
    with device.use(fake):
        mover = activation_offload._StreamMover()
        x = torch.randn(4, 8)
        fake.name(x, "x")
        host, d2h = mover.to_host(x)
        assert fake.pending() == 1  # queued on the side stream, not run yet
        assert fake.log == [
            ("wait_stream", "side0", "compute"),  # the source is ready
            ("copy", "side0", "host0", "x"),
            ("record_stream", "side0", "x"),  # its memory is not reused before the copy
            ("record", d2h.name, "side0"),
        ]
        assert mover.done(d2h, x.device) and torch.equal(host, x)
        fake.log.clear()
        dev, h2d = mover.to_device(host, x.device)
        mover.use(dev, h2d)
        assert torch.equal(dev, x) and dev.data_ptr() != x.data_ptr()
        assert fake.log == [
            ("copy", "side0", "dev0", "host0"),
            ("record", h2d.name, "side0"),
            ("wait_event", "compute", h2d.name),  # compute uses it only once it has arrived
            ("record_stream", "compute", "dev0"),
        ]
        # and through the whole model: one side stream, gradients unchanged although
        # every copy runs late (only when waited for)
        queue = activation_offload._OffloadQueue(mover)
        ref = _gpt(dropout=0.1)
        ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
        _, g0 = _gpt_grads(ref, ids)
        model = copy.deepcopy(ref)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(activation_offload, "_QUEUE", queue)
            apply_activation_checkpointing(model, Block, "selective", offload=True)
            _, g1 = _gpt_grads(model, ids)
    assert _max_diff(g0, g1) <= TOL
    assert len(mover._side) == 1 and not queue.pending
    copies = [e for e in fake.log if e[0] == "copy"]
    assert len(copies) > 20 and {e[1] for e in copies} == {"side0"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_moves_to_pinned_host_memory_on_cuda() -> None:
    x = torch.randn(4, 8, device="cuda")
    packed = activation_offload.to_host(x)
    assert isinstance(packed, activation_offload._Offloaded)
    assert packed.host.device.type == "cpu" and packed.host.is_pinned()
    assert packed.device == x.device
    torch.cuda.synchronize()
    activation_offload._QUEUE.reap()
    assert packed.src is None  # the copy was seen complete: the source was let go
    back = activation_offload.to_device(packed)
    assert torch.equal(back, x) and back.data_ptr() != x.data_ptr()
    ref = _gpt(dropout=0.1).cuda()
    ids = torch.randint(0, 256, (2, 33), device="cuda")
    _, g0 = _gpt_grads(ref, ids)
    for apply in (
        lambda m: apply_activation_checkpointing(m, Block, "selective", offload=True),
        lambda m: apply_activation_offload(m, Block),
    ):
        model = copy.deepcopy(ref)
        apply(model)
        _, g1 = _gpt_grads(model, ids)
        assert _max_diff(g0, g1) <= TOL
    assert not activation_offload._QUEUE.pending  # drained at the end of each backward


# -- configure(): DeepSpeed's activation_checkpointing section --------------------------------
def test_cpu_checkpointing_offloads_checkpoint_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    plain = _grads_of(lambda fn, x: checkpoint(fn, x))
    assert spy.packed == []  # default: nothing offloaded
    configure(deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert checkpointing.settings().cpu_checkpointing
    offloaded = _grads_of(lambda fn, x: checkpoint(fn, x))
    assert spy.packed == [(8, 16)] and spy.unpacked == 1  # the input, out and back
    assert _max_diff(plain, offloaded) <= TOL


def test_configure_reads_the_section_and_explicit_arguments_win(tmp_path, caplog) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        '{"train_batch_size": 8, "activation_checkpointing": {"partition_activations": true,'
        ' "contiguous_memory_optimization": true, "number_checkpoints": 4,'
        ' "synchronize_checkpoint_boundary": true}}'
    )
    with caplog.at_level(logging.WARNING, logger="zeroshard.checkpointing"):
        configure(deepspeed_config=str(path), checkpoint_in_cpu=True, num_checkpoints=6)
    s = checkpointing.settings()
    assert s.partition_activations and s.contiguous_memory_optimization
    assert s.cpu_checkpointing and s.synchronize_checkpoint_boundary
    assert s.number_checkpoints == 6
    assert "partition_activations has no effect" in caplog.text
    configure(checkpoint_in_cpu=False)  # without a config: from the defaults
    assert checkpointing.settings() == checkpointing.Settings()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_checkpoints": 0}, ValueError),
        ({"num_checkpoints": 2.5}, ValueError),
        ({"num_checkpoints": True}, ValueError),
    ],
)
def test_configure_validates(kwargs: dict, error: type) -> None:
    with pytest.raises(error):
        configure(**kwargs)
    assert checkpointing.settings() == checkpointing.Settings()  # unchanged


def test_configure_notes_each_inert_setting_once_on_rank_0(monkeypatch, caplog) -> None:
    # accepted alone (DeepSpeed would also ask for partition_activations and
    # num_checkpoints, which only size its buffer), one line per setting, once
    monkeypatch.setattr(checkpointing, "_noted", set())
    with caplog.at_level(logging.WARNING, logger="zeroshard.checkpointing"):
        configure(contiguous_checkpointing=True)
        configure(contiguous_checkpointing=True, partition_activations=True)
        configure(partition_activations=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "contiguous_memory_optimization has no effect" in lines[0]
    assert "partition_activations has no effect" in lines[1]
    assert checkpointing.settings().partition_activations
    monkeypatch.setattr(checkpointing, "_noted", set())
    monkeypatch.setattr(checkpointing, "_rank", lambda: 1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zeroshard.checkpointing"):
        configure(partition_activations=True)
    assert caplog.records == []  # other ranks stay quiet
    configure()
    assert checkpointing.settings() == checkpointing.Settings()


def test_partition_with_model_parallelism_is_refused() -> None:
    class MPU:
        def get_model_parallel_world_size(self) -> int:
            return 2

    with pytest.raises(NotImplementedError):
        configure(MPU(), partition_activations=True)


def test_profile_logs_checkpoint_time(caplog) -> None:
    configure(profile=True, synchronize=True)
    with caplog.at_level(logging.INFO, logger="zeroshard.checkpointing"):
        _grads_of(lambda fn, x: checkpoint(fn, x))
    assert "checkpoint" in caplog.text and "ms" in caplog.text


class _Net(nn.Module):
    """Calls checkpoint() in its forward, as Megatron calls deepspeed.checkpointing."""

    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.use_checkpoint = use_checkpoint
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def _layer(self, i: int):
        def run(x):
            return F.dropout(torch.tanh(self.layers[i](x)), p=0.3, training=self.training)

        return run

    def forward(self, x):
        for i in range(len(self.layers)):
            x = checkpoint(self._layer(i), x) if self.use_checkpoint else self._layer(i)(x)
        return x.square().mean()


def _engine_applies_section(rank: int, world: int) -> dict:
    import zeroshard

    packed = []
    to_host = activation_offload.to_host

    def recording_to_host(t):  # this rank's process only: nothing to restore
        packed.append(tuple(t.shape))
        return to_host(t)

    activation_offload.to_host = recording_to_host
    notes: list[str] = []

    class Notes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "partition_activations has no effect" in record.getMessage():
                notes.append(record.getMessage())

    logging.getLogger("zeroshard").addHandler(Notes())
    weights = []
    for use in (False, True):
        torch.manual_seed(0)
        model = _Net(use)
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": 1},
        }
        if use:
            config["activation_checkpointing"] = {
                "cpu_checkpointing": True,
                "partition_activations": True,
                "contiguous_memory_optimization": True,
                "number_checkpoints": 3,
            }
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        torch.manual_seed(1)
        x = torch.randn(4, 16)
        torch.manual_seed(2)
        engine.backward(engine(x))
        engine.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    s = checkpointing.settings()
    return {
        "packed": packed,
        "settings": [s.cpu_checkpointing, s.partition_activations, s.number_checkpoints],
        "diff": _max_diff(*weights),
        "notes": notes,
    }


def test_engine_applies_the_config_section() -> None:
    (r,) = multirank.run(_engine_applies_section, 1, timeout=120)
    assert r["settings"] == [True, True, 3]
    assert r["packed"] == [[4, 16]] * 3  # each checkpoint's input went through the offload
    assert r["diff"] <= TOL
    assert len(r["notes"]) == 1, r["notes"]  # the start-up line, not also configure()'s
