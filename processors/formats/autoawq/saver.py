"""``autoawq_saver``: an AutoAWQ checkpoint (GEMM layout) for vLLM and transformers (AutoAWQ
kernels). The format is named after AutoAWQ, its layout's origin, so that ``awq`` stays free for
the AWQ *algorithm*; the former type ``awq_saver`` is still accepted, with a deprecation warning,
and writes the same export (:class:`DeprecatedAWQSaver`).

Sample yaml::

    spec:
      process:
        - type: linear_quant
          qconfig:
            weight: {scope: per_group, dtype: int4, symmetric: false, method: gptq,
                     ext: {group_size: 128}}
      save:
        - type: autoawq_saver
          part_file_size: 4   # GiB per shard; 0 = one model.safetensors

Files written (a Hugging Face checkpoint folder): ``model.safetensors`` (or shards plus
``model.safetensors.index.json``), the model's config and tokenizer files, and ``config.json``
carrying ``quantization_config`` ``{"quant_method": "awq", "bits": 4, "group_size": G,
"zero_point": true, "version": "gemm", "modules_to_not_convert": [...]}``. The tensors of a
quantized linear are described in :mod:`msquant.processors.formats.autoawq.packer`.

The format holds one scheme for the whole model: every quantized linear must be 4-bit per-group
with one group size (symmetric weights are stored with the zero point 8), and the output head
stays in float. A config asking for anything else is refused before weights load (``msquant
plan`` shows why); other widths and per-module schemes go to ``gptq_saver`` or
``compressed_tensors``. Linear layers left in float are listed in ``modules_to_not_convert``.
The weights quantization (minmax or GPTQ) is msquant's, not AWQ's activation-aware scaling:
this saver writes the AWQ *file layout*, which vLLM's ``awq`` method loads.

Built on :class:`msquant.plugin.Saver` (writer, checkpoints, fused check); resumable.
"""

from __future__ import annotations

import logging
from typing import ClassVar, Literal

import torch
from torch import nn

from msquant.plugin import (
    ConfigIssue,
    DecoderLayer,
    ProcessorConfig,
    QuantizationError,
    QuantizedLinear,
    RunContext,
    Saver,
    SaverConfig,
    SaverState,
    adapter_for,
)
from msquant.plugin.export import write_hf_config
from msquant.plugin.model import OutputHeadStage
from msquant.plugin.planning import ModelPlan, PlanReview
from msquant.processors.formats.autoawq.config import build_quantization_config
from msquant.processors.formats.autoawq.packer import AWQ_BITS, awq_module_tensors

__all__ = [
    "AutoAWQSaverConfig",
    "AutoAWQSaver",
    "AutoAWQSaverState",
    "DeprecatedAWQSaverConfig",
    "DeprecatedAWQSaver",
    "DEPRECATED_TYPE_MESSAGE",
]

logger = logging.getLogger(__name__)

LISTED = 4
#: What a config still naming the former type is told (once per saver built).
DEPRECATED_TYPE_MESSAGE = (
    "spec.save type awq_saver is deprecated: the AutoAWQ checkpoint format is now "
    "autoawq_saver (the name awq is kept for the AWQ algorithm); write type: autoawq_saver "
    "(the export is the same)"
)


class AutoAWQSaverConfig(SaverConfig):
    """Config of ``autoawq_saver``."""

    type: Literal["autoawq_saver"] = "autoawq_saver"


class AutoAWQSaverState(SaverState):
    """The AutoAWQ saver's record: the model's one group size, fixed by the first quantized layer."""

    group_size: int | None = None


class AutoAWQSaver(Saver):
    """Writes an AutoAWQ GEMM checkpoint (qweight, qzeros, scales) as layers finish."""

    type_name = "autoawq_saver"
    config_class: ClassVar[type[ProcessorConfig]] = AutoAWQSaverConfig
    state_class = AutoAWQSaverState
    state: AutoAWQSaverState
    weights_prefix = "model"

    def review_plan(self, plan: ModelPlan, model: nn.Module) -> PlanReview:
        """Before weights load: refuse what one AWQ config cannot describe."""
        rows = [row for row in plan.rows if not row.skipped]
        problems = []
        odd = [r.module for r in rows if r.bits != AWQ_BITS or r.group_size in (None, -1)]
        if odd:
            problems.append(
                f"AWQ stores 4-bit per-group weights only ({_listing(odd)} are not); use "
                "type: gptq_saver or compressed_tensors for other widths"
            )
        sizes = sorted({int(r.group_size) for r in rows if r.group_size not in (None, -1)})
        if len(sizes) > 1:
            problems.append(
                f"an AWQ config holds one group_size, the plan uses {sizes}; use one group size"
            )
        found = adapter_for(model).output_head(model)
        if found is not None and any(r.module == found[0] for r in rows):
            problems.append(f"AWQ checkpoints keep the output head in float ({found[0]})")
        return PlanReview(errors=[f"{self.type_name}: {message}" for message in problems])

    def check_layer(self, ctx: RunContext, layer: DecoderLayer) -> None:
        if isinstance(layer, OutputHeadStage) and isinstance(layer.module, QuantizedLinear):
            raise QuantizationError(f"{self.type_name}: AWQ keeps the output head in float")
        for name, module in layer.module.named_modules(prefix=layer.name):
            if isinstance(module, QuantizedLinear) and module.group_size is not None:
                if self.state.group_size is None:
                    self.state.group_size = module.group_size
                elif module.group_size != self.state.group_size:
                    raise QuantizationError(
                        f"{self.type_name}: {name} uses group_size {module.group_size}, the "
                        f"export {self.state.group_size}; an AWQ config holds one"
                    )
        self.check_fused(layer.module, layer.name)

    def pack(self, ctx: RunContext, name: str, module: QuantizedLinear) -> dict[str, torch.Tensor]:
        return awq_module_tensors(name, module)

    def write_config(self, ctx: RunContext) -> None:
        if self.state.group_size is None:
            raise QuantizationError(
                f"{self.type_name}: no linear layer was quantized, so there is nothing to export "
                "as AWQ; add a linear_quant step that selects some layers"
            )
        routers = self.adapter.routers(ctx.model)
        float_linears = [
            ctx.disk_name(name)
            for name, module in ctx.model.named_modules()
            if (isinstance(module, nn.Linear) or name in routers)
            and name not in self.state.quantized
        ]
        config = build_quantization_config(self.state.group_size, float_linears, self.adapter)
        write_hf_config(ctx.model_path, self.directory, config, config_updates=ctx.config_updates)


class DeprecatedAWQSaverConfig(SaverConfig):
    """Config of the former type ``awq_saver`` (deprecated: ``autoawq_saver``)."""

    type: Literal["awq_saver"] = "awq_saver"


class DeprecatedAWQSaver(AutoAWQSaver):
    """Deprecated: the former name of `autoawq_saver`, the same export with a warning.

    :class:`AutoAWQSaver` under its former type name, which configs written before the rename
    still use. It keeps that name, so an export folder named after it (several savers) and the
    run's records are unchanged."""

    type_name = "awq_saver"
    config_class = DeprecatedAWQSaverConfig

    @classmethod
    def check_config(cls, config: ProcessorConfig) -> list[ConfigIssue]:
        """Every validation of a config naming the former type (``validate``, ``plan``,
        ``quant``) warns once."""
        logger.warning(DEPRECATED_TYPE_MESSAGE)
        return super().check_config(config)


def _listing(names: list[str]) -> str:
    more = len(names) - LISTED
    return ", ".join(names[:LISTED]) + (f" and {more} more" if more > 0 else "")
