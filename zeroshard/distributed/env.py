"""The environment variables zeroshard reads in one layer and sets in another (the
launcher sets them for its workers; tests and benchmarks set some). Names only: each
module that reads one says what it means. No imports, no communication.
"""

ACCELERATOR_ENV = "ZEROSHARD_ACCELERATOR"  # cpu | cuda: where ranks compute (process_group.py)
TIMEOUT_ENV = "ZEROSHARD_COMM_TIMEOUT"  # seconds before the watchdog reports a hang
STAGE_ON_CPU_ENV = "ZEROSHARD_STAGE_ON_CPU"  # CPU runs take the GPU's offload bookkeeping
LAUNCHER_PID_ENV = "ZEROSHARD_LAUNCHER_PID"  # workers die with this process
RUN_DIR_ENV = "ZEROSHARD_RUN_DIR"  # where preempted workers leave their markers
AS_DEEPSPEED_ENV = "ZEROSHARD_AS_DEEPSPEED"  # 1: `import deepspeed` gives zeroshard
