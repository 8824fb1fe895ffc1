"""Start-up hook of a peers run (``make test-peers`` puts ``tests/peers`` on PYTHONPATH).

Every Python process of the run (pytest, the ranks DeepSpeed's harness forks from its
forkserver, the ``accelerate launch`` children of accelerate's tests) imports this at
start-up; with ``ZEROSHARD_AS_DEEPSPEED=1`` it makes ``import deepspeed`` give zeroshard
before transformers or accelerate look for DeepSpeed, as ``zeroshard run --as-deepspeed``
does for its workers.
"""

import os

if os.environ.get("ZEROSHARD_AS_DEEPSPEED") == "1":
    import zeroshard.as_deepspeed  # noqa: F401
