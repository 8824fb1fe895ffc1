"""DeepSpeed's op builders (``deepspeed.ops.op_builder``, ``deepspeed.ops.aio``) and the
``deepspeed.ops.__compatible_ops__`` table, answered for zeroshard. No communication.

DeepSpeed compiles C++/CUDA kernels ("ops") and code asks a builder whether one can be
built here before using the feature behind it. zeroshard compiles nothing: a builder says
whether the *feature* runs in zeroshard (CPU Adam and fused Adam are torch's fused Adam,
async I/O is the Python NVMe swapper), and ``load()``, which would hand out the compiled
extension, is refused by name.
"""

from __future__ import annotations

from zeroshard import NotBuiltError

#: builder NAME -> (what runs it in zeroshard, or None when the feature is not built)
_OPS: dict[str, tuple[str, str | None]] = {
    "CPUAdamBuilder": ("cpu_adam", "deepspeed.ops.adam.DeepSpeedCPUAdam (torch's fused Adam)"),
    "FusedAdamBuilder": ("fused_adam", "deepspeed.ops.adam.FusedAdam (torch's fused Adam)"),
    "AsyncIOBuilder": ("async_io", "NVMe offload (offload_param / offload_optimizer nvme)"),
    "FusedLambBuilder": ("fused_lamb", None),
    "CPUAdagradBuilder": ("cpu_adagrad", None),
    "CPULionBuilder": ("cpu_lion", None),
    "FusedLionBuilder": ("fused_lion", None),
    "GDSBuilder": ("gds", None),
    "QuantizerBuilder": ("quantizer", None),
    "TransformerBuilder": ("transformer", None),
    "InferenceBuilder": ("transformer_inference", None),
    "SparseAttnBuilder": ("sparse_attn", None),
    "SpatialInferenceBuilder": ("spatial_inference", None),
    "StochasticTransformerBuilder": ("stochastic_transformer", None),
    "UtilsBuilder": ("utils", None),
    "RandomLTDBuilder": ("random_ltd", None),
    "EvoformerAttnBuilder": ("evoformer_attn", None),
    "FPQuantizerBuilder": ("fp_quantizer", None),
    "RaggedOpsBuilder": ("ragged_device_ops", None),
    "RaggedUtilsBuilder": ("ragged_ops", None),
    "InferenceCoreBuilder": ("inference_core_ops", None),
    "InferenceCutlassBuilder": ("cutlass_ops", None),
}


class OpBuilder:
    """A DeepSpeed op builder: ``NAME``, ``is_compatible()``, ``load()``."""

    NAME = ""
    #: what runs this feature in zeroshard; None: the feature is not built
    PROVIDED_BY: str | None = None

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether the feature behind this op runs in zeroshard."""
        return self.PROVIDED_BY is not None

    def load(self, verbose: bool = True):
        """DeepSpeed's compiled extension; zeroshard has none."""
        if self.PROVIDED_BY is None:
            raise NotBuiltError(
                f"{type(self).__name__} ({self.NAME}): this op's feature is not built yet in "
                "zeroshard"
            )
        raise NotBuiltError(
            f"{type(self).__name__}.load(): zeroshard compiles no C++/CUDA ops; "
            f"use {self.PROVIDED_BY}"
        )

    def builder(self):
        return self.load()

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.NAME}_op"


def _make(cls_name: str, name: str, provided: str | None) -> type[OpBuilder]:
    doc = f"DeepSpeed's ``{cls_name}`` (``{name}``): " + (
        f"runs as {provided}." if provided else "not built in zeroshard."
    )
    return type(cls_name, (OpBuilder,), {"NAME": name, "PROVIDED_BY": provided, "__doc__": doc})


BUILDERS: dict[str, type[OpBuilder]] = {
    cls_name: _make(cls_name, name, provided) for cls_name, (name, provided) in _OPS.items()
}

#: ``deepspeed.ops.__compatible_ops__``: op NAME -> whether zeroshard runs its feature
COMPATIBLE_OPS: dict[str, bool] = {b.NAME: b.PROVIDED_BY is not None for b in BUILDERS.values()}


def op_builder_names() -> dict[str, object]:
    """``deepspeed.ops.op_builder``'s names."""
    return {"OpBuilder": OpBuilder, **BUILDERS, "ALL_OPS": COMPATIBLE_OPS}


def get_op_builder(class_name: str) -> type[OpBuilder] | None:
    """``get_accelerator().get_op_builder(class_name)``."""
    return BUILDERS.get(class_name)
