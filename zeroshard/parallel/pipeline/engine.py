"""The pipeline engine: ``train_batch`` / ``eval_batch`` over a ``PipelineModule``.

What ``zeroshard.initialize`` returns for a :class:`PipelineModule` (or a model the
Hugging Face splitter cuts). Each rank is one pipeline stage's engine: the ordinary
:class:`~zeroshard.runtime.engine.Engine` (ZeRO over the stage's data-parallel ranks, tensor
parallelism inside the stage) on the stage's own layers, driven by a schedule from
``schedules.py`` through :class:`~zeroshard.parallel.pipeline.exec.StageRunner`.

One ``train_batch(data_iter)``: the first and the last stage read
``gradient_accumulation_steps`` micro-batches ``(inputs, labels)`` from ``data_iter``;
the schedule runs; gradients are then summed over the stages holding a tied layer and
reduced over data-parallel ranks; one optimizer step whose gradient norm and inf/nan
check span every stage. Returns the mean loss (over micro-batches and data-parallel
ranks) on every rank. ``engine.pipeline_trace`` holds the last batch's timed actions.

ZeRO (DeepSpeed allows stage 1 only with pipelines): stages 0 and 1 keep full gradients
and reduce them once, after the schedule (DeepSpeed's order: tied gradients first).
Stages 2 and 3 work, at a measured price (``tests/test_pipeline.py``): stage 2
reduce-scatters each micro-batch's gradients as its backward ends, m times stage 1's
reduction bytes per step; stage 3 also all-gathers the stage's parameters for every
micro-batch's forward and again for its backward, 2m times stage 1's all-gather bytes.
A tied parameter held by several stages sits in a segment of its own, so its gradient
chunk holds the same elements on every holder: at stages 2 and 3 the reduced chunks
are summed over the holders.

Communication, per batch: the transfers of ``p2p.py`` over ``pp``; the ZeRO
reductions over the stage's data-parallel group; per tied key one all-reduce of its
gradients (stages 0/1) or of this rank's chunk of them (stages 2/3) over the stages
holding it; the norm and inf/nan flag over ``pp``
(``zero/optim/optimizer.py``); the mean loss: one all-reduce over ``dp`` on the last stage
and one broadcast over ``pp``. At start-up: per tied key, one broadcast of its weights
from the first stage holding it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zeroshard import InternalError
from zeroshard.parallel.pipeline.exec import StageRunner
from zeroshard.parallel.pipeline.module import PipelineError, PipelineModule, check_config
from zeroshard.parallel.pipeline.p2p import HEADER_LEN, StageLink, header_of
from zeroshard.parallel.pipeline.schedules import Action, build_schedule, forward_only
from zeroshard.runtime.agreement import check_ranks_agree
from zeroshard.runtime.engine import Engine
from zeroshard.zero.optim.optimizer import PipelineGrads

log = logging.getLogger("zeroshard")


class PipelineEngine(Engine):
    """A pipeline stage's engine: ``train_batch`` / ``eval_batch`` (DeepSpeed's names).
    ``forward``, ``backward`` and ``step`` are refused, as in DeepSpeed."""

    module: PipelineModule

    def __init__(self, module: PipelineModule, config, mesh, **kwargs: Any) -> None:
        check_config(module, config)
        ties = self._sync_ties(module, mesh)
        self._in_step = False
        super().__init__(module, config, mesh, **kwargs)
        pc = config.pipeline
        self.num_stages = module.num_stages
        self.stage_id = module.stage_id
        self.micro_batches = config.gradient_accumulation_steps
        if pc.activation_checkpoint_interval is not None:
            module.activation_checkpoint_interval = pc.activation_checkpoint_interval
        # zb_h1's split backward (autograd.grad, backward(inputs=)) needs torch's
        # non-reentrant checkpoints
        module.use_reentrant = pc.use_reentrant and pc.schedule != "zb_h1"
        try:
            schedule = build_schedule(
                pc.schedule, module.num_stages, self.micro_batches, module.virtual_stages
            )
        except ValueError as err:
            raise PipelineError(str(err)) from None
        self.schedule: list[Action] = schedule[self.stage_id]
        self.pipe_comm = mesh.comm("pp")
        self._ties = [(comm, [self._flat_index(p) for _, p in module.tied_parameters(key)]) for key, comm in ties]  # fmt: skip
        #: flat parameters a checkpoint leaves to another stage: tied copies after the first
        self.checkpoint_skip = {
            self._flat_index(p)
            for key, comm in ties
            if comm.rank != 0
            for _, p in module.tied_parameters(key)
        }
        assert self.optimizer is not None  # initialize() refuses a pipeline without one
        self.optimizer.pipeline = PipelineGrads(self.pipe_comm, self._excluded_pieces())
        link = None
        if module.num_stages > 1:
            link = StageLink(
                self.pipe_comm,
                self.device,
                chunks=module.num_stages * module.virtual_stages,
                tp=mesh.comm("tp"),
                pipe_partitioned=pc.pipe_partitioned,
                grad_partitioned=pc.grad_partitioned,
            )
        self.runner = StageRunner(
            stage=self.stage_id,
            stages=module.num_stages,
            chunks=module.virtual_stages,
            link=link,
            forward=lambda x, chunk: self.module(x, chunk),
            loss_fn=module.loss_fn,
            params=[p for p in self.module.parameters() if p.requires_grad],
            backward=self._stage_backward,
            device=self.device,
        )
        #: the last train_batch's actions: dicts of stage, kind, microbatch, chunk,
        #: t_start, t_end (time.perf_counter seconds)
        self.pipeline_trace: list[dict] = []
        #: the last train_batch's peak saved-activation bytes and micro-batches in flight
        self.pipeline_memory: dict[str, int] = {}
        self._data_iterator: Iterator | None = None

    # -- construction -------------------------------------------------------------------
    @staticmethod
    def _sync_ties(module: PipelineModule, mesh) -> list[tuple[str, Any]]:
        """One Comm per tie key held by several stages (every rank creates every group);
        the holders start from the first holder's values."""
        out = []
        for key, holders in sorted(module.tied_stages.items()):
            if len(holders) < 2:
                continue
            comm = mesh.pipeline_subgroup(holders, "pp_tied")
            if module.stage_id in holders:
                for _, p in module.tied_parameters(key):
                    comm.broadcast(p.data, src=0)
                out.append((key, comm))
        return out

    def _alone(self) -> frozenset:
        """Tied parameters held by several stages get a segment each, so that at ZeRO
        stages 2 and 3 a rank's gradient chunk of one holds the same elements on every
        stage holding it (summed chunk by chunk)."""
        module = self.module
        return frozenset(
            id(p)
            for key, holders in module.tied_stages.items()
            if len(holders) > 1 and module.stage_id in holders
            for _, p in module.tied_parameters(key)
        )

    def _check_agreement(self, module: nn.Module, config) -> None:
        """Config and cut over the world; parameters over each stage's ranks."""
        check_ranks_agree(self.comm, module, config, parameters=False)
        check_ranks_agree(self.mesh.comm("stage"), module, config)

    def _flat_index(self, p: torch.Tensor) -> int:
        for i, q in enumerate(self.flat.params):
            if q is p:
                return i
        raise InternalError("internal: a tied parameter is not in the flat layout")

    def _excluded_pieces(self) -> list[tuple[int, int, int]]:
        """Tied parameters' pieces in this rank's gradient chunks, left out of the norm
        unless this is the first stage holding them (and not already left out as a
        tensor-parallel replica)."""
        flat, out = self.flat, []
        tp_skip = set()
        tp = self.optimizer.tp if self.optimizer is not None else None
        if tp is not None and tp.comm.rank != 0:
            tp_skip = set(tp.replicated)
        mine = self.checkpoint_skip
        for piece in flat.layout.pieces(flat.rank):
            if piece.param in mine:
                lo = piece.shard_lo - flat.layout.segments[piece.segment].shard_start
                where = (piece.segment, lo, lo + piece.numel)
                if where not in tp_skip:
                    out.append(where)
        return out

    # -- refused per-micro-batch calls ------------------------------------------------
    def forward(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch() or engine.eval_batch()")  # fmt: skip

    def backward(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch(); it runs backward")  # fmt: skip

    def step(self, lr_kwargs: dict | None = None) -> None:
        if not self._in_step:
            raise PipelineError("a pipeline engine runs whole batches: call engine.train_batch(); it steps")  # fmt: skip
        super().step(lr_kwargs)

    # -- one batch ----------------------------------------------------------------------
    def _stage_backward(self, run) -> None:
        """A backward that accumulates parameter gradients: ZeRO's reducer hooks see it
        (stage 2 reduces its buckets now; stages 0/1 wait for the end of the batch)."""
        self.reducer.begin(False)
        self.params.begin_backward()
        try:
            run()
        except BaseException:
            self.reducer.abandon()
            raise
        finally:
            self.params.end_backward()
        self.reducer.finish()

    def _read(self, data_iter, n: int) -> tuple[list | None, list | None]:
        module = self.module
        first = module.is_first_chunk(0)
        last = module.is_last_chunk(module.virtual_stages - 1)
        if not (first or last):
            return None, None
        if data_iter is None:
            if self._data_iterator is None:
                if self.training_dataloader is None:
                    raise PipelineError(
                        "train_batch(data_iter=None) needs training_data given to "
                        "initialize() or engine.set_dataiterator(it)"
                    )
                self._data_iterator = _repeat(self.training_dataloader)
            data_iter = self._data_iterator
        inputs, labels = [], []
        for i in range(n):
            try:
                batch = next(data_iter)
            except StopIteration:
                raise PipelineError(
                    f"data_iter ran out after {i} of the {n} micro-batches of this batch"
                ) from None
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise PipelineError(
                    "data_iter must yield (inputs, labels) pairs, as DeepSpeed's pipeline "
                    f"engine reads them; got {type(batch).__name__}"
                )
            inputs.append(_to(batch[0], self.device, self.policy.compute))
            labels.append(_to(batch[1], self.device, None))
        return (inputs if first else None), (labels if last else None)

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches through
        every stage; returns the mean loss on every rank."""
        self._enter("train_batch")
        started = time.perf_counter()
        self.module.train()
        m = self.micro_batches
        inputs, labels = self._read(data_iter, m)
        if self.module.loss_fn is None and labels is not None:
            raise PipelineError("train_batch: the PipelineModule has no loss_fn")
        scale = self.loss_scaler.scale / m
        self._agree_shapes(inputs, m)
        losses, _ = self.runner.run(self.schedule, inputs, labels, train=True, loss_scale=scale)
        self.pipeline_trace = self.runner.trace
        self.pipeline_memory = {
            "peak_saved_bytes": self.runner.saved.peak,
            "peak_inflight": self.runner.peak_inflight,
        }
        self._reduce_gradients()
        if losses:
            self._loss_finite = torch.isfinite(torch.stack(losses)).all()
        # one step() below ends the window of m micro-batches (also after loading a
        # checkpoint saved with another accumulation count)
        self.micro_steps += m - 1 - self.micro_steps % m
        mean = self._mean_loss(losses)
        self.monitor.whole_batch(mean, started)  # the step line's loss and samples/s
        self._in_step = True
        try:
            self.step()
        finally:
            self._in_step = False
        return mean

    def _agree_shapes(self, inputs: list | None, m: int) -> None:
        """Every stage learns the first stage's input shapes per micro-batch: one
        broadcast over ``pp`` of ``m x 65`` int64 (see ``p2p.py``)."""
        link = self.runner.link
        if link is None:
            return
        if self.module.dynamic_shape:
            link.begin_batch(None)
            return
        sig = torch.zeros(m, HEADER_LEN, dtype=torch.int64)
        if inputs is not None and self.module.is_first_chunk(0):
            for i, x in enumerate(inputs):
                sig[i] = header_of(x)
        sig = sig.to(self.device)
        self.pipe_comm.broadcast(sig, src=0)
        link.begin_batch([tuple(row) for row in sig.cpu().tolist()])

    def _reduce_gradients(self) -> None:
        """Stages 0/1: tied copies summed over their stages, then the data-parallel
        reduction of everything (stage 2 reduced each micro-batch already)."""
        if self.reducer.sharded:  # each tied parameter's chunk: the same elements
            self.reducer.flush()  # offload: the window's sum held on the device lands
            layout = self.flat.layout
            for comm, indices in self._ties:
                for pi in indices:
                    seg = next(g for g in layout.segments if pi in g.params)
                    chunk = self.reducer.grad_chunks[seg.index]
                    if chunk.numel():
                        comm.all_reduce(chunk)
            return
        for comm, indices in self._ties:
            comm.all_reduce_many([self.reducer.local_grad(pi) for pi in indices])
        self.reducer.flush()

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean loss, averaged over data-parallel ranks, on every rank."""
        out = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses:
            out = torch.stack([x.float() for x in losses]).mean()
            self.mesh.comm("dp").all_reduce(out, op="avg")
        if self.num_stages > 1:
            self.pipe_comm.broadcast(out, src=self.num_stages - 1)
        return out

    @torch.no_grad()
    def eval_batch(
        self,
        data_iter: Iterator | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ):
        """Forward only over ``num_micro_batches`` (default: gradient_accumulation_steps)
        micro-batches; returns the mean loss on every rank (``reduce_output=None``: the
        last stage's list of losses), and with ``return_logits`` also the last stage's
        outputs (None elsewhere)."""
        self._enter("eval_batch")
        m = num_micro_batches or self.micro_batches
        was_training = self.module.training
        self.module.eval()
        try:
            inputs, labels = self._read(data_iter, m)
            if not compute_loss:
                labels = None
            self._agree_shapes(inputs, m)
            actions = forward_only(self.module.num_stages, m, self.module.virtual_stages)
            losses, outputs = self.runner.run(
                actions[self.stage_id], inputs, labels, train=False, keep_outputs=return_logits
            )
        finally:
            self.module.train(was_training)
        if reduce_output is None:
            result: Any = losses
        elif reduce_output == "avg":
            result = self._mean_loss(losses) if (compute_loss and bcast_loss) else (torch.stack(losses).mean() if losses else None)  # fmt: skip
        else:
            raise PipelineError(f"eval_batch: reduce_output {reduce_output!r}: 'avg' or None")
        if return_logits:
            return result, (outputs or None)
        return result

    def save_16bit_model(self, save_dir: str, save_filename: str = "model.safetensors") -> bool:
        if self.num_stages > 1:
            raise PipelineError(
                "save_16bit_model with pipeline stages is not built yet in zeroshard (rank 0 "
                "holds only its stage's layers): save_checkpoint(dir), then `zeroshard "
                "convert dir OUT` writes the whole model"
            )
        return super().save_16bit_model(save_dir, save_filename)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """DeepSpeed's: the iterator ``train_batch()`` / ``eval_batch()`` read when given none."""
        self._data_iterator = iterator

    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    # -- helpers for tools ------------------------------------------------------------
    def gather_pipeline_trace(self) -> list[dict]:
        """Every rank's ``pipeline_trace`` of the last batch, with its ``rank`` (every rank
        must call it: one all-gather of objects over the world)."""
        every = self.comm.all_gather_object(self.pipeline_trace)
        return [{**e, "rank": r} for r, trace in enumerate(every) for e in trace]


def _repeat(loader) -> Iterator:
    while True:
        yield from loader


def _to(obj, device: torch.device, dtype: torch.dtype | None):
    if torch.is_tensor(obj):
        obj = obj.to(device)
        if dtype is not None and obj.is_floating_point():
            obj = obj.to(dtype)
        return obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device, dtype) for o in obj)
    return obj
