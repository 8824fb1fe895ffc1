"""The DeepSpeed names transformers and accelerate reach for, and zeroshard's answers.

``NAMES`` was taken from a grep of the installed transformers 5.x and accelerate 1.x
(``deepspeed.<a>.<b>`` chains and ``from deepspeed.<m> import <n>``, comments left out);
``test_grep_finds_nothing_else`` re-runs that grep so that a new release that calls
something else fails here. Each name must resolve through the alias (in a subprocess:
the alias must be registered before transformers is imported, and must not leak into
other tests). No ranks are spawned.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

# module-level names the integrations call (the engine's methods: test_hf_engine.py)
NAMES = [
    "deepspeed.__version__",
    "deepspeed.initialize",
    "deepspeed.init_distributed",
    "deepspeed.tp_model_init",
    "deepspeed.DeepSpeedEngine",
    "deepspeed.runtime.engine.DeepSpeedEngine",
    "deepspeed.comm.get_rank",
    "deepspeed.comm.get_world_size",
    "deepspeed.comm.is_initialized",
    "deepspeed.comm.init_distributed",
    "deepspeed.comm.all_reduce",
    "deepspeed.comm.broadcast",
    "deepspeed.comm.barrier",
    "deepspeed.accelerator.get_accelerator",
    "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "deepspeed.ops.adam.FusedAdam",
    "deepspeed.zero.Init",
    "deepspeed.zero.GatheredParameters",
    "deepspeed.zero.register_external_parameter",
    "deepspeed.runtime.zero.GatheredParameters",
    "deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor",
    "deepspeed.runtime.zero.partition_parameters._orig_torch_arange",
    "deepspeed.runtime.zero.partition_parameters.get_accelerator",
    "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES",
    "deepspeed.utils.set_z3_leaf_modules",
    "deepspeed.utils.logger",
    "deepspeed.utils.is_initialized",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME",
]

# what the grep also finds, and why it is not a module-level name zeroshard serves
EXCLUDED = {
    "deepspeed.runtime.sequence_parallel": "DeepSpeed's ALST/Ulysses for HF models: not built "
    "(importing it raises ImportError saying so)",
    "deepspeed.utils.groups": "sequence-parallel groups of ALST: not built",
    "deepspeed.runtime.utils.move_to_device": "only in accelerate's ALST test script",
    "deepspeed.ops.adagrad": "DeepSpeed's CPU Adagrad: not built (ImportError)",
    "deepspeed.ops.lion": "DeepSpeed's CPU Lion: not built (ImportError)",
    "deepspeed.HfDeepSpeedConfig": "a docstring",
    "deepspeed.ai": "a URL",
    "deepspeed.config.get": "engine.config (Trainer's self.deepspeed is the engine)",
    "deepspeed._zero3_consolidated_16bit_state_dict": "an engine method (self.deepspeed)",
}

_SPEC = importlib.util.find_spec("transformers")
assert _SPEC is not None and _SPEC.origin is not None
_SITE = pathlib.Path(_SPEC.origin).parent.parent


def _grep() -> set[str]:
    chain = re.compile(r"\bdeepspeed((?:\.[A-Za-z_]\w*)+)")
    from_import = re.compile(r"^\s*from (deepspeed(?:\.\w+)*) import \(?([\w, ]+)", re.M)
    found: set[str] = set()
    for pkg in ("transformers", "accelerate"):
        for path in (_SITE / pkg).rglob("*.py"):
            text = path.read_text(errors="ignore")
            if "deepspeed" not in text:
                continue
            for m in from_import.finditer(text):
                for n in m.group(2).split(","):
                    n = n.strip().split(" as ")[0]
                    if n:
                        found.add(f"{m.group(1)}.{n}")
            for line in text.splitlines():
                if not line.strip().startswith("#"):
                    found.update("deepspeed" + m.group(1) for m in chain.finditer(line))
    return found


def _covered(name: str) -> bool:
    known = [*NAMES, *EXCLUDED]
    return any(k == name or k.startswith(name + ".") or name.startswith(k + ".") for k in known)


def test_grep_finds_nothing_else() -> None:
    missing = sorted(n for n in _grep() if not _covered(n))
    assert not missing, f"transformers/accelerate call DeepSpeed names not listed here: {missing}"


TESTS = str(pathlib.Path(__file__).resolve().parent)

_RESOLVE = """
import importlib, json, sys
import zeroshard.as_deepspeed
sys.path.insert(0, sys.argv[-1])  # tests/, for alias_names
from alias_names import unresolved
bad = unresolved(json.loads(sys.argv[1]))
import importlib.metadata, deepspeed, zeroshard
assert importlib.metadata.version("deepspeed") == deepspeed.__version__
assert deepspeed.zero.Init is zeroshard.zero.Init
assert deepspeed.DeepSpeedEngine is zeroshard.DeepSpeedEngine
for mod in ("deepspeed.ops.lion", "deepspeed.runtime.sequence_parallel.ulysses_sp"):
    try:
        importlib.import_module(mod)
        bad.append(f"{mod} imported")
    except ImportError as e:
        assert "not built yet in zeroshard" in str(e), e
print(json.dumps(bad))
"""


def test_every_name_resolves_through_the_alias() -> None:
    import json

    out = subprocess.run(
        [sys.executable, "-c", _RESOLVE, json.dumps(NAMES), TESTS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_zeroshard_names_without_the_alias() -> None:
    import torch

    import zeroshard

    assert zeroshard.comm.get_world_size() >= 1 and zeroshard.comm.get_rank() >= 0
    assert zeroshard.accelerator.get_accelerator().device_name() in ("cpu", "cuda")
    from zeroshard.ops.adam import DeepSpeedCPUAdam, FusedAdam

    p = torch.nn.Parameter(torch.ones(3))
    for cls in (DeepSpeedCPUAdam, FusedAdam):
        opt = cls([p], lr=0.1, weight_decay=0.1)
        assert isinstance(opt, torch.optim.Adam) and opt.defaults["decoupled_weight_decay"]
        p.grad = torch.ones(3)
        opt.step()
    zeroshard.zero.register_external_parameter(torch.nn.Linear(1, 1), p)
    assert zeroshard.utils.set_z3_leaf_modules is not None
    assert zeroshard.DeepSpeedEngine.__name__ == "Engine"


_REFUSE = """
import sys, types, importlib.machinery
fake = types.ModuleType("deepspeed")
fake.__file__ = "/site-packages/deepspeed/__init__.py"
sys.modules["deepspeed"] = fake  # a real DeepSpeed already imported
from zeroshard.compat.deepspeed_alias import AliasError, register
try:
    register()
except AliasError as e:
    print("refused:", e)
del sys.modules["deepspeed"]
import transformers.integrations.deepspeed  # decides "no DeepSpeed" now
try:
    register()
except AliasError as e:
    print("late:", e)
"""


def test_alias_refuses_to_shadow_or_come_late() -> None:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_REFUSE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: zeroshard.as_deepspeed: a real DeepSpeed is installed" in out.stdout
    assert "late: zeroshard.as_deepspeed: transformers.integrations.deepspeed was" in out.stdout


@pytest.mark.parametrize("flag", ["--as-deepspeed"])
def test_launcher_flag_parses(flag: str) -> None:
    import argparse

    from zeroshard.tools.launch.launcher import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([flag, "x.py"]).as_deepspeed
