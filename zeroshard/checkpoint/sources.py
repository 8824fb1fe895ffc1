"""What a weights path holds, for ``zeroshard generate`` and ``zeroshard convert``.

A path is one of:

* a zeroshard checkpoint: a tag directory (``manifest.json``), or a directory whose
  ``latest`` names one. A Hugging Face Trainer's ``checkpoint-N/`` saved under zeroshard
  (``--as-deepspeed``) is such a directory, with the Trainer's files beside it.
* safetensors weights: a file, or a folder as ``save_pretrained``,
  ``Trainer.save_model`` or ``zeroshard convert`` write it (``model.safetensors``, or
  shards listed by ``model.safetensors.index.json``). The model's config is in the
  files' header (``zeroshard_model``: zeroshard's exports) or in ``config.json`` beside
  them (Hugging Face). A Trainer's ``checkpoint-N/`` without zeroshard is such a folder
  plus ``optimizer.pt``, ``trainer_state.json``, ... (pickles, never read).

Anything else is refused in one line naming what is missing (weights, a config, a
tokenizer) and what is there instead (``.bin`` / ``.pt`` pickles, DeepSpeed's own
checkpoint format). Reads directory listings, file headers and JSON only; no
collectives.
"""

from __future__ import annotations

import json
import os
from typing import Any

from zeroshard.checkpoint.format import CheckpointError
from zeroshard.checkpoint.model_config import HF_CLASS, ModelConfigError

MANIFEST, LATEST = "manifest.json", "latest"
SINGLE, INDEX, CONFIG = "model.safetensors", "model.safetensors.index.json", "config.json"
#: files any one of which means a folder holds a Hugging Face tokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _listing(path: str) -> str:
    names = sorted(os.listdir(path))
    return f"[{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}]" if names else "nothing"


def _latest_tag(path: str) -> str | None:
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        return None
    with open(latest, encoding="utf-8", errors="replace") as f:
        return f.read(4096).strip() or None


def is_zeroshard_checkpoint(path: str) -> bool:
    """``path`` is a tag directory, or ``latest`` in it names one (with its manifest)."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return True
    tag = _latest_tag(path)
    return tag is not None and os.path.isfile(os.path.join(path, tag, MANIFEST))


def is_checkpoint(path: str) -> bool:
    """Read ``path`` as a zeroshard checkpoint (else as safetensors weights). A folder
    with ``latest`` whose tag has no manifest is one (damaged: the checkpoint reader
    names what is wrong), unless Hugging Face weights lie beside it (a Trainer
    checkpoint whose ``latest`` is DeepSpeed's own, pickled)."""
    if not os.path.isdir(path):
        return False
    if is_zeroshard_checkpoint(path):
        return True
    if not os.path.exists(os.path.join(path, LATEST)):
        return False
    return not any(os.path.isfile(os.path.join(path, n)) for n in (SINGLE, INDEX))


def checkpoint_tags(path: str) -> list[str]:
    """Subdirectories of ``path`` that are zeroshard tag directories (for a hint)."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n, MANIFEST)))


def _safetensors_file(path: str) -> None:
    """Refuse a file that is not safetensors, naming it (``--checkpoint ds_config.json``)."""
    with open(path, "rb") as f:
        head = f.read(9)
    size = os.path.getsize(path)
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if n < 2 or n > size - 8 or head[8:9] != b"{":
        kind = "a JSON file" if head[:1] in (b"{", b"[") else "not a safetensors file"
        raise CheckpointError(
            f"{path}: {kind}, not weights; give a zeroshard checkpoint directory, a "
            f".safetensors file, or a folder saved by save_pretrained / zeroshard convert"
        )


def safetensors_files(path: str) -> list[str]:
    """The safetensors files at ``path`` (a file, or a folder with ``model.safetensors``
    or an index of shards); a :class:`CheckpointError` naming what is missing else."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory")
    if os.path.isfile(path):
        _safetensors_file(path)
        return [path]
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: unreadable index ({exc})") from exc
        files = [os.path.join(path, n) for n in names]
        absent = [n for n, f in zip(names, files, strict=True) if not os.path.isfile(f)]
        if absent:
            raise CheckpointError(f"{index}: lists {absent[0]}, which is missing from {path}")
        return files
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(_no_weights(path))


def _no_weights(path: str) -> str:
    """Why folder ``path`` has no weights zeroshard reads, in one line."""
    names = os.listdir(path)
    pickles = sorted(n for n in names if n.endswith(_PICKLES))
    tag = _latest_tag(path)
    if tag is not None and os.path.isdir(os.path.join(path, tag)):
        return (
            f"{path}: 'latest' names {tag}, which has no {MANIFEST}: DeepSpeed's own "
            "checkpoint format (pickled), which zeroshard never loads; and no model.safetensors "
            "beside it (Trainer.save_model writes one)"
        )
    tags = checkpoint_tags(path)
    if tags:
        return f"{path}: holds zeroshard checkpoints {tags[:5]} but no 'latest' naming one"
    what = "has config.json but no weights" if CONFIG in names else "has no weights"
    loose = sorted(n for n in names if n.endswith(".safetensors"))
    if loose:
        found = f"{_listing(path)}: give one of its .safetensors files itself"
    elif pickles:
        found = (
            f"only {pickles[:3]} (pickles: never loaded; save with "
            "save_pretrained(safe_serialization=True) or convert a zeroshard checkpoint)"
        )
    else:
        found = _listing(path)
    return (
        f"{path}: {what} zeroshard reads (no {SINGLE}, no {INDEX}, no zeroshard "
        f"checkpoint): it holds {found}"
    )


def hf_config(path: str) -> dict[str, Any] | None:
    """``config.json`` of the folder at ``path`` (or beside the file), or None."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    config = os.path.join(folder, CONFIG)
    if not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{config}: unreadable ({exc})") from exc
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelConfigError(f"{config}: not a Hugging Face model config (no model_type)")
    return data


def hf_description(path: str) -> dict[str, Any] | None:
    """The model description (``model_config.build_model``'s) from ``config.json``."""
    config = hf_config(path)
    return None if config is None else {"class": HF_CLASS, "config": config}


def no_model_config(path: str) -> ModelConfigError:
    """The error for weights without a model config (neither recorded nor config.json)."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)) or "."
    return ModelConfigError(
        f"{path}: no model config: the weights record none (zeroshard_model) and {folder} has "
        "no config.json; put the model's config.json beside them (save_pretrained writes "
        "it), or build the model yourself and load them with "
        "zeroshard.init_inference(model, checkpoint=...)"
    )


def tokenizer_folder(path: str) -> str | None:
    """The folder at (or of) ``path`` if it holds tokenizer files, else None."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if any(os.path.isfile(os.path.join(folder, n)) for n in TOKENIZER_FILES):
        return folder
    return None


def no_tokenizer(path: str) -> str:
    """One line: ``path`` has no tokenizer files; where one may be (the Trainer's
    output_dir above a checkpoint-N folder)."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    parent = os.path.dirname(os.path.abspath(folder))
    near = f" ({parent} has one: --tokenizer {parent})" if tokenizer_folder(parent) else ""
    return (
        f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...) for this Hugging "
        f"Face model; pass --tokenizer DIR, a folder tokenizer.save_pretrained() wrote{near}"
    )
