"""The DeepSpeed-compatible config: :func:`load_config` reads a dict or a JSON file into a
frozen, validated :class:`Config` (``training.py``), whose sections are defined in
``sections.py``, ``monitors.py``, ``parallel.py`` and ``features.py`` with the schema of
``schema.py``; ``jsonc.py`` reads JSON with comments. ``python -m zeroshard.config``
prints the table of every key. No collectives, no devices.
"""

from zeroshard.config.training import (
    DEFAULT_LEAF_CLASSES,
    DTYPES,
    OFFLOAD_DEVICES,
    OPTIMIZER_TYPES,
    SCHEDULER_TYPES,
    ActivationCheckpointingConfig,
    AIOConfig,
    BF16Config,
    CheckpointConfig,
    Config,
    ConfigError,
    DataTypesConfig,
    FP16Config,
    LeafModuleConfig,
    OffloadConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
    load_config,
    read_config,
    read_config_file,
    read_section,
    resolve_batch_sizes,
    schema_table,
)

__all__ = [
    "DEFAULT_LEAF_CLASSES",
    "DTYPES",
    "OFFLOAD_DEVICES",
    "OPTIMIZER_TYPES",
    "SCHEDULER_TYPES",
    "AIOConfig",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "LeafModuleConfig",
    "OffloadConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
    "load_config",
    "read_config",
    "read_config_file",
    "read_section",
    "resolve_batch_sizes",
    "schema_table",
]
