"""Shared pipeline parity harness: a tiny tied-embedding model as a PipelineModule,
trained by zeroshard's pipeline engine on N ranks and by plain single-process PyTorch on
the same micro-batches (fp32). A case is a dict: stages, schedule, virtual, dp, tp, zero,
gas (micro-batches), steps, clip, tied, layers, dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, SEQ, MICRO = 32, 16, 6, 2
TOL = 2e-5


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def logits(embedding: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    return x @ embedding.weight.t()


def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1))


def specs(case: dict) -> list:
    from zeroshard.pipe import LayerSpec, TiedLayerSpec

    n = case.get("layers", 8)
    out: list = [TiedLayerSpec("embed", nn.Embedding, VOCAB, D)]
    out += [LayerSpec(Block, D) for _ in range(n)]
    if case.get("tied", True):
        out.append(TiedLayerSpec("embed", nn.Embedding, VOCAB, D, forward_fn=logits))
    else:
        out.append(LayerSpec(nn.Linear, D, VOCAB, bias=False))
    return out


def build(case: dict, stages: int, stage_id: int | None = None):
    from zeroshard.pipe import PipelineModule

    return PipelineModule(
        specs(case),
        num_stages=stages,
        loss_fn=loss_fn,
        seed_layers=True,
        partition_method=case.get("partition", "uniform"),
        virtual_stages=case.get("virtual", 1),
        activation_checkpoint_interval=case.get("ckpt", 0),
        stage_id=stage_id,
        dynamic_shape=case.get("dynamic", False),
    )


def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of step ``step`` (over all data-parallel ranks); variable
    sequence length when ``index`` is odd."""
    g = torch.Generator().manual_seed(1000 * step + index)
    seq = SEQ + (index % 2)
    ids = torch.randint(0, VOCAB, (MICRO, seq), generator=g)
    labels = torch.randint(0, VOCAB, (MICRO, seq), generator=g)
    return ids, labels


def config(case: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": case.get("gas", 4),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "gradient_clipping": case.get("clip", 0.0),
        "zero_optimization": {"stage": case.get("zero", 1)},
        "pipeline": {
            "schedule": case.get("schedule", "1f1b"),
            "pipe_partitioned": case.get("partitioned", True),
            "grad_partitioned": case.get("partitioned", True),
        },
    }
    if case.get("print"):
        cfg["steps_per_print"] = 1
    if case.get("offload"):
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if case.get("dtype") in ("bf16", "fp16"):
        cfg[case["dtype"]] = {"enabled": True}
    if case.get("zero", 1) == 3:  # release every parameter after use, however small
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        cfg["zero_optimization"]["stage3_model_persistence_threshold"] = 0
        cfg["zero_optimization"]["reduce_bucket_size"] = 64
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 64
    if "reuse" in case:  # stage3_max_reuse_distance (0: freed after each forward too)
        cfg["zero_optimization"]["stage3_max_reuse_distance"] = case["reuse"]
    if case.get("cfg_ckpt"):  # the config's interval overrides the module's
        cfg["pipeline"]["activation_checkpoint_interval"] = case["cfg_ckpt"]
    if case.get("tp", 1) > 1:
        cfg["tensor_parallel"] = {
            "autotp_size": case["tp"],
            "tp_plan": {"*.fc1": "column", "*.fc2": "row", "tied_modules.*": "replicate"},
        }
    return cfg


def reference(case: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: the whole model in one process, every micro-batch of every
    data-parallel rank, mean loss; AdamW; clipping as configured."""
    torch.manual_seed(0)
    model = build({**case, "virtual": 1}, 1, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    n = case.get("gas", 4) * case.get("dp", 1)
    losses = []
    for step in range(case.get("steps", 3)):
        opt.zero_grad()
        total = 0.0
        for i in range(n):
            ids, labels = batch(step, i)
            loss = loss_fn(model(ids), labels) / n
            loss.backward()
            total += float(loss.detach())
        if case.get("clip", 0.0):
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_eval(case: dict, state: dict[str, torch.Tensor]) -> float:
    """The reference model with ``state``: mean loss over eval micro-batches of every
    data-parallel rank."""
    model = build({**case, "virtual": 1}, 1, 0)
    model.load_state_dict(state)
    n = case.get("gas", 4) * case.get("dp", 1)
    with torch.no_grad():
        return sum(float(loss_fn(model(b[0]), b[1])) for b in (batch(99, i) for i in range(n))) / n


def train(rank: int, world: int, case: dict) -> dict:
    """One rank of the pipeline run; returns its losses and the max difference of its
    stage's parameters (gathered whole over tensor parallelism) to the reference."""
    import zeroshard
    from zeroshard.parallel.pipeline.engine import PipelineEngine

    torch.manual_seed(0)
    model = build(case, case["stages"])
    engine, *_ = zeroshard.initialize(model=model, config=config(case))
    assert isinstance(engine, PipelineEngine)
    dp = engine.mesh.coord("dp")
    gas = case.get("gas", 4)
    losses = []
    poison = None
    if case.get("poison") and engine.stage_id == 0:  # an inf gradient on stage 0 only
        p = next(engine.module.parameters())
        poison = p.register_hook(lambda g: g * float("inf"))
    gathered = []  # all-gather bytes over the ZeRO group after each step

    def all_gather_bytes() -> int:
        ops = engine.comm_stats(by_axis=True).get("zero_shard", {})
        return ops.get("all_gather", {}).get("bytes", 0)

    for step in range(case.get("steps", 3)):
        mine = iter([batch(step, dp * gas + i) for i in range(gas)])
        losses.append(float(engine.train_batch(mine)))
        gathered.append(all_gather_bytes())
    if poison is not None:
        poison.remove()
    evaluated = float(engine.eval_batch(iter([batch(99, dp * gas + i) for i in range(gas)])))
    ref_losses, ref = reference({**case, "steps": 0} if case.get("poison") else case)
    ref_eval = reference_eval(case, ref)
    worst = 0.0
    with zeroshard.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3
        for name, p in engine.module.named_parameters():
            whole = gather_whole(engine, name, p)
            worst = max(worst, float((whole - ref[name]).abs().max()))
    out = {
        "losses": losses if not case.get("poison") else [],
        "ref_losses": ref_losses,
        "eval": evaluated,
        "ref_eval": ref_eval,
        "skipped": engine.skipped_steps,
        "gathered": gathered,
        "headers": _headers(engine),
        "step_line_loss": getattr(engine.monitor.summary(), "loss", None),
        "param_diff": worst,
        "memory": engine.pipeline_memory,
        "trace": len(engine.pipeline_trace),
        "stage": engine.stage_id,
        "comm": engine.comm_stats(by_axis=True).get("pp", {}),
        "comm_by_axis": engine.comm_stats(by_axis=True),
    }
    engine.destroy()
    return out


def gather_whole(engine, name: str, p: torch.Tensor) -> torch.Tensor:
    """``p`` whole: tensor-parallel slices gathered over the stage's tp group."""
    from zeroshard.parallel.tensor.slices import assemble, tp_slice_of

    spec = tp_slice_of(p)
    if spec is None:
        return p.detach().float().cpu()
    pieces = engine.mesh.comm("tp").all_gather_object(p.detach().float().cpu())
    return assemble(pieces, spec)


def _headers(engine) -> list[int]:
    link = engine.runner.link
    return [link.headers_sent, link.headers_received] if link is not None else [0, 0]


def train_many(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Several cases in one spawn (each its own engine)."""
    return [train(rank, world, case) for case in cases]


def _steps(engine, case: dict, start: int, n: int) -> list[float]:
    gas = engine.gradient_accumulation_steps()
    dp = engine.mesh.coord("dp")
    out = []
    for step in range(start, start + n):
        mine = iter([batch(step, dp * gas + i) for i in range(gas)])
        out.append(float(engine.train_batch(mine)))
    return out


def _engine(case: dict):
    import zeroshard

    torch.manual_seed(0)
    return zeroshard.initialize(model=build(case, case["stages"]), config=config(case))[0]


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: gather_whole(engine, n, p) for n, p in engine.module.named_parameters()}


def checkpoint_roundtrip(rank: int, world: int, root: str, zero: int) -> dict:
    """On 2 ranks: pp2 trains 2 steps and saves; pp1 x dp2 loads it and trains a third
    step, as pp2 does; pp1 saves; pp2 loads that and trains a fourth, as pp1 does.
    Returns the losses of each continuation and the largest parameter difference."""
    pp2 = {"stages": 2, "gas": 4, "zero": zero, "clip": 0.5}
    pp1 = {"stages": 1, "gas": 2, "zero": zero, "clip": 0.5, "dp": 2}
    a = _engine(pp2)
    _steps(a, pp2, 0, 2)
    a.save_checkpoint(f"{root}/a", tag="two")
    exported = []
    if rank == 0:  # `zeroshard convert`: every stage's tensors, the tied one once
        from zeroshard.checkpoint.export import open_checkpoint

        exported = sorted(e[0] for e in open_checkpoint(f"{root}/a/two")[0])
    a_third = _steps(a, pp2, 2, 2)
    a_params = _params(a)
    a.destroy()
    b = _engine(pp1)
    b.load_checkpoint(f"{root}/a", tag="two")
    b_third = _steps(b, pp1, 2, 1)
    b.save_checkpoint(f"{root}/b", tag="three")
    b_fourth = _steps(b, pp1, 3, 1)
    b_params = _params(b)
    b.destroy()
    c = _engine(pp2)
    c.load_checkpoint(f"{root}/b", tag="three")
    c_fourth = _steps(c, pp2, 3, 1)
    c_params = _params(c)
    c.destroy()
    ab = {n: float((p - b_params[n]).abs().max()) for n, p in a_params.items()}
    cb = {n: float((p - b_params[n]).abs().max()) for n, p in c_params.items()}
    diff = max(max(ab.values()), max(cb.values()))
    return {
        "a": a_third,
        "b": b_third + b_fourth,
        "c": c_fourth,
        "param_diff": diff,
        "ab": ab,
        "cb": cb,
        "exported": exported,
        "names": sorted(b_params),
    }
