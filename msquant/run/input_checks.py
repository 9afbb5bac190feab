"""The checks of a run's inputs that need no weights: calibration data, the processors and the plan
on the weightless model, the memory estimate, and the fingerprint a resumed run must match.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from msquant.backends import Backend
from msquant.config.resolve import ResolvedConfig
from msquant.config.spec import QuantConfig, RunnerType
from msquant.contracts.distributed import Distributed
from msquant.contracts.processor import Processor
from msquant.errors import QuantizationError
from msquant.load.calibration import (
    default_dataset_path,
    read_calibration_texts,
    resolve_dataset_path,
)
from msquant.model.adapter_registry import adapter_for
from msquant.planning.analysis import check_plan
from msquant.report.hashes import calibration_sha256, config_sha256
from msquant.run.checkpoint.fingerprint import run_fingerprint
from msquant.run.memory_estimate import (
    MemoryEstimate,
    calibration_size,
    check_memory,
    checkpoint_size,
    estimate_memory,
    format_size,
)
from msquant.run.runner import batch_token_limit, needs_calibration

__all__ = [
    "log_runner",
    "calibration_texts",
    "warn_long_samples",
    "warn_few_tokens",
    "check_applicable",
    "check_memory_limit",
    "estimate_run_memory",
    "fingerprint_of",
]

logger = logging.getLogger(__name__)


def log_runner(runner: RunnerType, dist: Distributed) -> None:
    """Say how ``runner`` is executed (results never depend on it, up to float summation order
    across processes)."""
    if dist.active:
        logger.info(
            "dp_layer_wise: process %d of %d shares the calibration batches and the GPTQ solves",
            dist.rank,
            dist.world_size,
        )
    elif runner is RunnerType.DP_LAYER_WISE:
        logger.warning(
            "runner dp_layer_wise with one process: launch with torchrun --nproc_per_node N, or "
            "give several devices (--device npu:0,1,2,3) to share the work out"
        )
    if runner is RunnerType.MODEL_WISE:
        logger.info("runner model_wise: every weight is loaded before the layer-wise run")
    else:
        logger.info("runner %s: decoder layers are streamed from disk one at a time", runner.value)


def calibration_texts(
    resolved: ResolvedConfig, calib_path: str | Path | None, required: bool
) -> list[str] | None:
    """Read the calibration file when one is given (always validated) or required."""
    if calib_path is not None:
        path = Path(calib_path)
    elif resolved.config.spec.dataset is not None:
        path = resolve_dataset_path(resolved.config.spec.dataset, resolved.directory)
    elif required:
        path = default_dataset_path()
        logger.info("no spec.dataset or --calib_path: calibrating on the shipped default set")
    else:
        return None
    texts = read_calibration_texts(path)
    return texts if required else None


def warn_long_samples(samples: Sequence[torch.Tensor], model_config: Any) -> None:
    """Warn about calibration samples longer than the context the model was trained for: its
    activations there are not the ones it serves, and attention memory grows with the square of
    the length."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return
    lengths = [int(s.shape[-1]) for s in samples]
    longer = [n for n in lengths if n > limit]
    if longer:
        logger.warning(
            "%d of %d calibration sample(s) are longer than the model's max_position_embeddings "
            "(%d; the longest has %d tokens): pass --max_calib_tokens %d (Python: "
            "max_calib_tokens=%d) to truncate them",
            len(longer), len(lengths), limit, max(longer), limit, limit,
        )  # fmt: skip


#: Fewer calibration tokens than this are warned about (msModelSlim's and msquant's default
#: sets hold tens of thousands): a static activation range, a GPTQ Hessian or a smoothing scale
#: measured on a few tokens describes those tokens, not the inputs the model will serve.
MIN_CALIB_TOKENS = 512


def warn_few_tokens(samples: Sequence[torch.Tensor], what: str = "calibration") -> None:
    """Warn when a calibrating run measures its statistics on fewer than
    :data:`MIN_CALIB_TOKENS` tokens in all."""
    tokens = sum(int(s.shape[-1]) for s in samples)
    if tokens < MIN_CALIB_TOKENS:
        logger.warning(
            "%s: %d sample(s) with %d token(s) in all, fewer than %d: what the run measures on "
            "them (static activation ranges, GPTQ Hessians, smoothing scales) describes those "
            "tokens, not the inputs the model will serve; calibrate on more text (leave out "
            "--calib_path and spec.dataset for msquant's default set)",
            what, len(samples), tokens, MIN_CALIB_TOKENS,
        )  # fmt: skip


def check_applicable(
    processors: list[Processor],
    meta_model: Any,
    allow_float_export: bool = False,
    images: bool = False,
) -> None:
    """Refuse, before weights load, a config that cannot be applied to the model: every
    processor's ``check_model`` and the plan's cross-entry problems (a config quantizing no
    linear layer among them, unless ``allow_float_export``), listed together (``images``: the
    run calibrates on images, which reach a vision-language model's vision tower).

    :raises QuantizationError: listing every problem.
    """
    adapter = adapter_for(meta_model)
    layers = adapter.decoder_layers(meta_model)
    problems = [msg for p in processors for msg in p.check_model(meta_model, layers)]
    # across entries: overlaps, fused splits
    problems += check_plan(
        processors,
        meta_model,
        layers,
        adapter=adapter,
        allow_float_export=allow_float_export,
        images=images,
    )
    if problems:
        count = len(problems)
        raise QuantizationError(
            f"the config cannot be applied to this model ({count} problem{'s' if count > 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def check_memory_limit(
    meta_model: torch.nn.Module,
    model_dir: Path,
    streaming: bool,
    samples: Sequence[torch.Tensor] | None,
    processors: list[Processor],
    dist: Distributed,
    limit: int,
) -> None:
    """Refuse, before weights load, a run whose estimated peak memory exceeds ``limit``."""
    estimate = estimate_run_memory(
        meta_model, model_dir, streaming, samples, processors, dist.world_size
    )
    logger.info(
        "estimated peak memory: %s at %s (%s)",
        format_size(estimate.total),
        estimate.layer,
        estimate.describe(),
    )
    check_memory(estimate, limit)


def estimate_run_memory(
    meta_model: torch.nn.Module,
    model_dir: Path,
    streaming: bool,
    samples: Sequence[torch.Tensor] | None,
    processors: list[Processor],
    world_size: int = 1,
) -> MemoryEstimate:
    """The peak memory estimate of a run (:mod:`msquant.run.memory_estimate`): ``samples`` are
    the tokenized calibration samples (None or ignored when no processor calibrates), shared
    out over ``world_size`` processes."""
    calibration = None
    if samples and needs_calibration(processors):
        calibration = calibration_size(
            meta_model,
            [int(s.numel()) for s in samples],
            world_size,
            batch_token_limit(processors),
        )
    return estimate_memory(
        meta_model,
        adapter_for(meta_model).decoder_layers(meta_model),
        checkpoint_size(model_dir),
        processors,
        streaming=streaming,
        calibration=calibration,
    )


def fingerprint_of(
    config: QuantConfig,
    samples: Sequence[torch.Tensor] | None,
    model_dir: Path,
    backend: Backend,
    meta_model: torch.nn.Module,
    model_type: str | None = None,
) -> dict[str, Any]:
    """What a resumed run must share with the run it continues (:func:`run_fingerprint`)."""
    return run_fingerprint(
        model_type=model_type,
        config_sha256=config_sha256(config.model_dump(mode="json")),
        calibration_sha256=calibration_sha256(samples),
        model_dir=model_dir,
        device_kind=backend.spec.kind,
        num_layers=len(adapter_for(meta_model).decoder_layers(meta_model)),
    )
