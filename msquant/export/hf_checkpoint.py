"""Pieces shared by exporters that write a Hugging Face checkpoint folder (GPTQ, compressed-tensors).

A Hugging Face checkpoint is ``model.safetensors`` (or ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json``), ``config.json`` carrying a ``quantization_config``, and the
tokenizer / generation files copied from the source model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.export.files import copy_model_files
from msquant.export.shards import ShardedSafetensorsWriter

__all__ = [
    "HF_WEIGHTS_PREFIX",
    "GIB",
    "hf_weights_writer",
    "unique_state_items",
    "write_hf_config",
]

HF_WEIGHTS_PREFIX = "model"
GIB = 1024**3


def hf_weights_writer(
    directory: Path, part_file_size_gib: int, rename: Callable[[str], str] | None = None
) -> ShardedSafetensorsWriter:
    """A writer producing ``model.safetensors`` (size 0) or ``model-*-of-*.safetensors`` + index.

    :param rename: model name -> name stored on disk (:meth:`msquant.plugin.RunContext.disk_name`), so
        that the checkpoint uses the original model's names; names are stored as given when None.
    """
    limit = part_file_size_gib * GIB if part_file_size_gib else None
    return ShardedSafetensorsWriter(directory, HF_WEIGHTS_PREFIX, limit, rename=rename)


def unique_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict with tied tensors kept once, under their first name.

    Hugging Face saves tied weights once (``model.embed_tokens.weight``, not ``lm_head.weight``) and
    re-ties them on load from ``tie_word_embeddings``.
    Tensors on the meta device (the released layers of a streamed run, already written) have no
    storage to compare and are all kept.
    """
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            yield name, tensor
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        yield name, tensor


def write_hf_config(
    model_path: Path,
    output_dir: Path,
    quantization_config: Mapping[str, Any],
    extra_json: Mapping[str, Mapping[str, Any]] | None = None,
    config_updates: Mapping[str, Any] | None = None,
) -> list[str]:
    """Copy the model's config/tokenizer files and set ``quantization_config`` in ``config.json``.

    :param extra_json: further JSON files to write, e.g. ``{"quantize_config.json": {...}}``.
    :param config_updates: further keys to set in ``config.json`` (``RunContext.config_updates``).
    :returns: the names of the files written, sorted.
    """
    written = set(copy_model_files(model_path, output_dir, config_updates))
    config_path = output_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config["quantization_config"] = dict(quantization_config)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    written.add(config_path.name)
    for name, content in (extra_json or {}).items():
        (output_dir / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        written.add(name)
    return sorted(written)
