"""Generate ``lr_schedules_reference.json`` from DeepSpeed's own LR schedules.

Not run by the test suite (it needs DeepSpeed).  Regenerate with, e.g.::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed   # fixture made with deepspeed 0.19.8
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python tests/data/make_lr_reference.py

Each case records the optimizer's param-group values after construction (index 0: the
lr in effect for the very first optimizer step) and after each of ``steps`` calls to
``scheduler.step(arg)`` (``step_args`` gives explicit arguments; ``None`` = plain step()).
"""

import json
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from deepspeed.runtime import lr_schedules

STEPS = 300

CASES = [
    # ---- WarmupLR
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    (
        "WarmupLR",
        {
            "warmup_min_lr": 1e-5,
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 10,
            "warmup_type": "linear",
        },
    ),
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 1}),
    ("WarmupLR", {"warmup_max_lr": 3e-4, "warmup_num_steps": 1, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_max_lr": 3e-4, "warmup_num_steps": 2, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 100, "warmup_type": "cosine"}),
    ("WarmupLR", {}),  # defaults: max = optimizer lr, 1000 log steps
    (
        "WarmupLR",
        {"warmup_min_lr": [1e-6, 2e-6], "warmup_max_lr": [1e-3, 5e-4], "warmup_num_steps": 50},
        {"groups": [0.1, 0.2]},
    ),
    ("WarmupLR", {"warmup_num_steps": 20, "warmup_type": "linear"}, {"groups": [0.1, 0.05]}),
    (
        "WarmupLR",
        {"warmup_max_lr": 0.02, "warmup_num_steps": 100, "last_batch_iteration": 49},
        {"groups": [0.123]},
    ),
    # ---- WarmupDecayLR
    ("WarmupDecayLR", {"total_num_steps": 300, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 200,
            "warmup_min_lr": 1e-5,
            "warmup_max_lr": 2e-3,
            "warmup_num_steps": 50,
            "warmup_type": "linear",
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 100,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 1,
            "warmup_type": "linear",
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 100, "warmup_max_lr": 1e-3, "warmup_num_steps": 1}),
    (
        "WarmupDecayLR",
        {
            "total_num_steps": 50,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 50,
            "warmup_type": "linear",
        },
    ),
    ("WarmupDecayLR", {"total_num_steps": 250}),  # defaults: max 0.001, 1000 log steps
    (
        "WarmupDecayLR",
        {"total_num_steps": 120, "warmup_max_lr": 1e-3, "warmup_num_steps": 20},
        {"step_args": [None, None, 5, 17, 3, 100, 119, 120, 400, None, None, 0, None]},
    ),
    # ---- WarmupCosineLR
    ("WarmupCosineLR", {"total_num_steps": 300, "warmup_num_steps": 10}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 200,
            "warmup_num_steps": 20,
            "warmup_type": "linear",
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
        },
        {"groups": [3e-4, 1e-3]},
    ),
    ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10}),
    ("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 1, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 1, "warmup_min_ratio": 0.2}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 30, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 250}),  # defaults
    # ---- OneCycle
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 50}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 40,
            "cycle_second_step_size": 80,
            "decay_lr_rate": 0.5,
            "decay_step_size": 10,
            "decay_mom_rate": 0.01,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 60,
            "cycle_second_step_size": 30,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 3,
            "decay_lr_rate": 0.1,
            "decay_step_size": 7,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 33,
            "cycle_second_step_size": 70,
            "cycle_first_stair_count": 5,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 25,
            "cycle_momentum": False,
            "decay_lr_rate": 0.2,
            "decay_step_size": 5,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 100,
            "cycle_second_step_size": 0,
            "decay_lr_rate": 0.3,
            "decay_step_size": 20,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 30,
            "decay_lr_rate": 0.3,
            "decay_step_size": 0,
            "decay_mom_rate": 0.1,
        },
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": [1e-3, 4e-3],
            "cycle_first_step_size": 45,
            "cycle_min_mom": [0.85, 0.8],
            "cycle_max_mom": [0.95, 0.9],
            "decay_lr_rate": 0.05,
            "decay_step_size": 3,
        },
        {"groups": [0.1, 0.2]},
    ),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2}),  # defaults: 2000-step halves
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-3,
            "cycle_first_step_size": 50,
            "decay_lr_rate": 0.1,
            "decay_step_size": 10,
        },
        {"step_args": [None, 10, 49, 50, 99, 100, 150, None, 0]},
    ),
    # DeepSpeed disables momentum cycling for optimizers without betas: lr only.
    (
        "OneCycle",
        {
            "cycle_min_lr": 1e-3,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 20,
            "decay_lr_rate": 0.5,
            "decay_step_size": 4,
        },
        {"optimizer": "sgd"},
    ),
    # ---- LRRangeTest
    ("LRRangeTest", {}),
    ("LRRangeTest", {"lr_range_test_step_size": 10, "lr_range_test_step_rate": 0.5}),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-4,
            "lr_range_test_step_size": 10,
            "lr_range_test_step_rate": 2.0,
            "lr_range_test_staircase": True,
        },
    ),
    (
        "LRRangeTest",
        {
            "lr_range_test_min_lr": [1e-5, 3e-5],
            "lr_range_test_step_size": 7,
            "lr_range_test_staircase": True,
        },
        {"groups": [0.1, 0.2]},
    ),
]


def make_optimizer(kind, group_lrs):
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in group_lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=group_lrs[0], momentum=0.9)
    return torch.optim.Adam(groups, lr=group_lrs[0], betas=(0.9, 0.999))


def snapshot(optimizer, kind, type_name):
    point: dict[str, list] = {"lr": [float(g["lr"]) for g in optimizer.param_groups]}
    if kind == "adam" and type_name == "OneCycle":  # only OneCycle touches betas
        point["betas"] = [[float(b) for b in g["betas"]] for g in optimizer.param_groups]
    return point


def run_case(type_name, params, opts):
    kind = opts.get("optimizer", "adam")
    group_lrs = opts.get("groups", [0.05])
    optimizer = make_optimizer(kind, group_lrs)
    sched = getattr(lr_schedules, type_name)(optimizer, **params)
    step_args = opts.get("step_args", [None] * STEPS)
    points = [snapshot(optimizer, kind, type_name)]
    for arg in step_args:
        sched.step() if arg is None else sched.step(arg)
        points.append(snapshot(optimizer, kind, type_name))
    return {
        "type": type_name,
        "params": params,
        "optimizer": kind,
        "group_lrs": group_lrs,
        "step_args": opts.get("step_args"),  # None: STEPS plain step() calls
        "lr": [p["lr"] for p in points],
        "betas": [p["betas"] for p in points] if "betas" in points[0] else None,
        "state_dict": sched.state_dict(),
    }


def main():
    cases = [run_case(c[0], c[1], c[2] if len(c) > 2 else {}) for c in CASES]
    out = Path(__file__).with_name("lr_schedules_reference.json")
    header = json.dumps(
        {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__}
    )
    body = ",\n".join(json.dumps(case, separators=(",", ":")) for case in cases)
    out.write_text(header[:-1] + ', "cases": [\n' + body + "\n]}\n")
    print(f"wrote {len(cases)} cases to {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
