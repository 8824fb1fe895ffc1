"""DeepSpeed-MoE's layer: ``MoE(hidden_size, expert, num_experts, ep_size, k, ...)``
returning ``(output, l_aux, exp_counts)``, with DeepSpeed's module structure and
parameter names (``deepspeed_moe.gate.wg``, ``deepspeed_moe.experts.deepspeed_experts.{i}``,
``mlp`` and ``coefficient`` for a residual MoE), so checkpoints and user code that walk
them keep working.

Each rank builds its ``num_experts / ep_size`` local experts (copies of ``expert``, as
DeepSpeed). ``zeroshard.initialize`` binds the layer to the mesh's ``ep`` group (its
expert-parallel rank decides which global experts the local ones are); before that, a
layer with ``ep_size`` 1 runs on its own, one with more needs the engine.

Communication in forward: the token exchange of ``dispatch.py`` over the ``ep`` axis
(and its reverse in backward); nothing with ``ep_size`` 1.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard import NotBuiltError, UsageError
from zeroshard.distributed.comm import Comm
from zeroshard.moe import gating
from zeroshard.moe.dispatch import run_experts
from zeroshard.moe.errors import ExpertParallelError
from zeroshard.moe.grouped import padded_slots, vmap_experts
from zeroshard.moe.marks import EXPERT_LIST_ATTR, ExpertShard, mark_expert

log = logging.getLogger("zeroshard")

_NOISY = (None, "None", "Jitter", "RSample")


class Experts(nn.Module):
    """This rank's experts (``deepspeed_experts``, copies of one module), run together:
    the rows of every expert in one padded block through ``torch.func.vmap`` of the
    expert over the experts' stacked parameters (one batched matmul per ``Linear``), or
    one call per expert with ``grouped = False``. A stage-3 leaf module: its experts are
    gathered together (every rank runs all of its experts every step)."""

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name
        self.grouped = True
        self._z3_leaf = True
        setattr(self, EXPERT_LIST_ATTR, "deepspeed_experts")

    def mark(self, shard: ExpertShard) -> None:
        for p in self.deepspeed_experts.parameters():
            mark_expert(p, shard, self.expert_group_name)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's layout: ``inputs`` ``[..., local experts, capacity, model]``
        chunked along dim 1 (``[groups, local, capacity, model]``), one chunk per expert."""
        g, e, c, m = inputs.shape[0], inputs.shape[1], inputs.shape[2], inputs.shape[-1]
        block = inputs.reshape(g, e, c, m).transpose(0, 1).reshape(e, g * c, m)
        out = self._block(block)
        return out.reshape(e, g, c, -1).transpose(0, 1)

    def rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by local expert (``counts[e]`` each) through their experts."""
        if not self.grouped:
            parts = [
                _first(expert(part))
                for expert, part in zip(self.deepspeed_experts, x.split(counts), strict=True)
            ]
            return torch.cat(parts)
        slots, most = padded_slots(counts, x.device)
        block = x.new_zeros(len(counts) * most, x.shape[-1]).index_copy(0, slots, x)
        # explicit widths: a rank whose experts got no rows has most == 0
        out = self._block(block.view(len(counts), most, x.shape[-1]))
        return out.reshape(len(counts) * most, out.shape[-1]).index_select(0, slots)

    def _block(self, block: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            try:
                return vmap_experts(self.deepspeed_experts, block)
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                log.warning(
                    "zeroshard MoE: the expert module %s does not run under torch.func.vmap "
                    "(%s); running its experts one by one",
                    type(self.deepspeed_experts[0]).__name__,
                    exc,
                )
                self.grouped = False
        outs = [
            _first(expert(part)) for expert, part in zip(self.deepspeed_experts, block, strict=True)
        ]
        return torch.stack(outs)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


class TopKGate(nn.Module):
    """The router: ``wg`` (``Linear(model_dim, num_experts, bias=False)``) and DeepSpeed's
    top-k gating (``gating.py``), in fp32."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group=None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_group is not None:
            raise ExpertParallelError(
                "TopKGate(ep_group=...): zeroshard.initialize binds the expert-parallel group"
            )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> gating.Routes:
        xf = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            xf = gating.multiplicative_jitter(xf)
        logits = F.linear(xf, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            noisy = self.noisy_gate_policy if self.training else None
            return gating.top1(
                logits, factor, self.min_capacity, used_token, noisy, self.drop_tokens, self.use_rts
            )
        if used_token is not None:
            raise ExpertParallelError(
                f"MoE(k={self.k}): used_token masks tokens for top-1 gating only (DeepSpeed's rule)"
            )
        if self.k == 2:
            return gating.top2(
                logits, factor, self.min_capacity, self.drop_tokens, self.top2_2nd_expert_sampling
            )
        return gating.topk(logits, self.k, factor, self.min_capacity, self.drop_tokens)


class MOELayer(nn.Module):
    """Gate, token exchange, experts, combine (GShard's Algorithm 2). After a forward,
    ``l_aux`` and ``exp_counts`` hold the gate's load-balancing loss and per-expert route
    counts, ``capacity`` the per-expert capacity applied (None: no drops), and
    ``rows_sent`` / ``rows_received`` the rows this rank exchanged (``dispatch.py``)."""

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        if use_tutel:
            raise NotBuiltError(
                "MoE(use_tutel=True): Tutel's kernels are not built in zeroshard; leave "
                "use_tutel False (the experts run as one grouped matmul already)"
            )
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size = ep_group_name, ep_size
        self.num_local_experts = num_local_experts
        self.num_experts = ep_size * num_local_experts
        self.ep_comm: Comm | None = None
        self.ep_rank = 0
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        self.capacity: int | None = None
        #: rows (routed token copies) this rank sent and received in the last forward
        self.rows_sent = self.rows_received = 0
        experts.mark(ExpertShard(num_experts=self.num_experts, ep=ep_size, ep_rank=0))

    def bind(self, comm: Comm) -> None:
        """Join the expert-parallel group ``comm`` (of ``ep_size`` ranks): the local
        experts become global experts ``[rank * local, (rank + 1) * local)``."""
        if comm.world_size != self.ep_size:
            raise ExpertParallelError(
                f"MoE(ep_size={self.ep_size}): the mesh's expert-parallel group has "
                f"{comm.world_size} ranks"
            )
        self.ep_comm, self.ep_rank = comm, comm.rank
        self.experts.mark(
            ExpertShard(num_experts=self.num_experts, ep=self.ep_size, ep_rank=comm.rank)
        )

    def forward(self, *inputs: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_comm is None:
            raise UsageError(
                f"MoE(ep_size={self.ep_size}): the layer is not bound to an expert-parallel "
                "group; wrap the model with zeroshard.initialize (or deepspeed.initialize) "
                "before running it"
            )
        x = inputs[0]
        used_token = inputs[1] if len(inputs) > 1 else kwargs.get("used_token")
        tokens = x.reshape(-1, x.shape[-1])
        routes = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts, self.capacity = (
            routes.l_aux,
            routes.exp_counts,
            routes.capacity,
        )
        comm = self.ep_comm if self.ep_size > 1 else None
        out, plan = run_experts(tokens, routes.experts, self.num_experts, comm, self.experts.rows)
        self.rows_sent, self.rows_received = sum(plan.sent), sum(plan.received)
        # routes summed in fp32 (the gate's dtype), then cast back (as DeepSpeed)
        combined = (out.float() * routes.weights.unsqueeze(-1)).sum(1).to(x.dtype)
        return combined.reshape(x.shape)


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``; every argument as DeepSpeed documents it.

    Args:
        hidden_size: the model dimension (input and output of the layer).
        expert: the expert module (``[..., hidden] -> [..., hidden]``); each rank holds
            ``num_experts / ep_size`` copies of it.
        num_experts: experts of the layer, over all ranks.
        ep_size: expert-parallel ranks; the mesh's ``ep`` axis (``initialize`` reads it
            from the model; every MoE layer must agree).
        k: experts per token (1, 2, or more: DeepSpeed's top-k gating).
        capacity_factor, eval_capacity_factor: tokens an expert takes, as a multiple of
            an even share, in training and in evaluation.
        min_capacity: the least capacity per expert.
        use_residual: Residual MoE: the output mixes the experts' and ``expert``'s own
            (a dense MLP) by a learned 2-way softmax (``coefficient``).
        noisy_gate_policy: ``"Jitter"`` (multiplicative input noise, training) or
            ``"RSample"`` (Gumbel noise on the logits for the top-1 choice, training).
        drop_tokens: drop tokens over capacity (False: none dropped, at any capacity).
        use_rts: random token selection when a top-1 expert drops tokens (DeepSpeed's
            rule: with k >= 2 tokens are dropped by position or gate value instead).
        use_tutel: refused (Tutel is not built).
        enable_expert_tensor_parallelism: refused (experts split by tensor parallelism
            are not built; with ``tensor_parallel.autotp_size`` the experts stay whole
            and the dense layers around them are split).
        top2_2nd_expert_sampling: sample the second of two experts (Gumbel-max).

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        _check_arguments(
            num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity
        )
        if noisy_gate_policy not in _NOISY:
            raise ExpertParallelError(
                f"MoE(noisy_gate_policy={noisy_gate_policy!r}): expected None, 'Jitter' or 'RSample'"
            )
        if noisy_gate_policy == "RSample" and k != 1:
            raise ExpertParallelError(
                f"MoE(noisy_gate_policy='RSample', k={k}): Gumbel noise picks the top-1 "
                "expert only (DeepSpeed's gating); use 'Jitter' or k=1"
            )
        if enable_expert_tensor_parallelism:
            raise NotBuiltError(
                "MoE(enable_expert_tensor_parallelism=True): experts split by tensor "
                "parallelism are not built yet; leave it False (with "
                "tensor_parallel.autotp_size the experts stay whole and the dense layers "
                "around them are split)"
            )
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(
            gate,
            experts,
            self.expert_group_name,
            ep_size,
            self.num_local_experts,
            use_tutel=use_tutel,
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed's engine calls this to create the expert groups; zeroshard's
        ``initialize`` binds them from its mesh. After that this checks the binding;
        before, it is refused (there is no group to join yet)."""
        if use_data_before_expert_parallel_:
            raise NotBuiltError(
                "MoE.set_deepspeed_parallelism(use_data_before_expert_parallel_=True): only "
                "DeepSpeed's default rank order (expert-parallel ranks adjacent) is built"
            )
        if self.ep_size > 1 and self.deepspeed_moe.ep_comm is None:
            raise UsageError(
                "MoE.set_deepspeed_parallelism: zeroshard.initialize binds the "
                "expert-parallel group from its mesh; pass the model to initialize()"
            )

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = _first(self.mlp(hidden_states))
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        moe = self.deepspeed_moe
        assert moe.l_aux is not None and moe.exp_counts is not None  # set by its forward
        return output, moe.l_aux, moe.exp_counts


def _check_arguments(
    num_experts: int,
    ep_size: int,
    k: int,
    capacity_factor: float,
    eval_capacity_factor: float,
    min_capacity: int,
) -> None:
    for name, value in (("num_experts", num_experts), ("ep_size", ep_size), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExpertParallelError(f"MoE({name}={value!r}): expected a whole number >= 1")
    if num_experts % ep_size:
        raise ExpertParallelError(
            f"MoE: num_experts ({num_experts}) must be divisible by ep_size ({ep_size})"
        )
    if k > num_experts:
        raise ExpertParallelError(
            f"MoE(k={k}): more experts per token than num_experts ({num_experts})"
        )
    factors: tuple[tuple[str, float], ...] = (
        ("capacity_factor", capacity_factor),
        ("eval_capacity_factor", eval_capacity_factor),
    )
    for name, factor in factors:
        if not factor > 0:
            raise ExpertParallelError(f"MoE({name}={factor!r}): expected a number > 0")
    if not isinstance(min_capacity, int) or min_capacity < 0:
        raise ExpertParallelError(
            f"MoE(min_capacity={min_capacity!r}): expected a whole number >= 0"
        )
