"""The plan of a model folder under a config (``msquant plan``): no weight is read, the model is
built on the meta device from its ``config.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from msquant.config.processors import build_processors
from msquant.config.resolve import ConfigLike, resolve_config
from msquant.contracts.processor import Processor
from msquant.contracts.registry import ProcessorRegistry, default_registry
from msquant.errors import QuantizationError
from msquant.load.model_folder import build_meta_model, check_model_dir, load_model_config
from msquant.model.adapter_registry import adapter_for
from msquant.planning.analysis import analyse_plan
from msquant.planning.model import ModelPlan, PlanRow

__all__ = ["build_plan", "plan", "plan_of"]

logger = logging.getLogger(__name__)


def build_plan(
    model_path: str | Path,
    config: ConfigLike,
    *,
    trust_remote_code: bool = False,
    registry: ProcessorRegistry | None = None,
    allow_float_export: bool = False,
) -> ModelPlan:
    """The plan of a model folder under a config, with every problem a run would report before
    loading weights (the processors' ``check_model`` errors included). Nothing is quantized and no
    weight is read: the model is built on the meta device from its ``config.json``.

    :param allow_float_export: a config that quantizes no linear layer is no error.
    :raises msquant.MsquantInputError: for an invalid config or model folder.
    """
    registry = registry if registry is not None else default_registry()
    resolved = resolve_config(config, registry)
    processors = build_processors(resolved.config, registry)
    model_dir = check_model_dir(model_path)
    meta_model = build_meta_model(
        load_model_config(model_dir, trust_remote_code), trust_remote_code
    )
    return plan_of(processors, meta_model, allow_float_export=allow_float_export)


def plan_of(
    processors: Sequence[Processor], meta_model: nn.Module, *, allow_float_export: bool = False
) -> ModelPlan:
    """The plan of built ``processors`` on a weightless model, their ``check_model`` errors
    first (what :func:`build_plan` returns once it has built both)."""
    adapter = adapter_for(meta_model)
    layers = adapter.decoder_layers(meta_model)
    own = [message for p in processors for message in p.check_model(meta_model, layers)]
    result = analyse_plan(
        processors, meta_model, layers, adapter=adapter, allow_float_export=allow_float_export
    )
    result.errors[:0] = own
    return result


def plan(
    model_path: str | Path,
    config: ConfigLike,
    *,
    trust_remote_code: bool = False,
    registry: ProcessorRegistry | None = None,
    allow_float_export: bool = False,
) -> list[PlanRow]:
    """Per linear layer: the bits, group size, symmetry, method, skip decision and deciding rule
    a run of ``config`` on ``model_path`` would use (``msquant plan``). Warnings are logged.
    ``allow_float_export``: as for :func:`build_plan`.

    :raises msquant.QuantizationError: listing every problem when the config cannot be applied
        to this model (the same problems ``quantize`` refuses before loading weights).
    :raises msquant.MsquantInputError: for an invalid config or model folder.
    """
    result = build_plan(
        model_path,
        config,
        trust_remote_code=trust_remote_code,
        registry=registry,
        allow_float_export=allow_float_export,
    )
    for warning in result.warnings:
        logger.warning("%s", warning)
    if result.errors:
        count = len(result.errors)
        raise QuantizationError(
            f"the config cannot be applied to this model ({count} problem{'s' if count > 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in result.errors)
        )
    return result.rows
