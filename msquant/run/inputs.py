"""The first step of a run: every input checked, cheapest first, before any weight is loaded.

Config and processors, device and process group, save path, calibration file, evaluation file,
model folder and config, then every processor's model-dependent checks and the plan on a
weightless copy of the model, the tokenized calibration and evaluation texts, the memory
estimate and the fingerprint a resumed run must match. Any problem raises a typed
:class:`~msquant.MsquantInputError` before the run has changed anything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from msquant.backends import Backend, get_backend
from msquant.config.processors import build_prior_stages, build_processors
from msquant.config.resolve import ConfigLike, ResolvedConfig, resolve_config
from msquant.contracts.distributed import Distributed
from msquant.contracts.processor import Processor
from msquant.contracts.registry import ProcessorRegistry, default_registry
from msquant.evaluate.run_evaluation import EvaluationData, prepare_evaluation
from msquant.evaluate.windows import DEFAULT_SEQLEN
from msquant.export.files import copied_model_files
from msquant.export.staging import check_save_path
from msquant.load.calibration import SampleLimit, tokenize_samples
from msquant.load.image_calibration import (
    ImageSamples,
    image_folder,
    image_samples,
    load_processor,
    read_image_folder,
)
from msquant.load.model_folder import (
    build_meta_model,
    check_model_dir,
    load_model_config,
    load_tokenizer,
)
from msquant.run.exports import check_evaluable_export
from msquant.run.input_checks import (
    calibration_texts,
    check_applicable,
    check_memory_limit,
    fingerprint_of,
    log_runner,
    warn_few_tokens,
    warn_long_samples,
)
from msquant.run.launch import from_environment
from msquant.run.placement import streams
from msquant.run.prior_inputs import check_prior_datasets, check_prior_stages
from msquant.run.runner import needs_calibration
from msquant.run.save_path import recover_early

__all__ = ["QuantizeOptions", "RunInputs", "check_inputs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizeOptions:
    """The keyword arguments of :func:`msquant.quantize`, as one value (documented there)."""

    device: str = "cpu"
    calib_path: str | Path | None = None
    trust_remote_code: bool = False
    registry: ProcessorRegistry | None = None
    max_calib_tokens: int | None = None
    progress: bool = True
    overwrite: bool = False
    verify: bool = True
    eval_data: str | Path | None = None
    eval_seqlen: int = DEFAULT_SEQLEN
    eval_stride: int | None = None
    eval_max_samples: int | None = None
    max_memory: int | None = None
    allow_float_export: bool = False
    resume: bool = False
    checkpoints: bool = True
    model_type: str | None = None


@dataclass(frozen=True)
class RunInputs:
    """What a run was given, checked and prepared before any weight is loaded.

    :param options: the run's options.
    :param model_path: the model folder as given (messages name it so).
    :param target: the save path, checked (absolute).
    :param resolved: the validated config and where it came from.
    :param processors: ``spec.process`` then ``spec.save`` (the default saver when it is empty).
    :param backend: the device backend.
    :param dist: this process's place in a ``dp_layer_wise`` group.
    :param model_dir: the checked model folder.
    :param model_config: the model's Hugging Face config.
    :param meta_model: a weightless instance of the model (its module tree).
    :param samples: the tokenized calibration samples; None when no processor calibrates.
    :param evaluation: the evaluation text and settings (``eval_data``), or None.
    :param eval_ids: its token ids, or None.
    :param fingerprint: what a resumed run must share with this one.
    :param media: for image calibration (a vision-language model's ``spec.dataset`` naming a
        folder of images), per sample the model inputs beside its token ids (``samples``);
        None for text calibration.
    """

    options: QuantizeOptions
    model_path: str | Path
    target: Path
    resolved: ResolvedConfig
    processors: list[Processor]
    backend: Backend
    dist: Distributed
    model_dir: Path
    model_config: Any
    meta_model: nn.Module
    samples: list[torch.Tensor] | None
    evaluation: EvaluationData | None
    eval_ids: torch.Tensor | None
    fingerprint: dict[str, Any]
    media: list[dict[str, torch.Tensor]] | None = None

    @property
    def streaming(self) -> bool:
        """Whether the decoder layers stay on disk until they run (``spec.runner``)."""
        return streams(self.resolved.config.spec.runner)


def check_inputs(
    model_path: str | Path, save_path: str | Path, config: ConfigLike, options: QuantizeOptions
) -> RunInputs:
    """Check and prepare everything a run needs that is not a weight (see the module docstring).

    :raises msquant.MsquantInputError: (a subclass) for any problem with the inputs.
    """
    registry = options.registry if options.registry is not None else default_registry()
    resolved = resolve_config(config, registry)
    processors = build_processors(resolved.config, registry)
    prior_stages = build_prior_stages(resolved.config, registry)
    backend = get_backend(options.device)
    dist = from_environment(backend.spec.kind, backend.device)
    log_runner(resolved.config.spec.runner, dist)
    if dist.is_main:
        recover_early(Path(save_path).expanduser().absolute())
    target = check_save_path(save_path, options.overwrite, model_path)
    images = _calibration_images(resolved, options.calib_path)
    texts = (
        None
        if images is not None
        else calibration_texts(resolved, options.calib_path, needs_calibration(processors))
    )
    if images is not None and options.checkpoints:
        logger.info("image calibration: the run writes no per-layer checkpoints")
        options = replace(options, checkpoints=False, resume=False)
    check_prior_datasets(resolved)  # prior stages are not run (msquant.run.prior_inputs)
    evaluation = _evaluation_data(options)
    model_dir, model_config, meta_model = _check_model(
        model_path, options, processors, resolved, evaluation, images is not None
    )
    check_prior_stages(prior_stages, meta_model)
    samples, eval_ids = _tokenize(model_dir, model_config, texts, evaluation, options)
    media = None
    if images is not None and needs_calibration(processors):
        encoded = _encode_images(model_dir, images, resolved, options)
        samples, media = encoded.input_ids, encoded.inputs
    streaming = streams(resolved.config.spec.runner)
    if options.max_memory is not None:
        check_memory_limit(
            meta_model, model_dir, streaming, samples, processors, dist, options.max_memory
        )
    fingerprint = fingerprint_of(
        resolved.config, samples, model_dir, backend, meta_model, options.model_type
    )
    return RunInputs(
        options, model_path, target, resolved, processors, backend, dist, model_dir,
        model_config, meta_model, samples if needs_calibration(processors) else None,
        evaluation, eval_ids, fingerprint, media,
    )  # fmt: skip


def _calibration_images(
    resolved: ResolvedConfig, calib_path: str | Path | None
) -> list[Path] | None:
    """The calibration images of a vision-language config (``spec.default_text``) whose
    ``spec.dataset`` (or ``calib_path``) names a folder of images; None for text calibration."""
    spec = resolved.config.spec
    if getattr(spec, "default_text", None) is None:
        return None
    name = str(calib_path) if calib_path is not None else spec.dataset
    if name is None:
        return None
    folder = image_folder(name, None if calib_path is not None else resolved.directory)
    return None if folder is None else read_image_folder(folder)


def _encode_images(
    model_dir: Path, images: list[Path], resolved: ResolvedConfig, options: QuantizeOptions
) -> ImageSamples:
    """The images, each with ``spec.default_text``, through the model folder's processor."""
    processor = load_processor(model_dir, options.trust_remote_code)
    text = str(getattr(resolved.config.spec, "default_text", ""))
    return image_samples(images, text, processor)


def _evaluation_data(options: QuantizeOptions) -> EvaluationData | None:
    """The evaluation text file, read and its settings checked (``eval_data``), or None."""
    if options.eval_data is None:
        return None
    return prepare_evaluation(
        options.eval_data, options.eval_seqlen, options.eval_stride, options.eval_max_samples
    )


def _check_model(
    model_path: str | Path,
    options: QuantizeOptions,
    processors: list[Processor],
    resolved: ResolvedConfig,
    evaluation: EvaluationData | None,
    images: bool = False,
) -> tuple[Path, Any, nn.Module]:
    """The model folder, its config and a weightless model, once the config is known to apply
    to it (the processors' checks and the plan; ``images``: calibrated on images) and, with an
    evaluation, that it can run."""
    model_dir = check_model_dir(model_path)
    copied_model_files(model_dir)  # a link out of the model folder is refused before any work
    model_config = load_model_config(model_dir, options.trust_remote_code)
    if evaluation is not None:
        evaluation.check_model(model_config, model_dir)
    meta_model = build_meta_model(model_config, options.trust_remote_code)
    check_applicable(processors, meta_model, options.allow_float_export, images=images)
    if evaluation is not None and streams(resolved.config.spec.runner):
        check_evaluable_export(processors)
    return model_dir, model_config, meta_model


def _tokenize(
    model_dir: Path,
    model_config: Any,
    texts: list[str] | None,
    evaluation: EvaluationData | None,
    options: QuantizeOptions,
) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
    """The calibration samples and the evaluation token ids (each None when not needed)."""
    samples = eval_ids = None
    if texts is None and evaluation is None:
        return None, None
    tokenizer = load_tokenizer(model_dir, options.trust_remote_code)
    if texts is not None:
        samples = tokenize_samples(
            texts, tokenizer, options.max_calib_tokens, SampleLimit.for_model(model_config)
        )
        logger.info("calibration: %d sample(s)", len(samples))
        warn_long_samples(samples, model_config)
        warn_few_tokens(samples, "calibration")
    if evaluation is not None:
        eval_ids = evaluation.tokens(tokenizer)
    return samples, eval_ids
