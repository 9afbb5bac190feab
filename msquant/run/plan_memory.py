"""``msquant plan --max_memory``: the plan of a config on a model folder together with the run's
peak memory estimate, both from the weightless model (no weight is read).

The estimate is the one ``msquant quant --max_memory`` makes (:mod:`msquant.run.memory_estimate`)
for one process: the calibration set (``--calib_path``, else the config's ``spec.dataset``, else
the shipped default set) is tokenized with the model's tokenizer when a processor calibrates.
"""

from __future__ import annotations

import logging
from pathlib import Path

from msquant.config.processors import build_processors
from msquant.config.resolve import ConfigLike, resolve_config
from msquant.contracts.registry import ProcessorRegistry, default_registry
from msquant.load.calibration import tokenize_samples
from msquant.load.model_folder import (
    build_meta_model,
    check_model_dir,
    load_model_config,
    load_tokenizer,
)
from msquant.planning.build import plan_of
from msquant.planning.model import ModelPlan
from msquant.run.input_checks import calibration_texts, estimate_run_memory
from msquant.run.memory_estimate import MemoryEstimate
from msquant.run.placement import streams
from msquant.run.runner import needs_calibration

__all__ = ["plan_with_memory"]

logger = logging.getLogger(__name__)


def plan_with_memory(
    model_path: str | Path,
    config: ConfigLike,
    *,
    calib_path: str | Path | None = None,
    max_calib_tokens: int | None = None,
    trust_remote_code: bool = False,
    registry: ProcessorRegistry | None = None,
    allow_float_export: bool = False,
) -> tuple[ModelPlan, MemoryEstimate | None]:
    """The plan (as :func:`msquant.plugin.planning.build_plan`) and, when the config can be applied, the
    run's peak memory estimate (None when it cannot).

    :raises msquant.MsquantInputError: for an invalid config, model folder or calibration file.
    """
    registry = registry if registry is not None else default_registry()
    resolved = resolve_config(config, registry)
    processors = build_processors(resolved.config, registry)
    model_dir = check_model_dir(model_path)
    model_config = load_model_config(model_dir, trust_remote_code)
    meta_model = build_meta_model(model_config, trust_remote_code)
    result = plan_of(processors, meta_model, allow_float_export=allow_float_export)
    if not result.ok:
        return result, None
    texts = calibration_texts(resolved, calib_path, needs_calibration(processors))
    samples = None
    if texts is not None and needs_calibration(processors):
        tokenizer = load_tokenizer(model_dir, trust_remote_code)
        samples = tokenize_samples(texts, tokenizer, max_calib_tokens)
        logger.info("calibration: %d sample(s)", len(samples))
    streaming = streams(resolved.config.spec.runner)
    return result, estimate_run_memory(meta_model, model_dir, streaming, samples, processors)
