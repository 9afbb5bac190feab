"""The run report of a quantization run: its run-wide fields at the start, the file at the end."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from msquant.backends import Backend
from msquant.config.spec import QuantConfig
from msquant.contracts.context import RunContext
from msquant.report.hashes import calibration_sha256, config_sha256
from msquant.report.run_report import REPORT_FILE, write_report
from msquant.report.table import render_report
from msquant.version import __version__

__all__ = ["start_report", "write_run_report"]

logger = logging.getLogger(__name__)


def start_report(
    ctx: RunContext,
    config: QuantConfig,
    samples: Sequence[torch.Tensor] | None,
    backend: Backend,
) -> None:
    """Fill the run-wide fields of ``ctx.report`` (versions, hashes, model, device)."""
    report = ctx.report
    report.msquant_version = __version__
    report.config_sha256 = config_sha256(config.model_dump(mode="json"))
    report.calibration_sha256 = calibration_sha256(samples)
    report.calibration_samples = len(samples) if samples else 0
    report.calibration_tokens = sum(int(s.numel()) for s in samples) if samples else 0
    report.model_path = str(ctx.model_path)
    report.model_type = ctx.model_type
    report.device = str(backend.device)


def write_run_report(ctx: RunContext, started: float) -> None:
    """``quant_report.json`` beside ``msquant_export.json`` (staged, moved with the export) and
    the same as a table at INFO. Written before the marker, which lists it."""
    ctx.report.total_seconds = time.perf_counter() - started
    write_report(ctx.report, ctx.output_dir)
    logger.info("run report (%s):\n%s", REPORT_FILE, render_report(ctx.report))
