"""What ``initialize`` does to a model with experts: find the expert-parallel size (for
the mesh), bind DeepSpeed ``MoE`` layers to the mesh's ``ep`` group, and, with the
config's ``expert_parallel`` section, convert Hugging Face sparse blocks in place
(``hf.py``). Issues no collectives itself (the engine broadcasts expert parameters over
the expert-data-parallel group; the layers exchange tokens in training).
"""

from __future__ import annotations

from torch import nn

from zeroshard import NotBuiltError
from zeroshard.moe.errors import ExpertParallelError
from zeroshard.moe.grouped import default_way
from zeroshard.moe.hf import convert_sparse_blocks
from zeroshard.moe.layer import MOELayer


def _layers(model: nn.Module) -> list[MOELayer]:
    return [m for m in model.modules() if isinstance(m, MOELayer)]


def expert_parallel_size(model: nn.Module, config) -> int:
    """The mesh's ``ep``: the ``ep_size`` of the model's ``MoE`` layers (all equal), or
    ``expert_parallel.autoep_size`` when ``expert_parallel.enabled``; both must agree."""
    sizes = {m.ep_size for m in _layers(model)}
    if len(sizes) > 1:
        raise ExpertParallelError(
            f"MoE(ep_size=...): the model's MoE layers use different ep_size values "
            f"{sorted(sizes)}; one expert-parallel size per model is built"
        )
    section = config.expert_parallel
    if section.enabled:
        if sizes and sizes != {section.autoep_size}:
            raise ExpertParallelError(
                f"expert_parallel.autoep_size ({section.autoep_size}) differs from the "
                f"model's MoE layers' ep_size ({sizes.pop()})"
            )
        return int(section.autoep_size)
    return sizes.pop() if sizes else 1


def check_composition(ep: int, config) -> None:
    """Combinations with expert parallelism that are not built, refused by name."""
    if ep == 1:
        return
    if config.sequence_parallel_size > 1:
        raise NotBuiltError(
            "sequence_parallel_size with expert parallelism (MoE ep_size > 1) is not built "
            "yet; use one of them"
        )
    if config.use_data_before_expert_parallelism:
        raise NotBuiltError(
            "use_data_before_expert_parallelism: true is not built; zeroshard places the "
            "ranks of an expert-parallel group next to each other (DeepSpeed's default)"
        )


def bind_layers(model: nn.Module, mesh) -> int:
    """Bind every DeepSpeed ``MoE`` layer of ``model`` to the mesh's ``ep`` group (its
    experts become this rank's global experts); returns how many."""
    layers = _layers(model)
    if layers:
        comm = mesh.comm("ep")
        for layer in layers:
            layer.bind(comm)
    return len(layers)


def convert_hf(model: nn.Module, mesh, config) -> list[str]:
    """With ``expert_parallel.enabled``: the transformers sparse blocks' experts split
    over the ``ep`` group (``hf.py``); returns the converted modules' names."""
    section = config.expert_parallel
    if not section.enabled:
        return []
    way = default_way() if section.use_grouped_mm else "loop"
    return convert_sparse_blocks(model, mesh.comm("ep"), section.preset_model, way)
