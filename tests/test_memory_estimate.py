"""The estimator against the ZeRO paper's formulas, seeds/004's table, and measurement."""

from __future__ import annotations

import argparse
import json

import multirank
import pytest
import torch

from zeroshard import ArgumentError
from zeroshard.monitor.memory import activation_bytes, estimate, paper_bytes

GB = 10**9


# Stage 3 keeps the parameter shard in fp32 where its optimizer states are: the shard is
# the master, so 4 + 2 + 8 bytes per parameter instead of the paper's 2 + 2 + 12.
STAGE3 = {"p": 4, "g": 2, "k": 8}


@pytest.mark.parametrize("stage", range(4))
def test_paper_formulas_7b_on_4_ranks(stage: int) -> None:
    e = estimate(7 * 10**9, 4, stage=stage, precision="bf16")
    assert e.model_states == paper_bytes(7 * 10**9, 4, stage, **(STAGE3 if stage == 3 else {}))
    assert e.model_states == [112 * GB, 49 * GB, 38.5 * GB, 24.5 * GB][stage]
    assert paper_bytes(7 * 10**9, 4, 3) == 28 * GB  # the paper's stage 3
    # stage 3 with DeepSpeed's stage3_max_reuse_distance (1e9): the 5e8 parameters
    # nearest the turn from forward to backward stay gathered, not gathered again
    gathers = 3 * 7 * 10**9 - 5 * 10**8 if stage == 3 else 2 * 7 * 10**9
    assert e.comm_bytes_per_step == 2 * gathers
    assert e.gathered == (2 * 5 * 10**8 if stage == 3 else 0)


def test_stage3_reuse_distance_and_live_cap() -> None:
    psi = 10**8
    none = estimate(psi, 4, stage=3, precision="bf16", reuse_numel=0)
    assert none.gathered == 0 and none.comm_bytes_per_step == 3 * 2 * psi  # the paper's
    whole = estimate(psi, 4, stage=3, precision="bf16")  # under 5e8: kept whole
    assert whole.gathered == 2 * psi and whole.comm_bytes_per_step == 2 * 2 * psi
    assert whole.device == none.device + 2 * psi
    capped = estimate(psi, 4, stage=3, precision="bf16", max_live_numel=psi // 4)
    assert capped.gathered == 2 * psi // 4


def test_seed_004_table_and_why_it_differs() -> None:
    """seeds/004 prints 98 / 56 / 35 / 24.5 GB per GPU for 7B on 4 GPUs: the paper's
    formula with bf16 parameters, fp32 gradients (4 bytes) and only Adam's two moments
    (8 bytes) — it leaves out the fp32 master weights (4 bytes per parameter)."""
    seed = [98, 56, 35, 24.5]
    for stage in range(4):
        assert paper_bytes(7 * 10**9, 4, stage, p=2, g=4, k=8) == seed[stage] * GB
        # ours: bf16 gradients (2 bytes less) but fp32 masters (4 bytes more) per
        # parameter; at stage 3 the fp32 shard is the master
        ours = estimate(7 * 10**9, 4, stage=stage).model_states
        mine = STAGE3 if stage == 3 else {"p": 2, "g": 2, "k": 12}
        assert ours == paper_bytes(7 * 10**9, 4, stage, **mine)


def test_offload_moves_the_optimizer_side() -> None:
    psi = 10**9
    e = estimate(psi, 2, stage=2, precision="bf16", offload="cpu")
    # masters + moments, and the gradient shard accumulated in fp32
    assert e.by_location["cpu"] == (12 + 4) * psi // 2
    e = estimate(psi, 2, stage=3, precision="bf16", offload="nvme", offload_params=True)
    assert e.by_location["nvme"] == (12 + 2) * psi // 2 and e.by_location.get("device", 0) == 0
    # with accumulation, micro-steps add up on the device in an fp32 gradient shard
    one = estimate(psi, 2, stage=2, precision="bf16", offload="cpu")
    acc = estimate(psi, 2, stage=2, precision="bf16", offload="cpu", gradient_accumulation=8)
    assert acc.by_location["device"] - one.by_location["device"] == 4 * psi // 2
    assert acc.by_location["cpu"] == one.by_location["cpu"]


def test_twin_flow_ratio_splits_the_optimizer_side() -> None:
    """offload_optimizer.ratio r: r of the masters, moments and gradient shard offloaded,
    the rest (and the gradients in the gradient dtype) on the device."""
    psi, n = 10**9, 2
    shard = psi // n
    plain = estimate(psi, n, stage=2, precision="bf16", offload="cpu")
    assert estimate(psi, n, stage=2, precision="bf16", offload="cpu", offload_ratio=1.0) == plain
    # ratio 0: everything on the device, as without offload
    none = estimate(psi, n, stage=2, precision="bf16")
    zero = estimate(psi, n, stage=2, precision="bf16", offload="cpu", offload_ratio=0.0)
    assert zero.by_location == none.by_location
    twin = estimate(psi, n, stage=2, precision="bf16", offload="cpu", offload_ratio=0.25)
    assert twin.by_location["cpu"] == (12 + 4) * shard // 4
    # 2 bytes of parameters per parameter, 3/4 of the 2-byte gradient and 12-byte states
    assert twin.by_location["device"] == 2 * psi + (2 + 12) * shard * 3 // 4 + twin.buffers
    # NVMe: the offloaded masters and moments on disk, its gradients in CPU memory
    nvme = estimate(psi, n, stage=3, precision="bf16", offload="nvme", offload_ratio=0.5)
    assert nvme.by_location["nvme"] == 12 * shard // 2 and nvme.by_location["cpu"] == 4 * shard // 2
    for offload, params_too, ratio in (("none", False, 0.5), ("cpu", True, 0.5), ("cpu", False, 1.5)):  # fmt: skip
        with pytest.raises(ArgumentError, match="offload_ratio"):
            estimate(psi, n, stage=3, offload=offload, offload_params=params_too, offload_ratio=ratio)  # fmt: skip


def test_cli_estimate_offload_ratio_rows(capsys) -> None:
    code, out = _cli(capsys, "estimate", "--params", "1e9", "--precision", "bf16", "--offload-ratio", "0.3")  # fmt: skip
    assert code == 0, out
    rows = {}
    for line in out.splitlines():
        cells = line.replace("|", " ").split()
        if len(cells) == 11 and cells[0] == "bf16":
            rows[int(cells[1]), cells[2]] = [float(c) for c in cells[3:]]
    assert (2, "cpu0.3") in rows and (2, "cpu") not in rows, rows
    e = estimate(10**9, stage=2, precision="bf16", offload="cpu", offload_ratio=0.3)
    assert rows[2, "cpu0.3"][6] == round(e.by_location["cpu"] / 2**30, 2)  # the cpu column
    assert "cpu0.3: offload_optimizer.ratio 0.3 (Twin-Flow)" in out


def _measure(rank: int, world: int, stage: int) -> dict:
    import zeroshard
    from zeroshard.models import GPT, GPTConfig

    cfg = GPTConfig.preset("small", seq_len=64)
    torch.manual_seed(0)
    model = GPT(cfg)
    bucket = 50_000
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
    }
    psi = sum(p.numel() for p in model.parameters())
    own = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    persistent = sum(p.numel() for p in model.parameters() if p.numel() < 100_000)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    ids = torch.randint(0, 256, (1, 65))
    engine.backward(engine(ids[:, :-1], ids[:, 1:]))
    engine.step()
    m = engine.memory_stats()
    e = estimate(
        psi,
        world,
        stage=stage,
        precision="fp32",
        bucket_numel=bucket,
        largest_unit=own if stage == 3 else 0,
        persistent_numel=persistent if stage == 3 else 0,
        p2p_reduce=True,  # gloo
    )
    return {
        "measured": m["params"] + m["grads"] + m["optimizer_states"],
        "estimated": e.model_states + e.buffers,
    }


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_estimate_matches_memory_stats(world: int, subtests: pytest.Subtests) -> None:
    for stage in range(4):  # a spawn per stage, each checked on its own
        with subtests.test(case=f"stage{stage}"):
            for r in multirank.run(_measure, world, stage, timeout=300):
                assert abs(r["measured"] - r["estimated"]) <= 0.05 * r["measured"], (
                    world,
                    stage,
                    r,
                )


def _peak_activation_bytes(cfg, policy: str, batch: int) -> int:
    """Measured peak minus model states: the most bytes of tensors created during
    forward + backward that are alive at once (saved for backward, live activations,
    gradients in flight), with the parameters and their gradient buffers excluded."""
    from zeroshard.checkpointing import apply_activation_checkpointing
    from zeroshard.models import GPT, Block
    from zeroshard.monitor.memory import ActivationTracker

    torch.manual_seed(0)
    model = GPT(cfg)
    if policy != "none":
        apply_activation_checkpointing(model, Block, policy)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # the engine's gradient buffers: model states
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    states = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    with ActivationTracker(exclude=[*states, x, y]) as tracker:
        model(x, y).backward()
    return tracker.peak


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_activation_estimate_within_15_percent(policy: str, tied: bool) -> None:
    from zeroshard.models import GPTConfig

    cfg = GPTConfig.preset("small", seq_len=256, tie_embeddings=tied)
    measured = _peak_activation_bytes(cfg, policy, batch=2)
    est = activation_bytes(
        layers=cfg.n_layer,
        hidden=cfg.d_model,
        seq=256,
        micro_batch=2,
        vocab=cfg.vocab_size,
        policy=policy,
        tied_embeddings=tied,
    )
    print(policy, tied, measured, est)
    assert abs(measured - est) <= 0.15 * measured, (policy, measured, est)


# -- the CLI ------------------------------------------------------------------------------
def _cli(capsys, *argv: str) -> tuple[int, str]:
    from zeroshard.tools.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().out


def test_cli_estimate_7b_on_4_ranks_prints_the_paper_figures(capsys) -> None:
    code, out = _cli(capsys, "estimate", "--params", "7e9", "--nproc", "4")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("7,000,000,000 parameters on 4 data-parallel ranks")
    # one unit: the paper's 112 / 49 / 38.5 / 28 GB (10^9 bytes) in GiB, as the table
    assert lines[1].endswith(
        "GiB per rank: stage 0 16Ψ = 104.31, stage 1 4Ψ+12Ψ/N = 45.63, "
        "stage 2 2Ψ+14Ψ/N = 35.86, stage 3 16Ψ/N = 26.08"
    )
    assert " GB" not in out
    assert lines[2].startswith("activations: not included: a parameter count")
    rows = {}
    for line in lines:
        cells = line.replace("|", " ").split()
        if len(cells) == 11 and cells[0] in ("fp32", "bf16", "fp16"):
            rows[cells[0], int(cells[1]), cells[2]] = [float(c) for c in cells[3:]]
    assert len(rows) == 3 * 10  # 3 precisions x (stage 0 + 3 stages x 3 offloads)
    # stage 3 in mixed precision: the fp32 shard is the master, 14Ψ/N (the paper: 16Ψ/N)
    paper = {"bf16": [112, 49, 38.5, 24.5], "fp16": [112, 49, 38.5, 24.5]}
    paper["fp32"] = [112, 70, 49, 28]  # 4 + 4 + 8 bytes: 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N
    for prec, figures in paper.items():
        for stage, gb in enumerate(figures):
            states = rows[prec, stage, "none"][3]  # GiB
            assert states == round(gb * GB / 2**30, 2), (prec, stage, states)
    # bf16 stage 2: 2Ψ parameters, 2Ψ/4 gradients, 12Ψ/4 optimizer states
    assert rows["bf16", 2, "none"][:3] == [round(b * GB / 2**30, 2) for b in (14, 3.5, 21)]
    # offloaded: the optimizer side and the gradient shard (accumulated in fp32 on the
    # host: 4Ψ/4) leave the device
    assert rows["bf16", 2, "cpu"][6] == round((7 + 21) * GB / 2**30, 2)


def test_cli_plan_picks_least_communication_that_fits(capsys) -> None:
    code, out = _cli(
        capsys, "plan", "--params", "7e9", "--nproc", "4", "--device-memory", "40GB",
        "--precision", "bf16",
    )  # fmt: skip
    assert code == 0, out
    lines = _plan_lines(out)
    assert lines["activations"].startswith("activations: not included")
    # stage 0/1 need 112 / 49 GB; stage 2 needs 38.5 GB + two 25 MiB staging buckets
    # (zeroshard's default bucket) and exchanges 2 x 2Ψ bytes per step, stage 3 3 x 2Ψ
    assert lines["plan"] == (
        "plan: stage 2, offload none: 35.90 GiB on the device of 37.25 (35.86 model states, "
        "0.00 activations), 26.08 GiB exchanged per step"
    )
    assert lines["why"].startswith("why: it fits, exchanges as few bytes as any layout that fits")
    # the runner-up keeps all but the smallest Twin-Flow share of the optimizer on the
    # device: 0.05 of it (and of the gradient shard) offloaded
    assert lines["runner-up"].startswith(
        "runner-up: stage 2, offload cpu (ratio 0.05: Twin-Flow): 34.76 GiB"
    )
    # DeepSpeed's 5e8-element bucket, double-buffered: 2 GB more, and stage 2 no longer fits
    code, out = _cli(
        capsys, "plan", "--params", "7e9", "--nproc", "4", "--device-memory", "40GB",
        "--precision", "bf16", "--bucket", "5e8",
    )  # fmt: skip
    assert code == 0 and _plan_lines(out)["plan"].startswith("plan: stage 2, offload cpu"), out
    code, out = _cli(
        capsys, "plan", "--params", "7e9", "--nproc", "4", "--device-memory", "10GB",
        "--precision", "bf16",
    )  # fmt: skip
    assert code == 0 and "plan: stage 3, offload none: 26.08" not in out
    # the smallest Twin-Flow ratio that fits: 0.8 of the optimizer offloaded, the rest
    # and the parameter shard on the device; then everything offloaded
    lines = _plan_lines(out)
    assert lines["plan"].startswith("plan: stage 3, offload cpu (ratio 0.8: Twin-Flow): 8.75"), out
    assert lines["runner-up"].startswith("runner-up: stage 3, offload cpu: 4.19"), out


def _plan_lines(out: str) -> dict[str, str]:
    """`zeroshard plan`'s lines by their first word (the assumptions' activation line
    under "activations")."""
    lines: dict[str, str] = {}
    for line in out.splitlines():
        word = line.strip().split(":", 1)[0]
        if word.startswith("activations"):
            word = "activations"
        lines.setdefault(word, line.strip())
    return lines


def _pasted_config(out: str) -> dict:
    """The JSON block `zeroshard plan` ends with, as a user would copy it."""
    lines = out.splitlines()
    start = lines.index("ds_config.json for this plan:") + 1
    end = lines.index("}", start) + 1
    return json.loads("\n".join(lines[start:end]))


@pytest.mark.parametrize(
    ("argv", "plan", "world"),
    [
        (["--params", "7e9", "--nproc", "4", "--device-memory", "40GB"], (2, "none"), 4),
        (["--params", "7e9", "--nproc", "4", "--device-memory", "10GB"], (3, "cpu", 0.8), 4),
        (["--params", "7e9", "--nproc", "4", "--device-memory", "5GB"], (3, "cpu"), 4),
        (
            ["--params", "7e9", "--nproc", "4", "--device-memory", "10GB", "--cpu-memory", "10GB"],
            (3, "nvme"),
            4,
        ),
        (
            [
                "--model",
                "25M",
                "--seq",
                "512",
                "--micro-batch",
                "4",
                "--nproc",
                "4",
                "--device-memory",
                "24GiB",
                "--precision",
                "fp16",
                "--tp",
                "2",
                "--megatron-sp",
                "--bucket",
                "1e6",
            ],
            (2, "none"),
            4,
        ),
    ],
)
def test_cli_plan_states_its_assumptions_and_prints_a_config_that_loads(
    capsys, argv: list[str], plan: tuple, world: int
) -> None:
    from zeroshard.config import load_config

    code, out = _cli(capsys, "plan", *argv)
    assert code == 0, out
    lines = _plan_lines(out)
    precision = argv[argv.index("--precision") + 1] if "--precision" in argv else "bf16"
    assert lines["precision"].startswith(f"precision: {precision} (--precision"), out
    assert lines["optimizer"].startswith("optimizer: Adam/AdamW, fp32 master weights"), out
    for word in ("model", "ranks", "micro-batch", "gradient bucket", "memory", "activations"):
        assert word in lines, (word, out)
    stage, offload, *twin = plan
    ratio = twin[0] if twin else 1.0
    said = f" (ratio {ratio:g}: Twin-Flow)" if twin else ""
    assert lines["plan"].startswith(f"plan: stage {stage}, offload {offload}{said}:"), out
    pasted = _pasted_config(out)
    cfg = load_config(pasted, world_size=world)  # the loader DeepSpeed users' configs meet
    assert cfg.zero_optimization.stage == stage
    assert cfg.zero_optimization.offload_optimizer.device == offload
    assert cfg.zero_optimization.offload_optimizer.ratio == ratio
    assert cfg.zero_optimization.offload_param.device == ("nvme" if offload == "nvme" else "none")
    assert cfg.bf16.enabled == (precision == "bf16") and cfg.fp16.enabled == (precision == "fp16")
    assert cfg.train_micro_batch_size_per_gpu == (4 if "--micro-batch" in argv else 1)
    if "--tp" in argv:
        assert cfg.tensor_parallel.size == 2 and cfg.tensor_parallel.sequence_parallel
        assert cfg.zero_optimization.reduce_bucket_size == 10**6
    assert not cfg.inert, cfg.inert  # nothing pasted that means nothing here


def test_cli_model_not_a_preset_lists_the_presets(capsys) -> None:
    from zeroshard.models import preset_names

    for command in (["estimate"], ["plan", "--device-memory", "80GB"]):
        with pytest.raises(SystemExit) as info:
            _cli(capsys, *command, "--model", "7B", "--nproc", "4")
        message = str(info.value)
        assert message.startswith("--model '7B': not a GPT preset (")
        assert all(name in message for name in preset_names())
        assert message.endswith("for a parameter count use --params 7e9")
    with pytest.raises(SystemExit, match="cannot import it: No module named 'no_such_pkg'"):
        _cli(capsys, "estimate", "--model", "no_such_pkg:build")


def test_cli_activations_for_models(capsys, tmp_path, monkeypatch) -> None:
    (tmp_path / "zs_user_models.py").write_text(
        "import torch\n"
        "from zeroshard.models import GPT, GPTConfig\n"
        "def gpt():\n    return GPT(GPTConfig.preset('small', seq_len=256))\n"
        "def mlp():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    expected = activation_bytes(
        layers=4, hidden=128, seq=256, micro_batch=2, vocab=256, policy="full", dtype_bytes=2
    )
    for spec in ("small", "zs_user_models:gpt"):
        args = ("--model", spec, "--seq", "256", "--micro-batch", "2", "--checkpointing", "full")
        code, out = _cli(capsys, "estimate", *args, "--precision", "bf16")
        assert code == 0
        line = f"checkpointing full): {expected / 2**30:.2f} GiB"
        assert line in out.splitlines()[2], out
        code, out = _cli(capsys, "plan", *args, "--device-memory", "24GiB")
        assert f"{expected / 2**30:.2f} activations" in out
    code, out = _cli(capsys, "estimate", "--model", "zs_user_models:mlp", "--seq", "256")
    assert code == 0
    assert "activations: not included: zs_user_models:mlp builds a Sequential" in out


def test_tensor_and_sequence_parallel_estimates() -> None:
    psi = 8 * 10**9
    base = estimate(psi, 8, stage=2, precision="bf16")
    tp = estimate(psi, 8, stage=2, precision="bf16", tp=2, tp_activation_numel=10**6)
    # parameters split by tp; ZeRO over the other 4 ranks; the TP all-reduces' traffic
    assert tp.params == base.params // 2
    assert tp.optimizer_states == round(12 * (psi / 2) / 4)
    assert tp.comm_bytes_per_step == 2 * 2 * psi // 2 + 8 * 2 * 10**6
    sp = estimate(psi, 8, stage=3, precision="bf16", sp=2)  # ZeRO shards over dp x sp
    assert sp.model_states == estimate(psi, 8, stage=3, precision="bf16").model_states
    with pytest.raises(ValueError, match="must divide"):
        estimate(psi, 6, stage=1, tp=4)


def test_host_peak_of_nvme_offload_on_a_cpu_only_host() -> None:
    """The host side of stage 3 with parameters and optimizer in swap files: RAM holds
    the fp32 gradient shard, the swap buffers and the units at work; disk 16 bytes per
    parameter (fp32 parameter file, master, two moments). Each part is the config's."""
    from zeroshard.monitor.host_memory import RANK_BASELINE, SwapTuning, host_peak
    from zeroshard.tools.estimate import facts_from_args

    facts = facts_from_args(argparse.Namespace(model="3B", params=None, seq=32))
    psi, unit = facts["params"], facts["largest_unit"]
    assert psi >= 3e9 and unit == 4 * 2560 * 2560 + 4 * 2560  # the MLP's first Linear
    e = estimate(psi, 1, stage=3, precision="fp32", offload="nvme", offload_params=True,
                 largest_unit=unit, reuse_numel=0)  # fmt: skip
    swap = SwapTuning(sub_group_numel=20_000_000, pipelined=True, param_buffers=5)
    h = host_peak(e, params=psi, ranks=1, cpu_only=True, largest_unit=unit, swap=swap)
    assert h.disk == 16 * psi
    assert h.parts == {
        "baseline": RANK_BASELINE,
        "cpu": 4 * psi,  # the gradient shard, fp32
        "optimizer swap buffers": 2 * 3 * 4 * 20_000_000,
        "parameter swap buffers": 5 * 4 * unit,
        "device": 2 * 4 * unit,  # two gradient staging buckets of the largest unit
        "gathered units": 4 * unit * 3,  # computing + two prefetched (5e7 elements)
        "unit gradients": 4 * unit,
    }
    assert h.train_rss == sum(h.parts.values()) and h.rss == h.train_rss
    assert h.build_rss == RANK_BASELINE + 4 * psi + 8 * unit < h.train_rss
    assert h.rss < 15 * 2**30  # what issue 31's 3B run on the 24 GiB machine may use
    # not pipelined: one set of sub-group buffers; 2 ranks: half the shard each, and
    # every rank gathers whole units
    flat = host_peak(e, params=psi, ranks=1, cpu_only=True, largest_unit=unit,
                     swap=SwapTuning(sub_group_numel=20_000_000))  # fmt: skip
    assert flat.parts["optimizer swap buffers"] == 3 * 4 * 20_000_000
    e2 = estimate(psi, 2, stage=3, precision="fp32", offload="nvme", offload_params=True,
                  largest_unit=unit, reuse_numel=0)  # fmt: skip
    h2 = host_peak(e2, params=psi, ranks=2, cpu_only=True, largest_unit=unit, swap=swap)
    assert h2.parts["cpu"] == 4 * e2.shard_numel and h2.total_disk == pytest.approx(16 * psi, 1e-6)
    assert h2.parts["gathered units"] == h.parts["gathered units"]
    assert h2.total_rss > h.total_rss  # two ranks duplicate what is not sharded
    # on a GPU host the device's part is not RSS, and zero.Init builds on the device
    gpu = host_peak(e, params=psi, ranks=1, cpu_only=False, largest_unit=unit, swap=swap)
    assert "device" not in gpu.parts and gpu.build_rss == 0


def test_plan_for_issue_31s_cpu_machine_proposes_the_3b_nvme_run(capsys) -> None:
    """This project's machine: 2 cores, 23.5 GiB RAM of which the run may use 15 GiB,
    ~70 GB of disk. In memory a 3B model needs 47 GiB: the plan is stage 3 with both
    sides in swap files, one rank (nothing duplicated, no communication), each unit
    freed after its forward, and the buffers the estimate assumed, in a config that
    loads with nothing inert."""
    from zeroshard.config import load_config

    argv = ["--model", "3B", "--precision", "fp32", "--seq", "32", "--cpu-only",
            "--host-memory", "15GiB", "--disk", "70GB", "--nvme-path", "/nvme"]  # fmt: skip
    code, out = _cli(capsys, "plan", *argv)
    assert code == 0, out
    lines = _plan_lines(out)
    assert lines["plan"].startswith(
        "plan: stage 3, offload nvme, each unit freed after its forward: CPU-only"
    ), out
    rss = float(lines["plan"].split("peak RSS ")[1].split(" GiB")[0])
    swap = float(lines["plan"].split("swap files ")[1].split(" GiB")[0])
    assert 12 < rss < 15 and swap == round(16 * 3_148_375_040 / 2**30, 2), lines["plan"]
    pasted = _pasted_config(out)
    zc = pasted["zero_optimization"]
    assert zc["sub_group_size"] == 20_000_000 and zc["stage3_max_reuse_distance"] == 0
    assert zc["offload_param"] == {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 5}
    cfg = load_config(pasted, world_size=1)
    opt = cfg.zero_optimization.offload_optimizer
    assert opt.device == "nvme" and opt.pipeline_read and opt.pipeline_write
    assert not cfg.inert, cfg.inert
    # 10 GiB of RAM cannot hold the 11.7 GiB gradient shard; 40 GB of disk not the files
    for limits in (["--host-memory", "10GiB", "--disk", "70GB"],
                   ["--host-memory", "15GiB", "--disk", "40GB"]):  # fmt: skip
        code, out = _cli(capsys, "plan", *argv[:7], *limits)
        assert code == 1 and "nothing fits" in out, out


def test_cli_estimate_host_columns_are_the_host_estimate(capsys) -> None:
    """`zeroshard estimate --cpu-only` adds each layout's peak RSS per rank, for the
    node's ranks and its swap files: those of ``host_peak`` with the buffers given."""
    from zeroshard.monitor.host_memory import SwapTuning, host_peak
    from zeroshard.tools.estimate import facts_from_args

    code, out = _cli(
        capsys, "estimate", "--model", "3B", "--precision", "fp32", "--nproc", "2",
        "--cpu-only", "--reuse-distance", "0", "--sub-group-size", "2e7", "--pipeline",
    )  # fmt: skip
    assert code == 0, out
    row = next(r for r in out.splitlines() if r.startswith("fp32          3    nvme"))
    rss, node, swap = (float(x) for x in row.split("|")[3].split())
    facts = facts_from_args(argparse.Namespace(model="3B", params=None, seq=0))
    e = estimate(facts["params"], 2, stage=3, precision="fp32", offload="nvme",
                 offload_params=True, largest_unit=facts["largest_unit"], reuse_numel=0)  # fmt: skip
    h = host_peak(e, params=facts["params"], ranks=2, cpu_only=True,
                  largest_unit=facts["largest_unit"], largest_param=facts["largest_param"],
                  swap=SwapTuning(sub_group_numel=20_000_000, pipelined=True))  # fmt: skip
    assert (rss, node, swap) == tuple(
        round(x / 2**30, 2) for x in (h.rss, h.total_rss, h.total_disk)
    )
    assert "CPU-only: the device's bytes are in RAM too" in out
