"""What a run does with its exports once the savers are done: read each back and compare it with the
in-memory result, pick the one to evaluate, and mark the save path as msquant's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from msquant.contracts.context import RunContext
from msquant.contracts.format import FormatRegistry, default_formats
from msquant.contracts.processor import Processor, flatten_processors
from msquant.contracts.transforms import TRANSFORMS_KEY
from msquant.errors import ConfigError, ConfigIssue
from msquant.evaluate.models import load_model_for_eval
from msquant.export.marker import TRANSFORMED_KEY, write_export_marker
from msquant.quant.quantized_linear import QuantizedLinear
from msquant.quant.quantized_weight import QuantizedWeight
from msquant.quant.spill import MergedWeights
from msquant.verify import ExportVerificationError, verify_export
from msquant.version import __version__

__all__ = [
    "verifiable_savers",
    "verify_exports",
    "check_evaluable_export",
    "model_to_evaluate",
    "write_export_marker",
]

logger = logging.getLogger(__name__)


def verifiable_savers(formats: FormatRegistry | None = None) -> frozenset[str]:
    """The ``spec.save`` types whose output a registered format reads back (the savers each
    verifiable :class:`~msquant.contracts.format.ExportFormat` lists)."""
    return (formats or default_formats()).verifiable_savers()


def verify_exports(
    ctx: RunContext,
    processors: list[Processor],
    stored: Mapping[str, QuantizedWeight] | None = None,
    formats: FormatRegistry | None = None,
) -> None:
    """Read each export back and compare it with the quantized modules still in memory (and
    those of ``stored``: a checkpointed run's layer store).

    Which exports are read back, and with which reader, comes from the format registry
    (``formats``; default: every installed format): a saver no verifiable format lists is skipped.

    The report's consumer notes (what a named serving engine refuses or treats differently in the
    export as written) are logged as warnings: they describe the files, which is what a user
    deploys, and the reader found them independently of the saver's own warnings.
    """
    registry = formats or default_formats()
    readable = registry.verifiable_savers()
    reference = _reference(ctx, stored)
    for saver in processors:
        if saver.stage != "save":
            continue
        if saver.type_name not in readable:
            logger.info("verify: skipping %s (no reader for its format)", saver.type_name)
            continue
        started = time.perf_counter()
        report = verify_export(saver.output_dir(ctx), reference=reference, formats=registry)
        for warning in report.warnings:
            logger.warning("verify: %s export: %s", saver.type_name, warning)
        if not report.ok:
            raise ExportVerificationError(report)
        logger.info(
            "verify: %s export read back, %d quantized layer(s) identical to the in-memory result "
            "(%.1f s)",
            saver.type_name,
            len(report.layers),
            time.perf_counter() - started,
        )


def _reference(
    ctx: RunContext, stored: Mapping[str, QuantizedWeight] | None = None
) -> Mapping[str, QuantizedWeight]:
    """The run's quantized weights: those still in memory and, in a streamed run, those the
    runner kept on disk when it released their layers (its spill, or the checkpoints' store).
    Keyed by the checkpoint's module names, as the exports are."""
    in_memory = {
        name: module.qweight
        for name, module in ctx.model.named_modules()
        if isinstance(module, QuantizedLinear) and not module.weight.is_meta
    }
    on_disk = [part for part in (ctx.spill, stored) if part is not None]
    return ctx.disk_keyed(MergedWeights(in_memory, *on_disk) if on_disk else in_memory)


def check_evaluable_export(
    processors: list[Processor], formats: FormatRegistry | None = None
) -> None:
    """A streamed run evaluates its export read back from disk: one must be readable."""
    readable = verifiable_savers(formats)
    if not any(p.stage == "save" and p.type_name in readable for p in processors):
        raise ConfigError(
            [
                ConfigIssue(
                    "spec.save",
                    "--eval_data in a streamed run (spec.runner auto or layer_wise) evaluates the "
                    "export read back from disk, and none of the configured savers writes a format "
                    f"msquant reads ({', '.join(sorted(readable))}); add one, or set "
                    "spec.runner: model_wise to evaluate the quantized model in memory",
                )
            ]
        )


def model_to_evaluate(
    ctx: RunContext,
    processors: list[Processor],
    trust_remote_code: bool,
    formats: FormatRegistry | None = None,
) -> torch.nn.Module:
    """The quantized model in memory, or in a streamed run the first readable export, rebuilt
    from the staging folder (identical to the in-memory result: it was just verified)."""
    if ctx.streamed is None:
        return ctx.model
    registry = formats or default_formats()
    readable = registry.verifiable_savers()
    saver = next(p for p in processors if p.stage == "save" and p.type_name in readable)
    model, _ = load_model_for_eval(saver.output_dir(ctx), trust_remote_code, registry)
    return model


def mark_export(ctx: RunContext, processors: list[Processor]) -> None:
    """``msquant_export.json`` at the top of the save path: what wrote this folder and how, and
    every file of it with its sha256 (:mod:`msquant.export.marker`).

    It marks the folder as an msquant export (so ``--overwrite`` may replace it, whatever its
    format, as long as it holds nothing else) and records where each saver's files are.
    Deterministic: no timestamps. It also holds what the processors recorded of their weight
    transforms (``ctx.transforms``), which ``msquant verify`` checks.
    """
    savers = [
        {"type": p.type_name, "path": p.output_subdir or "."}
        for p in processors
        if p.stage == "save"
    ]
    marker: dict[str, Any] = {
        "msquant_version": __version__,
        "model_path": str(ctx.model_path),
        "model_type": ctx.model_type,
        "savers": savers,
    }
    transformed = [p.type_name for p in flatten_processors(processors) if p.transforms_weights]
    if transformed:  # absent otherwise: earlier markers stay byte-identical
        marker[TRANSFORMED_KEY] = transformed
    recorded = ctx.transforms.to_json()
    if recorded is not None:
        marker[TRANSFORMS_KEY] = recorded
    write_export_marker(ctx.output_dir, marker)
