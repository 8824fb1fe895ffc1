"""pytest plugin of a peers run (``-p peers_plugin``): what the peers' suites need to run
on a CPU-only host, and nothing that changes what a test checks.

* The in-process DeepSpeed tests of transformers and accelerate are marked
  ``require_torch_accelerator`` / ``require_non_cpu`` because DeepSpeed needs a GPU;
  zeroshard runs them on the CPU (gloo), so those two markers are lifted. For the same
  reason accelerate's ``require_multi_device`` is lifted: it asks for more than one
  accelerator because each rank of its two-process tests needs a device of its own; here
  each rank is a CPU process (``accelerate launch --num_processes=2`` still starts two).
  Every other marker (``slow``, fp16 / bf16 support, optional packages) stays; the
  runner turns accelerate's ``slow`` tests on (``RUN_SLOW=1``).
* transformers' ``TrainingArguments(bf16=True)`` asks for a bf16 *GPU* unless ``use_cpu``
  (which turns DeepSpeed off in accelerate); the CPU computes bf16, so the plugin answers
  that bf16 is available.
* ``import deepspeed`` gives zeroshard in this process (``sitecustomize`` does it in every
  process when ``ZEROSHARD_AS_DEEPSPEED=1``); registering here too makes a run without the
  start-up hook fail loudly rather than skip everything as "deepspeed not installed".
"""

from __future__ import annotations

import contextlib
import os


def _identity(test_case):
    return test_case


def _true() -> bool:
    return True


def pytest_configure(config) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("ZEROSHARD_ACCELERATOR", "cpu")
    import zeroshard.as_deepspeed  # noqa: F401  (before transformers / accelerate)

    with contextlib.suppress(ImportError):
        import transformers.testing_utils as tu
        import transformers.training_args as ta

        setattr(tu, "require_torch_accelerator", _identity)  # noqa: B010
        setattr(ta, "is_torch_bf16_gpu_available", _true)  # noqa: B010
    with contextlib.suppress(ImportError):
        import accelerate.test_utils as atu
        import accelerate.test_utils.testing as att

        for name in ("require_non_cpu", "require_multi_device"):
            setattr(att, name, _identity)
            setattr(atu, name, _identity)
