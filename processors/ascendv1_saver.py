"""``ascendv1_saver``: msModelSlim v1 deployment weights for vLLM-Ascend and MindIE.

Sample yaml::

    spec:
      save:
        - type: ascendv1_saver
          part_file_size: 4   # GiB per shard; 0 = one quant_model_weights.safetensors

Files written (msModelSlim 26.1 layout):

* ``quant_model_weights-0000i-of-0000N.safetensors`` + ``quant_model_weights.safetensors.index.json``
  (or one ``quant_model_weights.safetensors`` when ``part_file_size`` is 0);
* ``quant_model_description.json``: every tensor typed ``W8A16`` or ``FLOAT``, plus ``version``,
  ``model_quant_type``, ``metadata``, ``group_size`` and ``optional``;
* the model's config/tokenizer files, ``quantization_config`` removed from ``config.json``, and the
  config used as ``{model_type}_best_practice.yaml``.

Per quantized linear ``P``: ``P.weight`` int8 ``[out, in]``, ``P.weight_scale`` and ``P.weight_offset``
float32 ``[out, 1]`` (per-channel) or ``[out, in/group_size]`` (per-group), ``P.bias`` float32
(``FLOAT``). Other tensors keep their dtype and are ``FLOAT``. Dequantization:
``w = (weight - weight_offset) * weight_scale``.

Lifecycle: ``after_layer`` queues the layer's tensors (written shard by shard); ``finalize`` adds
the remaining tensors (embeddings, final norm, head) and writes the description and copied files.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from msquant import (
    DecoderLayer,
    Processor,
    ProcessorConfig,
    QuantizedLinear,
    RunContext,
    ShardedSafetensorsWriter,
    copy_model_files,
)

__all__ = ["AscendV1SaverConfig", "AscendV1Saver", "QUANT_TYPE_PRIORITY"]

logger = logging.getLogger(__name__)

WEIGHTS_PREFIX = "quant_model_weights"
DESCRIPTION_FILE = "quant_model_description.json"
DESCRIPTION_VERSION = "1.0.0"
GIB = 1024**3
# msModelSlim's order for the global ``model_quant_type`` (the highest type present wins).
QUANT_TYPE_PRIORITY = ("FLOAT", "W16A16S", "W8A16", "W8A8_DYNAMIC", "W8A8_MIX", "W8A8")
QUANTIZED_SUFFIXES = ("weight", "weight_scale", "weight_offset")


class AscendV1SaverConfig(ProcessorConfig):
    """Config of ``ascendv1_saver``."""

    type: Literal["ascendv1_saver"] = "ascendv1_saver"
    part_file_size: int = Field(4, ge=0, description="Shard size in GiB; 0 writes a single file.")
    ext: dict[str, Any] = Field(
        default_factory=dict, description="Reserved (msModelSlim compatibility)."
    )


class AscendV1Saver(Processor):
    """Writes the Ascend (msModelSlim v1) export as layers finish."""

    type_name = "ascendv1_saver"
    config_class = AscendV1SaverConfig
    stage = "save"
    config: AscendV1SaverConfig

    def setup(self, ctx: RunContext) -> None:
        size = self.config.part_file_size
        self.writer = ShardedSafetensorsWriter(
            ctx.output_dir, WEIGHTS_PREFIX, size * GIB if size else None
        )
        self.types: dict[str, str] = {}
        self.group_sizes: set[int] = set()

    def after_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        self._write_module(layer.module, layer.name + ".")

    def finalize(self, ctx: RunContext) -> None:
        written = set(self.types)
        aliases: dict[str, str] = {}
        seen: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
        state = ctx.model.state_dict()
        for name, tensor in state.items():
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if tensor.numel() and key in seen:
                # Tied weights are stored once, as Hugging Face does, but still described: vLLM-Ascend
                # looks up e.g. "lm_head.weight" in the description even when the head is tied.
                aliases[name] = seen[key]
                continue
            seen[key] = name
            if name not in written:
                self._add(name, tensor, "FLOAT")
        self.writer.close()
        described = {
            **self.types,
            **{alias: self.types[target] for alias, target in aliases.items()},
        }
        order = [n for n in state if n in described]
        order += [n for n in described if n not in state]
        description = {name: described[name] for name in order}
        description.update(self._globals())
        (ctx.output_dir / DESCRIPTION_FILE).write_text(
            json.dumps(description, indent=4) + "\n", encoding="utf-8"
        )
        copy_model_files(ctx.model_path, ctx.output_dir)
        if ctx.config_text is not None:
            (ctx.output_dir / f"{ctx.model_type}_best_practice.yaml").write_text(
                ctx.config_text, encoding="utf-8"
            )
        logger.info(
            "ascendv1_saver: %d tensors (%.1f MiB), model_quant_type %s",
            len(self.types),
            self.writer.total_bytes / 2**20,
            description["model_quant_type"],
        )

    def _write_module(self, root: nn.Module, prefix: str) -> None:
        for module_name, module in root.named_modules(prefix=prefix.rstrip(".")):
            if not isinstance(module, QuantizedLinear):
                continue
            quant_type = _quant_type(module)
            for suffix in QUANTIZED_SUFFIXES:
                self._add(f"{module_name}.{suffix}", getattr(module, suffix), quant_type)
            if module.bias is not None:
                self._add(f"{module_name}.bias", module.bias.float(), "FLOAT")
            if module.group_size is not None:
                self.group_sizes.add(module.group_size)
        for name, tensor in root.state_dict(prefix=prefix).items():
            if name not in self.types:
                self._add(name, tensor, "FLOAT")

    def _add(self, name: str, tensor: torch.Tensor, quant_type: str) -> None:
        self.writer.add(name, tensor)
        self.types[name] = quant_type

    def _globals(self) -> dict[str, Any]:
        present = set(self.types.values())
        model_type = max(present, key=QUANT_TYPE_PRIORITY.index) if present else "FLOAT"
        if len(self.group_sizes) > 1:
            logger.warning(
                "per-group layers use different group sizes %s; the description holds one global "
                "group_size (%d), as msModelSlim writes it",
                sorted(self.group_sizes),
                max(self.group_sizes),
            )
        if self.group_sizes:
            logger.warning(
                "per-group W8A16 weights (scale [out, in/group_size]) are written as msModelSlim does, "
                "but vLLM-Ascend's W8A16 scheme loads per-channel weights only"
            )
        return {
            "version": DESCRIPTION_VERSION,
            "model_quant_type": model_type,
            "metadata": {},
            "group_size": max(self.group_sizes) if self.group_sizes else 0,
            "optional": {},
        }


def _quant_type(module: QuantizedLinear) -> str:
    if module.bits != 8:
        raise ValueError(f"ascendv1_saver writes 8-bit weights (W8A16) only, got int{module.bits}")
    return "W8A16"
